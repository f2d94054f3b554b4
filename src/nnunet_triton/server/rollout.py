"""Versions on a running server: load one, promote it, roll back, remove one, without a restart and without a
failed or mixed answer.

An endpoint name ``E`` (``io_names``) has versions 1, 2, ... Each version is a whole pipeline under its own
namespace with its own pinned endpoint ``E__vN``; the public endpoint ``E`` (and its typed copies) is an
ensemble with the promoted version's steps. So:

* **load** a version: every model of it (fold models first: the orchestrator reaches them by BLS, which the
  repository manager does not see; then the Python models; then the pinned endpoints), through Triton's
  model-control API. A loaded version answers on ``E__vN`` (``validate --endpoint E --version N``).
* **promote** version N: load it (a no-op when loaded), rewrite ``E``'s config.pbtxt files with N's steps
  (each replaced atomically) and load them again. Triton swaps a reloaded model only once the new one is
  ready, and requests it already took finish on the old one: every request runs entirely on one version
  (measured: ``tests/triton/test_many_models.py`` drives 4 clients through a promotion and a rollback with no
  error and every answer equal to one version's). The typed copies are reloaded one after the other, so for
  a moment ``E`` and ``E_int16`` may run different versions; each answer is still one version's.
* **rollback**: promote the version promoted before (the registry's ``previous``).
* **remove** a version (not the promoted one) or a whole name: unload its models (endpoints first), then
  delete their folders (``builder.repository.remove_endpoint``).

Every change holds the repository's lock (``registry.locked``) and commits the registry last. Without a server
(``control`` None) only the files change; a server started later loads what the registry lists.

The model-control API is restricted to the launcher's token (``server.model_control``):
:func:`local_control` finds the server ``nnunet-triton serve`` recorded for a repository; another server
needs its URL and ``$NNUNET_TRITON_CONTROL_TOKEN``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.builder.repository import remove_endpoint, write_public_endpoints
from nnunet_triton.errors import RepositoryError, ServerError
from nnunet_triton.repository import ModelRepository
from nnunet_triton.repository.registry import Registry, locked, write_registry
from nnunet_triton.server.handle import recorded_server
from nnunet_triton.server.model_control import ModelControl

__all__ = [
    "ModelControl",  # re-exported: the control every function here takes
    "RolloutStep",
    "local_control",
    "load_version",
    "promote",
    "rollback",
    "remove",
    "versions",
]

LOGGER = logging.getLogger(__name__)


def local_control(repository: str | Path, home: str | Path | None = None) -> ModelControl | None:
    """The model control of the server ``nnunet-triton serve`` runs on ``repository`` (recorded in
    ``<home>/run/server.json``), or None when no such server runs."""
    handle = recorded_server(home)
    if handle is None or not handle.is_running() or \
            Path(handle.model_repository).resolve() != Path(repository).resolve():
        return None
    return ModelControl(handle.http_url, handle.control_token)


@dataclass(frozen=True)
class RolloutStep:
    """What one rollout command did."""

    name: str
    version: int | None
    models: tuple[str, ...]  # models loaded, reloaded or removed
    promoted: int | None  # the promoted version afterwards (None: the endpoint is gone)
    server: str | None  # the server changed (None: only the repository's files)

    def summary(self, action: str) -> str:
        where = (f"on the server at {self.server}" if self.server else
                 "in the repository only (no server: the change takes effect when one starts)")
        what = self.name if self.version is None else f"{self.name} version {self.version}"
        tail = f"; {self.name!r} runs version {self.promoted}" if self.promoted is not None else ""
        return f"{action} {what} {where} ({len(self.models)} models){tail}"


def _registry(repository: Path) -> Registry:
    return ModelRepository(repository).require_registry()


def _load_order(repository: Path, models: Sequence[str]) -> list[str]:
    """Fold and Python models first (BLS callees and ensemble steps), the ensembles last."""
    return sorted(models, key=lambda m: (ModelRepository(repository).is_ensemble(m), m))


def _load_all(repository: Path, models: Sequence[str], control: ModelControl) -> None:
    for model in _load_order(repository, models):
        LOGGER.info("loading %s", model)
        control.load(model)


def load_version(repository: str | Path, name: str, version: int, control: ModelControl) -> RolloutStep:
    """Load every model of version ``version`` of ``name`` into the server (already loaded: no-op)."""
    repository = Path(repository)
    with locked(repository):
        registry = _registry(repository)
        entry = registry.endpoint(name)
        models = entry.version(version).models
        _load_all(repository, models, control)
    return RolloutStep(name, version, models, entry.promoted, control.url)


def promote(repository: str | Path, name: str, version: int, control: ModelControl | None = None
            ) -> RolloutStep:
    """Make the public endpoint ``name`` (and its typed copies) run version ``version``.

    Raises:
        RepositoryError: no such endpoint or version.
        ServerError: the server refused to load the version or the endpoint; the public endpoint is put back
            to the version it ran (its config files and, when the server took the new one, a reload).
    """
    repository = Path(repository)
    with locked(repository):
        registry = _registry(repository)
        entry = registry.endpoint(name)
        models = entry.version(version).models
        old = entry.promoted
        if control is not None:
            _load_all(repository, models, control)
        public = write_public_endpoints(repository, repository, name, version)
        if control is not None:
            try:
                for model in public:
                    control.load(model)
            except ServerError:
                write_public_endpoints(repository, repository, name, old)
                for model in public:
                    try:
                        control.load(model)
                    except ServerError as exc:
                        LOGGER.error("could not reload %s with version %d after the failed promotion: %s",
                                     model, old, exc)
                raise
        write_registry(repository, registry.with_promoted(name, version))
    LOGGER.info("%s now runs version %d (was %d)", name, version, old)
    return RolloutStep(name, version, (*public, *models) if control else tuple(public), version,
                       control.url if control else None)


def rollback(repository: str | Path, name: str, control: ModelControl | None = None) -> RolloutStep:
    """Promote the version ``name`` ran before the last promotion.

    Raises:
        RepositoryError: no such endpoint, or nothing to roll back to (one promotion so far, or the version
            it ran before was removed).
    """
    entry = _registry(Path(repository)).endpoint(name)
    if entry.previous is None:
        raise RepositoryError(f"endpoint {name!r} has nothing to roll back to: version {entry.promoted} is "
                              f"the only one promoted so far (versions {sorted(entry.versions)}; promote one "
                              "with `nnunet-triton promote`).")
    return promote(repository, name, entry.previous, control)


def remove(repository: str | Path, name: str, version: int | None = None,
           control: ModelControl | None = None) -> RolloutStep:
    """Unload (with a server) and delete version ``version`` of ``name``, or the whole endpoint.

    Raises:
        RepositoryError: no such endpoint or version, or the promoted version while others remain.
    """
    repository = Path(repository)
    registry = _registry(repository)
    entry = registry.endpoint(name)
    if version is None:
        models = sorted({*entry.public_models, *(m for v in entry.versions.values() for m in v.models)})
        remaining = None
    else:
        models = list(entry.version(version).models)
        remaining = registry.without_version(name, version).endpoint(name).promoted  # refuses the promoted
    if control is not None:
        unloaded = []
        for model in reversed(_load_order(repository, models)):  # ensembles first
            if control.ready(model):
                LOGGER.info("unloading %s", model)
                control.unload(model)
                unloaded.append(model)
        control.wait_unloaded(unloaded)  # the folders go only once nothing runs from them
    removed = remove_endpoint(repository, name, version)
    return RolloutStep(name, version, tuple(removed), remaining, control.url if control else None)


def versions(repository: str | Path, control: ModelControl | None = None) -> list[dict[str, Any]]:
    """Every endpoint version of the repository: promoted or not, loaded on the server (None: no server),
    and what it serves."""
    registry = _registry(Path(repository))
    rows = []
    for name, entry in sorted(registry.endpoints.items()):
        for version, held in sorted(entry.versions.items()):
            meta = held.metadata
            rows.append({
                "endpoint": name, "version": version, "promoted": version == entry.promoted,
                "previous": version == entry.previous, "pinned_endpoint": held.pinned,
                "loaded": control.ready(held.pinned) if control is not None else None,
                "dataset": meta.get("dataset_name"), "configuration": meta.get("configuration"),
                "model_folder": meta.get("model_folder"), "folds": meta.get("folds"),
                "target": meta.get("target"), "input_hash": (held.input_hash or "")[:12],
                "ensemble_members": [m.get("model_folder") for m in meta.get("ensemble_members", ())] or None,
            })
    return rows


def format_versions(rows: Sequence[dict[str, Any]]) -> str:
    """A table of :func:`versions` for the terminal."""
    lines = [f"{'endpoint':<20} {'ver':>3}  {'state':<19} {'loaded':<6}  dataset / configuration (folds)"]
    for row in rows:
        state = "promoted" if row["promoted"] else ("previous (rollback)" if row["previous"] else "")
        loaded = {True: "yes", False: "no", None: "?"}[row["loaded"]]
        what = row["dataset"] or "?"
        if row["ensemble_members"]:
            what += " / ensemble of " + ", ".join(row["ensemble_members"])
        else:
            what += f" / {row['configuration']}"
        lines.append(f"{row['endpoint']:<20} {row['version']:>3}  {state:<19} {loaded:<6}  {what} "
                     f"({json.dumps(row['folds'])})")
    return "\n".join(lines)
