"""From an nnU-Net results folder to a Triton model repository.

* ``config_gen`` -- typed model configs rendered to config.pbtxt (and parsed back)
* ``model_specs`` -- every model of the repository as a spec (``BuildOptions`` -> ``ModelSpec``)
* ``torchscript`` -- one fold's network traced, reloaded and checked against the eager network
* ``repository`` -- the whole build, atomic and hashed (``python -m repository.build``)
"""
