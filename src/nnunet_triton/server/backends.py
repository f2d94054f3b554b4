"""The backends tritonserver loads: its own Python backend merged with built ones, checked before start.

Triton takes ONE ``--backend-directory`` (a later flag replaces an earlier one), holding
``<name>/libtriton_<name>.so`` per backend. The wheel's server home has only ``python/``; Triton's PyTorch
backend is built by ``make triton-backends`` (``server.backend_build``) into ``build/triton-backends``.
:func:`merged_backend_dir` makes one folder of symbolic links to both (under ``<home>/backends``, named
by what it links, so servers with different backends never share one), and :func:`check_backends`
refuses a repository whose configs name a backend that folder lacks, in one line, before the server
starts (Triton itself would start and fail ~10 s later with "unable to find backend library").
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from nnunet_triton.errors import ServerError
from nnunet_triton.repository import ModelRepository
from nnunet_triton.server.backend_build import DEFAULT_OUT

__all__ = ["BUILD_HINTS", "available_backends", "check_backends", "default_backend_dirs",
           "merged_backend_dir", "required_backends"]

# platform -> backend (Triton core's backend_model.cc: a config with only a platform names its backend so)
_PLATFORM_BACKENDS = {"pytorch_libtorch": "pytorch", "onnxruntime_onnx": "onnxruntime",
                      "tensorrt_plan": "tensorrt", "tensorflow_savedmodel": "tensorflow",
                      "tensorflow_graphdef": "tensorflow"}
LOGGER = logging.getLogger(__name__)
BUILD_HINTS = {"pytorch": "build it with `nnunet-triton install-backend pytorch` "
                          "(a checkout: `make triton-backends`)"}


def _backends_of(backend_dir: Path) -> dict[str, Path]:
    if not backend_dir.is_dir():
        return {}
    return {entry.name: entry for entry in sorted(backend_dir.iterdir())
            if (entry / f"libtriton_{entry.name}.so").is_file()}


def available_backends(backend_dir: str | Path) -> list[str]:
    """Names of the backends a ``--backend-directory`` folder holds (``<name>/libtriton_<name>.so``)."""
    return sorted(_backends_of(Path(backend_dir)))


def required_backends(repositories: Iterable[str | Path]) -> dict[str, list[str]]:
    """``{backend: [model, ...]}`` named by the top-level ``backend``/``platform`` of every model config.

    Ensembles have no backend. A platform maps to its backend (``pytorch_libtorch`` -> ``pytorch``). A config
    that cannot be read is skipped with a warning (Triton refuses that model itself, naming the error).
    """
    found: dict[str, list[str]] = {}
    for repository in map(ModelRepository, repositories):
        for _model, config in repository.readable_configs("backend check"):
            backend = config.backend or _PLATFORM_BACKENDS.get(config.platform or "")
            if backend:
                found.setdefault(backend, []).append(config.name)
    return found


def default_backend_dirs(cwd: Path | None = None) -> list[Path]:
    """Where ``make triton-backends`` puts built backends (``build/triton-backends``), when it exists."""
    folder = (cwd or Path.cwd()) / DEFAULT_OUT
    return [folder.absolute()] if _backends_of(folder) else []


def merged_backend_dir(own: Path, extra: Sequence[Path], home: Path) -> Path:
    """One backend folder linking ``own``'s backends and those of each ``extra`` folder (earlier wins).

    Raises:
        ServerError: an ``extra`` folder that is missing or holds no backend.
    """
    links: dict[str, Path] = {}
    for folder in (own, *extra):
        backends = _backends_of(Path(folder))
        if folder is not own and not backends:
            raise ServerError(f"--backend-directory {str(folder)!r} holds no backend (expected "
                              f"<name>/libtriton_<name>.so, e.g. pytorch/libtriton_pytorch.so).")
        for name, path in backends.items():
            links.setdefault(name, path.resolve())
    digest = hashlib.sha256("\n".join(f"{n}={p}" for n, p in sorted(links.items())).encode()).hexdigest()
    merged = home / "backends" / digest[:12]
    if not merged.is_dir():
        staging = merged.with_name(f"{merged.name}.staging-{os.getpid()}")
        staging.mkdir(parents=True, exist_ok=True)
        for name, path in links.items():
            (staging / name).unlink(missing_ok=True)
            (staging / name).symlink_to(path, target_is_directory=True)
        try:
            staging.rename(merged)
        except OSError:  # another process made the same folder first
            for entry in staging.iterdir():
                entry.unlink()
            staging.rmdir()
    return merged


def check_backends(repositories: Iterable[str | Path], backend_dir: Path) -> None:
    """Refuse, in one line, a repository whose configs name a backend ``backend_dir`` lacks.

    Raises:
        ServerError: naming the backend, a model that needs it and how to build it.
    """
    have = set(available_backends(backend_dir))
    for backend, models in sorted(required_backends(repositories).items()):
        if backend not in have:
            hint = BUILD_HINTS.get(backend, "pass a folder holding it with --backend-directory DIR")
            more = f" (and {len(models) - 1} more)" if len(models) > 1 else ""
            raise ServerError(f"model {models[0]!r}{more} "
                              f"needs Triton backend {backend!r}, which this server lacks (it has "
                              f"{', '.join(sorted(have)) or 'none'}): {hint}.")
