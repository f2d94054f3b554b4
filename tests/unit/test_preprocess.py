"""preprocess_case against nnU-Net 2.8.1's DefaultPreprocessor.run_case_npy (bit-identical on NumPy).

Synthetic plans cover isotropic, separate-z (via the current and via the target spacing), a
non-identity transpose, an image smaller than the patch, several schemes per case, cropping zero
margins, an all-zero image, 2D configurations and odd shapes. Fixture model folders under
``tests/fixtures/`` (when present) add a parity test with real plans.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor
from nnunetv2.preprocessing.resampling.default_resampling import compute_new_shape as nnunet_new_shape
from nnunetv2.utilities.plans_handling.plans_handler import PlansManager
from scipy.ndimage import gaussian_filter

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics._xp import to_numpy
from nnunet_triton.numerics.model_folder import load_inference_config
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.preprocess import CaseProperties, preprocess_case

# CuPy: ZScore statistics are float32 reductions in another order (~1e-7 relative) and the float64
# spline math may move a float32 output by one ulp; on z-scores of order 10 that is below 1e-5.
CUPY_ATOL = 1e-5
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RESAMPLING = "resample_data_or_seg_to_shape"
CT = {
    "mean": 80.5,
    "median": 70.0,
    "std": 150.25,
    "min": -1000.0,
    "max": 2000.0,
    "percentile_00_5": -900.7,
    "percentile_99_5": 1400.3,
}
MR = {
    "mean": 300.0,
    "median": 280.0,
    "std": 90.0,
    "min": 0.0,
    "max": 900.0,
    "percentile_00_5": 10.0,
    "percentile_99_5": 800.0,
}




def make_configuration(spacing, patch_size, schemes, use_mask) -> dict[str, Any]:
    dim = len(patch_size)
    kwargs = {"is_seg": False, "order": 3, "order_z": 0, "force_separate_z": None}
    return {
        "data_identifier": f"synthetic_{dim}d",
        "preprocessor_name": "DefaultPreprocessor",
        "batch_size": 2,
        "patch_size": list(patch_size),
        "median_image_size_in_voxels": list(patch_size),
        "spacing": list(spacing),
        "normalization_schemes": list(schemes),
        "use_mask_for_norm": list(use_mask),
        "resampling_fn_data": RESAMPLING,
        "resampling_fn_data_kwargs": kwargs,
        "resampling_fn_seg": RESAMPLING,
        "resampling_fn_seg_kwargs": kwargs | {"is_seg": True, "order": 1},
        "resampling_fn_probabilities": RESAMPLING,
        "resampling_fn_probabilities_kwargs": kwargs | {"order": 1},
        "batch_dice": False,
        "architecture": {
            "network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
            "arch_kwargs": {
                "n_stages": 2,
                "features_per_stage": [4, 8],
                "conv_op": f"torch.nn.Conv{dim}d",
                "kernel_sizes": [[3] * dim] * 2,
                "strides": [[1] * dim, [2] * dim],
                "n_conv_per_stage": [1, 1],
                "n_conv_per_stage_decoder": [1],
                "conv_bias": True,
                "norm_op": f"torch.nn.InstanceNorm{dim}d",
                "norm_op_kwargs": {"eps": 1e-05, "affine": True},
                "dropout_op": None,
                "dropout_op_kwargs": None,
                "nonlin": "torch.nn.LeakyReLU",
                "nonlin_kwargs": {"inplace": True},
            },
            "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"],
        },
    }


def make_plans(configurations, transpose_forward=(0, 1, 2), intensities=(CT, MR, MR)) -> dict[str, Any]:
    backward = [list(transpose_forward).index(i) for i in range(3)]
    return {
        "dataset_name": "Dataset999_Synthetic",
        "plans_name": "nnUNetPlans",
        "original_median_spacing_after_transp": [1.0, 1.0, 1.0],
        "original_median_shape_after_transp": [32, 32, 32],
        "image_reader_writer": "SimpleITKIO",
        "transpose_forward": list(transpose_forward),
        "transpose_backward": backward,
        "configurations": configurations,
        "experiment_planner_used": "ExperimentPlanner",
        "label_manager": "LabelManager",
        "foreground_intensity_properties_per_channel": {str(c): dict(p) for c, p in enumerate(intensities)},
    }


def make_dataset(n_channels: int) -> dict[str, Any]:
    names = ["CT", "T1", "T2"][:n_channels]
    return {
        "channel_names": {str(c): n for c, n in enumerate(names)},
        "labels": {"background": 0, "organ": 1},
        "numTraining": 1,
        "file_ending": ".nii.gz",
    }


def _image(shape, seed, *, margin=0, scale=300.0, offset=100.0, dtype=np.float32) -> np.ndarray:
    """Smooth random channels; ``margin`` voxels of zeros on every side (to crop), plus a zero hole."""
    rng = np.random.default_rng(seed)
    img = gaussian_filter(rng.standard_normal(shape), sigma=(0, 1.5, 1.5, 1.5)) * scale * 4 + offset
    if margin:
        inner = img[(slice(None), *(slice(margin, s - margin) for s in shape[1:]))].copy()
        img[:] = 0
        img[(slice(None), *(slice(margin, s - margin) for s in shape[1:]))] = inner
        centre = tuple(s // 2 for s in shape[1:])
        img[(slice(None), *centre)] = 0  # enclosed: binary_fill_holes puts it back into the mask
    return img.astype(dtype)


def _case(
    shape,
    spacing,
    target,
    *,
    patch=(16, 16, 16),
    schemes=("ZScoreNormalization",),
    use_mask=(False,),
    transpose=(0, 1, 2),
    margin=0,
    seed=0,
    dtype=np.float32,
    image=None,
):
    return {
        "shape": shape,
        "spacing": spacing,
        "target": target,
        "patch": patch,
        "schemes": schemes,
        "use_mask": use_mask,
        "transpose": transpose,
        "margin": margin,
        "seed": seed,
        "dtype": dtype,
        "image": image,
    }


CASES = {
    "isotropic": _case((1, 20, 22, 24), (1.0, 1.0, 1.0), (0.8, 1.1, 1.3)),
    "sepz_via_current_spacing": _case(
        (1, 8, 30, 28), (5.0, 0.9, 0.9), (3.0, 1.0, 1.0), use_mask=(True,), margin=2
    ),
    "sepz_via_target_spacing": _case((1, 14, 20, 18), (1.5, 1.0, 1.0), (4.7, 1.0, 1.0)),
    "transpose_not_identity": _case((1, 25, 23, 6), (1.0, 1.1, 4.0), (3.0, 0.8, 0.8), transpose=(2, 0, 1)),
    "image_smaller_than_patch": _case((1, 5, 6, 7), (1.1, 0.9, 1.0), (1.0, 1.0, 1.0), patch=(32, 32, 32)),
    "ct_plus_zscore_mask_with_margins": _case(
        (2, 16, 18, 20),
        (1.2, 0.8, 0.8),
        (1.0, 1.0, 1.0),
        margin=3,
        schemes=("CTNormalization", "ZScoreNormalization"),
        use_mask=(False, True),
        seed=4,
    ),
    "all_zero": _case(
        (1, 6, 7, 8),
        (1.0, 1.0, 1.0),
        (1.3, 0.7, 1.0),
        use_mask=(True,),
        image=np.zeros((1, 6, 7, 8), np.float32),
    ),
    "2d_config_slices_kept": _case((1, 6, 30, 28), (3.0, 1.0, 1.0), (0.8, 0.8), patch=(32, 32)),
    "2d_config_no_separate_z": _case((1, 5, 17, 19), (1.2, 1.0, 1.0), (0.7, 1.3), patch=(32, 32)),
    "odd_shapes_half_even_rounding": _case((1, 5, 7, 9), (1.0, 1.0, 1.0), (2.0, 2.0, 2.0), seed=7),
    "shape_unchanged_pass_through": _case((1, 9, 10, 11), (1.0, 2.0, 3.0), (1.0, 2.0, 3.0), margin=1),
    "int16_ct": _case(
        (1, 12, 13, 11), (2.0, 0.7, 0.7), (1.5, 1.0, 1.0), schemes=("CTNormalization",), dtype=np.int16
    ),
    "float64_rescale_rgb_nonorm": _case(
        (3, 9, 11, 10),
        (1.0, 1.0, 1.0),
        (0.9, 1.2, 1.1),
        seed=9,
        schemes=("RescaleTo01Normalization", "RGBTo01Normalization", "NoNormalization"),
        use_mask=(False,) * 3,
        dtype=np.float64,
    ),
}


def _build(case: dict[str, Any]) -> tuple[np.ndarray, dict, dict, str]:
    name = "2d" if len(case["patch"]) == 2 else "3d_fullres"
    config = make_configuration(case["target"], case["patch"], case["schemes"], case["use_mask"])
    plans = make_plans({name: config}, case["transpose"])
    image = case["image"]
    if image is None:
        image = _image(case["shape"], case["seed"], margin=case["margin"], dtype=np.float64)
        if "RGBTo01Normalization" in case["schemes"]:
            image[case["schemes"].index("RGBTo01Normalization")] = np.clip(
                np.abs(image[case["schemes"].index("RGBTo01Normalization")]) % 256, 0, 255
            )
        image = image.astype(case["dtype"])
    return image, plans, make_dataset(case["shape"][0]), name


def _nnunet_preprocess(image, spacing, plans, dataset, name):
    pm = PlansManager(plans)
    cm = pm.get_configuration(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data, _, props = DefaultPreprocessor(verbose=False).run_case_npy(
            image, None, {"spacing": list(spacing)}, pm, cm, dataset
        )
    return data, props


def _config(plans, dataset, name) -> InferenceConfig:
    mirror = (0, 1) if name == "2d" else (0, 1, 2)
    return load_inference_config(
        plans, dataset, name, trainer_name="nnUNetTrainer", mirror_axes=mirror, folds=(0,)
    )


def _assert_case_matches(image, spacing, plans, dataset, name, xp, record_property=None, config=None):
    ref, ref_props = _nnunet_preprocess(image.copy(), spacing, plans, dataset, name)
    config = config or _config(plans, dataset, name)
    ours, props = preprocess_case(xp.asarray(image), spacing, config)
    ours_np = to_numpy(ours)
    diff = float(np.max(np.abs(ours_np.astype(np.float64) - ref), initial=0.0))
    if record_property is not None:
        record_property("max_abs_diff", diff)
    assert ours_np.dtype == np.float32 and ours_np.shape == ref.shape and ours_np.flags.c_contiguous
    if xp is np:
        assert np.array_equal(ours_np, ref), f"max abs diff {diff}"
    else:
        assert diff <= CUPY_ATOL, f"max abs diff {diff}"
    assert props.spacing == tuple(float(s) for s in spacing)
    assert props.shape_before_cropping == tuple(ref_props["shape_before_cropping"])
    assert props.bbox == tuple(tuple(int(v) for v in pair) for pair in ref_props["bbox_used_for_cropping"])
    assert props.shape_after_cropping_and_before_resampling == tuple(
        ref_props["shape_after_cropping_and_before_resampling"]
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_preprocess_case_equals_nnunet_run_case_npy_when_case_varies(case, xp, record_property):
    image, plans, dataset, name = _build(CASES[case])
    _assert_case_matches(image, CASES[case]["spacing"], plans, dataset, name, xp, record_property)


def test_preprocess_case_equals_nnunet_when_configuration_inherits_from_another(xp):
    image, plans, dataset, _ = _build(CASES["isotropic"])
    plans["configurations"]["3d_custom"] = {"inherits_from": "3d_fullres", "spacing": [1.4, 0.6, 1.0]}
    _assert_case_matches(image, (1.0, 1.0, 1.0), plans, dataset, "3d_custom", xp)


def test_preprocess_case_does_not_modify_its_input_when_called(xp):
    image, plans, dataset, name = _build(CASES["ct_plus_zscore_mask_with_margins"])
    before = image.copy()
    device_image = xp.asarray(image)
    preprocess_case(
        device_image, CASES["ct_plus_zscore_mask_with_margins"]["spacing"], _config(plans, dataset, name)
    )
    np.testing.assert_array_equal(to_numpy(device_image), before)


def _fixture_cases() -> list[tuple[Path, Path]]:
    """(model folder, held-out ``*_0000`` image) pairs of the CT fixtures (tools/fixtures/synthct.py)."""
    cases = []
    for plans_file in sorted(FIXTURES.glob("*/*/plans.json")):
        model_dir = plans_file.parent
        ending = json.loads((model_dir / "dataset.json").read_text()).get("file_ending", ".nii.gz")
        cases += [(model_dir, f) for f in sorted((model_dir.parent / "imagesTs").glob(f"*_0000{ending}"))]
    return cases


@pytest.mark.parametrize("model_dir, image_file", _fixture_cases(), ids=lambda p: p.name)
def test_preprocess_case_equals_nnunet_when_using_fixture_models(model_dir, image_file, xp, record_property):
    """Real plans (configuration and folds from the checkpoints) on the fixture's held-out images."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    from nnunet_triton.numerics.model_folder import read_model_folder

    folds = None if any(model_dir.glob("fold_[0-9]*")) else ("all",)  # cascade fixture: fold_all only
    config = read_model_folder(model_dir, folds=folds, allow_cascade=True)
    if config.previous_stage is not None:
        pytest.skip("cascade stage: its input includes the previous stage's segmentation (test_cascade.py)")
    plans = json.loads((model_dir / "plans.json").read_text())
    dataset = json.loads((model_dir / "dataset.json").read_text())
    first = str(image_file)
    channels = [first.replace("_0000.", f"_{c:04d}.") for c in range(config.num_input_channels)]
    image, props = SimpleITKIO().read_images(channels)
    _assert_case_matches(
        image, tuple(props["spacing"]), plans, dataset, config.configuration, xp, record_property, config
    )


