"""Deprecated location of :class:`ModelRepository`: use :mod:`nnunet_triton.repository` (the repository layer
below the builder and the server). Kept for one release so that imports of the old path keep working."""

from __future__ import annotations

import warnings

from nnunet_triton.repository.model_repository import ModelRepository

__all__ = ["ModelRepository"]

warnings.warn("nnunet_triton.builder.model_repository is deprecated and will be removed in the next "
              "release: import nnunet_triton.repository",
              DeprecationWarning, stacklevel=2)
