"""numerics.resampling against nnU-Net 2.8.1's own resampling functions (bit-identical on NumPy)."""

from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
from batchgenerators.augmentations.utils import resize_segmentation as bg_resize_segmentation
from nnunetv2.preprocessing.resampling import default_resampling as nn_resampling
from scipy.ndimage import map_coordinates
from skimage.transform import resize as sk_resize

from nnunet_triton.errors import UnsupportedModelError
from nnunet_triton.numerics import resampling
from nnunet_triton.numerics._xp import to_numpy
from nnunet_triton.numerics.plans import ResamplingSettings

# CuPy: float64 interpolation on the GPU (FMA, other summation order) moves the float64 result by
# ~1e-15 relative, which can flip the last bit of the float32/float16 output: one output ulp.
CUPY_RTOL = {np.float32: 1e-6, np.float16: 1e-3, np.float64: 1e-12}




def _assert_same(ours, ref, xp, record_property=None, *, exact_on_cupy=False):
    ours_np = to_numpy(ours)
    assert ours_np.dtype == ref.dtype and ours_np.shape == ref.shape
    diff = float(np.max(np.abs(ours_np.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
    if record_property is not None:
        record_property("max_abs_diff", diff)
    if xp is np or exact_on_cupy:
        assert np.array_equal(ours_np, ref), f"max abs diff {diff}"
    else:
        scale = float(np.max(np.abs(ref), initial=1.0))
        assert diff <= CUPY_RTOL[ref.dtype.type] * scale, f"max abs diff {diff}"


def _nn_resample(data, new_shape, current, new, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nn_resampling.resample_data_or_seg_to_shape(data, new_shape, current, new, **kwargs)


@pytest.mark.parametrize(
    "shape, old_sp, new_sp",
    [
        ((5, 7, 9), (1.0, 1.0, 1.0), (2.0, 2.0, 2.0)),  # 2.5, 3.5, 4.5: Python round is half-to-even
        ((64, 128, 97), (3.0, 0.7, 0.7), (2.5, 0.79, 0.79)),
        ((1, 512, 512), (999.0, 0.5, 0.5), (999.0, 0.8, 0.8)),
        ((33, 33, 33), (0.1, 0.3, 1.7), (0.37, 0.21, 1.1)),
    ],
)
def test_compute_new_shape_equals_nnunet_when_given_shapes_and_spacings(shape, old_sp, new_sp):
    ref = nn_resampling.compute_new_shape(np.array(shape), old_sp, new_sp)
    assert resampling.compute_new_shape(shape, old_sp, new_sp) == tuple(int(v) for v in ref)


SPACING_PAIRS = [
    ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),
    ((3.0, 1.0, 1.0), (1.0, 1.0, 1.0)),  # exactly 3: not anisotropic (strict >)
    ((3.0001, 1.0, 1.0), (1.0, 1.0, 1.0)),
    ((1.0, 5.0, 1.0), (1.0, 1.0, 1.0)),
    ((1.0, 1.0, 1.0), (1.0, 1.0, 4.0)),  # decided by the target spacing
    ((5.0, 5.0, 1.0), (1.0, 1.0, 1.0)),  # tie for the lowres axis: no separate z
    ((0.24, 1.25, 1.25), (0.24, 1.25, 1.25)),
    ((1.0, 4.0, 2.0), (1.0, 1.0, 6.0)),  # current spacing wins over the target
    ((0.1 + 0.2, 0.3, 3.0), (1.0, 1.0, 1.0)),  # 0.30000000000000004 vs 0.3, exact equality
]


@pytest.mark.parametrize("force", [None, True, False])
@pytest.mark.parametrize("current, new", SPACING_PAIRS)
def test_determine_do_sep_z_and_axis_equals_nnunet_when_spacings_vary(current, new, force):
    ref = nn_resampling.determine_do_sep_z_and_axis(force, current, new)
    ours = resampling.determine_do_sep_z_and_axis(force, current, new)
    assert ours == (bool(ref[0]), None if ref[1] is None else int(ref[1]))


# (shape (C, X, Y, Z), new_shape, current spacing, new spacing, dtype, kwargs)
RESAMPLE_CASES = {
    "iso_order3_up_down": ((2, 9, 11, 13), (12, 7, 20), (1.0, 1.0, 1.0), (0.8, 1.3, 0.6), np.float32, {}),
    "iso_order1": ((1, 10, 10, 10), (12, 14, 7), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), np.float32, {"order": 1}),
    "sepz_axis0_current": ((1, 6, 20, 21), (15, 17, 25), (4.0, 1.0, 1.0), (1.5, 1.2, 0.9), np.float32, {}),
    "sepz_axis0_down": ((1, 6, 20, 21), (3, 17, 25), (4.0, 1.0, 1.0), (8.0, 1.2, 0.9), np.float32, {}),
    "sepz_axis1": ((1, 20, 6, 21), (17, 15, 25), (1.0, 4.0, 1.0), (1.2, 1.5, 0.9), np.float32, {}),
    "sepz_axis2": ((1, 20, 21, 6), (17, 25, 4), (1.0, 1.0, 4.0), (1.2, 0.9, 6.0), np.float32, {}),
    "sepz_via_target": ((1, 10, 10, 10), (12, 14, 16), (1.0, 1.0, 1.0), (1.0, 1.0, 5.0), np.float32, {}),
    "sepz_z_unchanged": ((1, 5, 20, 21), (5, 17, 25), (5.0, 1.0, 1.0), (5.0, 1.2, 0.9), np.float32, {}),
    "sepz_order_z1": (
        (1, 6, 9, 8),
        (11, 12, 10),
        (4.0, 1.0, 1.0),
        (2.0, 0.8, 0.8),
        np.float32,
        {"order_z": 1},
    ),
    "forced_sepz": (
        (1, 6, 9, 8),
        (11, 12, 10),
        (1.0, 1.0, 1.5),
        (1.0, 0.8, 0.8),
        np.float32,
        {"force_separate_z": True},
    ),
    "logits_fp16_order1": (
        (3, 8, 9, 10),
        (13, 11, 17),
        (1.0, 1.0, 1.0),
        (1.0, 1.0, 1.0),
        np.float16,
        {"order": 1},
    ),
    "logits_fp16_sepz": (
        (3, 4, 9, 10),
        (9, 11, 17),
        (4.0, 1.0, 1.0),
        (4.0, 1.0, 1.0),
        np.float16,
        {"order": 1},
    ),
    "float64": ((1, 7, 8, 9), (9, 5, 12), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), np.float64, {}),
}


@pytest.mark.parametrize("case", sorted(RESAMPLE_CASES))
def test_resample_data_equals_nnunet_when_case_varies(case, xp, record_property):
    shape, new_shape, current, new, dtype, kwargs = RESAMPLE_CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    data = (rng.standard_normal(shape) * 100 + 20).astype(dtype)
    kw = {"is_seg": False, "order": 3, "order_z": 0, "force_separate_z": None} | kwargs
    ref = _nn_resample(data, new_shape, current, new, **kw)
    ours = resampling.resample_data_or_seg_to_shape(xp.asarray(data), new_shape, current, new, **kw)
    _assert_same(ours, ref, xp, record_property)


SEG_CASES = {
    "iso_up": ((1, 10, 12, 14), (15, 10, 9), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), {}),
    "even_factor_ties": ((1, 6, 7, 5), (12, 14, 10), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), {}),
    "sepz_down": ((1, 10, 12, 14), (5, 14, 16), (4.0, 1.0, 1.0), (8.0, 1.0, 1.0), {}),
    "sepz_ties": ((1, 4, 12, 14), (2, 10, 9), (5.0, 1.0, 1.0), (1.0, 1.0, 1.0), {}),
    "order0": ((1, 9, 8, 7), (13, 5, 9), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), {"order": 0}),
    "sepz_order_z1": ((1, 5, 8, 9), (9, 11, 10), (4.0, 1.0, 1.0), (1.0, 1.0, 1.0), {"order_z": 1}),
}