@pytest.mark.parametrize(
    "image, spacing, message",
    [
        (np.zeros((8, 8, 8), np.float32), (1, 1, 1), "4D array"),
        (np.zeros((2, 8, 8, 8), np.float32), (1, 1, 1), "2 channels.*expects 1"),
        (np.zeros((1, 8, 8, 8), np.complex64), (1, 1, 1), "real numeric dtype"),
        (np.zeros((1, 0, 8, 8), np.float32), (1, 1, 1), "empty spatial axis"),
        (np.zeros((1, 8, 8, 8), np.float32), (1, 1), "3 entries"),
        (np.zeros((1, 8, 8, 8), np.float32), (1, 0, 1), r"finite and > 0.*0\.0"),
        (np.zeros((1, 8, 8, 8), np.float32), (1, float("nan"), 1), "finite and > 0.*nan"),
        (np.full((1, 8, 8, 8), np.nan, np.float32), (1, 1, 1), "512 NaN/Inf"),
        (np.full((1, 8, 8, 8), 1e300, np.float64), (1, 1, 1), "after the cast to float32.*512"),
        (np.ones((1, 1, 8, 8), np.float32), (0.1, 1, 1), r"too small.*\(0, 7, 6\)"),
    ],
)
def test_preprocess_case_raises_input_validation_error_when_input_breaks_a_rule(image, spacing, message, xp):
    _, plans, dataset, name = _build(CASES["isotropic"])
    with pytest.raises(InputValidationError, match=message):
        preprocess_case(xp.asarray(image), spacing, _config(plans, dataset, name))


