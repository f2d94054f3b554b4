"""From an nnU-Net results folder to a Triton model repository.

* ``config_gen`` -- typed model configs rendered to config.pbtxt (and parsed back)
* ``model_specs`` -- every model of a single-configuration repository as a spec (``BuildOptions``);
  ``composite_specs`` -- ensembles of configurations and cascades
* ``fold_network``, ``torchscript``, ``torchscript_cli`` -- one fold's network rebuilt as nnU-Net does,
  traced, reloaded and checked against the eager network (``python -m network_models.export``)
* ``repository``, ``build_inputs``, ``repository_cli`` -- the whole build, hashed and atomic
  (``python -m repository.build``)
"""
