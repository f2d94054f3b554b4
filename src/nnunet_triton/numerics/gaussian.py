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
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError

__all__ = ["DEFAULT_SIGMA_SCALE", "compute_gaussian"]

DEFAULT_SIGMA_SCALE = 1.0 / 8  # sigma = P_d / 8 (nnU-Net's compute_gaussian default, the one it uses)


def compute_gaussian(
    patch_size: Sequence[int],
    *,
    sigma_scale: float = DEFAULT_SIGMA_SCALE,
    value_scaling_factor: float = 10,
    xp: ModuleType = np,
) -> Any:
    """Return nnU-Net's float16 Gaussian importance map of shape ``patch_size`` as an ``xp`` array."""
    import scipy.ndimage

    tile_size = tuple(int(p) for p in patch_size)
    if not tile_size or any(p < 1 for p in tile_size):
        raise InputValidationError(
            f"patch_size must be non-empty with entries >= 1, got {tuple(patch_size)}."
        )
    if not value_scaling_factor > 0:
        raise InputValidationError(f"value_scaling_factor must be > 0, got {value_scaling_factor!r}.")
    tmp = np.zeros(tile_size)
    tmp[tuple(i // 2 for i in tile_size)] = 1
    sigmas = [i * sigma_scale for i in tile_size]
    gaussian_importance_map = scipy.ndimage.gaussian_filter(tmp, sigmas, 0, mode="constant", cval=0)
    gaussian_importance_map /= np.max(gaussian_importance_map) / value_scaling_factor
    half = gaussian_importance_map.astype(np.float32).astype(np.float16)
    zero = half == 0
    if zero.any():
        half[zero] = half[~zero].min()
    return half if xp is np else xp.asarray(half)
