"""What a deployment needs to know about a built (or planned) model repository, and the torch check.

:class:`RepositoryInfo` comes either from a built repository (``repository_metadata.json`` written by
``repository/build.py`` plus one ``1/inference_config.json``) or, before anything is built, from the
model folder's :class:`InferenceConfig` and the :class:`BuildOptions` the builder will get (the model
names then come from ``model_specs.repository_specs``, exactly what the builder writes).

TorchScript compatibility: a ``model.pt`` saved by a newer torch may not load in an older libtorch
(pytorch/pytorch#62313: a newer export fails in an older Triton with "Unknown type name 'NoneType'").
:func:`check_torch_compatible` refuses a repository whose recorded exporting torch is newer (major.minor)
than the torch that will load it: the image's libtorch for the ``libtorch`` runner, the image's pip torch
for the ``python`` runner.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.builder.torch_compat import TRITON_RELEASES, TritonRelease, torch_minor, torch_minor_text
from nnunet_triton.errors import DeployError
from nnunet_triton.numerics.plans import InferenceConfig

__all__ = [
    "METADATA_FILE",
    "ModelGeometry",
    "RepositoryInfo",
    "triton_release",
    "check_torch_compatible",
]

METADATA_FILE = io_names.REPOSITORY_METADATA_FILE
# each has 1/inference_config.json
_CONFIG_DIRS = (io_names.PREPROCESS_MODEL, io_names.ORCHESTRATOR_MODEL, io_names.STITCH_MODEL)
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
class RepositoryInfo:
    """Everything deploy needs about a repository; ``torch_version``/``input_hash`` are None until built."""

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

    @property
    def fold_models(self) -> tuple[str, ...]:
        return tuple(name for name in self.models if name.startswith("fold_"))

    @property
    def fold_output_bytes(self) -> int:
        return 2 if self.fold_precision == "fp16" else 4

    @classmethod
    def planned(cls, config: InferenceConfig, options: Any) -> RepositoryInfo:
        """What ``repository/build.py`` will build for ``config`` with ``options`` (a BuildOptions)."""
        from nnunet_triton.builder import model_specs  # the builder's own spec list (Python >= 3.11 module)

        return cls(
            models=tuple(sorted(spec.name for spec in model_specs.repository_specs(config, options))),
            folds=tuple(config.folds), target=str(options.target), fold_runner=str(options.runner),
            fold_precision=options.fold_precision, tile_batch_size=options.tile_batch_size,
            max_inflight=options.max_inflight, preprocess_instances=options.preprocess_instances,
            orchestrator_instances=options.orchestrator_instances,
            stitch_instances=options.stitch_instances, fold_instances=options.fold_instances,
            geometry=ModelGeometry.from_config(config),
        )

    @classmethod
    def from_repository(cls, repository: str | Path) -> RepositoryInfo:
        """Read ``<repository>/repository_metadata.json`` and check it against the model directories."""
        repo = Path(repository)
        meta = _read_metadata(repo)
        models = tuple(sorted(meta["models"]))
        _check_model_dirs(repo, models)
        options = meta["build_options"]
        exports = tuple((str(e.get("path", f"fold_{e.get('fold')}")), str(e["torch_version"]))
                        for e in meta.get("exports", ()) if e.get("torch_version"))
        return cls(
            models=models, folds=tuple(meta["folds"]), target=str(meta["target"]),
            fold_runner=str(meta["fold_runner"]), fold_precision=str(meta["fold_precision"]),
            tile_batch_size=int(meta["tile_batch_size"]), max_inflight=int(options.get("max_inflight", 1)),
            preprocess_instances=int(options.get("preprocess_instances", 1)),
            orchestrator_instances=int(options.get("orchestrator_instances", 1)),
            stitch_instances=int(options.get("stitch_instances", 1)),
            fold_instances=int(options.get("fold_instances", 1)),
            geometry=ModelGeometry.from_config(_read_config(repo)),
            torch_versions=(*exports, ("the repository build", str(meta["torch_version"]))),
            input_hash=str(meta["input_hash"]),
        )


def _read_metadata(repo: Path) -> dict[str, Any]:
    path = repo / METADATA_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DeployError(
            f"{str(repo)!r} is not a built model repository: {METADATA_FILE} is missing "
            "(build it with `python -m repository.build --model <results folder> --out <dir>`)."
        ) from None
    except json.JSONDecodeError as exc:
        raise DeployError(f"{str(path)!r} is not valid JSON: {exc}.") from None
    missing = [key for key in _REQUIRED_KEYS if key not in meta]
    if missing:
        raise DeployError(f"{str(path)!r} lacks the keys {missing} (rebuild the repository).")
    return meta


def _check_model_dirs(repo: Path, models: tuple[str, ...]) -> None:
    """Every model in the metadata has a config, and every model directory is in the metadata.

    With ``--model-control-mode explicit`` only listed models load; a fold model missing from the list
    would only fail at the first BLS call (BLS callees are invisible to the repository manager).
    """
    on_disk = {p.parent.name for p in repo.glob("*/config.pbtxt")}
    missing, unlisted = sorted(set(models) - on_disk), sorted(on_disk - set(models))
    if missing or unlisted:
        raise DeployError(
            f"repository {str(repo)!r} disagrees with its {METADATA_FILE}: models without config.pbtxt "
            f"{missing}, model directories not in the metadata {unlisted} (rebuild it with --force)."
        )


def _read_config(repo: Path) -> InferenceConfig:
    for name in _CONFIG_DIRS:
        path = repo / name / io_names.VERSION_DIR / io_names.INFERENCE_CONFIG_FILE
        if path.is_file():
            return InferenceConfig.from_json(path.read_text())
    raise DeployError(
        f"repository {str(repo)!r} has no 1/inference_config.json in any of {list(_CONFIG_DIRS)}; "
        "deploy needs the full pipeline (not a --folds-only build)."
    )


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
