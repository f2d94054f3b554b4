"""nnunet_triton.numerics.gaussian against nnU-Net 2.8.1's compute_gaussian: bit-identical float16."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage
import torch
from nnunetv2.inference.sliding_window_prediction import compute_gaussian as nn_compute_gaussian

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics.gaussian import compute_gaussian

# (64, 160, 96) etc.: sizes where a direct float64 -> float16 cast would differ from torch's cast.
PATCHES = [
    (128, 128, 128),
    (16, 16, 16),
    (7, 9, 11),
    (64, 160, 96),
    (28, 256, 224),
    (512, 512),
    (192, 160),
    (1, 5),
    (3,),
]



def _nnunet(patch):
    return nn_compute_gaussian(
        tuple(patch), sigma_scale=1.0 / 8, value_scaling_factor=10, device=torch.device("cpu")
    ).numpy()


@pytest.mark.parametrize("patch", PATCHES)
def test_compute_gaussian_is_bit_identical_to_nnunet_when_patch_varies(patch, xp):
    ours = compute_gaussian(patch, xp=xp)
    ours_np = ours.get() if xp is not np else ours
    ref = _nnunet(patch)
    assert ours_np.dtype == np.float16 and ours_np.shape == tuple(patch)
    assert np.array_equal(ours_np.view(np.uint16), ref.view(np.uint16))


def test_compute_gaussian_rounds_via_float32_like_torch_when_cast_to_float16():
    patch = (64, 160, 96)
    tmp = np.zeros(patch)
    tmp[tuple(p // 2 for p in patch)] = 1
    g = scipy.ndimage.gaussian_filter(tmp, [p / 8 for p in patch], 0, mode="constant", cval=0)
    g /= g.max() / 10
    direct = g.astype(np.float16)
    via_float32 = g.astype(np.float32).astype(np.float16)
    assert np.count_nonzero(direct != via_float32) == 44  # a direct cast is wrong in 44 voxels
    assert np.array_equal(compute_gaussian(patch), _nnunet(patch))


def test_compute_gaussian_replaces_underflow_by_smallest_nonzero_when_patch_is_large():
    g = compute_gaussian((128, 128, 128))
    assert g.max() == np.float16(10) and g[64, 64, 64] == np.float16(10)
    tmp = np.zeros((128,) * 3)
    tmp[64, 64, 64] = 1
    raw = scipy.ndimage.gaussian_filter(tmp, 16.0, 0, mode="constant", cval=0)
    underflow = (raw / (raw.max() / 10)).astype(np.float32).astype(np.float16) == 0
    assert np.count_nonzero(underflow) == 8941 and np.all(g[underflow] == np.float16(2.0**-24))
    assert not np.any(g == 0)


@pytest.mark.parametrize(
    "kwargs", [{"sigma_scale": 1 / 4, "value_scaling_factor": 1}, {"value_scaling_factor": 1000}]
)
def test_compute_gaussian_matches_nnunet_when_scaling_changes(kwargs):
    ref = nn_compute_gaussian(
        (24, 20, 16),
        device=torch.device("cpu"),
        **{"sigma_scale": 1 / 8, "value_scaling_factor": 10, **kwargs},
    ).numpy()
    assert np.array_equal(compute_gaussian((24, 20, 16), **kwargs), ref)


@pytest.mark.parametrize("patch, factor", [((), 10), ((16, 0), 10), ((16, 16), 0)])
def test_compute_gaussian_raises_when_arguments_invalid(patch, factor):
    with pytest.raises(InputValidationError):
        compute_gaussian(patch, value_scaling_factor=factor)
