"""The previous stage's segmentation in a cascade stage's input (NumPy or CuPy); used by
:func:`nnunet_triton.numerics.preprocess.preprocess_case` when it is given ``previous_segmentation``.

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

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics._xp import get_array_module, to_numpy
from nnunet_triton.numerics.cropping import BBox, bbox_to_slices

__all__ = [
    "NONZERO_LABEL",
    "validate_previous_segmentation",
    "crop_previous_segmentation",
    "convert_labelmap_to_one_hot",
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
