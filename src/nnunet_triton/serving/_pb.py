"""Lazy access to ``triton_python_backend_utils``.

The module only exists inside a Triton Python-backend stub process. Importing it lazily keeps
``nnunet_triton.serving`` importable in unit tests, which put a fake module into ``sys.modules``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["pb_utils"]

_MODULE_NAME = "triton_python_backend_utils"


def pb_utils() -> ModuleType:
    """Return the ``triton_python_backend_utils`` module of the running stub."""
    return importlib.import_module(_MODULE_NAME)
