"""Shared test support: tiny real nnU-Net networks, synthetic plans, an nnUNetPredictor on CPU, xp params.

Used by test_sliding_window.py and test_export.py. torch and nnunetv2 are imported here on purpose:
tests compare our pure NumPy/CuPy numerics with nnU-Net's own code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

from nnunet_triton.numerics.model_folder import load_inference_config
from nnunet_triton.numerics.plans import InferenceConfig

CONFIG_NAME_3D = "3d_fullres"
CONFIG_NAME_2D = "2d"
RESAMPLING = "resample_data_or_seg_to_shape"


def _torch_sees_gpu() -> bool:
    return bool(torch.cuda.is_available())


def cupy_or_skip(*, torch_sees_gpu: Callable[[], bool] = _torch_sees_gpu) -> Any:
    """CuPy if it is installed and a CUDA device answers; else skip the test with the reason, unless torch
    sees a GPU: then CuPy's failure (not installed, or broken) is a defect of the GPU machine's setup, and
    the test fails instead of passing as skipped.

    Args:
        torch_sees_gpu: whether this machine has a GPU by torch's account (a parameter so the rule can be
            tested on a machine without one).
    """
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        cupy.zeros(1).sum().item()
    except Exception as exc:  # noqa: BLE001 - any CuPy or CUDA failure: no usable CuPy here
        if torch_sees_gpu():
            pytest.fail(f"torch sees a CUDA device but CuPy is not usable: {exc!r}; the GPU path needs "
                        "CuPy (pip install the cupy-cuda*x wheel matching the CUDA runtime)", pytrace=False)
        pytest.skip(f"no usable CuPy and torch sees no GPU: {exc!r}")
    return cupy


def xp_from_param(name: str) -> Any:
    return np if name == "numpy" else cupy_or_skip()


def _configuration(
    patch_size: tuple[int, ...], spacing: tuple[float, ...], n_channels: int
) -> dict[str, Any]:
    dim = len(patch_size)
    conv = f"torch.nn.modules.conv.Conv{dim}d"
    norm = f"torch.nn.modules.instancenorm.InstanceNorm{dim}d"
    return {
        "data_identifier": f"parity_{dim}d",
        "preprocessor_name": "DefaultPreprocessor",
        "batch_size": 2,
        "patch_size": list(patch_size),
        "median_image_size_in_voxels": [2 * p for p in patch_size],
        "spacing": list(spacing),
        "normalization_schemes": ["ZScoreNormalization"] * n_channels,
        "use_mask_for_norm": [False] * n_channels,
        "resampling_fn_data": RESAMPLING,
        "resampling_fn_seg": RESAMPLING,
        "resampling_fn_probabilities": RESAMPLING,
        "resampling_fn_data_kwargs": {"is_seg": False, "order": 3, "order_z": 0, "force_separate_z": None},
        "resampling_fn_seg_kwargs": {"is_seg": True, "order": 1, "order_z": 0, "force_separate_z": None},
        "resampling_fn_probabilities_kwargs": {
            "is_seg": False,
            "order": 1,
            "order_z": 0,
            "force_separate_z": None,
        },
        "batch_dice": True,
        "architecture": {
            "network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
            "arch_kwargs": {
                "n_stages": 2,
                "features_per_stage": [4, 8],
                "conv_op": conv,
                "kernel_sizes": [[3] * dim, [3] * dim],
                "strides": [[1] * dim, [2] * dim],
                "n_conv_per_stage": [1, 1],
                "n_conv_per_stage_decoder": [1],
                "conv_bias": True,
                "norm_op": norm,
                "norm_op_kwargs": {"eps": 1e-05, "affine": True},
                "dropout_op": None,
                "dropout_op_kwargs": None,
                "nonlin": "torch.nn.LeakyReLU",
                "nonlin_kwargs": {"inplace": True},
            },
            "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"],
        },
    }


def make_plans(
    *,
    patch_3d: tuple[int, ...] = (16, 16, 16),
    spacing_3d: tuple[float, ...] = (1.0, 1.0, 1.0),
    patch_2d: tuple[int, ...] = (16, 16),
    spacing_2d: tuple[float, ...] = (1.0, 1.0),
    transpose_forward: tuple[int, ...] = (0, 1, 2),
    n_channels: int = 1,
) -> dict[str, Any]:
    """A small but complete nnU-Net v2 plans dict with a 3d_fullres and a 2d configuration."""
    backward = tuple(int(i) for i in np.argsort(transpose_forward))
    return {
        "dataset_name": "Dataset999_Parity",
        "plans_name": "nnUNetPlans",
        "original_median_spacing_after_transp": list(spacing_3d),
        "original_median_shape_after_transp": [32, 32, 32],
        "image_reader_writer": "SimpleITKIO",
        "transpose_forward": list(transpose_forward),
        "transpose_backward": list(backward),
        "configurations": {
            CONFIG_NAME_3D: _configuration(patch_3d, spacing_3d, n_channels),
            CONFIG_NAME_2D: _configuration(patch_2d, spacing_2d, n_channels),
        },
        "experiment_planner_used": "ExperimentPlanner",
        "label_manager": "LabelManager",
        "foreground_intensity_properties_per_channel": {
            str(c): {
                "max": 5.0,
                "mean": 1.0,
                "median": 1.0,
                "min": -5.0,
                "percentile_00_5": -4.0,
                "percentile_99_5": 4.0,
                "std": 2.0,
            }
            for c in range(n_channels)
        },
    }


def make_dataset_json(*, n_labels: int = 3, regions: bool = False, n_channels: int = 1) -> dict[str, Any]:
    """Labels ``background, l1 .. l{n-1}``; with ``regions`` two overlapping regions (1, 2) and (2,)."""
    if regions:
        labels: dict[str, Any] = {"background": 0, "whole": [1, 2], "core": 2}
        extra = {"regions_class_order": [1, 2]}
    else:
        labels = {"background": 0, **{f"label{i}": i for i in range(1, n_labels)}}
        extra = {}
    return {
        "channel_names": {str(c): f"ch{c}" for c in range(n_channels)},
        "labels": labels,
        "numTraining": 1,
        "file_ending": ".nii.gz",
        **extra,
    }


def build_network(
    plans: dict[str, Any], configuration: str, n_in: int, n_out: int, seed: int
) -> torch.nn.Module:
    """The configuration's PlainConvUNet (deep_supervision=False) with seeded He-initialised weights."""
    arch = plans["configurations"][configuration]["architecture"]
    torch.manual_seed(seed)
    net = get_network_from_plans(
        arch["network_class_name"],
        copy.deepcopy(arch["arch_kwargs"]),
        arch["_kw_requires_import"],
        n_in,
        n_out,
        deep_supervision=False,
    )
    with torch.no_grad():  # non-trivial norm affine parameters and biases
        for name, p in net.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return net.eval()


