"""What a deployment needs to know about a built (or planned) model repository, and the torch check.

:class:`RepositoryInfo` holds one :class:`PipelineInfo` per endpoint version of the repository (several
nnU-Net models, and versions of each, behind one server) and every model a server loads. It comes either from
a built repository (read through the repository layer, :class:`~nnunet_triton.repository.ModelRepository`: the
registry written by the builder and each version's ``inference_config``) or, before anything is built, from
the model folder's :class:`InferenceConfig` and the :class:`BuildOptions` the builder will get (the model
names then come from ``model_specs.repository_specs`` renamed into the version's namespace, exactly what the
builder writes).

TorchScript compatibility: a ``model.pt`` saved by a newer torch may not load in an older libtorch
(pytorch/pytorch#62313: a newer export fails in an older Triton with "Unknown type name 'NoneType'").
:func:`check_torch_compatible` refuses a repository whose recorded exporting torch is newer (major.minor)
than the torch that will load it: the image's libtorch for the ``libtorch`` runner, the image's pip torch
for the ``python`` runner.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.builder.torch_compat import TRITON_RELEASES, TritonRelease, torch_minor, torch_minor_text
from nnunet_triton.errors import DeployError, RepositoryError
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.repository import ModelRepository
from nnunet_triton.repository.registry import Registry

__all__ = [
    "ModelGeometry",
    "PipelineInfo",
    "RepositoryInfo",
    "triton_release",
    "check_torch_compatible",
]

_FOLD_MODEL = re.compile(rf"(member[0-9]+_|{io_names.PREVIOUS_STAGE_PREFIX})?fold_.+")
_REQUIRED_KEYS = ("models", "folds", "target", "fold_runner", "fold_precision", "tile_batch_size",
                  "build_options", "torch_version", "input_hash")


def triton_release(release: str, libtorch: str | None = None) -> TritonRelease:
    """The known release, or one with the given ``libtorch`` version (raises for unknown without it)."""
    if libtorch is not None:
        known = TRITON_RELEASES.get(release)
        return TritonRelease(release, known.triton_version if known else "?", torch_minor_text(libtorch),
                             known.python if known else "?")
    if release not in TRITON_RELEASES:
        raise DeployError(
            f"triton release {release!r}: its libtorch version is not recorded here (known: "
            f"{sorted(TRITON_RELEASES)}); pass the torch version of nvcr.io/nvidia/pytorch:{release}-py3 "
            "explicitly (--image-torch-version X.Y)."
        )
    return TRITON_RELEASES[release]


@dataclass(frozen=True)
class ModelGeometry:
    """Tensor geometry of one trained configuration (spatial tuples in nnU-Net's transposed order)."""

    channels: int
    classes: int  # segmentation heads K (labels, or regions)
    patch_size: tuple[int, ...]
    target_spacing: tuple[float, ...]
    transpose_forward: tuple[int, ...]
    label_bytes: int  # 1 (UINT8) or 2 (UINT16) per voxel of SEGMENTATION

    @classmethod
    def from_config(cls, config: InferenceConfig) -> ModelGeometry:
        return cls(
            channels=config.num_input_channels,
            classes=config.labels.num_segmentation_heads,
            patch_size=tuple(config.patch_size),
            target_spacing=tuple(config.spacing),
            transpose_forward=tuple(config.transpose_forward),
            label_bytes=1 if config.labels.max_label <= 255 else 2,
        )


@dataclass(frozen=True)
class PipelineInfo:
    """One endpoint version's pipeline; ``torch_version``/``input_hash`` are None until built."""

    models: tuple[str, ...]
    folds: tuple[int | str, ...]
    target: str  # "cpu" | "gpu"
    fold_runner: str  # "python" | "libtorch"
    fold_precision: str  # "fp32" | "fp16"
    tile_batch_size: int
    max_inflight: int
    preprocess_instances: int
    orchestrator_instances: int
    stitch_instances: int
    fold_instances: int
    geometry: ModelGeometry
    # (what, exporting torch), e.g. ("fold_0/1/model.pt", "2.5.1")
    torch_versions: tuple[tuple[str, str], ...] = ()
    input_hash: str | None = None
    name: str = io_names.ENDPOINT_MODEL
    version: int = 1
    stages: int = 1  # pipelines of preprocess/orchestrator/stitch: ensemble members, or a cascade's two

    @property
    def label(self) -> str:
        """``liver v2``: how logs and ``info`` name the pipeline."""
        return f"{self.name} v{self.version}"

    @property
    def fold_models(self) -> tuple[str, ...]:
        """Every fold model of the version (ensemble members' and a cascade's previous stage's too)."""
        namespace = io_names.model_namespace(self.name, self.version)
        return tuple(name for name in self.models
                     if name.startswith(namespace) and _FOLD_MODEL.fullmatch(name[len(namespace):]))

    @property
    def fold_output_bytes(self) -> int:
        return 2 if self.fold_precision == "fp16" else 4

    @classmethod
    def planned(cls, config: InferenceConfig, options: Any, *, name: str = io_names.ENDPOINT_MODEL,
                version: int = 1) -> PipelineInfo:
        """What the builder will build for ``config`` with ``options`` (a BuildOptions) as version
        ``version`` of ``name`` (the builder's own spec list in the version's namespace)."""
        from nnunet_triton.builder import model_specs  # the builder's own spec list (Python >= 3.11 module)

        specs = model_specs.repository_specs(config, options)
        _, renaming = model_specs.namespaced_specs(specs, name, version)
        return cls(
            models=tuple(sorted(renaming.values())),
            folds=tuple(config.folds), target=str(options.target), fold_runner=str(options.runner),
            fold_precision=options.fold_precision, tile_batch_size=options.tile_batch_size,
            max_inflight=options.max_inflight, preprocess_instances=options.preprocess_instances,
            orchestrator_instances=options.orchestrator_instances,
            stitch_instances=options.stitch_instances, fold_instances=options.fold_instances,
            geometry=ModelGeometry.from_config(config), name=name, version=version,
        )

    @classmethod
    def from_metadata(cls, repository: Path, name: str, version: int, meta: dict[str, Any]) -> PipelineInfo:
        """The pipeline of ``name`` v``version`` from what the builder recorded of it (registry entry)."""
        where = f"{io_names.REPOSITORY_METADATA_FILE} of {str(repository)!r}, {name} version {version}"
        missing = [key for key in _REQUIRED_KEYS if key not in meta]
        if missing:
            raise DeployError(f"{where} lacks the keys {missing} (rebuild the repository).")
        options = meta["build_options"]
        exports = tuple((str(e.get("path", f"fold_{e.get('fold')}")), str(e["torch_version"]))
                        for e in meta.get("exports", ()) if e.get("torch_version"))
        return cls(
            models=tuple(sorted(meta["models"])), folds=tuple(meta["folds"]), target=str(meta["target"]),
            fold_runner=str(meta["fold_runner"]), fold_precision=str(meta["fold_precision"]),
            tile_batch_size=int(meta["tile_batch_size"]), max_inflight=int(options.get("max_inflight", 1)),
            preprocess_instances=int(options.get("preprocess_instances", 1)),
            orchestrator_instances=int(options.get("orchestrator_instances", 1)),
            stitch_instances=int(options.get("stitch_instances", 1)),
            fold_instances=int(options.get("fold_instances", 1)),
            geometry=ModelGeometry.from_config(_read_config(repository, name, version, where)),
            torch_versions=(*exports, (f"the build of {name} version {version}", str(meta["torch_version"]))),
            input_hash=str(meta["input_hash"]), name=name, version=version,
            stages=len(meta.get("ensemble_members") or ()) or (2 if meta.get("previous_stage") else 1),
        )


@dataclass(frozen=True)
class RepositoryInfo:
    """Everything deploy needs about a repository: every endpoint version it serves (``pipelines``, the
    promoted ones first) and every model a server loads (``models``: the versions' models and the public
    endpoints)."""

    pipelines: tuple[PipelineInfo, ...]
    models: tuple[str, ...]
    input_hash: str | None = None  # over every version's input hash and the promoted versions; None: planned

    @property
    def target(self) -> str:
        """The one target every pipeline was built for (a server is started for one)."""
        targets = sorted({p.target for p in self.pipelines})
        if len(targets) != 1:
            raise DeployError(f"the repository mixes targets {targets} "
                              f"({', '.join(f'{p.label}: {p.target}' for p in self.pipelines)}); a server "
                              "serves one target: build every endpoint with the same --target.")
        return targets[0]

    @property
    def fold_runner(self) -> str:
        """``python`` when any pipeline runs its folds in Python stubs (the image then needs torch)."""
        return "python" if any(p.fold_runner == "python" for p in self.pipelines) else "libtorch"

    @property
    def torch_versions(self) -> tuple[tuple[str, str], ...]:
        return tuple(entry for p in self.pipelines for entry in p.torch_versions)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(sorted({p.name for p in self.pipelines}))

    @property
    def first(self) -> PipelineInfo:
        """The first pipeline (the promoted version of the first endpoint)."""
        return self.pipelines[0]

    @classmethod
    def planned(cls, config: InferenceConfig | Mapping[str, InferenceConfig], options: Any, *,
                name: str = io_names.ENDPOINT_MODEL) -> RepositoryInfo:
        """What the builder will build with ``options``: version 1 of ``name`` for ``config``, or version 1
        of every endpoint of ``{name: config}``."""
        configs = config if isinstance(config, Mapping) else {name: config}
        pipelines = tuple(PipelineInfo.planned(configs[n], options, name=n) for n in sorted(configs))
        models = {m for p in pipelines for m in (*p.models, *io_names.public_endpoints(p.name))}
        return cls(pipelines=pipelines, models=tuple(sorted(models)))

    @classmethod
    def from_repository(cls, repository: str | Path) -> RepositoryInfo:
        """Read ``<repository>/repository_metadata.json`` (the registry) and check it against the model
        directories."""
        repository = Path(repository)
        registry = _read_registry(repository)
        _check_model_folders(ModelRepository(repository), registry.models())
        pipelines = []
        for name, entry in sorted(registry.endpoints.items()):
            order = [entry.promoted, *sorted(v for v in entry.versions if v != entry.promoted)]
            pipelines += [PipelineInfo.from_metadata(repository, name, v, dict(entry.versions[v].metadata))
                          for v in order]
        pipelines.sort(key=lambda p: p.version != registry.endpoints[p.name].promoted)  # promoted first
        digest = hashlib.sha256()
        for p in pipelines:
            promoted = registry.endpoints[p.name].promoted
            digest.update(f"{p.name} {p.version} {p.input_hash} {promoted}\n".encode())
        return cls(pipelines=tuple(pipelines), models=registry.models(), input_hash=digest.hexdigest())


def _read_registry(repository: Path) -> Registry:
    try:
        registry = ModelRepository(repository).require_registry()
    except RepositoryError as exc:
        raise DeployError(str(exc)) from None
    if not registry.endpoints:
        raise DeployError(f"{str(repository)!r} holds no endpoint (every one was removed): build one.")
    return registry


def _check_model_folders(repository: ModelRepository, models: tuple[str, ...]) -> None:
    """Every model in the registry has a config, and every model directory is in the registry.

    With ``--model-control-mode explicit`` only listed models load; a fold model missing from the list
    would only fail at the first BLS call (BLS callees are invisible to the repository manager).
    """
    on_disk = set(repository.model_folders())
    missing, unlisted = sorted(set(models) - on_disk), sorted(on_disk - set(models))
    if missing or unlisted:
        raise DeployError(
            f"repository {str(repository.path)!r} disagrees with its {io_names.REPOSITORY_METADATA_FILE}: "
            f"models without config.pbtxt {missing}, model directories not in the registry {unlisted} "
            "(rebuild it with --force)."
        )


def _read_config(repository: Path, name: str, version: int, where: str) -> InferenceConfig:
    """The version's configuration (``ModelRepository.inference_config``: an ensemble's first member's,
    which is what sizing needs)."""
    try:
        return ModelRepository(repository).inference_config(name, version)
    except RepositoryError as exc:
        raise DeployError(f"{where}: {exc} Deploy needs the full pipeline (not a --folds-only "
                          "build).") from None


def check_torch_compatible(info: RepositoryInfo, runtime_torch: str, runtime: str) -> None:
    """Raise when a TorchScript file was exported by a torch newer (major.minor) than ``runtime_torch``.

    Args:
        runtime_torch: version of the torch that loads the files in the image (libtorch or pip torch).
        runtime: what that is, for the message (e.g. "libtorch of nvcr.io/nvidia/tritonserver:24.10-py3").
    """
    limit = torch_minor(runtime_torch)
    newer = [(what, version) for what, version in info.torch_versions if torch_minor(version) > limit]
    if newer:
        what, version = newer[0]
        raise DeployError(
            f"{what} was exported with torch {version}, newer than torch {limit[0]}.{limit[1]} ({runtime}); "
            "a TorchScript file from a newer torch may fail to load in an older one. Re-export with torch "
            f"{limit[0]}.{limit[1]}.x: `nnunet-triton deploy --target docker ...` prints (with --execute "
            "runs) a container step that builds the repository with that torch (see docs/deploy.md, "
            "'Exporting with a matching torch')."
        )
