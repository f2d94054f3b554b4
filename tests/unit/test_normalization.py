"""numerics.normalization against nnU-Net 2.8.1's normalization classes (bit-identical on NumPy)."""

from __future__ import annotations

import numpy as np
import pytest
from nnunetv2.preprocessing.normalization import default_normalization_schemes as nn_norm

from nnunet_triton.errors import InputValidationError, UnsupportedModelError
from nnunet_triton.numerics import normalization
from nnunet_triton.numerics._xp import to_numpy
from nnunet_triton.numerics.plans import ChannelNormalization, IntensityProperties

# CuPy reduces float32 mean/std in another order than NumPy's pairwise sum: ~1e-7 relative on the
# statistics, so ~1e-6 absolute on z-scores of order 10. CT/Rescale/RGB/No are elementwise: exact.
CUPY_ZSCORE_ATOL = 1e-5

INTENSITY = {
    "mean": 71.25,
    "median": 60.0,
    "std": 133.7,
    "min": -1024.0,
    "max": 3071.0,
    "percentile_00_5": -960.3,
    "percentile_99_5": 1511.7,
}




def _views(xp, seed=0, zero_margin=True):
    """Like run_case_npy: a float32 copy, transposed and cropped, so channels are strided views."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal((2, 30, 40, 50)) * 300 + 40).astype(np.float32)
    if zero_margin:
        base[:, :, :2] = 0
    ref = base.copy().transpose(0, 2, 3, 1)[:, 1:, :-2, 1:-1]
    ours = xp.asarray(base.copy()).transpose(0, 2, 3, 1)[:, 1:, :-2, 1:-1]
    mask = np.asarray(ref[0] != 0)
    return ref, ours, mask


def _check(ours, ref, xp, record_property, atol=0.0):
    ours_np = to_numpy(ours)
    diff = float(np.max(np.abs(ours_np.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
    record_property("max_abs_diff", diff)
    assert ours_np.dtype == np.float32
    if xp is np or atol == 0.0:
        assert np.array_equal(ours_np, ref), f"max abs diff {diff}"
    else:
        assert diff <= atol, f"max abs diff {diff}"


def test_ct_normalization_equals_nnunet_when_values_exceed_the_percentiles(xp, record_property):
    ref, ours, _ = _views(xp)
    expected = nn_norm.CTNormalization(False, dict(INTENSITY)).run(ref[0] * 5)
    got = normalization.ct_normalization(ours[0] * 5, IntensityProperties(**INTENSITY))
    _check(got, expected, xp, record_property)


@pytest.mark.parametrize("use_mask", [False, True])
def test_zscore_normalization_equals_nnunet_when_channel_is_a_strided_view(use_mask, xp, record_property):
    ref, ours, mask = _views(xp)
    before = to_numpy(ours[1]).copy()
    expected = nn_norm.ZScoreNormalization(use_mask, dict(INTENSITY)).run(ref[1], np.where(mask, 0, -1))
    got = normalization.zscore_normalization(ours[1], xp.asarray(mask) if use_mask else None)
    _check(got, expected, xp, record_property, CUPY_ZSCORE_ATOL)
    if use_mask:  # voxels outside the mask keep their values
        np.testing.assert_array_equal(to_numpy(got)[~mask], before[~mask])


def test_zscore_normalization_leaves_image_unchanged_when_mask_is_empty(xp):
    image = xp.zeros((3, 4, 5), dtype=np.float32)
    got = normalization.zscore_normalization(image, xp.zeros((3, 4, 5), dtype=bool))
    np.testing.assert_array_equal(to_numpy(got), np.zeros((3, 4, 5), np.float32))


def test_zscore_normalization_equals_nnunet_when_image_is_all_zero_without_mask(xp, record_property):
    expected = nn_norm.ZScoreNormalization(False, {}).run(np.zeros((3, 4, 5), np.float32))
    _check(
        normalization.zscore_normalization(xp.zeros((3, 4, 5), dtype=np.float32)),
        expected,
        xp,
        record_property,
    )


@pytest.mark.parametrize("constant", [False, True])
def test_rescale_to_01_equals_nnunet_when_image_is_constant_or_not(constant, xp, record_property):
    ref, ours, _ = _views(xp)
    if constant:
        ref, ours = ref * 0 + 7, ours * 0 + 7
    expected = nn_norm.RescaleTo01Normalization(False, {}).run(ref[0])
    _check(normalization.rescale_to_01_normalization(ours[0]), expected, xp, record_property)


def test_rgb_to_01_equals_nnunet_when_values_are_in_range(xp, record_property):
    image = np.random.default_rng(1).integers(0, 256, (4, 5, 6)).astype(np.float32)
    expected = nn_norm.RGBTo01Normalization(False, {}).run(image.copy())
    _check(normalization.rgb_to_01_normalization(xp.asarray(image)), expected, xp, record_property)


@pytest.mark.parametrize("bad", [-1.0, 255.5])
def test_rgb_to_01_raises_input_validation_error_when_values_leave_0_255(bad, xp):
    image = xp.asarray(np.array([[[0.0, bad]]], dtype=np.float32))
    with pytest.raises(InputValidationError, match=r"\[0, 255\].*" + str(bad).replace(".", r"\.")):
        normalization.rgb_to_01_normalization(image)


def test_no_normalization_casts_to_float32_when_input_is_int16(xp):
    image = xp.asarray(np.arange(24, dtype=np.int16).reshape(2, 3, 4))
    got = normalization.no_normalization(image)
    expected = nn_norm.NoNormalization(False, {}).run(np.arange(24, dtype=np.int16).reshape(2, 3, 4))
    np.testing.assert_array_equal(to_numpy(got), expected)
    assert to_numpy(got).dtype == np.float32


def test_normalize_equals_nnunet_normalize_when_channels_use_different_schemes(xp, record_property):
    """DefaultPreprocessor._normalize: data[c] = scheme.run(data[c], seg[0]) on transposed, cropped views."""
    ref, ours, mask = _views(xp, seed=3)
    schemes = [
        ChannelNormalization("CTNormalization", False, IntensityProperties(**INTENSITY)),
        ChannelNormalization("ZScoreNormalization", True, IntensityProperties(**INTENSITY)),
    ]
    seg0 = np.where(mask, 0, -1)
    ref[0] = nn_norm.CTNormalization(False, dict(INTENSITY)).run(ref[0], seg0)
    ref[1] = nn_norm.ZScoreNormalization(True, dict(INTENSITY)).run(ref[1], seg0)
    got = normalization.normalize(ours, xp.asarray(mask), schemes)
    assert got is ours
    _check(got, ref, xp, record_property, CUPY_ZSCORE_ATOL)


def test_normalize_raises_when_channel_count_differs_from_schemes():
    schemes = [ChannelNormalization("NoNormalization", False, None)]
    with pytest.raises(InputValidationError, match="2 channels.*1 channels"):
        normalization.normalize(np.zeros((2, 3, 3, 3), np.float32), np.ones((3, 3, 3), bool), schemes)


def test_normalize_channel_raises_unsupported_when_scheme_is_unknown():
    with pytest.raises(UnsupportedModelError, match="MyNormalization"):
        normalization.normalize_channel(
            np.zeros((2, 2), np.float32), None, ChannelNormalization("MyNormalization", False, None)
        )
