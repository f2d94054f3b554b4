"""From an nnU-Net results folder to a Triton model repository.

* ``config_gen`` -- typed model configs rendered to config.pbtxt (read back and written through the repository
  layer, :mod:`nnunet_triton.repository`, which also holds ``ModelRepository``; ``model_repository`` here is
  its deprecated path)
* ``model_specs`` -- every model of a single-configuration repository as a spec (``BuildOptions``);
  ``composite_specs`` -- ensembles of configurations and cascades
* ``fold_network``, ``torchscript`` -- one fold's network rebuilt as nnU-Net does, traced, reloaded and
  checked against the eager network (``nnunet-triton export``, :mod:`nnunet_triton.cli.export`)
* ``repository``, ``build_inputs`` -- the whole build, hashed and atomic (``nnunet-triton build``,
  :mod:`nnunet_triton.cli.build`)
"""
