"""The registry of a built model repository: its endpoint names, their versions, the promoted version of each.

One file at the repository root, ``repository_metadata.json`` (Triton ignores plain files there)::

    {"format": 2,
     "endpoints": {
       "liver": {"promoted": 2, "previous": 1,
                 "versions": {"1": {<what the builder recorded: input_hash, folds, models, exports, ...>},
                              "2": {...}}},
       "nnunet": {"promoted": 1, "previous": null, "versions": {"1": {...}}}}}

Each version's ``models`` lists its own Triton models (composing models under the namespace
``io_names.model_namespace`` and its pinned endpoints ``<name>__v<N>``, typed copies included); the public
endpoints (``io_names.public_endpoints``) belong to the name and run the ``promoted`` version. The registry
is the commit point of every change: the builder writes a version's model folders first and the registry
last (:func:`write_registry`, an atomic rename), under :func:`locked`, so a folder no version lists is a
leftover of an interrupted build that the next build of that version removes.

Only the standard library: the container's health probe and entry point read it (Python 3.10 there). Read
it through :class:`~nnunet_triton.repository.ModelRepository` (``registry()``, ``require_registry()``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.errors import NotBuiltRepositoryError, OlderRepositoryError, RepositoryError
from nnunet_triton.util.durable import write_text_atomic

__all__ = [
    "FORMAT",
    "VersionEntry",
    "EndpointEntry",
    "Registry",
    "read_registry",
    "require_registry",
    "version_metadata",
    "write_registry",
    "locked",
]

FORMAT = 2


@dataclass(frozen=True)
class VersionEntry:
    """One built version of an endpoint: what the builder recorded about it."""

    name: str
    version: int
    metadata: Mapping[str, Any]

    @property
    def models(self) -> tuple[str, ...]:
        """Its own Triton models: composing models and pinned endpoints (not the public endpoints)."""
        return tuple(sorted(self.metadata.get("models", ())))

    @property
    def input_hash(self) -> str | None:
        value = self.metadata.get("input_hash")
        return str(value) if value else None

    @property
    def pinned(self) -> str:
        """The endpoint that always runs exactly this version (``liver__v2``)."""
        return io_names.pinned_endpoint(self.name, self.version)

    @property
    def namespace(self) -> str:
        return io_names.model_namespace(self.name, self.version)


@dataclass(frozen=True)
class EndpointEntry:
    """One endpoint name: its versions and which one the public endpoint runs."""

    name: str
    promoted: int
    previous: int | None = None  # the version promoted before ``promoted`` (what a rollback returns to)
    versions: Mapping[int, VersionEntry] = field(default_factory=dict)

    def version(self, version: int) -> VersionEntry:
        """The entry of ``version``; RepositoryError naming the versions there are."""
        try:
            return self.versions[version]
        except KeyError:
            raise RepositoryError(
                f"endpoint {self.name!r} has no version {version} (versions: {sorted(self.versions)}, "
                f"promoted: {self.promoted})."
            ) from None

    @property
    def latest(self) -> int:
        return max(self.versions)

    @property
    def public_models(self) -> tuple[str, ...]:
        """The public endpoint and its typed copies (none when the promoted version has no endpoint: a build
        of the fold models only)."""
        promoted = self.versions.get(self.promoted)
        if promoted is None or promoted.pinned not in promoted.models:
            return ()
        return io_names.public_endpoints(self.name)

    def to_dict(self) -> dict[str, Any]:
        return {"promoted": self.promoted, "previous": self.previous,
                "versions": {str(v): dict(e.metadata) for v, e in sorted(self.versions.items())}}


@dataclass(frozen=True)
class Registry:
    """Every endpoint of one repository (immutable; the ``with_*``/``without_*`` methods return new ones)."""

    endpoints: Mapping[str, EndpointEntry] = field(default_factory=dict)

    def endpoint(self, name: str) -> EndpointEntry:
        """The entry of ``name``; RepositoryError naming the endpoints there are."""
        try:
            return self.endpoints[name]
        except KeyError:
            raise RepositoryError(
                f"the repository has no endpoint {name!r} (endpoints: {sorted(self.endpoints) or 'none'})."
            ) from None

    def models(self) -> tuple[str, ...]:
        """Every Triton model of the repository: every version's models and every public endpoint."""
        found: set[str] = set()
        for entry in self.endpoints.values():
            found.update(entry.public_models)
            for version in entry.versions.values():
                found.update(version.models)
        return tuple(sorted(found))

    def required_models(self) -> tuple[str, ...]:
        """What must be loaded for every public endpoint to answer: the public endpoints and the models of
        their promoted versions (other versions may be loaded too, or not)."""
        found: set[str] = set()
        for entry in self.endpoints.values():
            found.update(entry.public_models)
            found.update(entry.version(entry.promoted).models)
        return tuple(sorted(found))

    def owner(self, model: str) -> tuple[str, int | None] | None:
        """(endpoint, version) a model belongs to; version None for a public endpoint; None if unknown."""
        for entry in self.endpoints.values():
            if model in entry.public_models:
                return entry.name, None
            for version in entry.versions.values():
                if model in version.models:
                    return entry.name, version.version
        return None

    def with_version(self, name: str, version: int, metadata: Mapping[str, Any], *,
                     promote: bool = False) -> Registry:
        """This registry with ``version`` of ``name`` (added or replaced); a new name's first version is
        promoted, and so is any version when ``promote``."""
        io_names.check_endpoint_name(name)
        entry = self.endpoints.get(name)
        versions = dict(entry.versions) if entry else {}
        versions[version] = VersionEntry(name, version, dict(metadata))
        if entry is None:
            entry = EndpointEntry(name, promoted=version, previous=None, versions=versions)
        else:
            entry = replace(entry, versions=versions)
            if promote and entry.promoted != version:
                entry = replace(entry, promoted=version, previous=entry.promoted)
        return replace(self, endpoints={**self.endpoints, name: entry})

    def with_promoted(self, name: str, version: int) -> Registry:
        """``version`` of ``name`` promoted (the one it replaces becomes ``previous``)."""
        entry = self.endpoint(name)
        entry.version(version)
        if entry.promoted == version:
            return self
        promoted = replace(entry, promoted=version, previous=entry.promoted)
        return replace(self, endpoints={**self.endpoints, name: promoted})

    def without_version(self, name: str, version: int) -> Registry:
        """This registry without ``version`` of ``name``; the promoted version cannot go (promote or roll
        back to another first), and the last version goes with ``without_endpoint``."""
        entry = self.endpoint(name)
        entry.version(version)
        if version == entry.promoted:
            raise RepositoryError(
                f"version {version} of {name!r} is promoted (its public endpoint runs it): promote another "
                f"version first, or remove the whole endpoint (remove --endpoint {name} without "
                "--endpoint-version)."
            )
        versions = {v: e for v, e in entry.versions.items() if v != version}
        previous = None if entry.previous == version else entry.previous
        return replace(self, endpoints={**self.endpoints,
                                        name: replace(entry, versions=versions, previous=previous)})

    def without_endpoint(self, name: str) -> Registry:
        self.endpoint(name)
        return replace(self, endpoints={k: v for k, v in self.endpoints.items() if k != name})

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "endpoints": {name: entry.to_dict() for name, entry in
                                                           sorted(self.endpoints.items())}},
                          indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str = "registry") -> Registry:
        """Parse a registry; RepositoryError naming the file and the rule for anything malformed (the file
        is read by servers and probes: a hand-edited value must not turn into a traceback)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RepositoryError(f"{where} is not valid JSON: {exc}.") from None
        if not isinstance(data, dict):
            raise RepositoryError(f"{where} must hold a JSON object, got {type(data).__name__}.")
        if data.get("format") != FORMAT:
            if "input_hash" in data and "format" not in data:
                raise OlderRepositoryError(
                    f"{where} was written by an older nnunet-triton (one model per repository, no endpoint "
                    "registry): build the repository again (build --force, or into a new folder).")
            raise RepositoryError(f"{where} has format {data.get('format')!r}; this nnunet-triton reads "
                                  f"format {FORMAT}.")
        endpoints = {}
        raw = data.get("endpoints")
        if not isinstance(raw, dict):
            raise RepositoryError(f"{where}: 'endpoints' must be an object, got {type(raw).__name__}.")
        for name, entry in raw.items():
            endpoints[name] = _endpoint_from_dict(name, entry, where)
        return cls(endpoints=endpoints)


def _endpoint_from_dict(name: str, entry: Any, where: str) -> EndpointEntry:
    try:
        io_names.check_endpoint_name(name)
    except ValueError as exc:
        raise RepositoryError(f"{where}: {exc}") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("versions"), dict) or not entry["versions"]:
        raise RepositoryError(f"{where}: endpoint {name!r} needs an object with a non-empty 'versions'.")
    versions = {}
    for key, metadata in entry["versions"].items():
        try:
            version = io_names.check_version(key)
        except ValueError as exc:
            raise RepositoryError(f"{where}: endpoint {name!r}: {exc}") from None
        if not isinstance(metadata, dict) or not isinstance(metadata.get("models"), list):
            raise RepositoryError(f"{where}: version {version} of {name!r} needs an object with a 'models' "
                                  "list.")
        versions[version] = VersionEntry(name, version, metadata)
    promoted, previous = entry.get("promoted"), entry.get("previous")
    if promoted not in versions or isinstance(promoted, bool):
        raise RepositoryError(f"{where}: endpoint {name!r} promotes version {promoted!r}, which is not one "
                              f"of its versions {sorted(versions)}.")
    if previous is not None and (previous not in versions or isinstance(previous, bool)):
        previous = None  # the version it named was removed: nothing to roll back to
    return EndpointEntry(name, promoted=promoted, previous=previous, versions=versions)


def read_registry(repository: str | Path) -> Registry | None:
    """The registry of ``repository``; None when it has no registry file (not built by this project).

    Raises:
        RepositoryError: the file is unreadable, malformed, or of another format.
    """
    path = Path(repository) / io_names.REPOSITORY_METADATA_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RepositoryError(f"cannot read {str(path)!r}: {exc}.") from None
    return Registry.from_json(text, where=str(path))


def require_registry(repository: str | Path) -> Registry:
    """The registry of ``repository``.

    Raises:
        NotBuiltRepositoryError: it has none (the one "not built by nnunet-triton" refusal of the project).
        RepositoryError: it is unreadable, malformed, or of another format.
    """
    registry = read_registry(repository)
    if registry is None:
        raise NotBuiltRepositoryError(
            f"{str(repository)!r} is not a model repository built by nnunet-triton (no "
            f"{io_names.REPOSITORY_METADATA_FILE}): build one with `nnunet-triton build --model-dir <results "
            "folder> --model-repository <folder>`.")
    return registry


def version_metadata(repository: str | Path, name: str = io_names.ENDPOINT_MODEL,
                     version: int | None = None) -> dict[str, Any]:
    """What the builder recorded of version ``version`` of ``name`` (default: the promoted version).

    Raises:
        NotBuiltRepositoryError: no registry.
        RepositoryError: no such endpoint or version.
    """
    entry = require_registry(repository).endpoint(name)
    return dict(entry.version(entry.promoted if version is None else version).metadata)


def write_registry(repository: str | Path, registry: Registry) -> None:
    """Replace the registry file atomically and durably (``util.durable``): readers see old or new."""
    write_text_atomic(Path(repository) / io_names.REPOSITORY_METADATA_FILE, registry.to_json() + "\n")


@contextlib.contextmanager
def locked(repository: str | Path, *, timeout_s: float = 600.0) -> Iterator[Path]:
    """Hold the repository's lock (``flock`` on its directory) while changing it: one build, promotion or
    removal at a time. The directory is created when missing; nothing is written for the lock itself."""
    import time

    root = Path(repository)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                    raise RepositoryError(f"could not lock repository {str(root)!r} within {timeout_s:.0f} s "
                                          f"(another build, promotion or removal holds it): {exc}.") from None
                time.sleep(0.1)
        yield root
    finally:
        os.close(fd)
