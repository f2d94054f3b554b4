"""nnunet_triton: nnU-Net v2 inference numerics and Triton serving glue.

Importing this package must stay cheap and dependency-free: it never imports torch, cupy,
tritonclient or triton_python_backend_utils. Submodules that need them import them lazily.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
