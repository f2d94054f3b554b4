"""numerics.tiling against nnU-Net 2.8.1 (steps, pad_nd_image, sliding-window slicers): exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from acvl_utils.cropping_and_padding.padding import pad_nd_image
from nnunetv2.inference.sliding_window_prediction import compute_steps_for_sliding_window as nn_steps

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics import tiling
from nnunet_triton.numerics._xp import to_numpy

try:
    from . import parity_support as ps
except ImportError:
    import parity_support as ps



@pytest.mark.parametrize(
    "image, tile, expected",
    [
        ((101,), (64,), [[0, 18, 37]]),
        ((110,), (64,), [[0, 23, 46]]),
        ((300,), (128,), [[0, 57, 115, 172]]),
        ((557,), (128,), [[0, 61, 123, 184, 245, 306, 368, 429]]),
        ((64, 64), (64, 64), [[0], [0]]),
    ],
)
def test_compute_steps_for_sliding_window_matches_spec_table_when_step_is_half(image, tile, expected):
    assert tiling.compute_steps_for_sliding_window(image, tile, 0.5) == expected


@pytest.mark.parametrize("step", [0.5, 0.25, 1 / 3, 0.7, 0.9, 1.0, 0.01])
def test_compute_steps_for_sliding_window_equals_nnunet_when_sizes_vary(step):
    rng = np.random.default_rng(0)
    for _ in range(200):
        tile = tuple(int(t) for t in rng.integers(1, 160, size=3))
        image = tuple(t + int(e) for t, e in zip(tile, rng.integers(0, 400, size=3), strict=True))
        assert tiling.compute_steps_for_sliding_window(image, tile, step) == nn_steps(image, tile, step)


@pytest.mark.parametrize("step", [0, -0.5, 1.0001, 2, float("nan"), "half", None])
def test_compute_steps_for_sliding_window_raises_when_step_outside_unit_interval(step):
    with pytest.raises(InputValidationError, match="tile_step_size must be"):
        tiling.compute_steps_for_sliding_window((100,), (64,), step)


def test_compute_steps_for_sliding_window_raises_when_image_smaller_than_tile():
    with pytest.raises(InputValidationError, match="must be >= tile_size"):
        tiling.compute_steps_for_sliding_window((100, 30), (64, 64), 0.5)


@pytest.mark.parametrize(
    "shape, patch",
    [
        ((1, 10, 20, 30), (16, 16, 16)),  # pads all, odd and even differences
        ((2, 17, 33, 64), (16, 16, 16)),  # no padding at all
        ((1, 15, 40, 15), (16, 32, 16)),  # pads axes 1 and 3 by one voxel (extra voxel at the high end)
        ((1, 5, 7, 9), (16, 16)),  # 2D patch on 3D data: only the last two axes
        ((3, 4, 11), (8, 8)),  # 2D data
    ],
)
def test_pad_to_patch_equals_pad_nd_image_when_shapes_vary(shape, patch, xp):
    data = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    ref, ref_slicer = pad_nd_image(data, patch, "constant", None, True, None)  # np.pad default: 0
    ref_t, ref_slicer_t = pad_nd_image(torch.from_numpy(data), patch, "constant", {"value": 0}, True, None)
    padded, unpad = tiling.pad_to_patch(xp.asarray(data), patch)
    assert np.array_equal(to_numpy(padded), ref) and np.array_equal(ref, ref_t.numpy())
    assert to_numpy(padded).dtype == np.float32
    assert unpad == tuple(ref_slicer[1:]) == tuple(ref_slicer_t[1:])
    assert np.array_equal(to_numpy(padded)[(slice(None), *unpad)], data)


def test_pad_to_patch_returns_input_object_when_no_padding_needed():
    data = np.zeros((1, 20, 20, 20), np.float32)
    padded, unpad = tiling.pad_to_patch(data, (16, 16, 16))
    assert padded is data and unpad == (slice(0, 20),) * 3


def test_pad_to_patch_raises_when_data_has_too_few_axes():
    with pytest.raises(InputValidationError, match="channel axis"):
        tiling.pad_to_patch(np.zeros((16, 16, 16), np.float32), (16, 16, 16))


def _nnunet_slicers(configuration: str, patch, spatial_shape, step):
    plans = ps.make_plans(
        patch_3d=patch if len(patch) == 3 else (16, 16, 16), patch_2d=patch if len(patch) == 2 else (16, 16)
    )
    predictor = ps.make_predictor(
        plans, ps.make_dataset_json(), configuration, None, [], mirror_axes=None, tile_step_size=step
    )
    return [tuple(sl[1:]) for sl in predictor._internal_get_sliding_window_slicers(spatial_shape)]


@pytest.mark.parametrize(
    "spatial, patch, step",
    [
        ((20, 27, 33), (16, 16, 16), 0.5),
        ((40, 17, 65), (16, 16, 32), 0.7),
        ((16, 16, 16), (16, 16, 16), 0.5),
        ((130, 70, 50), (64, 48, 32), 0.25),
    ],
)
def test_tile_slicers_equal_nnunet_order_when_configuration_is_3d(spatial, patch, step):
    ours = tiling.tile_slicers(spatial, patch, step)
    assert ours == _nnunet_slicers(ps.CONFIG_NAME_3D, patch, spatial, step)


@pytest.mark.parametrize(
    "spatial, patch, step",
    [
        ((3, 20, 27), (16, 16), 0.5),
        ((1, 40, 17), (32, 16), 0.8),
    ],
)
def test_tile_slicers_are_slice_major_when_2d_configuration_runs_on_3d_data(spatial, patch, step):
    ours = tiling.tile_slicers(spatial, patch, step)
    assert ours == _nnunet_slicers(ps.CONFIG_NAME_2D, patch, spatial, step)
    assert [sl[0] for sl in ours] == sorted(sl[0] for sl in ours)
    assert all(isinstance(sl[0], int) for sl in ours)


def test_tile_slicers_raise_when_patch_dimensionality_mismatches():
    with pytest.raises(InputValidationError, match="one fewer"):
        tiling.tile_slicers((20, 20, 20, 20), (16, 16), 0.5)
