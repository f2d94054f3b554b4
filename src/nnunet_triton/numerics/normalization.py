"""nnU-Net's intensity normalization schemes, on NumPy or CuPy float32 arrays.

Port of ``nnunetv2/preprocessing/normalization/default_normalization_schemes.py`` (nnU-Net 2.8.1) and
of ``DefaultPreprocessor._normalize`` (``nnunetv2/preprocessing/preprocessors/default_preprocessor.py``).
All arithmetic is float32 and in place, exactly like nnU-Net: a Python-float constant applied to a
float32 array is rounded to float32 first (``x -= float32(mean)``), which is what the ufunc loop
selection does under NumPy 1.26 (value-based casting) and NumPy 2 (NEP 50: a Python float is a weak
scalar) alike; here the constants are cast explicitly so that CuPy does
the same. On NumPy the ZScore statistics are NumPy's float32 ``mean``/``std`` of the same arrays
(and the same memory layout) nnU-Net reduces, hence bit-identical; CuPy's reductions sum in another
order (about 1e-7 relative).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError, UnsupportedModelError
from nnunet_triton.numerics._xp import get_array_module
from nnunet_triton.numerics.plans import ChannelNormalization, IntensityProperties

__all__ = [
    "EPS",
    "ct_normalization",
    "zscore_normalization",
    "rescale_to_01_normalization",
    "rgb_to_01_normalization",
    "no_normalization",
    "normalize_channel",
    "normalize",
]

EPS = 1e-8  # nnU-Net's eps for float32 targets (1e-4 would be for float16)


def _f32(value: Any) -> np.float32:
    return np.float32(float(value))


def _as_f32(image: Any) -> Any:
    return image.astype(np.float32, copy=False)


def ct_normalization(image: Any, intensity: IntensityProperties) -> Any:
    """``CTNormalization.run``: clip to the foreground [p0.5, p99.5], ``-= mean``, ``/= max(std, eps)``."""
    xp = get_array_module(image)
    image = _as_f32(image)
    xp.clip(image, _f32(intensity.percentile_00_5), _f32(intensity.percentile_99_5), out=image)
    image -= _f32(intensity.mean)
    image /= _f32(max(intensity.std, EPS))
    return image


def zscore_normalization(image: Any, mask: Any | None = None) -> Any:
    """``ZScoreNormalization.run``: ``(x - mean) / max(std, eps)``, statistics over ``mask`` if given.

    With a mask only the voxels inside it change (nnU-Net passes ``seg >= 0``, i.e. the nonzero mask).
    An empty mask leaves the image unchanged, as nnU-Net's NaN statistics do (without the warnings).
    """
    image = _as_f32(image)
    if mask is None:
        mean, std = image.mean(), image.std()
        image -= _f32(mean)
        image /= _f32(max(float(std), EPS))
        return image
    if mask.shape != image.shape:
        raise ValueError(f"zscore_normalization: mask shape {mask.shape} != image shape {image.shape}.")
    values = image[mask]
    if values.size == 0:
        return image
    mean, std = values.mean(), values.std()
    image[mask] = (values - _f32(mean)) / _f32(max(float(std), EPS))
    return image


def rescale_to_01_normalization(image: Any) -> Any:
    """``RescaleTo01Normalization.run``: ``x -= min``; ``x /= max(max, eps)``."""
    image = _as_f32(image)
    image -= _f32(image.min())
    image /= _f32(max(float(image.max()), EPS))
    return image


def rgb_to_01_normalization(image: Any) -> Any:
    """``RGBTo01Normalization.run``: ``x / 255``; values outside [0, 255] raise (nnU-Net asserts)."""
    lo, hi = float(image.min()), float(image.max())
    if lo < 0 or hi > 255:
        raise InputValidationError(
            f"image channel normalized with RGBTo01Normalization must have values in [0, 255], "
            f"got min {lo} and max {hi}."
        )
    image = _as_f32(image)
    image /= _f32(255.0)
    return image


def no_normalization(image: Any) -> Any:
    """``NoNormalization.run``: cast to float32 only."""
    return _as_f32(image)


def normalize_channel(image: Any, mask: Any, norm: ChannelNormalization) -> Any:
    """Apply one channel's scheme; ``mask`` (nonzero mask, bool) is only used by masked ZScore."""
    if norm.scheme == "CTNormalization":
        if norm.intensity is None:
            raise UnsupportedModelError("CTNormalization needs foreground intensity properties; none given.")
        return ct_normalization(image, norm.intensity)
    if norm.scheme == "ZScoreNormalization":
        return zscore_normalization(image, mask if norm.use_mask_for_norm else None)
    if norm.scheme == "RescaleTo01Normalization":
        return rescale_to_01_normalization(image)
    if norm.scheme == "RGBTo01Normalization":
        return rgb_to_01_normalization(image)
    if norm.scheme == "NoNormalization":
        return no_normalization(image)
    raise UnsupportedModelError(f"normalization scheme {norm.scheme!r} is not supported.")


def normalize(data: Any, mask: Any, normalization: Sequence[ChannelNormalization]) -> Any:
    """``DefaultPreprocessor._normalize``: ``data[c] = scheme_c.run(data[c], mask)`` for each channel.

    ``data`` is float32 (C, *spatial) and is modified in place (channel views, like nnU-Net, so the
    float32 reductions see the same memory layout); it is also returned.
    """
    if data.dtype != np.float32:
        raise ValueError(f"normalize: data must be float32 (nnU-Net casts first), got {data.dtype}.")
    if len(normalization) != data.shape[0]:
        raise InputValidationError(
            f"image has {data.shape[0]} channels but the model normalizes {len(normalization)} channels."
        )
    for c, norm in enumerate(normalization):
        channel = data[c]
        result = normalize_channel(channel, mask, norm)
        if result is not channel:
            data[c] = result
    return data
