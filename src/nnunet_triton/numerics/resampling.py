"""nnU-Net's resampling, bit for bit, on NumPy or CuPy arrays.

Port of ``nnunetv2/preprocessing/resampling/default_resampling.py`` (nnU-Net 2.8.1): the shape rule,
the separate-z (anisotropy) decision and ``resample_data_or_seg``. skimage's
``resize(x, shape, order, mode='edge', anti_aliasing=False)`` is replaced by the equivalent
``clip(ndimage.zoom(x, 1 / (in / out), order, mode='nearest', grid_mode=True), x.min(), x.max())``
(float64), because ``cupyx.scipy.ndimage`` has ``zoom`` but there is no CuPy skimage. Segmentations
follow ``batchgenerators.augmentations.utils.resize_segmentation`` as installed (0.25.5: per-label
indicator argmax with the 'nearest' tie break).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nnunet_triton.errors import UnsupportedModelError
from nnunet_triton.numerics._xp import get_array_module, get_ndimage
from nnunet_triton.numerics.plans import ResamplingSettings

__all__ = [
    "ANISO_THRESHOLD",
    "compute_new_shape",
    "determine_do_sep_z_and_axis",
    "resize",
    "resize_segmentation",
    "resample_data_or_seg",
    "resample_data_or_seg_to_shape",
    "resample_with_settings",
]

ANISO_THRESHOLD = 3  # nnunetv2/configuration.py


def compute_new_shape(
    old_shape: Sequence[int], old_spacing: Sequence[float], new_spacing: Sequence[float]
) -> tuple[int, ...]:
    """``compute_new_shape``: ``int(round(old_sp / new_sp * shape))`` per axis (Python round, half-even)."""
    if not len(old_shape) == len(old_spacing) == len(new_spacing):
        raise ValueError(
            f"compute_new_shape: shape {tuple(old_shape)}, old spacing {tuple(old_spacing)} and "
            f"new spacing {tuple(new_spacing)} must have the same length."
        )
    return tuple(
        int(round(float(i) / float(j) * int(k)))
        for i, j, k in zip(old_spacing, new_spacing, old_shape, strict=True)
    )


def _get_do_separate_z(spacing: Sequence[float]) -> bool:
    """``get_do_separate_z``: ``max / min > ANISO_THRESHOLD`` (strict), float64."""
    return bool((np.max(spacing) / np.min(spacing)) > ANISO_THRESHOLD)


def _get_lowres_axis(spacing: Sequence[float]) -> np.ndarray:
    """``get_lowres_axis``: every axis whose spacing equals the maximum (exact float equality)."""
    return np.where(max(spacing) / np.array(spacing) == 1)[0]


def determine_do_sep_z_and_axis(
    force_separate_z: bool | None, current_spacing: Sequence[float], new_spacing: Sequence[float]
) -> tuple[bool, int | None]:
    """``determine_do_sep_z_and_axis``: current spacing first, then the target; ties mean no separate z."""
    current = [float(s) for s in current_spacing]
    new = [float(s) for s in new_spacing]
    axis = None
    if force_separate_z is not None:
        do_separate_z = bool(force_separate_z)
        if force_separate_z:
            axis = _get_lowres_axis(current)
    elif _get_do_separate_z(current):
        do_separate_z, axis = True, _get_lowres_axis(current)
    elif _get_do_separate_z(new):
        do_separate_z, axis = True, _get_lowres_axis(new)
    else:
        do_separate_z = False
    if axis is None:
        return do_separate_z, None
    if len(axis) != 1:  # (0.24, 1.25, 1.25)-like ties or isotropic: no separate z
        return False, None
    return do_separate_z, int(axis[0])


def resize(image: Any, new_shape: Sequence[int], order: int) -> Any:
    """``skimage.transform.resize(image, new_shape, order, mode='edge', anti_aliasing=False)`` for float64.

    skimage computes ``zoom = 1 / (in / out)`` (only the output shape depends on it), calls
    ``ndimage.zoom(..., mode='nearest', cval=0, grid_mode=True)`` and clips to the input's range
    (``_clip_warp_output``). ``image`` must be float64 (CuPy prefilters in the input's precision).
    """
    xp = get_array_module(image)
    ndi = get_ndimage(xp)
    factors = np.divide(image.shape, tuple(int(s) for s in new_shape))
    out = ndi.zoom(image, [1 / f for f in factors], order=order, mode="nearest", cval=0, grid_mode=True)
    xp.clip(out, image.min(), image.max(), out=out)
    return out


def resize_segmentation(seg: Any, new_shape: Sequence[int], order: int) -> Any:
    """``batchgenerators.augmentations.utils.resize_segmentation`` (0.25.5, ``seg_tiebreak='nearest'``).

    Order 0 is a nearest-neighbour resize. Otherwise each label's indicator is resized, the per-voxel
    winner is the first label (ascending) with the largest score, and an exact tie among labels with a
    positive score goes to the order-0 (nearest) label if that label is one of the tied ones
    (``_resample_seg_by_argmax``). Returns the dtype of ``seg``.
    """
    xp = get_array_module(seg)
    new_shape = tuple(int(s) for s in new_shape)
    if seg.size == 0:
        return xp.zeros(new_shape, dtype=seg.dtype)
    nearest = resize(seg.astype(np.float64), new_shape, 0)
    if order == 0:
        return nearest.astype(seg.dtype)
    labels = xp.unique(seg)
    if len(labels) == 1:
        return xp.full(new_shape, labels[0].item(), dtype=seg.dtype)
    nn_idx = xp.searchsorted(labels.astype(np.float64), nearest)  # nearest only holds label values
    best = resize((seg == labels[0]).astype(np.float64), new_shape, order)
    win = xp.zeros(new_shape, dtype=np.int64)
    nn_top = (nn_idx == 0) & (best > 0)
    for i in range(1, len(labels)):
        score = resize((seg == labels[i]).astype(np.float64), new_shape, order)
        is_nn = nn_idx == i
        nn_top |= (score == best) & (score > 0) & is_nn
        better = score > best
        nn_top = xp.where(better, is_nn, nn_top)
        win = xp.where(better, i, win)
        xp.maximum(best, score, out=best)
    win = xp.where(nn_top, nn_idx, win)
    return labels.astype(seg.dtype)[win]


def _resize_fn(is_seg: bool):
    return resize_segmentation if is_seg else resize


def _resample_along_axis(vol: Any, axis: int, new_len: int, order_z: int, is_seg: bool) -> Any:
    """The ``map_coordinates(..., order=order_z, mode='nearest')`` step of separate-z resampling.

    In-plane coordinates are exact integers (scale 1), so order 0 is a gather with
    ``floor(c + 0.5)`` clamped to the axis, where ``c = (o + 0.5) * in / out - 0.5`` (float64).
    """
    xp = get_array_module(vol)
    old_len = vol.shape[axis]
    if order_z == 0:
        coords = float(old_len) / new_len * (np.arange(new_len) + 0.5) - 0.5
        idx = np.clip(np.floor(coords + 0.5), 0, old_len - 1).astype(np.int64)
        return xp.take(vol, xp.asarray(idx), axis=axis)
    ndi = get_ndimage(xp)
    out_shape = list(vol.shape)
    out_shape[axis] = new_len
    grids = np.mgrid[tuple(slice(0, s) for s in out_shape)]
    scales = [float(o) / n for o, n in zip(vol.shape, out_shape, strict=True)]
    coord_map = xp.asarray(np.array([s * (g + 0.5) - 0.5 for s, g in zip(scales, grids, strict=True)]))
    if not is_seg:
        return ndi.map_coordinates(vol, coord_map, order=order_z, mode="nearest")
    out = xp.zeros(out_shape, dtype=vol.dtype)
    for label in xp.unique(vol).tolist():
        hit = ndi.map_coordinates((vol == label).astype(np.float64), coord_map, order=order_z, mode="nearest")
        out[xp.round(hit) > 0.5] = label
    return out


def _resample_separate_z(
    channel: Any, new_shape: tuple[int, ...], axis: int, order: int, order_z: int, is_seg: bool
) -> Any:
    """One channel of ``resample_data_or_seg``'s ``do_separate_z`` branch (per-slice in-plane resize)."""
    xp = get_array_module(channel)
    fn = _resize_fn(is_seg)
    in_plane = tuple(s for d, s in enumerate(new_shape) if d != axis)
    tmp = list(new_shape)
    tmp[axis] = channel.shape[axis]
    reshaped = xp.zeros(tmp, dtype=np.float64)
    for slice_id in range(channel.shape[axis]):
        sl = (slice(None),) * axis + (slice_id,)
        reshaped[sl] = fn(channel[sl], in_plane, order)
    if channel.shape[axis] != new_shape[axis]:
        return _resample_along_axis(reshaped, axis, new_shape[axis], order_z, is_seg)
    return reshaped


def resample_data_or_seg(
    data: Any,
    new_shape: Sequence[int],
    *,
    is_seg: bool = False,
    axis: int | None = None,
    order: int = 3,
    do_separate_z: bool = False,
    order_z: int = 0,
) -> Any:
    """``resample_data_or_seg``: (C, *spatial) -> (C, *new_shape); float64 math, output in ``data.dtype``.

    Returns ``data`` itself when the spatial shape is already ``new_shape``.
    """
    xp = get_array_module(data)
    new_shape = tuple(int(s) for s in new_shape)
    if data.ndim != len(new_shape) + 1:
        raise ValueError(
            f"resample_data_or_seg: data of shape {data.shape} must be (C, *spatial) with "
            f"{len(new_shape)} spatial axes to match new_shape {new_shape}."
        )
    if tuple(data.shape[1:]) == new_shape:
        return data
    if do_separate_z and axis is None:
        raise ValueError("resample_data_or_seg: do_separate_z needs the anisotropic axis, got axis=None.")
    out = xp.zeros((data.shape[0], *new_shape), dtype=data.dtype)
    for c in range(data.shape[0]):
        channel = data[c].astype(np.float64, copy=False)  # per channel: same values, less peak memory
        if do_separate_z:
            out[c] = _resample_separate_z(channel, new_shape, axis, order, order_z, is_seg)
        else:
            out[c] = _resize_fn(is_seg)(channel, new_shape, order)
    return out


def resample_data_or_seg_to_shape(
    data: Any,
    new_shape: Sequence[int],
    current_spacing: Sequence[float],
    new_spacing: Sequence[float],
    *,
    is_seg: bool = False,
    order: int = 3,
    order_z: int = 0,
    force_separate_z: bool | None = None,
) -> Any:
    """``resample_data_or_seg_to_shape``: decide separate z from the spacings, then resample."""
    do_separate_z, axis = determine_do_sep_z_and_axis(force_separate_z, current_spacing, new_spacing)
    return resample_data_or_seg(
        data, new_shape, is_seg=is_seg, axis=axis, order=order, do_separate_z=do_separate_z, order_z=order_z
    )


def resample_with_settings(
    data: Any,
    new_shape: Sequence[int],
    current_spacing: Sequence[float],
    new_spacing: Sequence[float],
    settings: ResamplingSettings,
) -> Any:
    """Dispatch on a plans ``resampling_fn_*`` name with its kwargs (:class:`ResamplingSettings`)."""
    if settings.function != "resample_data_or_seg_to_shape":
        raise UnsupportedModelError(
            f"resampling function {settings.function!r} is not supported; "
            "supported: ['resample_data_or_seg_to_shape']."
        )
    return resample_data_or_seg_to_shape(
        data,
        new_shape,
        current_spacing,
        new_spacing,
        is_seg=settings.is_seg,
        order=settings.order,
        order_z=settings.order_z,
        force_separate_z=settings.force_separate_z,
    )
