"""Fakes for the deploy tests: an nnU-Net configuration and a repository laid out like the builder's output.

``write_repository`` follows the builder's contract: the registry ``repository_metadata.json`` (format 2:
per endpoint name and version the models, folds, target, runner, precision, tile batch size, build
options, exporting torch per fold), one ``config.pbtxt`` per model (the version's namespaced models, its
pinned and the name's public endpoints) and ``<namespace>preprocess_model/1/inference_config.json``;
deploy reads nothing else. Called again on the same root it adds another endpoint (or version).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from nnunet_triton.builder.model_specs import BuildOptions, namespaced_specs, repository_specs
from nnunet_triton.io_names import ENDPOINT_MODEL, model_namespace, public_endpoints
from nnunet_triton.numerics.model_folder import load_inference_config
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.repository.registry import Registry, read_registry, write_registry
from nnunet_triton.server.deploy import docker, k8s, sizing
from nnunet_triton.server.deploy.repository_info import ModelGeometry, RepositoryInfo

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
PATCH = (16, 24, 32)
PLANS = {
    "dataset_name": "Dataset903_Deploy",
    "plans_name": "nnUNetPlans",
    "transpose_forward": [2, 0, 1],
    "transpose_backward": [1, 2, 0],
    "image_reader_writer": "SimpleITKIO",
    "foreground_intensity_properties_per_channel": {},
    "configurations": {
        "3d_fullres": {
            "patch_size": list(PATCH),
            "spacing": [2.0, 1.0, 1.0],
            "normalization_schemes": ["ZScoreNormalization", "ZScoreNormalization"],
            "use_mask_for_norm": [False] * 2,
            **{
                f"resampling_fn_{kind}": "resample_data_or_seg_to_shape"
                for kind in ("data", "seg", "probabilities")
            },
            **{
                f"resampling_fn_{kind}_kwargs": {
                    "is_seg": kind == "seg",
                    "order": 1,
                    "order_z": 0,
                    "force_separate_z": None,
                }
                for kind in ("data", "seg", "probabilities")
            },
            "architecture": {
                "network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
                "arch_kwargs": {"n_stages": 2},
                "_kw_requires_import": [],
            },
        }
    },
}
DATASET = {
    "channel_names": {"0": "T1", "1": "T2"},
    "labels": {"background": 0, "a": 1, "b": 2},
    "file_ending": ".nii.gz",
}
# one orchestrator instance (gpu's default is 2): the sizing and rendering tests compute by hand per instance
GPU_OPTIONS = BuildOptions(target="gpu", fold_precision="fp16", orchestrator_instances=1)


def make_config() -> InferenceConfig:
    return load_inference_config(
        PLANS, DATASET, "3d_fullres", trainer_name="nnUNetTrainer", mirror_axes=(0, 1, 2), folds=(0, 1)
    )


def write_repository(
    root: Path,
    options: BuildOptions = GPU_OPTIONS,
    torch_version: str = "2.5.1",
    extra_dirs: tuple[str, ...] = (),
    drop: tuple[str, ...] = (),
    *,
    name: str = ENDPOINT_MODEL,
    version: int = 1,
    promote: bool = False,
    input_hash: str | None = None,
) -> Path:
    """A fake built repository following the builder's layout and registry contract: version ``version`` of
    endpoint ``name`` added to ``root`` (other endpoints already there stay), its models in the version's
    namespace, the public endpoints of ``name``, the registry written by
    ``nnunet_triton.repository.registry``."""
    config = make_config()
    specs = repository_specs(config, options)
    _, renaming = namespaced_specs(specs, name, version)
    models = sorted(renaming.values())
    for model in [*models, *public_endpoints(name), *extra_dirs]:
        if model not in drop:
            (root / model / "1").mkdir(parents=True, exist_ok=True)
            (root / model / "config.pbtxt").write_text(f'name: "{model}"\n')
    namespace = model_namespace(name, version)
    if namespace + "preprocess_model" not in drop:
        (root / f"{namespace}preprocess_model" / "1" / "inference_config.json").write_text(config.to_json())
    exports = [
        {"fold": f, "path": f"{namespace}fold_{f}/1/model.pt", "torch_version": torch_version}
        for f in config.folds
    ]
    metadata = {
        "input_hash": input_hash or hashlib.sha256(f"{name} {version}".encode()).hexdigest(),
        "torch_version": torch_version,
        "nnunetv2_version": "2.8.1",
        "configuration": "3d_fullres",
        "plans_sha256": "00" * 32,
        "folds": [0, 1],
        "models": models,
        "target": str(options.target),
        "fold_runner": str(options.runner),
        "fold_precision": options.fold_precision,
        "tile_batch_size": options.tile_batch_size,
        "exports": exports,
        "build_options": {
            "max_inflight": options.max_inflight,
            "fold_instances": options.fold_instances,
            "preprocess_instances": 1,
            "orchestrator_instances": options.orchestrator_instances,
            "stitch_instances": 1,
        },
    }
    registry = read_registry(root) or Registry()
    write_registry(root, registry.with_version(name, version, metadata, promote=promote))
    return root


def geometry() -> ModelGeometry:
    return ModelGeometry(
        channels=2,
        classes=3,
        patch_size=PATCH,
        target_spacing=(2.0, 1.0, 1.0),
        transpose_forward=(2, 0, 1),
        label_bytes=1,
    )


def two_endpoints(root: Path, options: BuildOptions = GPU_OPTIONS) -> Path:
    """One repository with two endpoints, ``liver`` and ``lung`` (version 1 each, same fake model)."""
    write_repository(root, options, name="liver")
    return write_repository(root, options, name="lung")


def docker_spec(root: Path, *, built: bool = False, **overrides: object) -> docker.DeploySpec:
    """A DeploySpec for a fake GPU repository under ``root`` (``built``: the one already there; default: the
    default endpoint written there) sized for a 600 x 512 x 512 volume."""
    info = RepositoryInfo.from_repository(root if built else write_repository(root))
    plan = sizing.plan_memory(info, sizing.VolumeSpec(shape=(600, 512, 512)))
    return docker.DeploySpec(info=info, plan=plan, repository="/srv/repo", **overrides)


def k8s_spec(root: Path, *, built: bool = False, **overrides: object) -> k8s.K8sSpec:
    spec = docker_spec(root, built=built)
    values = {
        "info": spec.info,
        "plan": spec.plan,
        "image": "registry.example/nnunet-triton:1",
        "model_source": k8s.ModelSource("image", "registry.example/nnunet-models:abc"),
        **overrides,
    }
    return k8s.K8sSpec(**values)
