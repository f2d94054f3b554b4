"""Build nnU-Net models into a Triton model repository: one endpoint name and version per build.

    nnunet-triton build --model-dir <Dataset.../Trainer__Plans__Config> [<more folders>] [--endpoint liver]
        [--new-version | --endpoint-version N] [--promote] [--folds 0 1]
        [--model-repository build/model_repository]
        [--target cpu|gpu] [--tile-batch-size 4] [--max-voxels N] [--max-request-bytes N] [--force]

Two or more ``--model-dir`` folders build an ensemble of configurations (``build_ensemble_repository``).

A repository holds any number of endpoint names, each with versions (``nnunet_triton.repository.registry``).
One build writes one version of one name and leaves every other name and version untouched::

    repository_metadata.json            the registry: every name's versions (what each build recorded:
                                        versions, plans sha256, folds, target, export checks, input hash)
                                        and the promoted version of each name
    liver/, liver_int16/, ...           the public endpoint: the promoted version's steps (server.rollout)
    liver__v2/, liver__v2_int16/, ...   the pinned endpoint of version 2
    liver__v2__preprocess_model/  liver__v2__orchestrator_model/  liver__v2__stitch_model/
        config.pbtxt, 1/model.py, 1/inference_config.json
    liver__v2__fold_<k>/config.pbtxt, 1/model.pt   (+ 1/model.py, 1/inference_config.json: Python runner)

Version 1 of the default name ``nnunet`` keeps the names of a one-model repository (``preprocess_model``,
``fold_0``, ...: ``io_names.model_namespace``). Which version a build writes (:class:`VersionChoice`): a new
name gets version 1, promoted; ``new_version`` adds the next version (not promoted unless ``promote``);
``version`` names one; otherwise the name's latest version is rebuilt in place. Inputs equal to those of a
version (its ``input_hash`` over the plans, dataset.json, the checkpoints, the build options, the adapters
and the generating code) make the build a no-op.

Every config.pbtxt comes from ``nnunet_triton.builder.model_specs``; every ``model.pt`` from
``nnunet_triton.builder.torchscript`` (reloaded and compared with the eager network before it is kept).
A version is built in a temporary sibling directory with the layout of one pipeline, renamed into its
namespace there, then its folders are moved in and the registry is replaced last (the commit point), all
under the repository's lock (``registry.locked``). A failure leaves the repository as it was.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from nnunet_triton import __version__ as NNUNET_TRITON_VERSION
from nnunet_triton import io_names
from nnunet_triton.builder import composite_specs, config_gen, model_specs, torch_compat
from nnunet_triton.builder import torchscript as export
from nnunet_triton.builder.build_inputs import (
    COMBINE_ADAPTER,
    FOLD_RUNNER_KEY,
    adapter_source,
    adapters_needed,
    compute_input_hash,
    replace_directory,
    torch_version,
)
from nnunet_triton.builder.config_gen import ModelSpec
from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner
from nnunet_triton.errors import OlderRepositoryError, PlansError, RepositoryError
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
from nnunet_triton.numerics.releases import release_numerics
from nnunet_triton.repository import ModelRepository
from nnunet_triton.repository.registry import Registry, locked, write_registry
from nnunet_triton.segment_metadata import PUBLISHED_KEY, SegmentMetadata, label_values, read_segment_metadata
from nnunet_triton.util.hashing import sha256_file

__all__ = [
    "BuildResult",
    "VersionChoice",
    "build_repository",
    "build_ensemble_repository",
    "remove_endpoint",
    "write_public_endpoints",
]

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildResult:
    """Outcome of :func:`build_repository`."""

    out: Path
    rebuilt: bool  # False when the version already held exactly these inputs
    input_hash: str
    seconds: float
    name: str = io_names.ENDPOINT_MODEL
    version: int = 1
    promoted: bool = True  # the public endpoint ``name`` runs this version

    def summary(self) -> str:
        """One line for the command line: what was built, where, and how to call it."""
        state = "built" if self.rebuilt else "up to date"
        call = (f"the public endpoint {self.name!r} runs it" if self.promoted else
                f"not promoted: call it as {io_names.pinned_endpoint(self.name, self.version)!r}; "
                f"`nnunet-triton promote --endpoint {self.name} --endpoint-version {self.version}` makes "
                f"{self.name!r} run it")
        return f"{state}: {self.name} version {self.version} in {self.out} ({self.seconds:.1f} s; {call})"


@dataclass(frozen=True)
class VersionChoice:
    """Which version of which endpoint a build writes (see the module docstring).

    Attributes:
        name: the endpoint name (``io_names.check_endpoint_name``).
        version: build exactly this version (added, or replaced when it exists).
        new_version: add the version after the name's latest (not with ``version``).
        promote: the public endpoint runs the built version (a new name's first version always does).
    """

    name: str = io_names.ENDPOINT_MODEL
    version: int | None = None
    new_version: bool = False
    promote: bool = False

    def __post_init__(self) -> None:
        io_names.check_endpoint_name(self.name)
        if self.version is not None:
            object.__setattr__(self, "version", io_names.check_version(self.version))
            if self.new_version:
                raise ValueError(f"give a version ({self.version}) or ask for a new one, not both.")


# An empty FILE named __pycache__ next to model.py: the stub's Python (whose embedded interpreter ignores
# PYTHONDONTWRITEBYTECODE) then cannot write model.py's bytecode into the repository. Written, that folder
# would make Triton take the model for a changed one and reload it on the next load of anything depending on
# it: a promotion (server.rollout) would restart the processes of the version it switches to.
BYTECODE_BLOCKER = "__pycache__"


def _write_python_model(model_dir: Path, step: str, config: InferenceConfig) -> None:
    version = model_dir / VERSION_DIR
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.py").write_text(adapter_source(step))
    (version / BYTECODE_BLOCKER).write_bytes(b"")
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
            _write_python_model(fold_dir.parent, adapters[FOLD_RUNNER_KEY], config)
    return exports


def _build_into(tmp: Path, model_dir: Path, config: InferenceConfig, options: BuildOptions, *,
                folds_only: bool, export_options: export.ExportOptions,
                postprocessing: PostprocessingPlan | None = None,
                previous: tuple[Path, InferenceConfig] | None = None) -> list[dict[str, Any]]:
    """The files of one pipeline (model.py, inference_config.json, postprocessing.json, model.pt) under the
    plain model names; the configs are written when the version lands (:func:`_land`)."""
    adapters = adapters_needed(options, folds_only)
    exports = []
    if previous is not None and not folds_only:  # cascade: the previous stage's pipeline feeds this one
        exports += _build_prefixed_into(tmp, *previous, options, io_names.PREVIOUS_STAGE_PREFIX,
                                        export_options)
    _write_python_models(tmp, adapters, config)
    if postprocessing is not None and not folds_only:
        (tmp / io_names.STITCH_MODEL / VERSION_DIR / POSTPROCESSING_FILE).write_text(postprocessing.to_json())
    return exports + _export_fold_models(tmp, model_dir, config, options, export_options, adapters)


def _write_python_models(tmp: Path, adapters: dict[str, str], config: InferenceConfig, *,
                         prefix: str = "") -> None:
    """model.py + inference_config.json of every pipeline step in ``adapters`` (the fold runner's are
    written with the fold models)."""
    for name, step in adapters.items():
        if name != FOLD_RUNNER_KEY:
            _write_python_model(tmp / (prefix + name), step, config)


def _metadata(model_dir: Path, config: InferenceConfig, options: BuildOptions, input_hash: str,
              exports: list[dict[str, Any]], *, seconds: float,
              postprocessing: PostprocessingPlan | None = None) -> dict[str, Any]:
    """What the registry records of one version (``models`` and the export paths are set when it lands)."""
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
        "per_sample_forward": bool(options.per_sample_forward),  # true: each tile its own forward (exact)
        "fold_request_tiles": options.fold_request_tiles,
        "fold_forward": options.fold_forward,
        "build_options": json.loads(json.dumps(asdict(options), default=str)),
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
    endpoint: VersionChoice | None = None,
    seg_metadata: str | Path | None = None,
) -> BuildResult:
    """Build (or keep, when up to date) one version of one endpoint of the repository ``out`` from the
    results folder ``model_dir``.

    Args:
        configuration: if given, must equal the configuration the checkpoints were trained with.
        force: rebuild even when up to date, and replace an ``out`` that is not a repository of this
            nnunet-triton (its whole content).
        folds_only: only the fold models (testing the runners without the pipeline adapters).
        export_device: device to trace on (default cpu; cuda for fp16).
        postprocessing: ``"auto"`` applies nnU-Net's ``postprocessing.pkl`` from
            ``<model>/crossval_results_folds_<folds>/`` when it exists (where
            ``nnUNetv2_find_best_configuration`` writes it for exactly these folds); a path uses that pkl;
            ``None`` or ``"none"`` deploys no postprocessing.
        previous_stage_model: for a cascade stage (``previous_stage`` in its configuration), the previous
            stage's model folder; default: nnU-Net's sibling ``<trainer>__<plans>__<previous stage>``. Both
            stages run in one endpoint call (the previous stage's segmentation feeds this one).
        endpoint: the name and version to write (default: ``nnunet``, its latest version, or 1).
        seg_metadata: dcmqi segment metadata JSON (``client.dicom.segment_metadata``) for the labels of
            the model, checked against them here and published with the version (SEG and RTSTRUCT codes,
            names and colours); None: the DICOM writers use private codes.

    Raises:
        PlansError / UnsupportedModelError / ExportError: see ``read_model_folder`` and ``export_fold``;
        RepositoryError: the registry cannot be read, or ``out`` is not a repository (without ``force``).
        ``out`` is left untouched.
    """
    start = time.perf_counter()
    model_dir, out = Path(model_dir), Path(out)
    options = options or BuildOptions()
    endpoint = endpoint or VersionChoice()
    torch_compat.check_export_torch(torch_version(), options.loading_torch, runner=str(options.runner))
    config = _with_numerics(read_model_folder(model_dir, folds=folds, allow_cascade=True), options)
    previous = _previous_stage(model_dir, config, previous_stage_model, folds)
    if previous is not None:
        previous = previous[0], _with_numerics(previous[1], options, warn=False)
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
    metadata_of_segments = _segment_metadata(seg_metadata, config)
    input_hash = _with_segment_metadata(input_hash, metadata_of_segments)
    if previous is not None and not folds_only:
        specs = composite_specs.cascade_repository_specs(previous[1], config, options)
    else:
        specs = model_specs.repository_specs(config, options, folds_only=folds_only)

    def write(tmp: Path) -> dict[str, Any]:
        exports = _build_into(tmp, model_dir, config, options, folds_only=folds_only,
                              export_options=export_options, postprocessing=pp_plan, previous=previous)
        metadata = _metadata(model_dir, config, options, input_hash, exports,
                             seconds=time.perf_counter() - start, postprocessing=pp_plan)
        if previous is not None:
            metadata["previous_stage"] = {"model_folder": previous[0].name,
                                          "configuration": previous[1].configuration,
                                          "folds": list(previous[1].folds)}
        return metadata | _recorded_segment_metadata(metadata_of_segments)

    result = _land(out, endpoint, input_hash, specs, write, force=force, start=start,
                   described=_published_postprocessing(pp_plan) | _published_segments(metadata_of_segments))
    if result.rebuilt:
        LOGGER.info("built %s version %d into %s in %.1f s (folds %s, target %s)", result.name,
                    result.version, out, result.seconds, list(config.folds), options.target)
    return result


def _with_numerics(config: InferenceConfig, options: BuildOptions, *, warn: bool = True) -> InferenceConfig:
    """``config`` reproducing the release arithmetic ``options.numerics`` asks for; a release whose
    arithmetic is an upstream bug is served as asked, with the bug named in a warning."""
    if warn:
        for bug in release_numerics(options.numerics).warnings:
            LOGGER.warning("--numerics %s reproduces an nnU-Net bug: %s", options.numerics, bug)
    return replace(config, numerics=options.numerics)


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
                         prefix: str, export_options: export.ExportOptions) -> list[dict[str, Any]]:
    """The files of one pipeline with ``prefix`` on every model name (ensemble member, cascade's previous
    stage); the configs are written when the version lands."""
    adapters = adapters_needed(options, folds_only=False)
    _write_python_models(tmp, adapters, config, prefix=prefix)
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
    endpoint: VersionChoice | None = None,
    seg_metadata: str | Path | None = None,
) -> BuildResult:
    """An ensemble of configurations (``nnUNetv2_ensemble``) behind one endpoint (one version of it).

    Every model folder becomes a member pipeline (its folds averaged as usual); the members'
    probabilities are averaged in the given order by ``combine_model``. ``postprocessing`` is the
    ensemble's ``postprocessing.pkl`` (``nnUNetv2_find_best_configuration`` writes it under
    ``<results>/<dataset>/ensembles/``), or None. Versions, input-hash reuse and the atomic landing are
    those of :func:`build_repository`.

    Raises:
        PlansError: fewer than two folders, or members with different labels or input channels.
    """
    start = time.perf_counter()
    model_dirs, out = [Path(m) for m in model_dirs], Path(out)
    options = options or BuildOptions()
    endpoint = endpoint or VersionChoice()
    torch_compat.check_export_torch(torch_version(), options.loading_torch, runner=str(options.runner))
    configs = [_with_numerics(read_model_folder(m, folds=folds), options, warn=index == 0)
               for index, m in enumerate(model_dirs)]
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
    metadata_of_segments = _segment_metadata(seg_metadata, configs[0])
    input_hash = _with_segment_metadata(digest.hexdigest(), metadata_of_segments)

    def write(tmp: Path) -> dict[str, Any]:
        members = []
        for index, (model_dir, config) in enumerate(zip(model_dirs, configs, strict=True)):
            exports = _build_prefixed_into(tmp, model_dir, config, options, io_names.member_prefix(index),
                                           export_options)
            members.append(_metadata(model_dir, config, options, "", exports, seconds=0.0))
        _write_python_model(tmp / io_names.COMBINE_MODEL, COMBINE_ADAPTER, configs[0])
        if pp_plan is not None:
            (tmp / io_names.COMBINE_MODEL / VERSION_DIR / POSTPROCESSING_FILE).write_text(pp_plan.to_json())
        return {
            **members[0],
            "input_hash": input_hash,
            "ensemble_members": [{k: m[k] for k in ("model_folder", "configuration", "trainer_name",
                                                    "plans_name", "folds", "exports")} for m in members],
            "exports": [e for m in members for e in m["exports"]],
            "postprocessing": None if pp_plan is None else json.loads(pp_plan.to_json()),
            "build_seconds": round(time.perf_counter() - start, 3),
        } | _recorded_segment_metadata(metadata_of_segments)

    specs = composite_specs.ensemble_repository_specs(configs, options)
    result = _land(out, endpoint, input_hash, specs, write, force=force, start=start,
                   described=_published_postprocessing(pp_plan) | _published_segments(metadata_of_segments))
    if result.rebuilt:
        LOGGER.info("built ensemble %s version %d of %d members into %s in %.1f s", result.name,
                    result.version, len(configs), out, result.seconds)
    return result


# --- landing one version in the repository ----------------------------------------------------------------

def _repository_state(out: Path) -> tuple[str, Registry | None]:
    """``("new" | "registry" | "legacy" | "foreign", registry)`` of the build output ``out``."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return "new", None
    if not out.is_dir():
        return "foreign", None
    try:
        registry = ModelRepository(out).registry()
    except OlderRepositoryError:
        return "legacy", None
    return ("registry", registry) if registry is not None else ("foreign", None)


def _chosen_version(registry: Registry | None, choice: VersionChoice, input_hash: str,
                    force: bool) -> tuple[int, bool, bool]:
    """(version, up to date, promote) for a build of ``choice`` into a repository with ``registry``."""
    entry = registry.endpoints.get(choice.name) if registry is not None else None
    if entry is None:
        return choice.version or 1, False, True
    if choice.version is not None:
        same = choice.version in entry.versions and entry.versions[choice.version].input_hash == input_hash
        return choice.version, same and not force, choice.promote or entry.promoted == choice.version
    if not force:
        for version, held in sorted(entry.versions.items()):
            if held.input_hash == input_hash:  # these inputs are built already: never a duplicate version
                return version, True, False
    version = entry.latest + 1 if choice.new_version else entry.latest
    return version, False, choice.promote or entry.promoted == version


def _segment_metadata(path: str | Path | None, config: InferenceConfig) -> SegmentMetadata | None:
    """The segment metadata file ``path``, checked against the model's labels (None: no file)."""
    if path is None:
        LOGGER.info("no --seg-metadata: DICOM-SEG and RTSTRUCT of this endpoint code its labels with the "
                    "private scheme 99NNUNET and carry no display colour")
        return None
    metadata = read_segment_metadata(path)
    names = {name: list(v) if isinstance(v, tuple) else v for name, v in config.labels.label_names}
    labels = label_values(names, config.labels.regions_class_order)
    metadata.check_against_labels({value: name for value, name, _ in labels})
    LOGGER.info("segment metadata %s: %d coded segment(s)", path, len(metadata.segments))
    return metadata


def _with_segment_metadata(input_hash: str, metadata: SegmentMetadata | None) -> str:
    """The input hash with the segment metadata in it (unchanged without: builds before it stay current)."""
    if metadata is None:
        return input_hash
    text = json.dumps(metadata.to_published(), sort_keys=True)
    return hashlib.sha256(f"{input_hash}\nsegment_metadata={text}".encode()).hexdigest()


def _recorded_segment_metadata(metadata: SegmentMetadata | None) -> dict[str, Any]:
    """What the registry records of the segment metadata: its digest (the content is published)."""
    if metadata is None:
        return {}
    text = json.dumps(metadata.to_published(), sort_keys=True)
    return {"segment_metadata_sha256": hashlib.sha256(text.encode()).hexdigest()}


def _published_segments(metadata: SegmentMetadata | None) -> dict[str, Any]:
    """What the endpoint's description publishes of the segments (the DICOM writers read it)."""
    return {} if metadata is None else {PUBLISHED_KEY: metadata.to_published()}


def _published_postprocessing(plan: PostprocessingPlan | None) -> dict[str, Any]:
    """What the endpoint's description says of the deployed postprocessing (``validate`` applies the same)."""
    return {"postprocessing": None if plan is None else json.loads(plan.to_json())["steps"]}


def _land(out: Path, choice: VersionChoice, input_hash: str, specs: Sequence[ModelSpec],
          write: Callable[[Path], dict[str, Any]], *, force: bool, start: float,
          described: dict[str, Any] | None = None) -> BuildResult:
    """Write the pipeline of ``specs`` (``write`` builds it, unprefixed, into a folder and returns its
    metadata) as one version of ``choice.name`` into ``out``; see the module docstring."""
    state, registry = _repository_state(out)
    if state == "legacy" and choice.name == io_names.ENDPOINT_MODEL:
        force = True  # a one-model repository of an older version is the default name: rebuilt, as it was
    if state in ("legacy", "foreign") and not force:
        what = (f"was built by an older nnunet-triton (one model, {io_names.ENDPOINT_MODEL!r}, no endpoint "
                f"registry): building {choice.name!r} beside it would lose it" if state == "legacy"
                else f"exists but has no {io_names.REPOSITORY_METADATA_FILE}")
        raise PlansError(f"output {str(out)!r} {what}; refusing to replace it (use --force, which replaces "
                         "its whole content, or build into another folder).")
    version, current, promote = _chosen_version(registry, choice, input_hash, force)
    if current:
        entry = registry.endpoint(choice.name) if registry is not None else None
        LOGGER.info("%s version %d in %s is up to date (input hash %s)", choice.name, version, out,
                    input_hash[:12])
        return BuildResult(out=out, rebuilt=False, input_hash=input_hash, seconds=time.perf_counter() - start,
                           name=choice.name, version=version,
                           promoted=entry is not None and entry.promoted == version)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        raw, models = stage / "raw", stage / "models"
        raw.mkdir()
        models.mkdir()
        metadata = write(raw)
        named, renaming = model_specs.namespaced_specs(specs, choice.name, version, described=described)
        unexpected = {p.name for p in raw.iterdir()} - set(renaming)
        if unexpected:
            raise RuntimeError(f"the build wrote {sorted(unexpected)}, which its specs do not name")
        # a version folder for every model (Triton needs one, ensembles too), then its namespaced name
        for old, new in renaming.items():
            (raw / old / VERSION_DIR).mkdir(parents=True, exist_ok=True)
            (raw / old).rename(models / new)
        for spec in named:  # the one place a version's configs are written
            config_gen.write_config(spec, models / spec.name)
        metadata["models"] = sorted(renaming.values())
        metadata["exports"] = [{**e, "path": _renamed_path(e["path"], renaming)} for e in metadata["exports"]]
        metadata["build_seconds"] = round(time.perf_counter() - start, 3)
        if state in ("legacy", "foreign"):  # --force: the whole folder is replaced by this one version
            landed = Registry().with_version(choice.name, version, metadata, promote=True)
            if landed.endpoint(choice.name).public_models:
                write_public_endpoints(models, models, choice.name, version)
            write_registry(models, landed)
            replace_directory(models, out)
            promoted = True
        else:
            before = registry.endpoints.get(choice.name) if registry is not None else None
            held = before.versions.get(version) if before is not None else None
            promoted = _install(out, models, stage / "trash", choice.name, version, metadata, promote,
                                expected=held.input_hash if held is not None else None)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return BuildResult(out=out, rebuilt=True, input_hash=input_hash, seconds=time.perf_counter() - start,
                       name=choice.name, version=version, promoted=promoted)


def _renamed_path(path: str, renaming: dict[str, str]) -> str:
    first, _, rest = path.partition("/")
    return f"{renaming.get(first, first)}/{rest}" if rest else renaming.get(first, first)


def _install(out: Path, models: Path, trash: Path, name: str, version: int, metadata: dict[str, Any],
             promote: bool, *, expected: str | None) -> bool:
    """Move the staged version's folders into ``out`` and commit the registry (under the lock); returns
    whether the public endpoint runs the version. ``expected`` is the input hash the version had when the
    build chose it (None: it did not exist): another build that changed it meanwhile wins, this one stops."""
    trash.mkdir()
    with locked(out):
        registry = ModelRepository(out).registry() or Registry()
        entry = registry.endpoints.get(name)
        now = entry.versions[version].input_hash if entry is not None and version in entry.versions else None
        if now != expected:
            raise RepositoryError(f"another build wrote {name} version {version} into {str(out)!r} while "
                                  "this one ran; nothing of this build was kept: build again.")
        replaced = set(entry.versions[version].models) if entry and version in entry.versions else set()
        landed = registry.with_version(name, version, metadata, promote=promote)
        promoted = landed.endpoint(name).promoted == version
        if promoted and landed.endpoint(name).public_models:
            write_public_endpoints(models, models, name, version)
        ours = {p.name for p in models.iterdir()}
        for model in sorted(ours):
            owner = registry.owner(model)
            if owner is not None and owner[0] != name:
                raise RepositoryError(f"model folder {model!r} of {name} version {version} belongs to "
                                      f"endpoint {owner[0]!r} of this repository; nothing was changed.")
        for model in sorted(ours | (replaced - ours)):
            if (out / model).exists():
                (out / model).rename(trash / model)
        for model in sorted(ours):
            (models / model).rename(out / model)
        write_registry(out, landed)
    shutil.rmtree(trash, ignore_errors=True)
    return promoted


def write_public_endpoints(source: Path, target: Path, name: str, version: int) -> list[str]:
    """Write the public endpoint ``name`` and its typed copies into ``target`` as copies of the pinned
    endpoints of ``version`` in ``source`` (same steps, inputs, outputs and description; only the name
    differs).

    Each config.pbtxt is replaced atomically, so a server loading the endpoint reads one version's steps.
    Returns the public endpoints written.
    """
    pinned = io_names.public_endpoints(io_names.pinned_endpoint(name, version))
    written = []
    for source_name, public in zip(pinned, io_names.public_endpoints(name), strict=True):
        if not ModelRepository(source).has_model(source_name):
            raise RepositoryError(f"version {version} of {name!r} has no pinned endpoint {source_name!r} "
                                  f"({str(ModelRepository(source).config_path(source_name))!r} is missing): "
                                  "build it again.")
        (target / public / VERSION_DIR).mkdir(parents=True, exist_ok=True)  # Triton needs a version folder
        ModelRepository(target).write_config_text(
            public, config_gen.renamed_config(ModelRepository(source).config_text(source_name), public))
        written.append(public)
    return written


def remove_endpoint(repository: str | Path, name: str, version: int | None = None) -> list[str]:
    """Remove version ``version`` of ``name`` from the model repository ``repository`` (every version and the
    public endpoint when ``version`` is None); returns the model folders removed. The registry is committed
    first, so an interrupted removal leaves only unlisted folders. Unload them from a running server first
    (``server.rollout.remove``).

    Raises:
        NotBuiltRepositoryError: not a repository built by nnunet-triton (no registry).
        RepositoryError: no such endpoint or version, the promoted version (while others remain).
    """
    repository = Path(repository)
    if not repository.is_dir():
        raise RepositoryError(f"{str(repository)!r} is not a model repository (no such folder).")
    with locked(repository):
        registry = ModelRepository(repository).require_registry()
        entry = registry.endpoint(name)
        if version is None:
            gone = set(entry.public_models).union(*(set(v.models) for v in entry.versions.values()))
            remaining = registry.without_endpoint(name)
        else:
            gone = set(entry.version(version).models)
            remaining = registry.without_version(name, version)
        write_registry(repository, remaining)
        trash = Path(tempfile.mkdtemp(prefix=f".{repository.name}.remove-", dir=repository.parent))
        try:
            for model in sorted(gone):
                if (repository / model).exists():
                    (repository / model).rename(trash / model)
        finally:
            shutil.rmtree(trash, ignore_errors=True)
    what = name if version is None else f"{name} version {version}"
    LOGGER.info("removed %s from %s (%d model folders)", what, repository, len(gone))
    return sorted(gone)
