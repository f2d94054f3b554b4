"""One case through nnU-Net's inference preprocessing, on NumPy or CuPy arrays.

Port of ``DefaultPreprocessor.run_case_npy``
(``nnunetv2/preprocessing/preprocessors/default_preprocessor.py``, nnU-Net 2.8.1) for images
without a segmentation: float32 copy -> ``transpose_forward`` -> ``crop_to_nonzero`` ->
normalization (before resampling) -> resampling to the configuration's spacing.
:class:`CaseProperties` carries what the export needs to undo it (nnU-Net's ``properties``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError, UnsupportedModelError
from nnunet_triton.numerics._xp import get_array_module
from nnunet_triton.numerics.cascade import (
    convert_labelmap_to_one_hot,
    crop_previous_segmentation,
    validate_previous_segmentation,
)
from nnunet_triton.numerics.cropping import BBox, crop_to_nonzero
from nnunet_triton.numerics.limits import check_request_memory, check_voxel_limit
from nnunet_triton.numerics.normalization import normalize
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.resampling import compute_new_shape, resample_with_settings

__all__ = [
    "CaseProperties",
    "validate_image",
    "validate_spacing",
    "transpose_case",
    "target_spacing",
    "preprocess_case",
]


@dataclass(frozen=True)
class CaseProperties:
    """nnU-Net's per-case ``properties`` needed to export a prediction.

    ``spacing`` is in the reader's axis order (as given to :func:`preprocess_case`); the shapes and
    ``bbox`` (half-open ``(lo, hi)`` per axis) are in the transposed order, like nnU-Net's
    ``shape_before_cropping``, ``bbox_used_for_cropping`` and ``shape_after_cropping_and_before_resampling``.
    """

    spacing: tuple[float, ...]
    shape_before_cropping: tuple[int, ...]
    bbox: BBox
    shape_after_cropping_and_before_resampling: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.spacing)

    def to_array(self) -> np.ndarray:
        """Flat float64 ``[spacing, shape_before_cropping, bbox (lo, hi) pairs, shape_after_cropping]``.

        15 values for 3D.
        """
        values = [
            *self.spacing,
            *self.shape_before_cropping,
            *(v for pair in self.bbox for v in pair),
            *self.shape_after_cropping_and_before_resampling,
        ]
        return np.asarray(values, dtype=np.float64)

    @classmethod
    def from_array(cls, array: Any) -> CaseProperties:
        """Inverse of :meth:`to_array`; raises :class:`InputValidationError` for a malformed vector."""
        a = np.asarray(array, dtype=np.float64).reshape(-1)
        if a.size == 0 or a.size % 5 or not np.all(np.isfinite(a)):
            raise InputValidationError(
                f"case properties must be a finite float64 vector of length 5 * ndim (15 for 3D), "
                f"got {a.size} "
                f"values: {a.tolist()}."
            )
        n = a.size // 5
        ints = a[n:]
        if np.any(ints != np.round(ints)) or np.any(ints < 0):
            raise InputValidationError(
                f"case properties: shapes and bbox must be non-negative integers, got {ints.tolist()}."
            )
        i = [int(v) for v in ints]
        bbox = tuple((i[n + 2 * k], i[n + 2 * k + 1]) for k in range(n))
        return cls(
            spacing=tuple(float(v) for v in a[:n]),
            shape_before_cropping=tuple(i[:n]),
            bbox=bbox,
            shape_after_cropping_and_before_resampling=tuple(i[3 * n :]),
        )

    def to_nnunet_dict(self) -> dict[str, Any]:
        """The same fields under nnU-Net's ``properties`` keys (for calling nnU-Net's export functions)."""
        return {
            "spacing": list(self.spacing),
            "shape_before_cropping": tuple(self.shape_before_cropping),
            "bbox_used_for_cropping": [list(pair) for pair in self.bbox],
            "shape_after_cropping_and_before_resampling": tuple(
                self.shape_after_cropping_and_before_resampling
            ),
        }


def validate_image(image: Any, num_channels: int) -> None:
    """Raise :class:`InputValidationError` unless ``image`` is a real (``num_channels``, Z, Y, X) array."""
    if getattr(image, "ndim", None) != 4:
        raise InputValidationError(
            f"image must be a 4D array (channels, z, y, x) in the reader's axis order, got shape "
            f"{getattr(image, 'shape', None)}."
        )
    if image.dtype.kind not in "biuf":
        raise InputValidationError(f"image must have a real numeric dtype, got {image.dtype}.")
    if image.shape[0] != num_channels:
        raise InputValidationError(
            f"image has {image.shape[0]} channels (axis 0 of shape {tuple(image.shape)}) "
            f"but the model expects "
            f"{num_channels}."
        )
    if min(image.shape[1:]) < 1:
        raise InputValidationError(
            f"image must not have an empty spatial axis, got shape {tuple(image.shape)}."
        )


def validate_spacing(spacing: Sequence[float], ndim: int) -> tuple[float, ...]:
    """Return ``spacing`` as Python floats; raise unless it has ``ndim`` finite positive entries."""
    try:
        values = tuple(float(s) for s in np.asarray(spacing, dtype=np.float64).reshape(-1))
    except (TypeError, ValueError):
        raise InputValidationError(f"spacing must be {ndim} numbers, got {spacing!r}.") from None
    if len(values) != ndim:
        raise InputValidationError(f"spacing must have {ndim} entries (one per spatial axis), got {values}.")
    if not all(math.isfinite(s) and s > 0 for s in values):
        raise InputValidationError(f"spacing entries must be finite and > 0, got {values}.")
    return values


def transpose_case(
    data: Any, spacing: Sequence[float], transpose_forward: Sequence[int]
) -> tuple[Any, list[float]]:
    """``run_case_npy``'s transpose: a view of (C, *spatial) data and the spacing in the new order."""
    data = data.transpose((0, *(int(t) + 1 for t in transpose_forward)))
    return data, [spacing[int(t)] for t in transpose_forward]


