"""The model repositories a benchmark serves: the pipeline (``repository.build``) and the monolith.

Pipeline repositories go to ``build/perf/repos/<workload>/<variant>``; the builder skips a rebuild
when its input hash is unchanged, so only the first run pays for the export.

Benchmark builds use :func:`light_export`, which changes two things for the duration of a build:
the builder's reload check runs once at batch sizes 2 and 1 instead of three times at 2, 1 and 3
(the default costs ~32 full-size tile forwards per fold, about 15 min per fold for nnU-Net's default
3d_fullres network on two shared cores; the full check is the export tests' job), and every
``model.pt`` is cached under ``build/perf/export-cache`` keyed by the checkpoint's sha256, the
export options and the torch version, so the realistic folds (one shared random weight set) and
every tuning variant reuse one export. Both go through the builder's module attributes because
``build_repository`` takes no export options; the export options still enter its input hash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.util.hashing import sha256_file
from tools.perf.monolith import build_monolith_repository

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["REPOS_ROOT", "pipeline_repository", "monolith_repository", "light_export"]

REPOS_ROOT = REPO_ROOT / "build" / "perf" / "repos"
EXPORT_CACHE = REPO_ROOT / "build" / "perf" / "export-cache"


@dataclass(frozen=True)
class _CachedExport:
    """What the builder needs from an export result (it only calls ``to_dict``)."""

    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


@cache
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    """``sha256_file``, cached per (path, size, mtime)."""
    return sha256_file(path)


def _cache_entry(checkpoint: Path, options: Any) -> Path:
    import torch

    stat = checkpoint.stat()
    key = f"{_file_sha256(checkpoint, stat.st_size, stat.st_mtime_ns)}|{options!r}|{torch.__version__}"
    return EXPORT_CACHE / hashlib.sha256(key.encode()).hexdigest()[:32]


@contextlib.contextmanager
def light_export() -> Iterator[None]:
    """Reload check once at batch sizes (2, 1); one export per distinct checkpoint, cached on disk."""
    from nnunet_triton.builder import repository as build
    from nnunet_triton.builder import torchscript as export

    original_options, original_export = build._export_options, export.export_fold

    def options(build_options: BuildOptions, device: str | None) -> Any:
        default = original_options(build_options, device)
        return dataclasses.replace(default, check_batch_sizes=(1,), check_runs=1)

    def export_fold(model_dir: Any, fold: Any, out_path: Any, *, options: Any = None) -> Any:
        entry = _cache_entry(Path(model_dir) / f"fold_{fold}" / options.checkpoint_name, options)
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        if (entry / "export.json").is_file():
            shutil.copyfile(entry / "model.pt", out_path)
            data = json.loads((entry / "export.json").read_text())
            return _CachedExport({**data, "fold": fold, "path": str(out_path), "cached_from": entry.name})
        result = original_export(model_dir, fold, out_path, options=options)
        tmp = entry.with_name(f".{entry.name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shutil.copyfile(out_path, tmp / "model.pt")
        (tmp / "export.json").write_text(json.dumps(result.to_dict(), default=str))
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
        return result

    build._export_options, export.export_fold = options, export_fold
    try:
        yield
    finally:
        build._export_options, export.export_fold = original_options, original_export


def pipeline_repository(model_dir: Path, workload: str, *, variant: str = "default",
                        options: BuildOptions | None = None, folds: tuple[int, ...] | None = None,
                        light: bool = True) -> Path:
    """Build (or reuse) the ``nnunet`` pipeline repository for ``workload``/``variant``."""
    from nnunet_triton.builder.repository import build_repository

    out = REPOS_ROOT / workload / variant
    with light_export() if light else contextlib.nullcontext():
        return build_repository(model_dir, out, options=options or BuildOptions(), folds=folds).out


def monolith_repository(model_dir: Path, workload: str, *, folds: tuple[int, ...] | None = None,
                        instances: int = 1, device: str = "cpu") -> Path:
    """(Re)write the monolith repository for ``workload`` (hard links, so it is cheap)."""
    return build_monolith_repository(model_dir, REPOS_ROOT / workload / "monolith", folds=folds,
                                     instances=instances, device=device)
