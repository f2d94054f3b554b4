"""A model repository on disk, read (and its configs written) in one place.

Every reader of a repository goes through :class:`ModelRepository`: which model folders it holds (a folder
with a ``config.pbtxt``), the registry (``repository_metadata.json``, :mod:`nnunet_triton.registry`: the
endpoints, their versions, the public endpoints and the models of each version), each model's config and
the files in its version folder. Configs are parsed and rendered by :mod:`nnunet_triton.builder.config_gen`
(the only module that opens a ``config.pbtxt``), imported when a config is first read, so the layout and
the registry stay standard-library only for the container's health probe (Python 3.10 there).

Used by the launchers (thread budget, backends), the health probe, rollouts and deploy
(``server/deploy/repository_info``, whose facts ``sizing`` reads).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from nnunet_triton import io_names
from nnunet_triton.errors import RepositoryError
from nnunet_triton.registry import Registry, read_registry

if TYPE_CHECKING:
    from nnunet_triton.builder.config_gen import ModelConfigInfo, ModelSpec

__all__ = ["ModelRepository"]

LOGGER = logging.getLogger(__name__)


class ModelRepository:
    """The repository folder ``path``. Nothing is cached: every call reads the disk as it is now (a build,
    promotion or removal may change it between calls)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"ModelRepository({str(self.path)!r})"

    # --- layout ---------------------------------------------------------------------------------------

    def model_dir(self, model: str) -> Path:
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

    def model_dirs(self) -> list[str]:
        """Names of the model folders (sub-folders holding a ``config.pbtxt``), sorted; OSError when the
        repository cannot be listed."""
        return sorted(p.name for p in self.path.iterdir() if self.has_model(p.name))

    # --- registry -------------------------------------------------------------------------------------

    def registry(self) -> Registry | None:
        """The registry; None when the repository has none (not built by this project).

        Raises:
            RepositoryError: the registry is unreadable, malformed or of another format.
        """
        return read_registry(self.path)

    def require_registry(self) -> Registry:
        """The registry; RepositoryError when there is none."""
        registry = self.registry()
        if registry is None:
            raise RepositoryError(f"{str(self.path)!r} is not a model repository built by nnunet-triton (no "
                                  f"{io_names.REPOSITORY_METADATA_FILE}).")
        return registry

    def models(self) -> list[str]:
        """Every Triton model of the repository: the registry's (every version's and the public
        endpoints), or every model folder when there is no registry."""
        registry = self.registry()
        return list(registry.models()) if registry is not None else self.model_dirs()

    def expected_models(self) -> tuple[list[str], list[str]]:
        """(models that must be loaded, models that may be): with a registry the public endpoints and their
        promoted versions, then every other version's models; without a readable one every model folder
        must be loaded (an older or hand-made repository)."""
        try:
            registry = self.registry()
        except RepositoryError:
            registry = None
        if registry is None:
            return self.model_dirs(), []
        required = list(registry.required_models())
        return required, sorted(set(registry.models()) - set(required))

    # --- configs --------------------------------------------------------------------------------------

    def config(self, model: str) -> ModelConfigInfo:
        """The parsed ``config.pbtxt`` of ``model``.

        Raises:
            RepositoryError: it is missing, unreadable or not a model config (names the file).
        """
        from nnunet_triton.builder.config_gen import read_config

        try:
            return read_config(self.path / model)
        except (OSError, ValueError) as exc:
            raise RepositoryError(f"cannot read the config of model {model!r} in {str(self.path)!r}: "
                                  f"{exc}") from None

    def readable_configs(self, reader: str) -> Iterator[tuple[str, ModelConfigInfo]]:
        """``(model, config)`` of every model folder whose config reads; one that does not is skipped with a
        warning naming ``reader`` (a launch check: Triton refuses that model itself, naming the error)."""
        for model in self.model_dirs():
            try:
                yield model, self.config(model)
            except RepositoryError as exc:
                LOGGER.warning("%s: skipping model %s: %s", reader, model, exc)

    def configs(self) -> list[ModelConfigInfo]:
        """Every model folder's parsed config, in folder order."""
        return [self.config(model) for model in self.model_dirs()]

    def is_ensemble(self, model: str) -> bool:
        """Whether ``model`` is an ensemble (False when its config cannot be read)."""
        try:
            return self.config(model).is_ensemble
        except RepositoryError:
            return False

    def config_text(self, model: str) -> str:
        """The ``config.pbtxt`` text of ``model`` (OSError when missing)."""
        from nnunet_triton.builder.config_gen import read_config_text

        return read_config_text(self.path / model)

    def write_config(self, spec: ModelSpec) -> Path:
        """Render ``spec`` into ``<spec.name>/config.pbtxt`` (atomically); returns its path."""
        from nnunet_triton.builder.config_gen import write_config

        return write_config(spec, self.path / spec.name)

    def write_config_text(self, model: str, text: str) -> Path:
        """Write ``text`` as the ``config.pbtxt`` of ``model`` (atomically); returns its path."""
        from nnunet_triton.builder.config_gen import write_config_text

        return write_config_text(self.path / model, text)
