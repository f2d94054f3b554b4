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

import hashlib
import importlib.metadata
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nnunet_triton import __version__ as NNUNET_TRITON_VERSION
from nnunet_triton import io_names
from nnunet_triton.builder import composite_specs, config_gen, model_specs, torch_compat
from nnunet_triton.builder import torchscript as export
from nnunet_triton.builder.build_inputs import (
    COMBINE_ADAPTER,
    METADATA_FILE,
    adapter_source,
    adapters_needed,
    compute_input_hash,
    sha256_file,
    staging,
    torch_version,
    up_to_date,
)
from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner
from nnunet_triton.errors import PlansError
from nnunet_triton.io_names import TORCHSCRIPT_FILE, VERSION_DIR
from nnunet_triton.numerics.ensembling import check_ensemble_members
from nnunet_triton.numerics.model_folder import read_model_folder
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.postprocessing import (
    POSTPROCESSING_FILE,
    PostprocessingPlan,
    find_postprocessing_pkl,
    load_postprocessing_pkl,
)
from nnunet_triton.options import ProbabilitiesOutput

__all__ = [
    "BuildResult",
    "build_repository",
    "build_ensemble_repository",
]

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildResult:
    """Outcome of :func:`build_repository`."""

    out: Path
    rebuilt: bool  # False when the existing repository already matched the inputs
    input_hash: str
    seconds: float


def _write_python_model(model_dir: Path, step: str, config: InferenceConfig) -> None:
    version = model_dir / VERSION_DIR
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.py").write_text(adapter_source(step))
    config.save(version)


def _export_options(options: BuildOptions, export_device: str | None) -> export.ExportOptions:
    device = export_device or ("cuda" if options.fold_precision == "fp16" else "cpu")
    return export.ExportOptions(precision=options.fold_precision, device=device)


def _export_fold_models(tmp: Path, model_dir: Path, config: InferenceConfig, options: BuildOptions,
                        export_options: export.ExportOptions, adapters: dict[str, str], *,
                        prefix: str = "") -> list[dict[str, Any]]:
    """Export every fold to ``<prefix>fold_<k>/1/model.pt`` (+ the Python runner's model.py)."""
    exports = []
    exported: dict[str, export.ExportResult] = {}  # identical checkpoints are traced once
    for fold in config.folds:
        fold_dir = tmp / (prefix + io_names.fold_model_name(fold)) / VERSION_DIR
        result = export.export_fold_reusing(model_dir, fold, fold_dir / TORCHSCRIPT_FILE,
                                            options=export_options, exported=exported)
        exports.append({**result.to_dict(), "path": str(Path(fold_dir.relative_to(tmp)) / TORCHSCRIPT_FILE)})
        if options.runner is FoldRunner.PYTHON:
            _write_python_model(fold_dir.parent, adapters["fold runner"], config)
    return exports


def _build_into(tmp: Path, model_dir: Path, config: InferenceConfig, options: BuildOptions, *,
                folds_only: bool, export_options: export.ExportOptions,
                postprocessing: PostprocessingPlan | None = None,
                previous: tuple[Path, InferenceConfig] | None = None) -> list[dict[str, Any]]:
    adapters = adapters_needed(options, folds_only)
    exports = []
    specs = list(model_specs.repository_specs(config, options, folds_only=folds_only))
    if previous is not None and not folds_only:  # cascade: the previous stage's pipeline feeds this one
        cascade = composite_specs.cascade_ensemble_spec(config)
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
    return exports + _export_fold_models(tmp, model_dir, config, options, export_options, adapters)


