"""What a built repository depends on, and how a build lands: input hash, adapters, atomic replacement.

``compute_input_hash`` covers the plans, dataset.json, the checkpoints, the build options, the model.py
adapters and the generating code, so a re-run with the same inputs is a no-op and any change rebuilds.
The build happens in a temporary sibling directory (``staging``) that replaces the output only when
complete: a failure leaves the previous repository (or nothing) in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from nnunet_triton import __version__ as NNUNET_TRITON_VERSION
from nnunet_triton import io_names
from nnunet_triton.builder import torchscript as export
from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner
from nnunet_triton.builder.torchscript import sha256_file
from nnunet_triton.errors import PlansError
from nnunet_triton.numerics.model_folder import CHECKPOINT_NAME
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.postprocessing import (
    PostprocessingPlan,
)

__all__ = [
    "ADAPTERS",
    "compute_input_hash",
]

LOGGER = logging.getLogger(__name__)


# The model.py adapters live in the source checkout (preprocess_model/, repository/, network_models/ ...):
# src/nnunet_triton/builder/build_inputs.py -> the checkout root.
REPO_ROOT = Path(__file__).resolve().parents[3]


METADATA_FILE = io_names.REPOSITORY_METADATA_FILE


# model name -> its model.py adapter, relative to the source tree root
ADAPTERS = {
    io_names.PREPROCESS_MODEL: Path("preprocess_model/model.py"),
    io_names.ORCHESTRATOR_MODEL: Path("repository/orchestrator/model.py"),
    io_names.STITCH_MODEL: Path("stitch_model/model.py"),
}


FOLD_RUNNER_ADAPTER = Path("network_models/python_runner/model.py")


COMBINE_ADAPTER = Path("repository/ensemble_combine/model.py")


# code whose change changes the built repository (hashed into input_hash)
GENERATING_CODE = (
    *sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "src/nnunet_triton/builder").glob("*.py")),
    Path("src/nnunet_triton/numerics/plans.py"),
    Path("src/nnunet_triton/numerics/model_folder.py"),
    Path("src/nnunet_triton/numerics/postprocessing.py"),
    Path("src/nnunet_triton/io_names.py"),
    Path("src/nnunet_triton/parameters.py"),
    Path("src/nnunet_triton/dtypes.py"),
)


def adapters_needed(options: BuildOptions, folds_only: bool) -> dict[str, Path]:
    adapters = {} if folds_only else dict(ADAPTERS)
    if options.runner is FoldRunner.PYTHON:
        adapters["fold runner"] = FOLD_RUNNER_ADAPTER
    missing = {name: str(path) for name, path in adapters.items() if not (REPO_ROOT / path).is_file()}
    if missing:
        raise PlansError(
            f"cannot build the repository: model.py adapters are missing from the source tree: {missing}."
        )
    return {name: REPO_ROOT / path for name, path in adapters.items()}


def compute_input_hash(model_dir: Path, config: InferenceConfig, options: BuildOptions, *, folds_only: bool,
                       export_options: export.ExportOptions, checkpoint_name: str = CHECKPOINT_NAME,
                       postprocessing: PostprocessingPlan | None = None) -> str:
    """sha256 over everything the built repository depends on (inputs, options, adapters, code)."""
    digest = hashlib.sha256()

    def add(label: str, value: str) -> None:
        digest.update(f"{label}={value}\n".encode())

    add("nnunet_triton", NNUNET_TRITON_VERSION)
    add("torch", torch_version())
    add("nnunetv2", importlib.metadata.version("nnunetv2"))
    add("options", json.dumps(asdict(options), sort_keys=True, default=str))
    add("export", json.dumps(asdict(export_options), sort_keys=True, default=str))
    add("folds_only", str(folds_only))
    add("config", config.to_json())
    add("postprocessing", postprocessing.to_json() if postprocessing is not None else "none")
    for name in ("plans.json", "dataset.json"):
        add(name, sha256_file(model_dir / name))
    for fold in config.folds:
        add(f"fold_{fold}", sha256_file(model_dir / f"fold_{fold}" / checkpoint_name))
    for name, path in sorted(adapters_needed(options, folds_only).items()):
        add(f"adapter:{name}", sha256_file(path))
    for path in GENERATING_CODE:
        add(f"code:{path}", sha256_file(REPO_ROOT / path))
    return digest.hexdigest()


def torch_version() -> str:
    import torch

    return torch.__version__


def existing_hash(out: Path) -> str | None:
    try:
        return json.loads((out / METADATA_FILE).read_text()).get("input_hash")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def up_to_date(out: Path, input_hash: str, force: bool) -> bool:
    """True when ``out`` was built from exactly these inputs; refuses to replace a foreign directory."""
    existing = existing_hash(out) if out.exists() else None
    if out.exists() and existing is None and not force:
        raise PlansError(
            f"output {str(out)!r} exists but has no {METADATA_FILE}; refusing to replace it (use --force)."
        )
    if existing == input_hash and not force:
        LOGGER.info("%s is up to date (input hash %s)", out, input_hash[:12])
        return True
    return False


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to build into; swapped in when the block ends, removed on any error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        yield tmp
        replace_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_directory(tmp: Path, out: Path) -> None:
    """Swap the finished ``tmp`` into ``out`` (renames within one directory, old copy removed last)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{time.time_ns()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