@pytest.mark.parametrize("case", sorted(SEG_CASES))
def test_resample_seg_equals_nnunet_when_case_varies(case, xp, record_property):
    shape, new_shape, current, new, kwargs = SEG_CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    seg = rng.integers(-1, 4, shape).astype(np.int8)
    kw = {"is_seg": True, "order": 1, "order_z": 0, "force_separate_z": None} | kwargs
    ref = _nn_resample(seg, new_shape, current, new, **kw)
    ours = resampling.resample_data_or_seg_to_shape(xp.asarray(seg), new_shape, current, new, **kw)
    # Exact ties between label scores decide voxels; GPU float64 scores could differ in the last bit.
    _assert_same(ours, ref, np, record_property)


def test_resample_returns_input_unchanged_when_shape_is_already_the_target(xp):
    data = xp.asarray(np.arange(2 * 3 * 4 * 5, dtype=np.float16).reshape(2, 3, 4, 5))
    assert resampling.resample_data_or_seg_to_shape(data, (3, 4, 5), (1, 1, 1), (2, 2, 2)) is data


@pytest.mark.parametrize(
    "in_shape, out_shape", [((7, 9), (12, 5)), ((6, 6, 6), (3, 9, 13)), ((1, 5, 4), (1, 8, 8))]
)
@pytest.mark.parametrize("order", [0, 1, 3])
def test_resize_equals_skimage_when_order_and_shapes_vary(in_shape, out_shape, order, xp, record_property):
    image = np.random.default_rng(order).standard_normal(in_shape) * 50
    ref = sk_resize(image, out_shape, order, mode="edge", anti_aliasing=False)
    _assert_same(resampling.resize(xp.asarray(image), out_shape, order), ref, xp, record_property)


