"""Deprecated location of the repository's registry: use :mod:`nnunet_triton.repository.registry` (or
``nnunet_triton.repository``). Kept for one release so that imports of the old path keep working."""

from __future__ import annotations

import warnings

from nnunet_triton.repository.registry import (  # noqa: F401  (re-exported)
    FORMAT,
    EndpointEntry,
    Registry,
    VersionEntry,
    __all__,
    locked,
    read_registry,
    require_registry,
    version_metadata,
    write_registry,
)

warnings.warn("nnunet_triton.registry is deprecated and will be removed in the next "
              "release: import nnunet_triton.repository.registry",
              DeprecationWarning, stacklevel=2)