def test_case_properties_round_trip_when_converted_to_array():
    props = CaseProperties(
        spacing=(2.5, 0.7, 0.7000000000000001),
        shape_before_cropping=(40, 50, 60),
        bbox=((1, 39), (0, 50), (5, 55)),
        shape_after_cropping_and_before_resampling=(38, 50, 50),
    )
    array = props.to_array()
    assert array.dtype == np.float64 and array.shape == (15,)
    assert CaseProperties.from_array(array) == props
    assert props.to_nnunet_dict()["bbox_used_for_cropping"] == [[1, 39], [0, 50], [5, 55]]


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros(14),
        np.r_[np.ones(3), np.full(12, 1.5)],
        np.r_[np.ones(3), -np.ones(12)],
        np.r_[np.nan, np.ones(14)],
    ],
)
def test_case_properties_from_array_raises_when_vector_is_malformed(bad):
    with pytest.raises(InputValidationError, match="case properties"):
        CaseProperties.from_array(bad)


def _resampled_case() -> tuple[np.ndarray, tuple[float, ...], InferenceConfig, tuple[int, ...]]:
    """The ``isotropic`` case with 2 zero margins, and the shape nnU-Net resamples its cropped data to."""
    case = CASES["isotropic"]
    image, plans, dataset, name = _build({**case, "margin": 2})
    ref, props = _nnunet_preprocess(image.copy(), case["spacing"], plans, dataset, name)
    cropped = props["shape_after_cropping_and_before_resampling"]
    new_shape = tuple(int(s) for s in nnunet_new_shape(cropped, case["spacing"], case["target"]))
    assert ref.shape[1:] == new_shape  # nnU-Net resamples the CROPPED shape
    return image, case["spacing"], _config(plans, dataset, name), new_shape


