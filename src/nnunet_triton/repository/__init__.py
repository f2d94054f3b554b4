"""The model repository on disk: one layer below the builder and the server.

* ``model_repository`` -- :class:`ModelRepository`, the one reader of a repository folder (model folders,
  registry, each model's parsed config, each endpoint version's ``inference_config.json``)
* ``registry`` -- the registry ``repository_metadata.json`` (endpoints, versions, the promoted one), the
  repository lock and the one "not built by nnunet-triton" refusal (:func:`require_registry`)
* ``config`` -- a model folder's ``config.pbtxt`` read and written (the only module that opens one)

Standard library only at import time and no import of the builder or the server
(``tests/unit/test_repository_layer.py``): the container's health probe and entry point read a repository
here. Writing a repository (specs rendered to configs, exports, the atomic build) is the builder's.
"""

from __future__ import annotations

from nnunet_triton.errors import NotBuiltRepositoryError, OlderRepositoryError, RepositoryError
from nnunet_triton.repository.config import ModelConfigInfo
from nnunet_triton.repository.model_repository import ModelRepository
from nnunet_triton.repository.registry import (
    EndpointEntry,
    Registry,
    VersionEntry,
    locked,
    read_registry,
    require_registry,
    version_metadata,
    write_registry,
)

__all__ = [
    "ModelRepository",
    "ModelConfigInfo",
    "Registry",
    "EndpointEntry",
    "VersionEntry",
    "read_registry",
    "require_registry",
    "version_metadata",
    "write_registry",
    "locked",
    "RepositoryError",
    "NotBuiltRepositoryError",
    "OlderRepositoryError",
]
