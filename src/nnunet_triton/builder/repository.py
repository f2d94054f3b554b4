"""Build a Triton model repository from a trained nnU-Net v2 results folder.

    python -m repository.build --model <Dataset.../Trainer__Plans__Config> [<more folders>] [--folds 0 1]
        [--out build/model_repository] [--target cpu|gpu] [--tile-batch-size 4] [--max-voxels N]
        [--max-request-bytes N] [--force]

Two or more ``--model`` folders build an ensemble of configurations (``build_ensemble_repository``).

What it writes (``<out>``)::

    repository_metadata.json            versions, plans sha256, folds, target, export checks, input hash
    nnunet/config.pbtxt, 1/             the ensemble endpoint
    preprocess_model/  orchestrator_model/  stitch_model/
        config.pbtxt, 1/model.py, 1/inference_config.json
    fold_<k>/config.pbtxt, 1/model.pt   (+ 1/model.py, 1/inference_config.json for the Python runner)

Every config.pbtxt comes from ``nnunet_triton.builder.model_specs``; every ``model.pt`` from
``nnunet_triton.builder.torchscript`` (reloaded and compared with the eager network before it is kept).

The build happens in a temporary sibling directory that replaces ``<out>`` only when complete, so a
failure leaves the previous repository (or nothing) in place. ``input_hash`` covers the plans,
dataset.json, the checkpoints, the build options, the adapters and the generating code; a re-run
with the same inputs is a no-op, any change rebuilds. Triton ignores plain files at the repository
root (verified with the embedded 2.51 server), so the metadata file can live there.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nnunet_triton import __version__ as NNUNET_TRITON_VERSION
from nnunet_triton import io_names
from nnunet_triton.builder import config_gen, model_specs
from nnunet_triton.builder import torchscript as export
from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner, Target
from nnunet_triton.errors import NnunetTritonError, PlansError
from nnunet_triton.numerics.ensembling import check_ensemble_members
from nnunet_triton.numerics.plans import CHECKPOINT_NAME, InferenceConfig, parse_fold, read_model_folder
from nnunet_triton.numerics.postprocessing import (
    POSTPROCESSING_FILE,
    PostprocessingPlan,
    find_postprocessing_pkl,
    load_postprocessing_pkl,
)
from nnunet_triton.options import ProbabilitiesOutput

# The model.py adapters live in the source checkout (preprocess_model/, repository/, network_models/ ...):
# src/nnunet_triton/builder/repository.py -> the checkout root.
REPO_ROOT = Path(__file__).resolve().parents[3]

__all__ = ["ADAPTERS", "BuildResult", "build_repository", "build_ensemble_repository", "compute_input_hash",
           "main"]

LOGGER = logging.getLogger(__name__)

METADATA_FILE = "repository_metadata.json"
CONFIG_FILE = "inference_config.json"
VERSION_DIR = "1"
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
    Path("src/nnunet_triton/builder/repository.py"),
    Path("src/nnunet_triton/builder/torchscript.py"),
    Path("src/nnunet_triton/builder/model_specs.py"),
    Path("src/nnunet_triton/builder/config_gen.py"),
    Path("src/nnunet_triton/numerics/plans.py"),
    Path("src/nnunet_triton/io_names.py"),
    Path("src/nnunet_triton/numerics/postprocessing.py"),
)


@dataclass(frozen=True)
class BuildResult:
    """Outcome of :func:`build_repository`."""

    out: Path
    rebuilt: bool  # False when the existing repository already matched the inputs
    input_hash: str
    seconds: float


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _adapters_needed(options: BuildOptions, folds_only: bool) -> dict[str, Path]:
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
    add("torch", _torch_version())
    add("nnunetv2", importlib.metadata.version("nnunetv2"))
    add("options", json.dumps(asdict(options), sort_keys=True, default=str))
    add("export", json.dumps(asdict(export_options), sort_keys=True, default=str))
    add("folds_only", str(folds_only))
    add("config", config.to_json())
    add("postprocessing", postprocessing.to_json() if postprocessing is not None else "none")
    for name in ("plans.json", "dataset.json"):
        add(name, _sha256_file(model_dir / name))
    for fold in config.folds:
        add(f"fold_{fold}", _sha256_file(model_dir / f"fold_{fold}" / checkpoint_name))
    for name, path in sorted(_adapters_needed(options, folds_only).items()):
        add(f"adapter:{name}", _sha256_file(path))
    for path in GENERATING_CODE:
        add(f"code:{path}", _sha256_file(REPO_ROOT / path))
    return digest.hexdigest()


def _torch_version() -> str:
    import torch

    return torch.__version__


def _existing_hash(out: Path) -> str | None:
    try:
        return json.loads((out / METADATA_FILE).read_text()).get("input_hash")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_python_model(model_dir: Path, adapter: Path, config: InferenceConfig) -> None:
    version = model_dir / VERSION_DIR
    version.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(adapter, version / "model.py")
    (version / CONFIG_FILE).write_text(config.to_json())


def _export_options(options: BuildOptions, export_device: str | None) -> export.ExportOptions:
    device = export_device or ("cuda" if options.fold_precision == "fp16" else "cpu")
    return export.ExportOptions(precision=options.fold_precision, device=device)


def _build_into(tmp: Path, model_dir: Path, config: InferenceConfig, options: BuildOptions, *,
                folds_only: bool, export_options: export.ExportOptions,
                postprocessing: PostprocessingPlan | None = None,
                previous: tuple[Path, InferenceConfig] | None = None) -> list[dict[str, Any]]:
    adapters = _adapters_needed(options, folds_only)
    exports = []
    specs = list(model_specs.repository_specs(config, options, folds_only=folds_only))
    if previous is not None and not folds_only:  # cascade: the previous stage's pipeline feeds this one
        cascade = model_specs.cascade_ensemble_spec(config)
        specs = [s for s in specs if not model_specs.is_endpoint(s)]
        specs += [cascade, *model_specs.typed_endpoint_specs(cascade)]
        exports += _build_prefixed_into(tmp, *previous, options, io_names.PREVIOUS_STAGE_PREFIX,
                                        export_options, probabilities=ProbabilitiesOutput.NEVER)
    for spec in specs:
        config_gen.write_config(spec, tmp / spec.name)
        (tmp / spec.name / VERSION_DIR).mkdir(exist_ok=True)  # Triton needs a version dir, ensembles too
        if spec.name in adapters:
            _write_python_model(tmp / spec.name, adapters[spec.name], config)
        if spec.name == io_names.STITCH_MODEL and postprocessing is not None:
            (tmp / spec.name / VERSION_DIR / POSTPROCESSING_FILE).write_text(postprocessing.to_json())
    exported: dict[str, export.ExportResult] = {}  # identical checkpoints are traced once
    for fold in config.folds:
        fold_dir = tmp / io_names.fold_model_name(fold) / VERSION_DIR
        result = export.export_fold_reusing(model_dir, fold, fold_dir / "model.pt", options=export_options,
                                            exported=exported)
        exports.append({**result.to_dict(), "path": str(Path(fold_dir.relative_to(tmp)) / "model.pt")})
        if options.runner is FoldRunner.PYTHON:
            _write_python_model(fold_dir.parent, adapters["fold runner"], config)
    return exports


def _metadata(model_dir: Path, config: InferenceConfig, options: BuildOptions, input_hash: str,
              exports: list[dict[str, Any]], *, folds_only: bool, seconds: float,
              postprocessing: PostprocessingPlan | None = None) -> dict[str, Any]:
    return {
        "input_hash": input_hash,
        "nnunet_triton_version": NNUNET_TRITON_VERSION,
        "nnunetv2_version": importlib.metadata.version("nnunetv2"),
        "torch_version": _torch_version(),
        "model_folder": model_dir.name,
        "dataset_name": config.dataset_name,
        "plans_name": config.plans_name,
        "configuration": config.configuration,
        "trainer_name": config.network.trainer_name,
        "plans_sha256": _sha256_file(model_dir / "plans.json"),
        "dataset_json_sha256": _sha256_file(model_dir / "dataset.json"),
        "folds": list(config.folds),
        "target": str(options.target),
        "fold_runner": str(options.runner),
        "fold_precision": options.fold_precision,
        "tile_batch_size": options.tile_batch_size,
        "build_options": json.loads(json.dumps(asdict(options), default=str)),
        "models": sorted(
            spec.name for spec in model_specs.repository_specs(config, options, folds_only=folds_only)
        ),
        "exports": exports,
        "postprocessing": None if postprocessing is None else json.loads(postprocessing.to_json()),
        "build_seconds": round(seconds, 3),
    }


def _up_to_date(out: Path, input_hash: str, force: bool) -> bool:
    """True when ``out`` was built from exactly these inputs; refuses to replace a foreign directory."""
    existing = _existing_hash(out) if out.exists() else None
    if out.exists() and existing is None and not force:
        raise PlansError(
            f"output {str(out)!r} exists but has no {METADATA_FILE}; refusing to replace it (use --force)."
        )
    if existing == input_hash and not force:
        LOGGER.info("%s is up to date (input hash %s)", out, input_hash[:12])
        return True
    return False


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to build into; swapped in when the block ends, removed on any error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        yield tmp
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, out: Path) -> None:
    """Swap the finished ``tmp`` into ``out`` (renames within one directory, old copy removed last)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{time.time_ns()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_repository(
    model_dir: str | Path,
    out: str | Path,
    *,
    options: BuildOptions | None = None,
    folds: Sequence[int | str] | None = None,
    configuration: str | None = None,
    force: bool = False,
    folds_only: bool = False,
    export_device: str | None = None,
    postprocessing: str | Path | None = "auto",
    previous_stage_model: str | Path | None = None,
) -> BuildResult:
    """Build (or keep, when up to date) the model repository ``out`` for the results folder ``model_dir``.

    Args:
        configuration: if given, must equal the configuration the checkpoints were trained with.
        force: rebuild even when up to date, and replace an ``out`` that is not a built repository.
        folds_only: only the fold models (testing the runners without the pipeline adapters).
        export_device: device to trace on (default cpu; cuda for fp16).
        postprocessing: ``"auto"`` applies nnU-Net's ``postprocessing.pkl`` from
            ``<model>/crossval_results_folds_<folds>/`` when it exists (where
            ``nnUNetv2_find_best_configuration`` writes it for exactly these folds); a path uses that pkl;
            ``None`` or ``"none"`` deploys no postprocessing.
        previous_stage_model: for a cascade stage (``previous_stage`` in its configuration), the previous
            stage's model folder; default: nnU-Net's sibling ``<trainer>__<plans>__<previous stage>``. Both
            stages run in one endpoint call (the previous stage's segmentation feeds this one).

    Raises:
        PlansError / UnsupportedModelError / ExportError: see ``read_model_folder`` and ``export_fold``;
        ``out`` is left untouched.
    """
    start = time.perf_counter()
    model_dir, out = Path(model_dir), Path(out)
    options = options or BuildOptions()
    config = read_model_folder(model_dir, folds=folds, allow_cascade=True)
    previous = _previous_stage(model_dir, config, previous_stage_model, folds)
    if configuration is not None and configuration != config.configuration:
        raise PlansError(
            f"--configuration {configuration!r} does not match the configuration {config.configuration!r} "
            f"the checkpoints in {str(model_dir)!r} were trained with."
        )
    export_options = _export_options(options, export_device)
    pp_plan = _postprocessing_plan(model_dir, config, postprocessing)
    input_hash = compute_input_hash(model_dir, config, options, folds_only=folds_only,
                                    export_options=export_options, postprocessing=pp_plan)
    if previous is not None:
        previous_hash = compute_input_hash(*previous, options, folds_only=False,
                                           export_options=export_options)
        input_hash = hashlib.sha256(f"{input_hash}\nprevious_stage={previous_hash}".encode()).hexdigest()
    if _up_to_date(out, input_hash, force):
        return BuildResult(out=out, rebuilt=False, input_hash=input_hash, seconds=time.perf_counter() - start)
    with _staging(out) as tmp:
        exports = _build_into(tmp, model_dir, config, options, folds_only=folds_only,
                              export_options=export_options, postprocessing=pp_plan, previous=previous)
        metadata = _metadata(model_dir, config, options, input_hash, exports, folds_only=folds_only,
                             seconds=time.perf_counter() - start, postprocessing=pp_plan)
        if previous is not None:
            metadata["previous_stage"] = {"model_folder": previous[0].name,
                                          "configuration": previous[1].configuration,
                                          "folds": list(previous[1].folds)}
            metadata["models"] = sorted(spec.name for spec in model_specs.cascade_repository_specs(
                previous[1], config, options))
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
    seconds = time.perf_counter() - start
    LOGGER.info("built %s in %.1f s (folds %s, target %s)", out, seconds, list(config.folds), options.target)
    return BuildResult(out=out, rebuilt=True, input_hash=input_hash, seconds=seconds)


def _previous_stage(model_dir: Path, config: InferenceConfig, explicit: str | Path | None,
                    folds: Sequence[int | str] | None) -> tuple[Path, InferenceConfig] | None:
    """The previous stage of a cascade stage (model folder, config); None for any other configuration."""
    if config.previous_stage is None:
        if explicit is not None:
            raise PlansError(
                f"a previous-stage model was given but configuration {config.configuration!r} of "
                f"{str(model_dir)!r} is not a cascade stage (its plans have no previous_stage)."
            )
        return None
    sibling = f"{config.network.trainer_name}__{config.plans_name}__{config.previous_stage}"
    previous_dir = Path(explicit) if explicit is not None else model_dir.parent / sibling
    if not (previous_dir / "plans.json").is_file():
        raise PlansError(
            f"configuration {config.configuration!r} is a cascade stage after {config.previous_stage!r}: its "
            f"model folder was expected at {str(previous_dir)!r} (nnU-Net's layout); pass the previous "
            "stage's folder explicitly (--previous-stage-model)."
        )
    previous = read_model_folder(previous_dir, folds=folds)
    if previous.configuration != config.previous_stage:
        raise PlansError(
            f"{str(previous_dir)!r} holds configuration {previous.configuration!r}, but the cascade stage "
            f"{config.configuration!r} expects its previous stage {config.previous_stage!r}."
        )
    if previous.labels != config.labels or previous.channel_names != config.channel_names:
        raise PlansError(
            f"previous stage {str(previous_dir)!r} predicts other labels or reads other channels than the "
            f"cascade stage {str(model_dir)!r}."
        )
    return previous_dir, previous


def _postprocessing_plan(model_dir: Path, config: InferenceConfig,
                         choice: str | Path | None) -> PostprocessingPlan | None:
    """The postprocessing to deploy (see ``build_repository``); an empty pkl choice deploys none."""
    if choice is None or str(choice) == "none":
        return None
    path = find_postprocessing_pkl(model_dir, config.folds) if str(choice) == "auto" else Path(choice)
    if path is None:
        return None
    plan = load_postprocessing_pkl(path)
    LOGGER.info("postprocessing from %s: %d step(s)", path, len(plan.steps))
    return plan if plan.steps else None


def _build_prefixed_into(tmp: Path, model_dir: Path, config: InferenceConfig, options: BuildOptions,
                         prefix: str, export_options: export.ExportOptions, *,
                         probabilities: ProbabilitiesOutput) -> list[dict[str, Any]]:
    """One pipeline's models with ``prefix`` on every name (ensemble member, cascade's previous stage)."""
    adapters = _adapters_needed(options, folds_only=False)
    by_name = {prefix + name: path for name, path in adapters.items()}
    exports = []
    specs = model_specs.prefixed_pipeline_specs(config, options, prefix,
                                                probabilities=probabilities)
    for spec in specs:
        config_gen.write_config(spec, tmp / spec.name)
        (tmp / spec.name / VERSION_DIR).mkdir(exist_ok=True)
        if spec.name in by_name:
            _write_python_model(tmp / spec.name, by_name[spec.name], config)
    exported: dict[str, export.ExportResult] = {}
    for fold in config.folds:
        fold_dir = tmp / (prefix + io_names.fold_model_name(fold)) / VERSION_DIR
        result = export.export_fold_reusing(model_dir, fold, fold_dir / "model.pt", options=export_options,
                                            exported=exported)
        exports.append({**result.to_dict(), "path": str(Path(fold_dir.relative_to(tmp)) / "model.pt")})
        if options.runner is FoldRunner.PYTHON:
            _write_python_model(fold_dir.parent, adapters["fold runner"], config)
    return exports


def build_ensemble_repository(
    model_dirs: Sequence[str | Path],
    out: str | Path,
    *,
    options: BuildOptions | None = None,
    folds: Sequence[int | str] | None = None,
    force: bool = False,
    export_device: str | None = None,
    postprocessing: str | Path | None = None,
) -> BuildResult:
    """An ensemble of configurations (``nnUNetv2_ensemble``) behind the one ``nnunet`` endpoint.

    Every model folder becomes a member pipeline (its folds averaged as usual); the members'
    probabilities are averaged in the given order by ``combine_model``. ``postprocessing`` is the
    ensemble's ``postprocessing.pkl`` (``nnUNetv2_find_best_configuration`` writes it under
    ``<results>/<dataset>/ensembles/``), or None. Same atomic replace and input-hash reuse as
    :func:`build_repository`.

    Raises:
        PlansError: fewer than two folders, or members with different labels or input channels.
    """
    start = time.perf_counter()
    model_dirs, out = [Path(m) for m in model_dirs], Path(out)
    options = options or BuildOptions()
    configs = [read_model_folder(m, folds=folds) for m in model_dirs]
    check_ensemble_members(configs, [str(m) for m in model_dirs])
    export_options = _export_options(options, export_device)
    pp_plan = None if postprocessing in (None, "none") else load_postprocessing_pkl(Path(postprocessing))
    pp_plan = pp_plan if pp_plan is not None and pp_plan.steps else None
    digest = hashlib.sha256()
    for index, (model_dir, config) in enumerate(zip(model_dirs, configs, strict=True)):
        member_hash = compute_input_hash(model_dir, config, options, folds_only=False,
                                         export_options=export_options)
        digest.update(f"member{index}={member_hash}\n".encode())
    digest.update(f"combine={_sha256_file(REPO_ROOT / COMBINE_ADAPTER)}\n".encode())
    digest.update(f"postprocessing={pp_plan.to_json() if pp_plan else 'none'}\n".encode())
    input_hash = digest.hexdigest()
    if _up_to_date(out, input_hash, force):
        return BuildResult(out=out, rebuilt=False, input_hash=input_hash, seconds=time.perf_counter() - start)
    with _staging(out) as tmp:
        members = []
        for index, (model_dir, config) in enumerate(zip(model_dirs, configs, strict=True)):
            exports = _build_prefixed_into(tmp, model_dir, config, options, io_names.member_prefix(index),
                                           export_options, probabilities=ProbabilitiesOutput.ALWAYS)
            members.append(_metadata(model_dir, config, options, "", exports, folds_only=False, seconds=0.0))
        combine = model_specs.combine_spec(configs, options)
        config_gen.write_config(combine, tmp / combine.name)
        _write_python_model(tmp / combine.name, REPO_ROOT / COMBINE_ADAPTER, configs[0])
        if pp_plan is not None:
            (tmp / combine.name / VERSION_DIR / POSTPROCESSING_FILE).write_text(pp_plan.to_json())
        endpoint = model_specs.configuration_ensemble_spec(configs)
        for spec in (endpoint, *model_specs.typed_endpoint_specs(endpoint)):
            config_gen.write_config(spec, tmp / spec.name)
            (tmp / spec.name / VERSION_DIR).mkdir(exist_ok=True)
        metadata = {
            **members[0],
            "input_hash": input_hash,
            "ensemble_members": [{k: m[k] for k in ("model_folder", "configuration", "trainer_name",
                                                    "plans_name", "folds", "exports")} for m in members],
            "models": sorted(spec.name for spec in model_specs.ensemble_repository_specs(configs, options)),
            "exports": [e for m in members for e in m["exports"]],
            "postprocessing": None if pp_plan is None else json.loads(pp_plan.to_json()),
            "build_seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
    seconds = time.perf_counter() - start
    LOGGER.info("built ensemble %s of %d members in %.1f s", out, len(configs), seconds)
    return BuildResult(out=out, rebuilt=True, input_hash=input_hash, seconds=seconds)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Build a Triton model repository from an nnU-Net results folder.")
    p.add_argument("--model", required=True, type=Path, nargs="+",
                   help="results folder with plans.json, dataset.json and fold_<k>/checkpoint_final.pth; "
                        "two or more folders build an ensemble of configurations (nnUNetv2_ensemble)")
    p.add_argument("--configuration", nargs="+", default=None,
                   help="check that the checkpoints use this configuration (one per --model, or one for all)")
    p.add_argument("--folds", nargs="+", type=parse_fold, default=None, help="default: all fold_<k> found")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "model_repository")
    p.add_argument("--target", choices=[t.value for t in Target], default=Target.CPU.value)
    p.add_argument("--tile-batch-size", type=int, default=BuildOptions.tile_batch_size,
                   help="tiles per fold request = fold models' max_batch_size")
    p.add_argument("--fold-runner", choices=[r.value for r in FoldRunner], default=None,
                   help="default: python on cpu, libtorch on gpu")
    p.add_argument("--precision", choices=export.PRECISIONS, default="fp32", help="fold networks (fp16: gpu)")
    p.add_argument("--export-device", default=None, help="device to trace on (default cpu; cuda for fp16)")
    p.add_argument("--torch-threads", type=int, default=0, help="Python runner threads (0: torch default)")
    p.add_argument("--per-sample-forward", choices=("true", "false"), default=None,
                   help="Python runner: one batch-1 forward per tile like nnU-Net (bit-identical on CPU); "
                        "default true on cpu, false on gpu")
    p.add_argument("--fold-instances", type=int, default=1)
    p.add_argument("--orchestrator-instances", type=int, default=1)
    p.add_argument("--max-inflight", type=int, default=BuildOptions.max_inflight)
    p.add_argument("--max-voxels", type=int, default=BuildOptions.max_voxels,
                   help="most voxels an IMAGE, and the volume it resamples to, may have; larger requests get "
                        "INVALID_ARG (0: no limit; default 2**28 = 512x512x1024)")
    p.add_argument("--max-request-bytes", type=int, default=BuildOptions.max_request_bytes,
                   help="most bytes a request's float32 logits (preprocessed geometry) or probabilities "
                        "(original geometry) may take; larger requests get INVALID_ARG before anything is "
                        "allocated (0: no budget; default 8 GiB)")
    p.add_argument("--postprocessing", default="auto",
                   help="nnU-Net postprocessing.pkl to apply: 'auto' (<model>/crossval_results_folds_<folds>/"
                        "postprocessing.pkl if present), 'none', or a path")
    p.add_argument("--no-metrics", action="store_true",
                   help="no custom nnunet_* metrics in the Python models")
    p.add_argument("--previous-stage-model", type=Path, default=None,
                   help="cascade: the previous stage's results folder (default: nnU-Net's sibling folder)")
    p.add_argument("--folds-only", action="store_true", help="only the fold models")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    return p


def _configurations(models: Sequence[Path], given: Sequence[str] | None) -> list[str | None]:
    """``--configuration`` per model; with several models each is checked against its checkpoints here."""
    if not given:
        return [None] * len(models)
    if len(given) not in (1, len(models)):
        raise PlansError(
            f"--configuration takes one value or one per --model ({len(models)}), got {list(given)}.")
    wanted = list(given) * len(models) if len(given) == 1 else list(given)
    if len(models) > 1:
        for model, configuration in zip(models, wanted, strict=True):
            found = read_model_folder(model).configuration
            if found != configuration:
                raise PlansError(f"--configuration {configuration!r} does not match the configuration "
                                 f"{found!r} the checkpoints in {str(model)!r} were trained with.")
    return wanted


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0 on success (built or up to date), 1 on a reported error."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        options = BuildOptions(
            target=Target(args.target), tile_batch_size=args.tile_batch_size, fold_runner=args.fold_runner,
            fold_precision=args.precision, torch_threads=args.torch_threads,
            per_sample_forward=None if args.per_sample_forward is None else args.per_sample_forward == "true",
            fold_instances=args.fold_instances,
            orchestrator_instances=args.orchestrator_instances, max_inflight=args.max_inflight,
            max_voxels=args.max_voxels, max_request_bytes=args.max_request_bytes, metrics=not args.no_metrics,
        )
        configurations = _configurations(args.model, args.configuration)
        if len(args.model) > 1:
            pp = None if args.postprocessing == "auto" else args.postprocessing
            result = build_ensemble_repository(args.model, args.out, options=options, folds=args.folds,
                                               force=args.force, export_device=args.export_device,
                                               postprocessing=pp)
        else:
            result = build_repository(args.model[0], args.out, options=options, folds=args.folds,
                                      configuration=configurations[0], force=args.force,
                                      folds_only=args.folds_only, export_device=args.export_device,
                                      postprocessing=args.postprocessing,
                                      previous_stage_model=args.previous_stage_model)
    except (NnunetTritonError, ValueError) as exc:
        LOGGER.error("%s", exc)
        return 1
    print(f"{'built' if result.rebuilt else 'up to date'}: {result.out} ({result.seconds:.1f} s)")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
