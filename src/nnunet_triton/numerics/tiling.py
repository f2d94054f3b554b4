"""Sliding-window geometry: tile positions, padding to the patch size, and nnU-Net's tile order.

Ports, kept numerically identical:

- ``compute_steps_for_sliding_window`` from ``nnunetv2/inference/sliding_window_prediction.py``
  (numpy ``ceil``/``round``: round-half-to-even, never C ``round``);
- ``pad_nd_image(image, patch_size, 'constant', {'value': 0}, return_slicer=True)`` from
  ``acvl_utils/cropping_and_padding/padding.py`` (low side gets ``diff // 2``);
- ``nnUNetPredictor._internal_get_sliding_window_slicers`` from
  ``nnunetv2/inference/predict_from_raw_data.py`` (x, y, z nested loops; a 2D configuration on
  3D data loops over slices first).

Slicers here index the *spatial* axes only (nnU-Net's carry a leading ``slice(None)`` for channels).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics._xp import is_torch_module, tensor_namespace
from nnunet_triton.options import check_tile_step_size

__all__ = [
    "compute_steps_for_sliding_window",
    "pad_to_patch",
    "tile_slicers",
]

SpatialSlicer = tuple[Any, ...]  # (int | slice, ...)


def compute_steps_for_sliding_window(
    image_size: Sequence[int], tile_size: Sequence[int], tile_step_size: float
) -> list[list[int]]:
    """Tile start positions per axis, exactly as nnU-Net's function of the same name.

    ``n = ceil((I - P) / (P * step)) + 1`` tiles per axis at ``np.round(i * (I - P) / (n - 1))``.
    Unlike nnU-Net (whose size assert can never fail), an image smaller than the tile is rejected.
    """
    step = check_tile_step_size(tile_step_size)
    if len(image_size) != len(tile_size):
        raise InputValidationError(
            f"image_size {tuple(image_size)} and tile_size {tuple(tile_size)} must have the same length."
        )
    if any(int(i) < int(t) for i, t in zip(image_size, tile_size, strict=True)):
        raise InputValidationError(
            f"image_size {tuple(image_size)} must be >= tile_size {tuple(tile_size)} on every axis "
            "(pad with pad_to_patch first)."
        )
    target_step_sizes_in_voxels = [i * step for i in tile_size]
    num_steps = [
        int(np.ceil((i - k) / j)) + 1
        for i, j, k in zip(image_size, target_step_sizes_in_voxels, tile_size, strict=True)
    ]
    steps = []
    for dim in range(len(tile_size)):
        max_step_value = image_size[dim] - tile_size[dim]
        if num_steps[dim] > 1:
            actual_step_size = max_step_value / (num_steps[dim] - 1)
        else:
            actual_step_size = 99999999999  # only one step, at 0 (as nnU-Net)
        steps.append([int(np.round(actual_step_size * i)) for i in range(num_steps[dim])])
    return steps


def pad_to_patch(data: Any, patch_size: Sequence[int]) -> tuple[Any, tuple[slice, ...]]:
    """Pad the last ``len(patch_size)`` axes of ``data`` with 0 up to at least ``patch_size``.

    Returns ``(padded, unpad_slicer)``; ``unpad_slicer`` indexes the spatial axes (all axes after
    the first) of the padded array and recovers the input, like the slicer of ``pad_nd_image``
    without its leading channel entry. Axes already >= the patch are left alone; odd padding puts
    the extra voxel at the high end. When nothing is padded the input itself is returned.
    """
    xp = tensor_namespace(data)
    n_pad = len(patch_size)
    if data.ndim < n_pad + 1:
        raise InputValidationError(
            f"data with shape {tuple(data.shape)} needs a channel axis plus at least {n_pad} spatial axes "
            f"for patch_size {tuple(patch_size)}."
        )
    old_shape = tuple(int(s) for s in data.shape)
    lead = data.ndim - n_pad
    new_shape = list(old_shape[:lead]) + [
        max(int(p), s) for p, s in zip(patch_size, old_shape[lead:], strict=True)
    ]
    pad_list = [((n - o) // 2, (n - o) - (n - o) // 2) for n, o in zip(new_shape, old_shape, strict=True)]
    if all(lo == 0 and hi == 0 for lo, hi in pad_list):
        padded = data
    elif is_torch_module(xp):  # torch.nn.functional.pad lists (lo, hi) from the last axis backwards
        padded = xp.nn.functional.pad(data, [v for pair in reversed(pad_list) for v in pair], value=0)
    else:
        padded = xp.pad(data, pad_list, mode="constant", constant_values=0)
    unpad = tuple(slice(lo, n - hi) for (lo, hi), n in zip(pad_list[1:], new_shape[1:], strict=True))
    return padded, unpad


def tile_slicers(
    padded_spatial_shape: Sequence[int], patch_size: Sequence[int], tile_step_size: float
) -> list[SpatialSlicer]:
    """All tiles of a padded volume in nnU-Net's order, as spatial slicers.

    Same dimensionality: ``itertools.product`` over the per-axis steps, i.e. the nested
    ``for sx: for sy: for sz`` loops. A patch with one axis fewer (2D configuration on 3D data):
    ``for d in range(shape[0]): for sx: for sy``, giving ``(d, slice, slice)``.
    """
    shape = tuple(int(s) for s in padded_spatial_shape)
    patch = tuple(int(p) for p in patch_size)
    if len(patch) == len(shape) - 1:
        steps = compute_steps_for_sliding_window(shape[1:], patch, tile_step_size)
        return [
            (d, *(slice(s, s + p) for s, p in zip(start, patch, strict=True)))
            for d in range(shape[0])
            for start in itertools.product(*steps)
        ]
    if len(patch) != len(shape):
        raise InputValidationError(
            f"patch_size {patch} must have as many axes as the spatial shape {shape}, or one fewer "
            "(2D configuration on 3D data)."
        )
    steps = compute_steps_for_sliding_window(shape, patch, tile_step_size)
    return [
        tuple(slice(s, s + p) for s, p in zip(start, patch, strict=True))
        for start in itertools.product(*steps)
    ]
