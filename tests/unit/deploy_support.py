"""Fakes for the deploy tests: an nnU-Net configuration and a repository laid out like the builder's output.

``write_repository`` follows the pipeline contract: ``repository_metadata.json`` (models, folds, target,
runner, precision, tile batch size, build options, exporting torch per fold), one ``config.pbtxt`` per
model and ``preprocess_model/1/inference_config.json``; deploy reads nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

from nnunet_triton.builder.model_specs import BuildOptions, repository_specs
from nnunet_triton.numerics.model_folder import load_inference_config
from nnunet_triton.numerics.plans import InferenceConfig
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
) -> Path:
    """A fake built repository following the builder's layout and metadata contract."""
    config = make_config()
    models = sorted(spec.name for spec in repository_specs(config, options))
    for name in [*models, *extra_dirs]:
        if name not in drop:
            (root / name / "1").mkdir(parents=True)
            (root / name / "config.pbtxt").write_text(f'name: "{name}"\n')
    (root / "preprocess_model" / "1" / "inference_config.json").write_text(config.to_json())
    exports = [
        {"fold": f, "path": f"fold_{f}/1/model.pt", "torch_version": torch_version} for f in config.folds
    ]
    metadata = {
        "input_hash": "ab" * 32,
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
    (root / "repository_metadata.json").write_text(json.dumps(metadata))
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


def docker_spec(root: Path, **overrides: object) -> docker.DeploySpec:
    """A DeploySpec for a fake GPU repository under ``root`` sized for a 600 x 512 x 512 volume."""
    info = RepositoryInfo.from_repository(write_repository(root))
    plan = sizing.plan_memory(info, sizing.VolumeSpec(shape=(600, 512, 512)))
    return docker.DeploySpec(info=info, plan=plan, repository="/srv/repo", **overrides)


def k8s_spec(root: Path, **overrides: object) -> k8s.K8sSpec:
    spec = docker_spec(root)
    values = {
        "info": spec.info,
        "plan": spec.plan,
        "image": "registry.example/nnunet-triton:1",
        "model_source": k8s.ModelSource("image", "registry.example/nnunet-models:abc"),
        **overrides,
    }
    return k8s.K8sSpec(**values)
