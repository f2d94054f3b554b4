"""numerics.prediction_export against
 nnU-Net 2.8.1's convert_predicted_logits_to_segmentation_with_correct_shape.

Segmentations are compared with ``np.array_equal`` (dtype included). Probabilities agree to
PROB_ATOL: nnU-Net's softmax/sigmoid use torch's vectorised float32 ``exp``, ours rounds a float64
``exp`` to float32, so single values differ by a float32 ulp or two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from nnunetv2.inference.export_prediction import convert_predicted_logits_to_segmentation_with_correct_shape
from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics._xp import to_numpy
from nnunet_triton.numerics.prediction_export import (
    apply_inference_nonlin,
    convert_logits_to_segmentation,
    segmentation_from_logits,
)
from nnunet_triton.numerics.preprocess import CaseProperties
from nnunet_triton.numerics.resampling import compute_new_shape
from nnunet_triton.numerics.sliding_window import predict_sliding_window
from nnunet_triton.numerics.window import SlidingWindowSettings

try:
    from . import parity_support as ps
except ImportError:
    import parity_support as ps

PROB_ATOL = 1e-6  # float32 ulp-level differences of exp (see module docstring)
CUPY_SEG_MISMATCH = 1e-3  # CuPy resampling is 1 fp16 ulp off in places (see test_resampling.py)



@dataclass(frozen=True)
class Case:
    """One export geometry: reader-order shape and spacing, transpose, bbox, configuration spacing."""

    name: str
    configuration: str
    reader_shape: tuple[int, ...]
    reader_spacing: tuple[float, ...]
    transpose_forward: tuple[int, ...]
    bbox_margin: tuple[tuple[int, int], ...]  # voxels cut at (low, high) per transposed axis
    config_spacing: tuple[float, ...]


CASES = [
    Case(
        "passthrough",
        ps.CONFIG_NAME_3D,
        (14, 15, 13),
        (1.0, 1.0, 1.0),
        (0, 1, 2),
        ((0, 0),) * 3,
        (1.0, 1.0, 1.0),
    ),
    Case(
        "passthrough_transposed_cropped",
        ps.CONFIG_NAME_3D,
        (14, 15, 13),
        (2.0, 1.0, 1.5),
        (1, 2, 0),
        ((1, 2), (0, 3), (2, 2)),
        (1.0, 1.5, 2.0),
    ),
    Case(
        "resampled_transposed_cropped",
        ps.CONFIG_NAME_3D,
        (17, 21, 19),
        (1.2, 0.9, 1.4),
        (2, 0, 1),
        ((2, 1), (0, 3), (4, 2)),
        (1.0, 1.0, 1.0),
    ),
    Case(
        "separate_z",
        ps.CONFIG_NAME_3D,
        (9, 22, 20),
        (4.2, 0.8, 0.8),
        (0, 1, 2),
        ((1, 0), (2, 2), (0, 3)),
        (3.5, 1.0, 1.0),
    ),
    Case(
        "2d_configuration",
        ps.CONFIG_NAME_2D,
        (5, 23, 19),
        (3.0, 0.8, 0.7),
        (0, 1, 2),
        ((1, 1), (2, 0), (0, 1)),
        (1.0, 1.0),
    ),
]


def _setup(case: Case, dataset_json: dict, rng: np.random.Generator, *, integer_logits: bool = False):
    plans = ps.make_plans(
        spacing_3d=case.config_spacing if len(case.config_spacing) == 3 else (1.0, 1.0, 1.0),
        spacing_2d=case.config_spacing if len(case.config_spacing) == 2 else (1.0, 1.0),
        transpose_forward=case.transpose_forward,
    )
    config = ps.inference_config(
        plans,
        dataset_json,
        case.configuration,
        mirror_axes=(0, 1, 2) if case.configuration == ps.CONFIG_NAME_3D else (0, 1),
    )
    shape_t = tuple(case.reader_shape[i] for i in case.transpose_forward)
    spacing_t = [case.reader_spacing[i] for i in case.transpose_forward]
    bbox = tuple((lo, s - hi) for (lo, hi), s in zip(case.bbox_margin, shape_t, strict=True))
    cropped = tuple(hi - lo for lo, hi in bbox)
    target_spacing = (
        list(case.config_spacing) if len(case.config_spacing) == 3 else [spacing_t[0], *case.config_spacing]
    )
    preprocessed = compute_new_shape(cropped, spacing_t, target_spacing)
    props = CaseProperties(
        spacing=case.reader_spacing,
        shape_before_cropping=shape_t,
        bbox=bbox,
        shape_after_cropping_and_before_resampling=cropped,
    )
    heads = config.labels.num_segmentation_heads
    logits = rng.standard_normal((heads, *preprocessed)) * 3
    logits = (np.round(logits) if integer_logits else logits).astype(np.float16)
    return plans, config, props, logits


def _nnunet(plans, dataset_json, configuration, logits, props, return_probabilities):
    pm = PlansManager(plans)
    return convert_predicted_logits_to_segmentation_with_correct_shape(
        logits.copy(),
        pm,
        pm.get_configuration(configuration),
        pm.get_label_manager(dataset_json),
        props.to_nnunet_dict(),
        return_probabilities=return_probabilities,
    )


def _resamples(props: CaseProperties, logits: np.ndarray) -> bool:
    return tuple(logits.shape[1:]) != tuple(props.shape_after_cropping_and_before_resampling)


def _assert_seg(ours, ref, xp, exact: bool):
    ours = to_numpy(ours)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if exact:
        assert np.array_equal(ours, ref)
    else:
        assert np.mean(ours != ref) <= CUPY_SEG_MISMATCH


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("regions", [False, True], ids=["labels", "regions"])
@pytest.mark.parametrize("return_probabilities", [False, True], ids=["seg", "seg+probs"])
def test_convert_logits_to_segmentation_equals_nnunet_when_geometry_varies(
    case, regions, return_probabilities, xp
):
    dataset_json = ps.make_dataset_json(regions=regions)
    plans, config, props, logits = _setup(case, dataset_json, np.random.default_rng(len(case.name)))
    ref = _nnunet(plans, dataset_json, case.configuration, logits, props, return_probabilities)
    ours = convert_logits_to_segmentation(
        xp.asarray(logits), props, config, return_probabilities=return_probabilities
    )
    exact = xp is np or not _resamples(props, logits)
    if not return_probabilities:
        _assert_seg(ours, ref, xp, exact)
        assert ours.shape == case.reader_shape
        return
    _assert_seg(ours[0], ref[0], xp, exact)
    probs, ref_probs = to_numpy(ours[1]), ref[1]
    assert probs.dtype == ref_probs.dtype == np.float32 and probs.shape == ref_probs.shape
    assert ps.max_abs_diff(probs, ref_probs) <= (PROB_ATOL if exact else 1e-2)


def test_convert_logits_to_segmentation_breaks_ties_to_lowest_label_when_logits_are_integers(xp):
    dataset_json = ps.make_dataset_json(n_labels=4)
    case = CASES[1]
    plans, config, props, logits = _setup(case, dataset_json, np.random.default_rng(0), integer_logits=True)
    assert not _resamples(props, logits)
    ref = _nnunet(plans, dataset_json, case.configuration, logits, props, False)
    ours = to_numpy(convert_logits_to_segmentation(xp.asarray(logits), props, config))
    ties = (logits == logits.max(axis=0)).sum(axis=0) > 1
    assert ties.mean() > 0.1 and np.array_equal(ours, ref)


def test_convert_logits_to_segmentation_returns_uint16_when_255_foreground_labels():
    dataset_json = ps.make_dataset_json(n_labels=256)
    case = CASES[0]
    plans, config, props, logits = _setup(case, dataset_json, np.random.default_rng(1))
    ref = _nnunet(plans, dataset_json, case.configuration, logits, props, False)
    ours = convert_logits_to_segmentation(logits, props, config)
    assert ours.dtype == ref.dtype == np.uint16 and np.array_equal(ours, ref) and ours.max() == 255


def test_region_threshold_equals_torch_sigmoid_when_all_float16_values():
    values = np.arange(65536, dtype=np.uint16).view(np.float16)
    values = values[np.isfinite(values)]
    labels = ps.inference_config(
        ps.make_plans(), ps.make_dataset_json(regions=True), ps.CONFIG_NAME_3D
    ).labels
    logits = np.stack([values, np.full_like(values, -1)])
    expected = np.where(torch.sigmoid(torch.from_numpy(values).float()).numpy() > 0.5, 1, 0)
    assert np.array_equal(segmentation_from_logits(logits, labels), expected)


@pytest.mark.parametrize("regions", [False, True])
def test_apply_inference_nonlin_is_within_float32_ulps_of_torch_when_logits_random(regions):
    labels = ps.inference_config(
        ps.make_plans(), ps.make_dataset_json(n_labels=5, regions=regions), ps.CONFIG_NAME_3D
    ).labels
    logits = (
        np.random.default_rng(2).standard_normal((labels.num_segmentation_heads, 30, 20, 10)) * 8
    ).astype(np.float16)
    nonlin = torch.sigmoid if regions else (lambda t: torch.softmax(t, 0))
    ref = nonlin(torch.from_numpy(logits).float()).numpy()
    ours = apply_inference_nonlin(logits, labels)
    assert ours.dtype == np.float32 and ps.max_abs_diff(ours, ref) <= PROB_ATOL


def test_convert_logits_to_segmentation_raises_when_logits_shape_wrong():
    dataset_json = ps.make_dataset_json()
    _, config, props, logits = _setup(CASES[0], dataset_json, np.random.default_rng(3))
    with pytest.raises(InputValidationError, match="logits must have shape"):
        convert_logits_to_segmentation(logits[:2], props, config)
    bad = CaseProperties(
        props.spacing,
        props.shape_before_cropping,
        ((0, 3), (0, 3), (0, 3)),
        props.shape_after_cropping_and_before_resampling,
    )
    with pytest.raises(InputValidationError, match="bbox"):
        convert_logits_to_segmentation(logits, bad, config)


@pytest.mark.slow
def test_network_to_segmentation_equals_nnunet_when_real_network_and_cropped_transposed_case():
    dataset_json = ps.make_dataset_json()
    case = CASES[1]
    plans, config, props, logits = _setup(case, dataset_json, np.random.default_rng(4))
    net = ps.build_network(plans, ps.CONFIG_NAME_3D, 1, 3, seed=5)
    data = np.random.default_rng(5).standard_normal((1, *logits.shape[1:])).astype(np.float32)
    predictor = ps.make_predictor(
        plans, dataset_json, ps.CONFIG_NAME_3D, net, [net.state_dict()], mirror_axes=(0, 1, 2)
    )
    ref_logits = predictor.predict_logits_from_preprocessed_data(torch.from_numpy(data)).numpy()
    ref = _nnunet(plans, dataset_json, ps.CONFIG_NAME_3D, ref_logits, props, True)
    ours_logits = predict_sliding_window(
        data,
        ps.torch_predict_batch(net),
        SlidingWindowSettings(patch_size=config.patch_size, num_heads=3, mirror_axes=config.mirror_axes),
    )
    seg, probs = convert_logits_to_segmentation(ours_logits, props, config, return_probabilities=True)
    assert np.array_equal(ours_logits, ref_logits) and np.array_equal(seg, ref[0])
    assert ps.max_abs_diff(probs, ref[1]) <= PROB_ATOL
