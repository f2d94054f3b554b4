"""Triton model ``preprocess_model``: IMAGE + SPACING -> PREPROCESSED + CASE_PROPERTIES.

The step lives in the installed package: :mod:`nnunet_triton.serving.steps.preprocess`.
"""

from nnunet_triton.serving.steps.preprocess import TritonPythonModel  # noqa: F401
