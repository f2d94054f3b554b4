"""Gaussian importance map used to weight tiles, bit-identical to nnU-Net's.

Port of ``compute_gaussian`` from ``nnunetv2/inference/sliding_window_prediction.py`` (v2.8.1):

1. a float64 delta at ``P_d // 2`` (upper-middle voxel for even sizes);
2. ``scipy.ndimage.gaussian_filter(sigma=P_d * sigma_scale, mode='constant', cval=0)`` (truncate 4);
3. ``g /= (g.max() / value_scaling_factor)`` in float64 (peak 10 since v2.2.1, this form since v2.4);
4. cast to float16 the way ``torch.Tensor.to(float16)`` does it from float64: via float32
   (c10::Half converts from float, so the cast rounds twice; a direct float64 -> float16 cast
   differs for some voxels);
5. voxels that underflowed to 0 get the smallest nonzero value (else 0 / 0 at volume corners).

The map is always computed on the host with SciPy (cheap, once per model) and then moved to the
requested array module, so the NumPy and CuPy maps are the same bits.

Older releases scale and cast the map differently (``numerics.releases.GaussianRule``, chosen with
``rule``): 2.0 and 2.1 scale the peak to 1 in float64 and cast with NumPy (one rounding); 2.2 casts the raw
filter output to float16 first and scales it by ``/ max * 1000`` in float16 (torch's float16 arithmetic:
each operation in float32, rounded to float16); 2.2.1 to 2.3 compute ``g / max * 10`` in float64 before
the cast (the peak is 10 either way, but the last bit of some weights differs from ``g /= max / 10``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics.releases import GaussianRule

__all__ = ["DEFAULT_SIGMA_SCALE", "compute_gaussian"]

DEFAULT_SIGMA_SCALE = 1.0 / 8  # sigma = P_d / 8 (nnU-Net's compute_gaussian default, the one it uses)


def compute_gaussian(
    patch_size: Sequence[int],
    *,
    sigma_scale: float = DEFAULT_SIGMA_SCALE,
    value_scaling_factor: float | None = None,
    xp: ModuleType = np,
    rule: GaussianRule = GaussianRule.PEAK10_DIVIDE,
) -> Any:
    """Return nnU-Net's float16 Gaussian importance map of shape ``patch_size`` as an ``xp`` array.

    ``rule``: the release's arithmetic (default: 2.4 and later); ``value_scaling_factor``: the peak
    (default: the release's own, 10, 1000 for 2.2's rule, 1 for 2.0's).
    """
    import scipy.ndimage

    tile_size = tuple(int(p) for p in patch_size)
    if not tile_size or any(p < 1 for p in tile_size):
        raise InputValidationError(
            f"patch_size must be non-empty with entries >= 1, got {tuple(patch_size)}."
        )
    rule = GaussianRule(rule)
    peak = _PEAKS[rule] if value_scaling_factor is None else value_scaling_factor
    if not peak > 0:
        raise InputValidationError(f"value_scaling_factor must be > 0, got {value_scaling_factor!r}.")
    tmp = np.zeros(tile_size)
    tmp[tuple(i // 2 for i in tile_size)] = 1
    sigmas = [i * sigma_scale for i in tile_size]
    g = scipy.ndimage.gaussian_filter(tmp, sigmas, 0, mode="constant", cval=0)
    half = _scale_and_cast(g, peak, rule)
    zero = half == 0
    if zero.any():
        half[zero] = half[~zero].min()
    return half if xp is np else xp.asarray(half)


_PEAKS = {GaussianRule.PEAK1_NUMPY: 1, GaussianRule.FP16_PEAK1000: 1000, GaussianRule.PEAK10_MULTIPLY: 10,
          GaussianRule.PEAK10_DIVIDE: 10}


def _torch_half(x: np.ndarray) -> np.ndarray:
    """float64 -> float16 the way torch casts it (through float32: two roundings)."""
    return x.astype(np.float32).astype(np.float16)


def _scale_and_cast(g: np.ndarray, peak: float, rule: GaussianRule) -> np.ndarray:
    """The filtered delta ``g`` (float64) scaled to ``peak`` and cast to float16 by ``rule``."""
    if rule is GaussianRule.PEAK1_NUMPY:  # 2.0, 2.1: g / max(g) * 1, then numpy's astype(float16)
        return (g / np.max(g) * peak).astype(np.float16)
    if rule is GaussianRule.FP16_PEAK1000:  # 2.2: float16 first, then torch's float16 / and *
        half = _torch_half(g)
        scaled = (half.astype(np.float32) / np.float32(np.max(half))).astype(np.float16)
        return (scaled.astype(np.float32) * np.float32(peak)).astype(np.float16)
    if rule is GaussianRule.PEAK10_MULTIPLY:  # 2.2.1 - 2.3: g / max(g) * peak in float64
        return _torch_half(g / np.max(g) * peak)
    g /= np.max(g) / peak  # 2.4 and later
    return _torch_half(g)