def fold_parameters(plans, configuration, n_in, n_out, seeds) -> list[dict[str, torch.Tensor]]:
    return [copy.deepcopy(build_network(plans, configuration, n_in, n_out, s).state_dict()) for s in seeds]


def make_predictor(
    plans,
    dataset_json,
    configuration,
    network,
    parameters,
    *,
    mirror_axes,
    tile_step_size=0.5,
    use_mirroring=True,
    use_gaussian=True,
) -> nnUNetPredictor:
    """nnUNetPredictor on the CPU, initialised like the trainer's final validation."""
    predictor = nnUNetPredictor(
        tile_step_size=tile_step_size,
        use_gaussian=use_gaussian,
        use_mirroring=use_mirroring,
        perform_everything_on_device=False,
        device=torch.device("cpu"),
        verbose=False,
        allow_tqdm=False,
    )
    plans_manager = PlansManager(copy.deepcopy(plans))
    predictor.manual_initialization(
        network,
        plans_manager,
        plans_manager.get_configuration(configuration),
        parameters,
        dataset_json,
        "nnUNetTrainer",
        mirror_axes,
    )
    return predictor


def torch_predict_batch(network: torch.nn.Module):
    """``predict_batch`` calling a torch network on the CPU: (N, C, *P) float32 -> (N, K, *P) float32.

    CuPy input is copied to the host and the result back to the GPU, so the network numerics are
    the CPU ones nnU-Net uses in these tests.
    """

    @torch.inference_mode()
    def predict_batch(x: Any) -> Any:
        is_cupy = type(x).__module__.startswith("cupy")
        host = x.get() if is_cupy else x
        out = network(torch.from_numpy(np.ascontiguousarray(host))).numpy()
        if is_cupy:
            import cupy

            return cupy.asarray(out)
        return out

    return predict_batch


def inference_config(
    plans, dataset_json, configuration, *, mirror_axes=(0, 1, 2), folds=(0,)
) -> InferenceConfig:
    return load_inference_config(
        plans, dataset_json, configuration, trainer_name="nnUNetTrainer", mirror_axes=mirror_axes, folds=folds
    )


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