def target_spacing(config: InferenceConfig, transposed_spacing: Sequence[float]) -> list[float]:
    """The configuration's spacing; for 2D configurations the slice axis keeps its spacing."""
    spacing = [float(s) for s in config.spacing]
    if len(spacing) < len(transposed_spacing):
        spacing = [float(transposed_spacing[0]), *spacing]
    return spacing


def _check_finite(data: Any) -> None:
    xp = get_array_module(data)
    bad = int((~xp.isfinite(data)).sum())
    if bad:
        raise InputValidationError(
            f"image must contain only finite values (after the cast to float32), got {bad} NaN/Inf voxels."
        )


def resampled_geometry(config: InferenceConfig, shape_after_cropping: Sequence[int],
                       original_spacing: Sequence[float]) -> tuple[list[float], tuple[int, ...]]:
    """(target spacing, new shape) nnU-Net resamples the cropped data to (``run_case_npy``).

    Raises:
        InputValidationError: an axis would resample to zero voxels.
    """
    new_spacing = target_spacing(config, original_spacing)
    new_shape = compute_new_shape(shape_after_cropping, original_spacing, new_spacing)
    if min(new_shape) < 1:
        raise InputValidationError(
            f"image is too small for the model's spacing: the cropped shape {tuple(shape_after_cropping)} "
            f"at spacing {tuple(original_spacing)} resamples to {new_shape} at {tuple(new_spacing)} "
            "(an empty axis)."
        )
    return new_spacing, new_shape


