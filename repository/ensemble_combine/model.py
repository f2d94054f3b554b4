"""Triton model ``combine_model``: the members' PROBABILITIES -> SEGMENTATION (ensemble of configurations).

The step lives in the installed package: :mod:`nnunet_triton.serving.steps.combine`.
"""

from nnunet_triton.serving.steps.combine import TritonPythonModel  # noqa: F401