def _metadata(model_dir: Path, config: InferenceConfig, options: BuildOptions, input_hash: str,
              exports: list[dict[str, Any]], *, folds_only: bool, seconds: float,
              postprocessing: PostprocessingPlan | None = None) -> dict[str, Any]:
    return {
        "input_hash": input_hash,
        "nnunet_triton_version": NNUNET_TRITON_VERSION,
        "nnunetv2_version": importlib.metadata.version("nnunetv2"),
        "torch_version": torch_version(),
        "serving_torch": options.loading_torch,  # None: the serving environment's own torch
        "model_folder": model_dir.name,
        "dataset_name": config.dataset_name,
        "plans_name": config.plans_name,
        "configuration": config.configuration,
        "trainer_name": config.network.trainer_name,
        "plans_sha256": sha256_file(model_dir / "plans.json"),
        "dataset_json_sha256": sha256_file(model_dir / "dataset.json"),
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
    torch_compat.check_export_torch(torch_version(), options.loading_torch, runner=str(options.runner))
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
    if up_to_date(out, input_hash, force):
        return BuildResult(out=out, rebuilt=False, input_hash=input_hash, seconds=time.perf_counter() - start)
    with staging(out) as tmp:
        exports = _build_into(tmp, model_dir, config, options, folds_only=folds_only,
                              export_options=export_options, postprocessing=pp_plan, previous=previous)
        metadata = _metadata(model_dir, config, options, input_hash, exports, folds_only=folds_only,
                             seconds=time.perf_counter() - start, postprocessing=pp_plan)
        if previous is not None:
            metadata["previous_stage"] = {"model_folder": previous[0].name,
                                          "configuration": previous[1].configuration,
                                          "folds": list(previous[1].folds)}
            metadata["models"] = sorted(spec.name for spec in composite_specs.cascade_repository_specs(
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
    adapters = adapters_needed(options, folds_only=False)
    by_name = {prefix + name: path for name, path in adapters.items()}
    for spec in composite_specs.prefixed_pipeline_specs(config, options, prefix, probabilities=probabilities):
        config_gen.write_config(spec, tmp / spec.name)
        (tmp / spec.name / VERSION_DIR).mkdir(exist_ok=True)
        if spec.name in by_name:
            _write_python_model(tmp / spec.name, by_name[spec.name], config)
    return _export_fold_models(tmp, model_dir, config, options, export_options, adapters, prefix=prefix)


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
    torch_compat.check_export_torch(torch_version(), options.loading_torch, runner=str(options.runner))
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
    digest.update(f"combine={adapter_source(COMBINE_ADAPTER)}\n".encode())
    digest.update(f"postprocessing={pp_plan.to_json() if pp_plan else 'none'}\n".encode())
    input_hash = digest.hexdigest()
    if up_to_date(out, input_hash, force):
        return BuildResult(out=out, rebuilt=False, input_hash=input_hash, seconds=time.perf_counter() - start)
    with staging(out) as tmp:
        members = []
        for index, (model_dir, config) in enumerate(zip(model_dirs, configs, strict=True)):
            exports = _build_prefixed_into(tmp, model_dir, config, options, io_names.member_prefix(index),
                                           export_options, probabilities=ProbabilitiesOutput.ALWAYS)
            members.append(_metadata(model_dir, config, options, "", exports, folds_only=False, seconds=0.0))
        combine = composite_specs.combine_spec(configs, options)
        config_gen.write_config(combine, tmp / combine.name)
        _write_python_model(tmp / combine.name, COMBINE_ADAPTER, configs[0])
        if pp_plan is not None:
            (tmp / combine.name / VERSION_DIR / POSTPROCESSING_FILE).write_text(pp_plan.to_json())
        endpoint = composite_specs.configuration_ensemble_spec(configs)
        for spec in (endpoint, *model_specs.typed_endpoint_specs(endpoint)):
            config_gen.write_config(spec, tmp / spec.name)
            (tmp / spec.name / VERSION_DIR).mkdir(exist_ok=True)
        metadata = {
            **members[0],
            "input_hash": input_hash,
            "ensemble_members": [{k: m[k] for k in ("model_folder", "configuration", "trainer_name",
                                                    "plans_name", "folds", "exports")} for m in members],
            "models": sorted(spec.name for spec in
                             composite_specs.ensemble_repository_specs(configs, options)),
            "exports": [e for m in members for e in m["exports"]],
            "postprocessing": None if pp_plan is None else json.loads(pp_plan.to_json()),
            "build_seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
    seconds = time.perf_counter() - start
    LOGGER.info("built ensemble %s of %d members in %.1f s", out, len(configs), seconds)
    return BuildResult(out=out, rebuilt=True, input_hash=input_hash, seconds=seconds)