def preprocess_case(
    image: Any, spacing: Sequence[float], config: InferenceConfig, *, previous_segmentation: Any = None,
    max_voxels: int = 0, max_request_bytes: int = 0, original_geometry: bool = True,
) -> tuple[Any, CaseProperties]:
    """``DefaultPreprocessor.run_case_npy(data, seg, {'spacing': spacing}, ...)``: a case's network input.

    ``image`` is (C, Z, Y, X) in the reader's axis order (SimpleITK), any real dtype, NumPy or CuPy;
    ``spacing`` is in the same order. Returns C-contiguous float32 (C, *target_shape) in the transposed
    axis order and the :class:`CaseProperties`.

    A cascade stage (``config.previous_stage``) also takes ``previous_segmentation``, the previous
    stage's label map (Z, Y, X) or (1, Z, Y, X) in the image's geometry: it is transposed, cropped and
    resampled with the image (``run_case_npy(data, seg)``; the normalization mask becomes ``seg >= 0``)
    and its one-hot foreground channels are stacked after the image's, exactly the tensor nnU-Net's data
    iterators give the cascade network (see :mod:`.cascade`). The :class:`CaseProperties` do not change.

    ``max_voxels`` (0 = no limit) caps ``C * prod(target_shape)`` (``C + K`` channels in a cascade stage):
    the shape nnU-Net computes after
    cropping (``compute_new_shape(data.shape[1:], original_spacing, target_spacing)``) is checked with
    :func:`nnunet_triton.numerics.limits.check_voxel_limit` before normalization and resampling allocate it;
    ``max_request_bytes`` (0 = none) caps the request's float32 logits and, with ``original_geometry``
    (a K x original-geometry array will exist: probabilities asked for, or a whole-volume export), its
    probabilities (:func:`nnunet_triton.numerics.limits.check_request_memory`) at the same point.
    """
    cascade = config.previous_stage is not None
    if previous_segmentation is not None and not cascade:
        raise UnsupportedModelError(
            f"configuration {config.configuration!r} has no previous_stage; it is not a cascade stage and "
            "takes no previous_segmentation."
        )
    if cascade and previous_segmentation is None:
        raise InputValidationError(
            f"configuration {config.configuration!r} is a cascade stage after {config.previous_stage!r}: "
            "it needs the previous stage's segmentation."
        )
    validate_image(image, config.num_input_channels)
    spacing = validate_spacing(spacing, image.ndim - 1)
    seg = validate_previous_segmentation(previous_segmentation, image.shape[1:], config.labels.all_labels) \
        if cascade else None
    xp = get_array_module(image)
    with np.errstate(over="ignore"):  # out-of-range values become inf and are reported just below
        data = image.astype(np.float32)  # a copy, like nnU-Net's
    _check_finite(data)
    data, original_spacing = transpose_case(data, spacing, config.transpose_forward)
    shape_before = tuple(int(s) for s in data.shape[1:])
    data, mask, bbox = crop_to_nonzero(data)
    shape_after = tuple(int(s) for s in data.shape[1:])
    new_spacing, new_shape = resampled_geometry(config, shape_after, original_spacing)
    foreground = config.labels.foreground_labels if cascade else ()
    check_voxel_limit("resampled image", (data.shape[0] + len(foreground), *new_shape), max_voxels)
    check_request_memory(config.labels.num_segmentation_heads, new_shape, shape_before, max_request_bytes,
                         original_geometry=original_geometry)
    if seg is not None:
        seg, _ = transpose_case(seg, spacing, config.transpose_forward)
        seg = crop_previous_segmentation(seg, mask, bbox)
        mask = seg[0] >= 0  # nnU-Net's normalization mask when a segmentation is given
    data = normalize(data, mask, config.normalization)
    data = resample_with_settings(data, new_shape, original_spacing, new_spacing, config.resampling_data)
    props = CaseProperties(
        spacing=spacing,
        shape_before_cropping=shape_before,
        bbox=bbox,
        shape_after_cropping_and_before_resampling=shape_after,
    )
    if seg is None:
        return xp.ascontiguousarray(data), props
    seg = resample_with_settings(seg, new_shape, original_spacing, new_spacing, config.resampling_seg)
    out = xp.empty((data.shape[0] + len(foreground), *new_shape), dtype=np.float32)
    out[: data.shape[0]] = data
    out[data.shape[0]:] = convert_labelmap_to_one_hot(seg[0], foreground, np.float32)
    return out, props
