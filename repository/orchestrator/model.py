"""Triton model ``orchestrator_model``: PREPROCESSED -> LOGITS, tiles fanned out to the folds by BLS.

The step lives in the installed package: :mod:`nnunet_triton.serving.steps.orchestrator`.
"""

from nnunet_triton.serving.steps.orchestrator import TritonPythonModel  # noqa: F401
