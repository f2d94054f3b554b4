"""Triton model ``stitch_model``: LOGITS + CASE_PROPERTIES -> SEGMENTATION (+ PROBABILITIES).

The step lives in the installed package: :mod:`nnunet_triton.serving.steps.stitch`.
"""

from nnunet_triton.serving.steps.stitch import TritonPythonModel  # noqa: F401
