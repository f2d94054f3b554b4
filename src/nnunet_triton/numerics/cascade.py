"""Input of an nnU-Net cascade stage: the image plus the previous stage's segmentation, on NumPy or CuPy.

nnU-Net's cascade (``3d_lowres`` -> ``3d_cascade_fullres``) feeds the second network the preprocessed
image stacked with a one-hot encoding of the first stage's segmentation. At inference
(``nnUNetPredictor.predict_from_files(..., folder_with_segs_from_prev_stage=...)``, i.e.
``nnUNetv2_predict -prev_stage_predictions``, and
``predict_single_npy_array(..., segmentation_previous_stage)``) the data iterators
(``nnunetv2/inference/data_iterators.py``, nnU-Net 2.8.1) do::

    data, seg, props = DefaultPreprocessor.run_case_npy(image, previous_seg, props, ...)
    data = np.vstack((data, convert_labelmap_to_one_hot(seg[0], label_manager.foreground_labels, data.dtype)))

where ``run_case_npy`` (``nnunetv2/preprocessing/preprocessors/default_preprocessor.py``) processes the
segmentation with the image: ``transpose_forward``, ``crop_to_nonzero`` (which writes -1 where the
segmentation is 0 outside the nonzero mask; the normalization's ``use_mask_for_norm`` mask is then
``seg >= 0``), and ``resampling_fn_seg`` to the image's new shape. ``nnUNetv2_predict`` reads the previous
stage's segmentation with the plans' reader (``SimpleITKIO.read_seg``: float32, shape (1, *spatial));
this port casts to float32 the same way, so integer and float label maps give the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError, UnsupportedModelError
from nnunet_triton.numerics._xp import get_array_module, to_numpy
from nnunet_triton.numerics.cropping import BBox, bbox_to_slices, crop_to_nonzero
from nnunet_triton.numerics.limits import check_request_memory, check_voxel_limit
from nnunet_triton.numerics.normalization import normalize
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.preprocess import (
    CaseProperties,
    _check_finite,
    resampled_geometry,
    transpose_case,
    validate_image,
    validate_spacing,
)
from nnunet_triton.numerics.resampling import resample_with_settings

__all__ = [
    "NONZERO_LABEL",
    "validate_previous_segmentation",
    "crop_previous_segmentation",
    "convert_labelmap_to_one_hot",
    "preprocess_cascade_case",
]

NONZERO_LABEL = -1  # crop_to_nonzero's ``nonzero_label``: background outside the nonzero mask


def validate_previous_segmentation(
    segmentation: Any, image_shape: Sequence[int], labels: Sequence[int]
) -> Any:
    """Check the previous stage's label map and return it as float32 (1, *spatial), like ``read_seg``.

    ``segmentation`` is (*spatial) or (1, *spatial) in the reader's axis order (the image's), with the
    image's spatial shape (nnU-Net asserts the same in ``run_case_npy``) and only values in ``labels``
    (the model's ``all_labels``; a previous stage predicts nothing else).
    """
    spatial = tuple(int(s) for s in image_shape)
    shape = tuple(getattr(segmentation, "shape", ()))
    if shape not in (spatial, (1, *spatial)):
        raise InputValidationError(
            f"previous-stage segmentation must have the image's spatial shape {spatial} (optionally with a "
            f"leading axis of 1), got shape {shape}."
        )
    if segmentation.dtype.kind not in "biuf":
        raise InputValidationError(
            f"previous-stage segmentation must have a real numeric dtype, got {segmentation.dtype}."
        )
    xp = get_array_module(segmentation)
    seg = segmentation.reshape((1, *spatial)).astype(np.float32)  # a copy, like nnU-Net's np.copy
    allowed = xp.asarray(np.asarray(sorted(int(v) for v in labels), dtype=np.float32))
    bad = int((~xp.isin(seg, allowed)).sum())
    if bad:
        found = sorted(float(v) for v in np.unique(to_numpy(seg)))[:20]
        raise InputValidationError(
            f"previous-stage segmentation may only contain the model's labels {sorted(labels)}, got {bad} "
            f"voxels with other values (values present: {found})."
        )
    return seg


def crop_previous_segmentation(seg: Any, mask: Any, bbox: BBox) -> Any:
    """``crop_to_nonzero``'s seg branch: ``seg[slicer]``, then -1 where it is 0 outside the nonzero mask.

    ``seg`` is (1, *spatial) float32 in the transposed order, ``mask`` the cropped nonzero mask and
    ``bbox`` the crop (both from :func:`.cropping.crop_to_nonzero`). Returns a new array.
    """
    xp = get_array_module(seg)
    cropped = xp.array(seg[(slice(None), *bbox_to_slices(bbox))])  # copy: nnU-Net writes into its own copy
    cropped[(cropped == 0) & ~mask[None]] = NONZERO_LABEL
    return cropped


def convert_labelmap_to_one_hot(segmentation: Any, labels: Sequence[int], dtype: Any = np.float32) -> Any:
    """``convert_labelmap_to_one_hot`` (``nnunetv2/utilities/label_handling/label_handling.py``), NumPy path.

    (len(labels), *spatial) of ``dtype``, channel i is ``segmentation == labels[i]``; other values (the -1
    outside the nonzero mask, background) are 0 in every channel.
    """
    xp = get_array_module(segmentation)
    result = xp.zeros((len(labels), *segmentation.shape), dtype=dtype)
    for i, label in enumerate(labels):
        result[i] = segmentation == label
    return result


def preprocess_cascade_case(
    image: Any,
    spacing: Sequence[float],
    previous_segmentation: Any,
    config: InferenceConfig,
    *,
    max_voxels: int = 0,
    max_request_bytes: int = 0,
) -> tuple[Any, CaseProperties]:
    """``run_case_npy(image, previous_seg, ...)`` + the one-hot stack: the cascade network's whole input.

    ``image`` is (C, Z, Y, X) and ``previous_segmentation`` (Z, Y, X) or (1, Z, Y, X), both in the reader's
    axis order (SimpleITK) and the original geometry (what the previous stage's export wrote); ``spacing``
    is in the same order. Returns C-contiguous float32 (C + len(foreground labels), *target_shape) in the
    transposed axis order, exactly the tensor nnU-Net's data iterators give the cascade network, and the
    :class:`CaseProperties` (identical to :func:`nnunet_triton.numerics.preprocess.preprocess_case`'s: the
    segmentation changes neither the crop nor the shapes).

    ``max_voxels`` (0 = no limit) caps ``(C + K) * prod(target_shape)``; ``max_request_bytes`` as in
    :func:`~nnunet_triton.numerics.preprocess.preprocess_case`.
    """
    if config.previous_stage is None:
        raise UnsupportedModelError(
            f"configuration {config.configuration!r} has no previous_stage; it is not a cascade stage, use "
            "preprocess_case."
        )
    validate_image(image, config.num_input_channels)
    spacing = validate_spacing(spacing, image.ndim - 1)
    seg = validate_previous_segmentation(previous_segmentation, image.shape[1:], config.labels.all_labels)
    xp = get_array_module(image)
    with np.errstate(over="ignore"):  # out-of-range values become inf and are reported just below
        data = image.astype(np.float32)  # a copy, like nnU-Net's
    _check_finite(data)
    data, original_spacing = transpose_case(data, spacing, config.transpose_forward)
    seg, _ = transpose_case(seg, spacing, config.transpose_forward)
    shape_before = tuple(int(s) for s in data.shape[1:])
    data, mask, bbox = crop_to_nonzero(data)
    seg = crop_previous_segmentation(seg, mask, bbox)
    shape_after = tuple(int(s) for s in data.shape[1:])
    new_spacing, new_shape = resampled_geometry(config, shape_after, original_spacing)
    foreground = config.labels.foreground_labels
    check_voxel_limit("resampled image", (data.shape[0] + len(foreground), *new_shape), max_voxels)
    check_request_memory(config.labels.num_segmentation_heads, new_shape, shape_before, max_request_bytes)
    data = normalize(data, seg[0] >= 0, config.normalization)  # nnU-Net's mask: seg >= 0
    data = resample_with_settings(data, new_shape, original_spacing, new_spacing, config.resampling_data)
    seg = resample_with_settings(seg, new_shape, original_spacing, new_spacing, config.resampling_seg)
    out = xp.empty((data.shape[0] + len(foreground), *new_shape), dtype=np.float32)
    out[: data.shape[0]] = data
    out[data.shape[0]:] = convert_labelmap_to_one_hot(seg[0], foreground, np.float32)
    props = CaseProperties(
        spacing=spacing,
        shape_before_cropping=shape_before,
        bbox=bbox,
        shape_after_cropping_and_before_resampling=shape_after,
    )
    return out, props