@pytest.mark.parametrize("order", [0, 1, 3])
def test_resize_segmentation_equals_batchgenerators_when_labels_tie(order, xp, record_property):
    seg = np.random.default_rng(3).integers(0, 4, (6, 5, 7)).astype(np.float64)
    ref = bg_resize_segmentation(seg, (12, 10, 14), order)
    ours = resampling.resize_segmentation(xp.asarray(seg), (12, 10, 14), order)
    _assert_same(ours, ref, np, record_property)


def test_resize_segmentation_returns_the_label_when_only_one_label(xp):
    seg = xp.asarray(np.full((3, 4, 5), 2.0))
    np.testing.assert_array_equal(
        to_numpy(resampling.resize_segmentation(seg, (5, 6, 7), 1)), np.full((5, 6, 7), 2.0)
    )


@pytest.mark.parametrize(
    "old_len, new_len", [(n, m) for n in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 5, 7, 10, 16)]
)
def test_order0_along_axis_equals_map_coordinates_when_lengths_vary(old_len, new_len, xp):
    vol = np.random.default_rng(old_len * 100 + new_len).standard_normal((3, old_len, 4))
    rows, dims, cols = np.mgrid[:3, :new_len, :4].astype(float)
    coords = np.array([rows, float(old_len) / new_len * (dims + 0.5) - 0.5, cols])
    ref = map_coordinates(vol, coords, order=0, mode="nearest")
    ours = resampling._resample_along_axis(xp.asarray(vol), 1, new_len, 0, False)
    np.testing.assert_array_equal(to_numpy(ours), ref)


def test_resample_with_settings_raises_when_function_is_not_supported():
    settings = ResamplingSettings("resample_torch_fornnunet", False, 3, 0, None)
    with pytest.raises(UnsupportedModelError, match="resample_torch_fornnunet"):
        resampling.resample_with_settings(
            np.zeros((1, 2, 2, 2), np.float32), (3, 3, 3), (1, 1, 1), (1, 1, 1), settings
        )


def test_resample_with_settings_passes_kwargs_when_settings_are_from_plans(xp):
    data = np.random.default_rng(0).standard_normal((1, 4, 9, 10)).astype(np.float32)
    settings = ResamplingSettings("resample_data_or_seg_to_shape", False, 1, 0, None)
    ref = _nn_resample(
        data,
        (8, 7, 12),
        (4.0, 1.0, 1.0),
        (2.0, 1.2, 0.8),
        is_seg=False,
        order=1,
        order_z=0,
        force_separate_z=None,
    )
    ours = resampling.resample_with_settings(
        xp.asarray(data), (8, 7, 12), (4.0, 1.0, 1.0), (2.0, 1.2, 0.8), settings
    )
    _assert_same(ours, ref, xp)
