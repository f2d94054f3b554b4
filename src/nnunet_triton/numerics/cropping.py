"""Crop to the nonzero region and put crops back, on NumPy or CuPy arrays.

Ports of ``nnunetv2/preprocessing/cropping/cropping.py`` (``create_nonzero_mask``, ``crop_to_nonzero``)
and of acvl_utils' ``get_bbox_from_mask`` / ``insert_crop_into_image``
(``acvl_utils/cropping_and_padding/bounding_boxes.py``). Bounding boxes are half-open ``(lo, hi)``
per spatial axis, as everywhere in nnU-Net.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nnunet_triton.numerics._xp import get_array_module, get_ndimage

__all__ = [
    "BBox",
    "create_nonzero_mask",
    "bbox_from_mask",
    "bbox_to_slices",
    "crop_to_nonzero",
    "insert_crop",
]

BBox = tuple[tuple[int, int], ...]


def create_nonzero_mask(data: Any) -> Any:
    """``create_nonzero_mask``: OR over channels of ``data[c] != 0``, then ``binary_fill_holes``.

    ``data`` is (C, *spatial). ``binary_fill_holes`` uses its default structure (face connectivity).
    """
    if data.ndim not in (3, 4):
        raise ValueError(f"create_nonzero_mask: data must be (C, X, Y[, Z]), got shape {data.shape}.")
    xp = get_array_module(data)
    mask = data[0] != 0
    for c in range(1, data.shape[0]):
        mask |= data[c] != 0
    return get_ndimage(xp).binary_fill_holes(mask)


def bbox_from_mask(mask: Any) -> BBox:
    """``get_bbox_from_mask``: per axis ``[first True, last True + 1)``; full extent for an empty mask."""
    xp = get_array_module(mask)
    bbox = []
    for axis, size in enumerate(mask.shape):
        others = tuple(a for a in range(mask.ndim) if a != axis)
        hits = np.flatnonzero(np.asarray(_to_host(xp.any(mask, axis=others))))
        bbox.append((int(hits[0]), int(hits[-1]) + 1) if hits.size else (0, int(size)))
    return tuple(bbox)


def _to_host(array: Any) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


def bbox_to_slices(bbox: BBox) -> tuple[slice, ...]:
    """``bounding_box_to_slice``: one ``slice(lo, hi)`` per axis."""
    return tuple(slice(int(lo), int(hi)) for lo, hi in bbox)


def crop_to_nonzero(data: Any) -> tuple[Any, Any, BBox]:
    """``crop_to_nonzero(data, seg=None)`` without the seg: returns (cropped data, cropped mask, bbox).

    The cropped data is a view of ``data`` (as in nnU-Net). nnU-Net's seg is
    ``where(mask, 0, -1)`` (int8); its ``seg >= 0`` is exactly the returned boolean mask.
    """
    mask = create_nonzero_mask(data)
    bbox = bbox_from_mask(mask)
    slicer = bbox_to_slices(bbox)
    return data[(slice(None), *slicer)], mask[slicer], bbox


def insert_crop(full: Any, crop: Any, bbox: BBox) -> Any:
    """``insert_crop_into_image`` for a bbox inside ``full``: ``crop`` goes into the last ``len(bbox)`` axes.

    ``full`` is modified in place and returned.
    """
    n_lead = full.ndim - len(bbox)
    expected = tuple(full.shape[:n_lead]) + tuple(hi - lo for lo, hi in bbox)
    if n_lead < 0 or tuple(crop.shape) != expected:
        raise ValueError(
            f"insert_crop: crop of shape {tuple(crop.shape)} does not fit bbox {bbox} in an array "
            f"of shape {tuple(full.shape)} (expected crop shape {expected})."
        )
    for (lo, hi), size in zip(bbox, full.shape[n_lead:], strict=True):
        if not 0 <= lo <= hi <= size:
            raise ValueError(f"insert_crop: bbox {bbox} lies outside an array of shape {tuple(full.shape)}.")
    full[(slice(None),) * n_lead + bbox_to_slices(bbox)] = crop
    return full
