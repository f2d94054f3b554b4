"""Triton model ``nnunet_monolith``: nnUNetPredictor whole, the benchmarks' one-model baseline.

The step lives in the installed package: :mod:`nnunet_triton.serving.steps.monolith`.
"""

from nnunet_triton.serving.steps.monolith import TritonPythonModel  # noqa: F401
