"""Stitched float16 logits -> segmentation (and probabilities) in the input image's geometry.

Port of ``convert_predicted_logits_to_segmentation_with_correct_shape``
(``nnunetv2/inference/export_prediction.py``, v2.8.1) and the ``LabelManager`` methods it calls
(``nnunetv2/utilities/label_handling/label_handling.py``):

1. resample the logits to ``shape_after_cropping_and_before_resampling`` with the plans'
   ``resampling_fn_probabilities`` (float64 math, stored back as float16; pass-through if the
   shape is unchanged); a 2D configuration keeps the slice axis' spacing;
2. labels: ``argmax`` over the float16 channels, first index wins ties; regions:
   ``sigmoid(float32) > 0.5`` written in ``regions_class_order`` (later regions overwrite); when the
   probabilities are asked for, the argmax (or threshold) of the probabilities, as nnU-Net does then;
3. uncrop into zeros of ``shape_before_cropping`` (uint8 if fewer than 255 foreground labels,
   else uint16), then ``transpose_backward``;
4. probabilities (optional): float32 softmax / sigmoid, background channel = 1 outside the bbox
   for label models, uncropped and transposed back.

Older releases differ in three places (``numerics.releases``, chosen by ``config.numerics``): 2.0 and 2.1
resample float32 logits, releases up to 2.5.x take the labels from the probabilities, and releases before
2.5.1 pass the original spacing in the reader's axis order.

nnU-Net computes the nonlinearity with torch's CPU ``softmax``, whose vectorised ``exp`` is an
approximation for most elements and ``std::exp`` for the rest, chosen by the element's place in the
array: the same logits give other bits in another layout or with another torch thread count (1 element of
100,003 differs between 1 and 2 threads, torch 2.14). Here ``exp`` is taken in float64 and rounded to
float32, the same for every element wherever it is, so the whole-volume and the by-rows export agree bit
for bit, and the probabilities are within a few float32 ulps of torch's. Labels taken from the
probabilities (releases up to 2.5.x, and every release when probabilities are asked for) can therefore
differ from nnU-Net's only where two classes' probabilities are within such an ulp of each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics._xp import get_array_module
from nnunet_triton.numerics.cropping import insert_crop
from nnunet_triton.numerics.plans import InferenceConfig, LabelSettings
from nnunet_triton.numerics.preprocess import CaseProperties
from nnunet_triton.numerics.releases import release_numerics
from nnunet_triton.numerics.resampling import resample_with_settings

__all__ = [
    "segmentation_dtype",
    "apply_inference_nonlin",
    "segmentation_from_logits",
    "check_logits_fit",
    "convert_logits_to_segmentation",
]

# torch.sigmoid(x.float()) > 0.5 holds for a float16 x exactly when x > 2**-24 (checked against torch
# for all 63488 finite float16 values in tests/unit/test_export.py); a float32 sigmoid here rounds
# differently for x = 2**-23, so the float16 decision is taken on the logit itself.
_FP16_SIGMOID_THRESHOLD = 2.0**-24


def segmentation_dtype(labels: LabelSettings) -> np.dtype:
    """uint8 if there are fewer than 255 foreground labels, else uint16 (as nnU-Net's export)."""
    return np.dtype(np.uint8 if len(labels.foreground_labels) < 255 else np.uint16)


def _exp_float32(x: Any, xp: Any) -> Any:
    """float32 ``exp`` computed in float64 and rounded once (stand-in for torch's vectorised expf)."""
    return xp.exp(x.astype(xp.float64)).astype(xp.float32)


def apply_inference_nonlin(logits: Any, labels: LabelSettings) -> Any:
    """float32 probabilities: sigmoid per region, or softmax over channels (``softmax_helper_dim0``)."""
    xp = get_array_module(logits)
    x = logits.astype(xp.float32)
    one = xp.float32(1)
    if labels.has_regions:
        with np.errstate(over="ignore"):
            return one / (one + _exp_float32(-x, xp))
    x -= x.max(axis=0, keepdims=True)
    for c in range(x.shape[0]):
        x[c] = _exp_float32(x[c], xp)
    total = x[0].copy()
    for c in range(1, x.shape[0]):
        total += x[c]
    x /= total
    return x


def segmentation_from_logits(logits: Any, labels: LabelSettings, *, from_probabilities: bool = False,
                             probabilities: Any = None) -> Any:
    """``LabelManager.convert_logits_to_segmentation``: argmax (labels) or thresholded sigmoid (regions).

    ``from_probabilities``: the argmax of the float32 softmax instead of the logits (nnU-Net up to 2.5.x,
    and whenever it computes probabilities; ``probabilities`` when already computed): two logits the float32
    softmax rounds to one probability then go to the first label, as there.
    """
    xp = get_array_module(logits)
    if not labels.has_regions:
        if from_probabilities:
            if probabilities is None:
                probabilities = apply_inference_nonlin(logits, labels)
            return xp.argmax(probabilities, axis=0)
        return xp.argmax(logits, axis=0)
    seg = xp.zeros(logits.shape[1:], dtype=xp.uint16)
    if probabilities is not None:
        inside = probabilities > 0.5
    elif logits.dtype == xp.float16:
        inside = logits.astype(xp.float32) > xp.float32(_FP16_SIGMOID_THRESHOLD)
    else:
        inside = apply_inference_nonlin(logits, labels) > 0.5
    for i, c in enumerate(labels.regions_class_order or ()):
        seg[inside[i]] = c
    return seg


def _current_spacing(props: CaseProperties, config: InferenceConfig) -> tuple[list[float], list[float]]:
    """(spacing of the logits, original spacing), as the nnU-Net export passes them to the resampling: in
    the transposed order (2.5.1 and later), or the original spacing in the reader's order (before 2.5.1,
    ``numerics.releases``; it decides the slice axis of a 2D configuration and separate z)."""
    original = [float(s) for s in props.spacing]
    if release_numerics(config.numerics).export_spacing_transposed:
        original = [original[i] for i in config.transpose_forward]
    target_ndim = len(props.shape_after_cropping_and_before_resampling)
    if len(config.spacing) == target_ndim:
        return [float(s) for s in config.spacing], original
    return [original[0], *(float(s) for s in config.spacing)], original


def check_logits_fit(logits: Any, props: CaseProperties, config: InferenceConfig) -> None:
    """Refuse logits whose channels or rank do not fit the configuration, or case properties whose crop
    box does not match their cropped shape."""
    heads = config.labels.num_segmentation_heads
    ndim = len(props.shape_after_cropping_and_before_resampling)
    if logits.ndim != ndim + 1 or logits.shape[0] != heads:
        raise InputValidationError(
            f"logits must have shape ({heads}, <{ndim} spatial axes>), got {tuple(logits.shape)}."
        )
    bbox_shape = tuple(hi - lo for lo, hi in props.bbox)
    if bbox_shape != tuple(props.shape_after_cropping_and_before_resampling):
        raise InputValidationError(
            f"case properties: bbox {props.bbox} (size {bbox_shape}) does not match "
            f"shape_after_cropping_and_before_resampling {props.shape_after_cropping_and_before_resampling}."
        )


def convert_logits_to_segmentation(
    logits: Any,
    props: CaseProperties,
    config: InferenceConfig,
    *,
    return_probabilities: bool = False,
) -> Any:
    """Segmentation ``(*reader-order shape)``, or ``(segmentation, probabilities (K, *shape))`` float32.

    ``logits``: float16 ``(K, *preprocessed shape)`` (fold-averaged) on NumPy or CuPy.
    """
    check_logits_fit(logits, props, config)
    xp = get_array_module(logits)
    numerics = release_numerics(config.numerics)
    if numerics.export_float32:  # nnU-Net 2.0 / 2.1 resample float32 logits
        logits = logits.astype(xp.float32)
    current_spacing, original_spacing = _current_spacing(props, config)
    logits = resample_with_settings(
        logits,
        props.shape_after_cropping_and_before_resampling,
        current_spacing,
        original_spacing,
        config.resampling_probabilities,
    )
    # nnU-Net takes the labels from the probabilities when it computes them (and always up to 2.5.x)
    probabilities = apply_inference_nonlin(logits, config.labels) if return_probabilities else None
    segmentation = segmentation_from_logits(logits, config.labels, probabilities=probabilities,
                                            from_probabilities=numerics.labels_from_probabilities
                                            or return_probabilities)
    del logits
    seg_full = xp.zeros(props.shape_before_cropping, dtype=segmentation_dtype(config.labels))
    insert_crop(seg_full, segmentation.astype(seg_full.dtype), props.bbox)
    del segmentation
    seg_full = xp.ascontiguousarray(seg_full.transpose(config.transpose_backward))
    if probabilities is None:
        return seg_full
    probs_full = xp.zeros((probabilities.shape[0], *props.shape_before_cropping), dtype=xp.float32)
    if not config.labels.has_regions:
        probs_full[0] = 1
    insert_crop(probs_full, probabilities, props.bbox)
    axes = (0, *(i + 1 for i in config.transpose_backward))
    return seg_full, xp.ascontiguousarray(probs_full.transpose(axes))
