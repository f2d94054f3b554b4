"""Triton model ``fold_<k>``: INPUT__0 -> OUTPUT__0, one fold's TorchScript network (Python backend).

The step lives in the installed package: :mod:`nnunet_triton.serving.steps.fold_runner`.
"""

from nnunet_triton.serving.steps.fold_runner import TritonPythonModel  # noqa: F401
