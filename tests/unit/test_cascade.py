"""nnunet_triton.numerics.cascade against nnU-Net 2.8.1's cascade input (bit-identical on NumPy).

The reference is nnU-Net's own data iterator, ``PreprocessAdapterFromNpy`` (what
``nnUNetPredictor.predict_single_npy_array(..., segmentation_previous_stage)`` runs):
``DefaultPreprocessor.run_case_npy(image, seg, ...)`` + ``convert_labelmap_to_one_hot`` stacked on the data.
The previous stage's segmentation is handed over as ``SimpleITKIO.read_seg`` returns it (float32,
(1, *spatial)), which is what ``nnUNetv2_predict -prev_stage_predictions`` does. Synthetic plans cover
resampling, separate z, a non-identity transpose, zero margins with foreground of the previous stage
outside the nonzero mask (the -1 of ``crop_to_nonzero`` and the ``seg >= 0`` ZScore mask), and no
resampling. The fixture ``tests/fixtures/Dataset904_SynthCascade`` (spec `cascade`, tools/fixtures) adds
its held-out cases with the low-res stage's real predictions and an end-to-end cascade prediction.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nnunetv2.inference.data_iterators import PreprocessAdapterFromNpy
from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
from nnunetv2.utilities.plans_handling.plans_handler import PlansManager
from test_preprocess import _image, make_configuration, make_dataset, make_plans

from nnunet_triton.errors import InputValidationError, UnsupportedModelError
from nnunet_triton.numerics._xp import to_numpy
from nnunet_triton.numerics.cascade import convert_labelmap_to_one_hot
from nnunet_triton.numerics.model_folder import load_inference_config, read_model_folder
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.preprocess import preprocess_case
from nnunet_triton.validate.oracle import nnunet_predictor
from tests.fixture_paths import require_fixture

CUPY_ATOL = 1e-5  # image channels on CuPy: as tests/unit/test_preprocess.py (float32 reduction order)
# One-hot channels on CuPy: resize_segmentation breaks exact ties of interpolated indicators; CuPy's zoom
# may move a score by one float64 ulp and flip such a tie, so up to 0.1 % of voxels may differ.
CUPY_ONE_HOT_MISMATCH = 1e-3
LABELS = {"background": 0, "organ": 1, "lesion": 2}
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "Dataset904_SynthCascade"
LOWRES_DIR = FIXTURE / "nnUNetTrainer__nnUNetPlans__3d_lowres_tiny"
CASCADE_DIR = FIXTURE / "nnUNetTrainer__nnUNetPlans__3d_cascade_tiny"



# --------------------------------------------------------------------------------------------------
# Reference: nnU-Net's own data iterator
# --------------------------------------------------------------------------------------------------


def _nnunet_cascade_input(image, seg, spacing, plans, dataset, name) -> tuple[np.ndarray, dict]:
    """``PreprocessAdapterFromNpy``: run_case_npy(image, seg) + one-hot of the processed seg (float32)."""
    pm = PlansManager(plans)
    cm = pm.get_configuration(name)
    seg = np.asarray(seg, dtype=np.float32).reshape((1, *image.shape[1:]))  # SimpleITKIO.read_seg
    adapter = PreprocessAdapterFromNpy([image.copy()], [seg], [{"spacing": list(spacing)}], None, pm, dataset,
                                       cm, num_threads_in_multithreaded=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        item = next(adapter)
    return item["data"].numpy(), item["data_properties"]


def _assert_matches(ours, props, ref, ref_props, n_image_channels, xp, record_property=None):
    ours_np = to_numpy(ours)
    assert ours_np.dtype == np.float32 and ours_np.shape == ref.shape and ours_np.flags.c_contiguous
    image_diff = float(np.max(np.abs(ours_np[:n_image_channels].astype(np.float64) - ref[:n_image_channels])))
    one_hot_mismatch = float(np.mean(ours_np[n_image_channels:] != ref[n_image_channels:]))
    if record_property is not None:
        record_property("max_abs_diff_image", image_diff)
        record_property("one_hot_mismatch_fraction", one_hot_mismatch)
    if xp is np:
        assert np.array_equal(ours_np, ref), f"image max abs diff {image_diff}, one-hot {one_hot_mismatch}"
    else:
        assert image_diff <= CUPY_ATOL and one_hot_mismatch <= CUPY_ONE_HOT_MISMATCH
    assert props.shape_before_cropping == tuple(ref_props["shape_before_cropping"])
    assert props.bbox == tuple(tuple(int(v) for v in pair) for pair in ref_props["bbox_used_for_cropping"])
    assert props.shape_after_cropping_and_before_resampling == tuple(
        ref_props["shape_after_cropping_and_before_resampling"]
    )


# --------------------------------------------------------------------------------------------------
# Synthetic cases
# --------------------------------------------------------------------------------------------------


def _wedge(shape) -> np.ndarray:
    """A corner wedge over all slices, open to the border (binary_fill_holes keeps it out of the mask)."""
    grids = np.meshgrid(*[np.arange(n) for n in shape], indexing="ij")
    return (grids[1] + grids[2]) < 0.35 * (shape[1] + shape[2])


def _previous_segmentation(shape, seed) -> np.ndarray:
    """Two blobs (labels 1, 2), plus label 1 in half of the wedge that the image zeroes (see ``_build``).

    Inside the crop, the wedge's background becomes -1 (``crop_to_nonzero``) while its label-1 half stays 1
    and joins the ZScore mask ``seg >= 0``: both only match nnU-Net if ported exactly.
    """
    rng = np.random.default_rng(seed)
    grids = np.meshgrid(*[np.arange(n) for n in shape], indexing="ij")
    seg = np.zeros(shape, dtype=np.uint8)
    for label, radius_fraction in ((1, 0.45), (2, 0.2)):
        centre = [rng.uniform(0.2, 0.8) * n for n in shape]
        radius = [max(radius_fraction * n, 1.5) for n in shape]
        inside = sum(((g - c) / r) ** 2 for g, c, r in zip(grids, centre, radius, strict=True)) <= 1.0
        seg[inside] = label
    seg[_wedge(shape) & (grids[0] < shape[0] // 2)] = 1
    return seg


def _cascade_case(shape, spacing, target, *, schemes=("ZScoreNormalization",), use_mask=(False,),
                  transpose=(0, 1, 2), margin=0, seed=0) -> dict[str, Any]:
    return {"shape": shape, "spacing": spacing, "target": target, "schemes": schemes, "use_mask": use_mask,
            "transpose": transpose, "margin": margin, "seed": seed}


CASES = {
    "isotropic_resampling": _cascade_case((1, 20, 22, 24), (1.0, 1.0, 1.0), (0.8, 1.1, 1.3)),
    "crop_margins_zscore_mask": _cascade_case(
        (1, 16, 18, 20), (1.2, 0.8, 0.8), (1.0, 1.0, 1.0), use_mask=(True,), margin=3, seed=1
    ),
    "separate_z_via_current_spacing": _cascade_case(
        (1, 8, 30, 28), (5.0, 0.9, 0.9), (3.0, 1.0, 1.0), use_mask=(True,), margin=2, seed=2
    ),
    "separate_z_via_target_spacing": _cascade_case((1, 14, 20, 18), (1.5, 1.0, 1.0), (4.7, 1.0, 1.0), seed=3),
    "transpose_not_identity": _cascade_case(
        (1, 25, 23, 6), (1.0, 1.1, 4.0), (3.0, 0.8, 0.8), transpose=(2, 0, 1), margin=1, seed=4
    ),
    "ct_plus_zscore_mask_two_channels": _cascade_case(
        (2, 16, 18, 20), (1.2, 0.8, 0.8), (2.4, 1.6, 1.6), schemes=("CTNormalization", "ZScoreNormalization"),
        use_mask=(False, True), margin=3, seed=5,
    ),
    "no_resampling_pass_through": _cascade_case((1, 9, 10, 11), (1.0, 2.0, 3.0), (1.0, 2.0, 3.0), margin=1),
}


def _build(case: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict, dict]:
    fullres = make_configuration(case["target"], (16, 16, 16), case["schemes"], case["use_mask"])
    plans = make_plans({"3d_fullres": fullres,
                        "3d_cascade": {"inherits_from": "3d_fullres", "previous_stage": "3d_lowres"}},
                       case["transpose"])
    image = _image(case["shape"], case["seed"], margin=case["margin"])
    image[:, _wedge(case["shape"][1:])] = 0  # the nonzero mask is not a box: -1 inside the crop
    seg = _previous_segmentation(case["shape"][1:], case["seed"])
    dataset = make_dataset(case["shape"][0]) | {"labels": dict(LABELS)}
    return image, seg, plans, dataset


def _config(plans, dataset, name="3d_cascade") -> InferenceConfig:
    return load_inference_config(plans, dataset, name, trainer_name="nnUNetTrainer", mirror_axes=(0, 1, 2),
                                 folds=(0,), allow_cascade=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cascade_input_equals_nnunet_data_iterator_when_case_varies(case, xp, record_property):
    image, seg, plans, dataset = _build(CASES[case])
    spacing = CASES[case]["spacing"]
    ref, ref_props = _nnunet_cascade_input(image, seg, spacing, plans, dataset, "3d_cascade")
    config = _config(plans, dataset)
    ours, props = preprocess_case(xp.asarray(image), spacing, config, previous_segmentation=xp.asarray(seg))
    _assert_matches(ours, props, ref, ref_props, image.shape[0], xp, record_property)
    assert ref.shape[0] == image.shape[0] + 2


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int64, np.float32, np.float64])
def test_cascade_input_gives_the_same_input_when_segmentation_dtype_or_leading_axis_varies(dtype):
    image, seg, plans, dataset = _build(CASES["crop_margins_zscore_mask"])
    spacing = CASES["crop_margins_zscore_mask"]["spacing"]
    ref, _ = _nnunet_cascade_input(image, seg, spacing, plans, dataset, "3d_cascade")
    config = _config(plans, dataset)
    for given in (seg.astype(dtype), seg.astype(dtype)[None]):
        ours, _ = preprocess_case(image, spacing, config, previous_segmentation=given)
        assert np.array_equal(ours, ref)


def test_cascade_input_does_not_modify_its_inputs_when_called():
    image, seg, plans, dataset = _build(CASES["crop_margins_zscore_mask"])
    image_before, seg_before = image.copy(), seg.copy()
    preprocess_case(image, CASES["crop_margins_zscore_mask"]["spacing"], _config(plans, dataset),
                    previous_segmentation=seg)
    assert np.array_equal(image, image_before) and np.array_equal(seg, seg_before)


def test_convert_labelmap_to_one_hot_equals_nnunet_when_map_has_minus_one_and_background(xp):
    from nnunetv2.utilities.label_handling.label_handling import convert_labelmap_to_one_hot as nn_one_hot

    seg = np.random.default_rng(0).integers(-1, 3, size=(5, 6, 7)).astype(np.int8)
    ours = convert_labelmap_to_one_hot(xp.asarray(seg), (1, 2), np.float32)
    assert np.array_equal(to_numpy(ours), nn_one_hot(seg, [1, 2], np.float32))


@pytest.mark.parametrize(
    "segmentation, message",
    [
        (np.zeros((20, 22, 23)), r"spatial shape \(20, 22, 24\)"),
        (np.zeros((2, 20, 22, 24)), r"spatial shape"),
        (np.full((20, 22, 24), 3), r"only contain the model's labels \[0, 1, 2\].*values present: \[3.0\]"),
        (np.full((20, 22, 24), 0.5), r"only contain the model's labels"),
        (np.full((20, 22, 24), -1), r"only contain the model's labels"),
        (np.zeros((20, 22, 24), dtype=np.complex64), r"real numeric dtype"),
    ],
    ids=["wrong_shape", "two_channels", "unknown_label", "fractional", "negative", "complex"],
)
def test_cascade_input_raises_input_validation_error_when_segmentation_breaks_a_rule(
    segmentation, message
):
    image, _, plans, dataset = _build(CASES["isotropic_resampling"])
    with pytest.raises(InputValidationError, match=message):
        preprocess_case(image, (1.0, 1.0, 1.0), _config(plans, dataset),
                        previous_segmentation=segmentation)


def test_cascade_input_raises_unsupported_when_configuration_is_not_a_cascade_stage():
    image, seg, plans, dataset = _build(CASES["isotropic_resampling"])
    with pytest.raises(UnsupportedModelError, match="no previous_stage"):
        preprocess_case(image, (1.0, 1.0, 1.0), _config(plans, dataset, "3d_fullres"),
                        previous_segmentation=seg)


# --------------------------------------------------------------------------------------------------
# plans: loading a cascade stage
# --------------------------------------------------------------------------------------------------


def test_load_inference_config_raises_unsupported_when_cascade_is_not_allowed():
    _, _, plans, dataset = _build(CASES["isotropic_resampling"])
    with pytest.raises(UnsupportedModelError, match="previous_stage = '3d_lowres'"):
        load_inference_config(plans, dataset, "3d_cascade", trainer_name="nnUNetTrainer", mirror_axes=None,
                              folds=(0,))


def test_load_inference_config_counts_one_hot_channels_like_nnunet_when_cascade_is_allowed():
    _, _, plans, dataset = _build(CASES["ct_plus_zscore_mask_two_channels"])
    config = _config(plans, dataset)
    pm = PlansManager(plans)
    assert (config.previous_stage, config.num_input_channels, config.num_previous_stage_channels) == (
        "3d_lowres", 2, 2
    )
    assert config.network.num_input_channels == determine_num_input_channels(
        pm, pm.get_configuration("3d_cascade"), dataset
    ) == 4
    assert InferenceConfig.from_json(config.to_json()) == config
    plain = _config(plans, dataset, "3d_fullres")
    assert (plain.previous_stage, plain.num_previous_stage_channels, plain.network.num_input_channels) == (
        None, 0, 2
    )


# --------------------------------------------------------------------------------------------------
# The nnU-Net-trained cascade fixture
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def _committed_cascade() -> None:
    require_fixture(CASCADE_DIR / "fold_all" / "checkpoint_final.pth")


needs_fixture = pytest.mark.usefixtures("_committed_cascade")


def _held_out() -> list[str]:
    return sorted(p.name[: -len("_0000.nii.gz")] for p in (FIXTURE / "imagesTs").glob("*_0000.nii.gz"))


def _read(case: str) -> tuple[np.ndarray, dict, np.ndarray]:
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    io = SimpleITKIO()
    image, props = io.read_images([str(FIXTURE / "imagesTs" / f"{case}_0000.nii.gz")])
    previous, _ = io.read_seg(str(FIXTURE / "predictions" / "3d_lowres_tiny" / f"{case}.nii.gz"))
    return image, props, previous


@needs_fixture
def test_read_model_folder_loads_fixture_cascade_stage_when_cascade_is_allowed():
    import torch

    with pytest.raises(UnsupportedModelError, match="cascade"):
        read_model_folder(CASCADE_DIR, folds=("all",))
    config = read_model_folder(CASCADE_DIR, folds=("all",), allow_cascade=True)
    plans = json.loads((CASCADE_DIR / "plans.json").read_text())
    dataset = json.loads((CASCADE_DIR / "dataset.json").read_text())
    pm = PlansManager(plans)
    assert (config.configuration, config.previous_stage, config.folds) == (
        "3d_cascade_tiny", "3d_lowres_tiny", ("all",)
    )
    assert config.network.num_input_channels == determine_num_input_channels(
        pm, pm.get_configuration("3d_cascade_tiny"), dataset
    ) == 3
    weights = torch.load(CASCADE_DIR / "fold_all" / "checkpoint_final.pth", map_location="cpu",
                         weights_only=False)["network_weights"]
    first_conv = next(v for k, v in weights.items() if k.endswith("conv.weight"))
    assert first_conv.shape[1] == config.network.num_input_channels
    lowres = read_model_folder(LOWRES_DIR, folds=("all",))
    assert (lowres.previous_stage, lowres.network.num_input_channels) == (None, 1)
    assert plans["configurations"]["3d_lowres_tiny"]["next_stage"] == "3d_cascade_tiny"


@needs_fixture
@pytest.mark.parametrize("case", _held_out() if FIXTURE.is_dir() else [])
def test_cascade_input_equals_nnunet_when_using_fixture_low_res_predictions(
    case, xp, record_property
):
    image, props, previous = _read(case)
    plans = json.loads((CASCADE_DIR / "plans.json").read_text())
    dataset = json.loads((CASCADE_DIR / "dataset.json").read_text())
    spacing = props["spacing"]
    ref, ref_props = _nnunet_cascade_input(image, previous, spacing, plans, dataset, "3d_cascade_tiny")
    config = read_model_folder(CASCADE_DIR, folds=("all",), allow_cascade=True)
    ours, ours_props = preprocess_case(xp.asarray(image), props["spacing"], config,
                                       previous_segmentation=xp.asarray(previous[0]))
    _assert_matches(ours, ours_props, ref, ref_props, 1, xp, record_property)


@needs_fixture
@pytest.mark.parametrize("case", _held_out() if FIXTURE.is_dir() else [])
def test_preprocess_case_equals_nnunet_when_using_fixture_low_res_stage(case, xp, record_property):
    """The first stage is a plain model: preprocess_case (no segmentation) on its coarser spacing."""
    from test_preprocess import _assert_case_matches

    image, props, _ = _read(case)
    plans = json.loads((LOWRES_DIR / "plans.json").read_text())
    dataset = json.loads((LOWRES_DIR / "dataset.json").read_text())
    config = read_model_folder(LOWRES_DIR, folds=("all",))
    spacing = tuple(props["spacing"])
    _assert_case_matches(image, spacing, plans, dataset, "3d_lowres_tiny", xp, record_property, config)


def _predictor(model_dir: Path):
    return nnunet_predictor(model_dir, folds=("all",), mirroring=False)


@needs_fixture
def test_cascade_with_library_preprocessing_equals_nnunet_predictor_when_using_fixture_networks():
    """nnU-Net low-res stage -> library cascade input -> nnU-Net's network and export == nnU-Net's cascade."""
    import torch
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
    from nnunetv2.inference.export_prediction import (
        convert_predicted_logits_to_segmentation_with_correct_shape,
    )

    lowres, cascade = _predictor(LOWRES_DIR), _predictor(CASCADE_DIR)
    config = read_model_folder(CASCADE_DIR, folds=("all",), allow_cascade=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for case in _held_out():
            image, props, _ = _read(case)
            previous = lowres.predict_single_npy_array(image, dict(props), None, None, False)
            expected = cascade.predict_single_npy_array(image, dict(props), previous[None].astype(np.float32),
                                                        None, False)
            data, case_props = preprocess_case(image, props["spacing"], config,
                                               previous_segmentation=previous)
            logits = cascade.predict_logits_from_preprocessed_data(torch.from_numpy(data)).cpu()
            ours = convert_predicted_logits_to_segmentation_with_correct_shape(
                logits, cascade.plans_manager, cascade.configuration_manager, cascade.label_manager,
                case_props.to_nnunet_dict(), return_probabilities=False,
            )
            assert np.array_equal(ours, expected), case
            reference, _ = SimpleITKIO().read_seg(str(FIXTURE / "labelsTs" / f"{case}.nii.gz"))
            organ = reference[0] == 1
            dice = 2 * np.sum((ours == 1) & organ) / (np.sum(ours == 1) + np.sum(organ))
            assert dice > 0.8, f"{case}: organ Dice {dice:.3f} (the fixture's cascade should segment)"
    finally:
        torch.set_num_threads(previous_threads)