def test_preprocess_case_raises_naming_resampled_shape_and_limit_when_over_max_voxels(xp):
    image, spacing, config, new_shape = _resampled_case()
    voxels = int(np.prod(new_shape))
    with pytest.raises(InputValidationError) as info:
        preprocess_case(xp.asarray(image), spacing, config, max_voxels=voxels - 1)
    assert str(info.value) == (
        f"resampled image has {voxels} voxels (shape {(1, *new_shape)}), more than the server's limit of "
        f"{voxels - 1} voxels (model parameter 'max_voxels')."
    )
    assert info.value.triton_code == "INVALID_ARG"


@pytest.mark.parametrize("limit", ["exact", "zero"])
def test_preprocess_case_is_unchanged_when_resampled_shape_is_within_max_voxels(limit, xp):
    image, spacing, config, new_shape = _resampled_case()
    max_voxels = int(np.prod(new_shape)) if limit == "exact" else 0
    unlimited, props = preprocess_case(xp.asarray(image), spacing, config)
    limited, limited_props = preprocess_case(xp.asarray(image), spacing, config, max_voxels=max_voxels)
    assert tuple(limited.shape) == (1, *new_shape) and limited_props == props
    np.testing.assert_array_equal(to_numpy(limited), to_numpy(unlimited))


def test_preprocess_case_raises_naming_logits_and_probabilities_sizes_when_over_memory_budget(xp):
    image, spacing, config, new_shape = _resampled_case()
    heads = config.labels.num_segmentation_heads
    logits, probabilities = heads * int(np.prod(new_shape)) * 4, heads * int(np.prod(image.shape[1:])) * 4
    budget = max(logits, probabilities) - 1
    expected = (rf"more than the server's budget of .* \({budget} bytes\) per array "
                r"\(model parameter 'max_request_bytes'\)")
    with pytest.raises(InputValidationError, match=expected) as info:
        preprocess_case(xp.asarray(image), spacing, config, max_request_bytes=budget)
    assert f"({heads} x {tuple(new_shape)} float32, preprocessed geometry)" in str(info.value)
    assert info.value.triton_code == "INVALID_ARG"
    limited, _ = preprocess_case(xp.asarray(image), spacing, config, max_request_bytes=budget + 1)
    assert tuple(limited.shape) == (1, *new_shape)
