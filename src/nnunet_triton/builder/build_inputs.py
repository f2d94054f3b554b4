"""What a built repository depends on: input hash, adapters, the builder's own code.

``compute_input_hash`` covers the plans, dataset.json, the checkpoints, the build options, the model.py
adapters (generated from the package, :func:`adapter_source`), the package version and the source of every
module the builder runs (its import closure, computed: :func:`generating_code`), so a re-run with the same
inputs is a no-op and any change rebuilds.
How a version lands in the repository (staged in a sibling folder, moved in under the lock, the registry
last): ``builder.repository``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from nnunet_triton import __version__ as NNUNET_TRITON_VERSION
from nnunet_triton import io_names
from nnunet_triton.builder import torchscript as export
from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner
from nnunet_triton.numerics.model_folder import CHECKPOINT_NAME
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.postprocessing import (
    PostprocessingPlan,
)
from nnunet_triton.util.hashing import sha256_file

__all__ = [
    "ADAPTERS",
    "adapter_source",
    "generating_code",
    "compute_input_hash",
]

LOGGER = logging.getLogger(__name__)



# model name -> the serving step its model.py imports (nnunet_triton.serving.steps.<step>)
ADAPTERS = {
    io_names.PREPROCESS_MODEL: "preprocess",
    io_names.ORCHESTRATOR_MODEL: "orchestrator",
    io_names.STITCH_MODEL: "stitch",
}
FOLD_RUNNER_ADAPTER = "fold_runner"
FOLD_RUNNER_KEY = "fold runner"  # adapters_needed's key of the fold runner (every fold model writes one)
COMBINE_ADAPTER = "combine"
# what each model does, for its model.py's docstring
_WHAT = {
    "preprocess": ("preprocess_model", "IMAGE + SPACING -> PREPROCESSED + CASE_PROPERTIES"),
    "orchestrator": ("orchestrator_model", "PREPROCESSED -> LOGITS, tiles fanned out to the folds by BLS"),
    "fold_runner": ("fold_<k>", "INPUT__0 -> OUTPUT__0, one fold's TorchScript network (Python backend)"),
    "stitch": ("stitch_model", "LOGITS + CASE_PROPERTIES -> SEGMENTATION (+ PROBABILITIES)"),
    "combine": ("combine_model", "the members' PROBABILITIES -> SEGMENTATION (ensemble of configurations)"),
}
# the modules whose code decides what a build writes: their import closure is hashed into input_hash
_BUILDER_ENTRIES = ("nnunet_triton.builder.repository", "nnunet_triton.builder.build_inputs")


def adapter_source(step: str) -> str:
    """The ``model.py`` a repository holds for ``step``: a few lines importing the step's
    ``TritonPythonModel`` from the installed package (``nnunet_triton.serving.steps.<step>``).

    Raises:
        KeyError: ``step`` is not a serving step.
    """
    model, what = _WHAT[step]
    return (f'"""Triton model ``{model}``: {what}.\n\n'
            f"The step lives in the installed package: :mod:`nnunet_triton.serving.steps.{step}`.\n"
            '"""\n\n'
            f"from nnunet_triton.serving.steps.{step} import TritonPythonModel  # noqa: F401\n")


def adapters_needed(options: BuildOptions, folds_only: bool) -> dict[str, str]:
    """Model name (or ``"fold runner"``) -> the step its model.py imports."""
    adapters = {} if folds_only else dict(ADAPTERS)
    if options.runner is FoldRunner.PYTHON:
        adapters[FOLD_RUNNER_KEY] = FOLD_RUNNER_ADAPTER
    return adapters


def _imported(module: str) -> tuple[Path | None, set[str]]:
    """``module``'s file and the ``nnunet_triton`` modules it imports (lazy imports included)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None, set()
    path = Path(spec.origin)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("nnunet_triton")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
                "nnunet_triton"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # a submodule, or a name (skipped below)
    return path, found


def generating_code() -> dict[str, Path]:
    """Every ``nnunet_triton`` module the builder runs (its import closure, lazy imports included)."""
    seen: dict[str, Path] = {}
    todo = list(_BUILDER_ENTRIES)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        try:
            path, imports = _imported(module)
        except ModuleNotFoundError:  # ``from package import name``: a name, not a module
            continue
        if path is None:
            continue
        seen[module] = path
        parents = {".".join(module.split(".")[:i]) for i in range(2, module.count(".") + 1)}
        todo += sorted((imports | parents) - set(seen))
    return dict(sorted(seen.items()))


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
    for name, step in sorted(adapters_needed(options, folds_only).items()):
        add(f"adapter:{name}", adapter_source(step))
    for module, path in generating_code().items():
        add(f"code:{module}", sha256_file(path))
    return digest.hexdigest()


def torch_version() -> str:
    import torch

    return torch.__version__


def replace_directory(tmp: Path, out: Path) -> None:
    """Swap the finished ``tmp`` into ``out`` (renames within one directory, old copy removed last)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{time.time_ns()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
