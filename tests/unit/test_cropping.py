"""nnunet_triton.numerics.cropping against nnU-Net 2.8.1's crop_to_nonzero and acvl_utils' bbox helpers."""

from __future__ import annotations

import numpy as np
import pytest
from acvl_utils.cropping_and_padding.bounding_boxes import get_bbox_from_mask, insert_crop_into_image
from nnunetv2.preprocessing.cropping import cropping as nn_cropping

from nnunet_triton.numerics import cropping
from nnunet_triton.numerics._xp import to_numpy


def _hollow_box_case() -> np.ndarray:
    """Two channels, zero margins, a closed shell (hole to fill) in channel 0 and a blob in channel 1."""
    data = np.zeros((2, 12, 14, 16), dtype=np.float32)
    data[0, 2:9, 3:10, 4:12] = 5.0
    data[0, 4:7, 5:8, 6:10] = 0.0  # enclosed hole: filled by binary_fill_holes
    data[1, 9:11, 1:3, 13:15] = -2.0
    return data


CASES = {
    "hollow_two_channels": _hollow_box_case,
    "all_zero": lambda: np.zeros((1, 5, 6, 7), dtype=np.float32),
    "no_zeros": lambda: np.ones((1, 4, 5, 6), dtype=np.float32),
    "single_voxel": lambda: np.pad(np.ones((1, 1, 1, 1), np.float32), ((0, 0), (3, 1), (0, 4), (2, 2))),
    "random_sparse": lambda: (np.random.default_rng(5).random((3, 9, 10, 11)) > 0.97).astype(np.float32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crop_to_nonzero_equals_nnunet_when_case_varies(case, xp):
    data = CASES[case]()
    ref_data, ref_seg, ref_bbox = nn_cropping.crop_to_nonzero(data.copy())
    ours_data, ours_mask, ours_bbox = cropping.crop_to_nonzero(xp.asarray(data))
    np.testing.assert_array_equal(to_numpy(ours_data), ref_data)
    np.testing.assert_array_equal(to_numpy(ours_mask), ref_seg[0] >= 0)
    assert to_numpy(ours_mask).dtype == np.bool_
    assert ours_bbox == tuple(tuple(int(v) for v in pair) for pair in ref_bbox)


def test_create_nonzero_mask_fills_enclosed_holes_when_a_shell_is_closed(xp):
    data = _hollow_box_case()
    mask = to_numpy(cropping.create_nonzero_mask(xp.asarray(data)))
    np.testing.assert_array_equal(mask, nn_cropping.create_nonzero_mask(data))
    assert mask[5, 6, 7] and data[0, 5, 6, 7] == 0  # inside the shell, zero in the data


@pytest.mark.parametrize("seed", range(4))
def test_bbox_from_mask_equals_acvl_when_mask_is_random(seed, xp):
    mask = np.random.default_rng(seed).random((7, 8, 9)) > 0.995
    expected = tuple(tuple(int(v) for v in pair) for pair in get_bbox_from_mask(mask))
    assert cropping.bbox_from_mask(xp.asarray(mask)) == expected


def test_bbox_from_mask_is_full_extent_when_mask_is_empty(xp):
    assert cropping.bbox_from_mask(xp.zeros((3, 4, 5), dtype=bool)) == ((0, 3), (0, 4), (0, 5))


def test_insert_crop_equals_acvl_when_crop_has_a_channel_axis(xp):
    full = np.zeros((2, 6, 7, 8), dtype=np.float32)
    crop = np.random.default_rng(0).random((2, 3, 4, 2)).astype(np.float32)
    bbox = ((1, 4), (2, 6), (5, 7))
    expected = insert_crop_into_image(full.copy(), crop, [list(p) for p in bbox])
    ours = cropping.insert_crop(xp.asarray(full), xp.asarray(crop), bbox)
    np.testing.assert_array_equal(to_numpy(ours), expected)


def test_insert_crop_raises_when_crop_does_not_fit_the_bbox():
    with pytest.raises(ValueError, match="does not fit bbox"):
        cropping.insert_crop(np.zeros((4, 4, 4)), np.zeros((2, 2, 3)), ((0, 2), (0, 2), (0, 2)))


def test_insert_crop_raises_when_bbox_lies_outside_the_array():
    with pytest.raises(ValueError, match="outside"):
        cropping.insert_crop(np.zeros((4, 4, 4)), np.zeros((2, 2, 2)), ((3, 5), (0, 2), (0, 2)))
