"""Running Triton with a built repository: on this machine, in a container, in Kubernetes.

* ``embedded``, ``handle`` -- the embedded server (pytriton's tritonserver binary; its command line is
  ``nnunet-triton serve|stop|status``, :mod:`nnunet_triton.cli.serve`); ``triton_install`` makes the binary
  runnable
* ``thread_budget`` -- CPU threads per model so the processes do not oversubscribe the cores
* ``health``, ``watchdog`` -- honest health and the recovery of dead model processes
* ``deploy`` -- docker and Kubernetes specs
"""
