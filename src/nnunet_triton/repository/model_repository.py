"""A model repository on disk, read (and its configs written) in one place.

Every reader of a repository goes through :class:`ModelRepository`: which model folders it holds (a folder
with a ``config.pbtxt``), the registry (``repository_metadata.json``,
:mod:`nnunet_triton.repository.registry`: the endpoints, their versions, the public endpoints and the models
of each version), each model's config, each endpoint version's ``inference_config.json`` and the files in its
version folder. Configs are parsed and written by :mod:`nnunet_triton.repository.config` (the only module that
opens a ``config.pbtxt``); rendering one from a typed spec is the builder's (``builder.config_gen``), which
this layer never imports. Standard library only at import time: the container's health probe reads a
repository here (Python 3.10 there, no builder).

Used by the launchers (thread budget, backends), the health probe, rollouts, ``predict`` and deploy
(``server/deploy/repository_info``, whose facts ``sizing`` reads), and by the builder itself.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from nnunet_triton import io_names
from nnunet_triton.errors import PlansError, RepositoryError
from nnunet_triton.repository import config as config_file
from nnunet_triton.repository.config import ModelConfigInfo
from nnunet_triton.repository.registry import Registry, read_registry, require_registry

if TYPE_CHECKING:
    from nnunet_triton.numerics.plans import InferenceConfig

__all__ = ["ModelRepository"]

LOGGER = logging.getLogger(__name__)

# the models of a pipeline that carry 1/inference_config.json
_CONFIG_MODELS = (io_names.PREPROCESS_MODEL, io_names.ORCHESTRATOR_MODEL, io_names.STITCH_MODEL)


class ModelRepository:
    """The repository folder ``path``. Nothing is cached: every call reads the disk as it is now (a build,
    promotion or removal may change it between calls)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"ModelRepository({str(self.path)!r})"

    # --- layout ---------------------------------------------------------------------------------------

    def model_folder(self, model: str) -> Path:
        """The Triton model folder of ``model`` (``<repository>/<model>``)."""
        return self.path / model

    def version_file(self, model: str, filename: str, *, version: str = io_names.VERSION_DIR) -> Path:
        """``<model>/<version>/<filename>`` (every model built here has the one version ``1``)."""
        return self.path / model / version / filename

    def config_path(self, model: str) -> Path:
        """Where the ``config.pbtxt`` of ``model`` is (read it with :meth:`config`)."""
        return self.path / model / io_names.MODEL_CONFIG_FILE

    def has_model(self, model: str) -> bool:
        """Whether ``model`` has a folder with a config (what Triton loads as a model)."""
        return self.config_path(model).is_file()

    def model_folders(self) -> list[str]:
        """Names of the model folders (sub-folders holding a ``config.pbtxt``), sorted; OSError when the
        repository cannot be listed."""
        return sorted(p.name for p in self.path.iterdir() if self.has_model(p.name))

    def model_dirs(self) -> list[str]:
        """Deprecated name of :meth:`model_folders` (``model_dir`` means an nnU-Net results folder)."""
        warnings.warn("ModelRepository.model_dirs() is deprecated and will be removed in the next release: "
                      "use model_folders()", DeprecationWarning, stacklevel=2)
        return self.model_folders()

    # --- registry -------------------------------------------------------------------------------------

    def has_registry(self) -> bool:
        """Whether the repository has a registry file (was built by nnunet-triton); not whether it reads."""
        return (self.path / io_names.REPOSITORY_METADATA_FILE).is_file()

    def registry(self) -> Registry | None:
        """The registry; None when the repository has none (not built by this project).

        Raises:
            RepositoryError: the registry is unreadable, malformed or of another format.
        """
        return read_registry(self.path)

    def require_registry(self) -> Registry:
        """The registry; :class:`~nnunet_triton.errors.NotBuiltRepositoryError` when there is none."""
        return require_registry(self.path)

    def inference_config(self, endpoint: str = io_names.ENDPOINT_MODEL,
                         version: int | None = None) -> InferenceConfig:
        """The :class:`~nnunet_triton.numerics.plans.InferenceConfig` version ``version`` of ``endpoint`` was
        built from (default: the promoted version): the ``1/inference_config.json`` its preprocess,
        orchestrator or stitch model carries (an ensemble's first member's: members predict the same labels
        from the same channels).

        Raises:
            NotBuiltRepositoryError: the repository has no registry.
            RepositoryError: no such endpoint or version, or the version has no pipeline (a ``--folds``-only
                build), or its file is unreadable or malformed (names it).
        """
        from nnunet_triton.numerics.plans import InferenceConfig  # standard library only, read on use

        entry = self.require_registry().endpoint(endpoint)
        version = entry.promoted if version is None else version
        entry.version(version)
        namespace = io_names.model_namespace(endpoint, version)
        candidates = [namespace + prefix + step for prefix in ("", io_names.member_prefix(0))
                      for step in _CONFIG_MODELS]
        for model in candidates:
            path = self.version_file(model, io_names.INFERENCE_CONFIG_FILE)
            if path.is_file():
                try:
                    return InferenceConfig.load(path.parent)
                except (OSError, ValueError, KeyError, TypeError, PlansError) as exc:
                    raise RepositoryError(f"cannot read {str(path)!r}: {exc}") from None
        raise RepositoryError(
            f"{endpoint} version {version} in {str(self.path)!r} has no {io_names.VERSION_DIR}/"
            f"{io_names.INFERENCE_CONFIG_FILE} in any of {candidates}: it holds no pipeline (a --folds-only "
            "build?)."
        )

    def models(self) -> list[str]:
        """Every Triton model of the repository: the registry's (every version's and the public
        endpoints), or every model folder when there is no registry."""
        registry = self.registry()
        return list(registry.models()) if registry is not None else self.model_folders()

    def expected_models(self) -> tuple[list[str], list[str]]:
        """(models that must be loaded, models that may be): with a registry the public endpoints and their
        promoted versions, then every other version's models; without a readable one every model folder
        must be loaded (an older or hand-made repository)."""
        try:
            registry = self.registry()
        except RepositoryError:
            registry = None
        if registry is None:
            return self.model_folders(), []
        required = list(registry.required_models())
        return required, sorted(set(registry.models()) - set(required))

    # --- configs --------------------------------------------------------------------------------------

    def config(self, model: str) -> ModelConfigInfo:
        """The parsed ``config.pbtxt`` of ``model``.

        Raises:
            RepositoryError: it is missing, unreadable or not a model config (names the file).
        """
        try:
            return config_file.read_config(self.path / model)
        except (OSError, ValueError) as exc:
            raise RepositoryError(f"cannot read the config of model {model!r} in {str(self.path)!r}: "
                                  f"{exc}") from None

    def readable_configs(self, reader: str) -> Iterator[tuple[str, ModelConfigInfo]]:
        """``(model, config)`` of every model folder whose config reads; one that does not is skipped with a
        warning naming ``reader`` (a launch check: Triton refuses that model itself, naming the error)."""
        for model in self.model_folders():
            try:
                yield model, self.config(model)
            except RepositoryError as exc:
                LOGGER.warning("%s: skipping model %s: %s", reader, model, exc)

    def configs(self) -> list[ModelConfigInfo]:
        """Every model folder's parsed config, in folder order."""
        return [self.config(model) for model in self.model_folders()]

    def is_ensemble(self, model: str) -> bool:
        """Whether ``model`` is an ensemble (False when its config cannot be read)."""
        try:
            return self.config(model).is_ensemble
        except RepositoryError:
            return False

    def config_text(self, model: str) -> str:
        """The ``config.pbtxt`` text of ``model`` (OSError when missing)."""
        return config_file.read_config_text(self.path / model)

    def write_config_text(self, model: str, text: str) -> Path:
        """Write ``text`` as the ``config.pbtxt`` of ``model`` (atomically); returns its path."""
        return config_file.write_config_text(self.path / model, text)
