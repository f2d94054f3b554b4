"""The export's resampling by ranges of output rows equals nnU-Net's whole-volume resampling bit for bit.

``zoom_rows`` against SciPy's ``ndimage.zoom`` (the interpolation skimage's ``resize`` runs for nnU-Net), and
``RowResampling`` against ``resample_data_or_seg`` (our exact copy of nnU-Net's, with skimage's clip) on
float16 logits, for every way the rows can be cut: one row at a time, uneven ranges, the whole axis.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from nnunet_triton.errors import UnsupportedModelError
from nnunet_triton.numerics.resampling import resample_data_or_seg
from nnunet_triton.numerics.slab_resampling import RowResampling, source_rows, zoom_rows


def _cuts(n: int, rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """Ways to cut ``n`` rows: one by one, random uneven ranges, all at once."""
    edges = sorted({0, n, *(int(e) for e in rng.integers(1, max(n, 2), size=min(n, 4)))})
    return [[(i, i + 1) for i in range(n)], list(zip(edges, edges[1:], strict=False)), [(0, n)]]


@pytest.mark.parametrize("order", [0, 1])
def test_zoom_rows_equal_scipys_zoom_bit_for_bit_for_random_shapes(order):
    rng = np.random.default_rng(order)
    checked = 0
    for _ in range(400):
        nd = int(rng.integers(1, 4))
        ins = tuple(int(s) for s in rng.integers(1, 13, nd))
        outs = tuple(int(s) for s in rng.integers(1, 23, nd))
        image = (rng.normal(size=ins) * 10).astype(np.float16).astype(np.float64)
        expected = ndimage.zoom(image, [o / i for i, o in zip(ins, outs, strict=True)], order=order,
                                mode="nearest", grid_mode=True)
        if expected.shape != outs:  # zoom rounds the output shape; nnU-Net's shapes always round-trip
            continue
        r0 = int(rng.integers(0, outs[0]))
        r1 = int(rng.integers(r0 + 1, outs[0] + 1))
        lo, hi = source_rows(ins[0], outs[0], (r0, r1), order)
        got = zoom_rows(image[lo:hi], lo, ins[0], outs, (r0, r1), order)
        assert got.tobytes() == expected[r0:r1].tobytes(), (ins, outs, (r0, r1))
        checked += 1
    assert checked > 300


CONFIGS = [  # in shape, new shape, separate z, axis
    ((9, 14, 11), (13, 20, 17), False, None),  # upsampled, every axis
    ((16, 12, 15), (11, 9, 10), False, None),  # downsampled
    ((5, 12, 13), (12, 18, 17), True, 0),  # thick slices along the rows: order 0 between slices
    ((12, 13, 5), (18, 17, 11), True, 2),  # thick slices along the last axis
    ((7, 12, 13), (7, 18, 17), True, 0),  # separate z, same slice count
    ((10, 11), (17, 8), False, None),  # 2D
    ((8, 9, 10), (8, 9, 10), False, None),  # nothing to resample: the data itself
]


@pytest.mark.parametrize(("in_shape", "new_shape", "separate", "axis"), CONFIGS)
def test_row_ranges_of_the_export_resampling_equal_the_whole_volume_bit_for_bit(in_shape, new_shape, separate,
                                                                                axis):
    rng = np.random.default_rng(sum(in_shape))
    logits = (rng.normal(size=(3, *in_shape)) * 8).astype(np.float16)
    logits[1, 0] = logits[1].max()  # ties at the channel's maximum: where skimage's clip could bite
    expected = resample_data_or_seg(logits, new_shape, is_seg=False, axis=axis, order=1,
                                    do_separate_z=separate, order_z=0)
    plan = RowResampling(in_shape, new_shape, axis=axis, order=1, do_separate_z=separate, order_z=0)
    for cut in _cuts(new_shape[0], rng):
        pieces = []
        for rows in cut:
            lo, hi = plan.source_rows(rows)
            pieces.append(plan.rows(logits[:, lo:hi], lo, rows))
        got = np.concatenate(pieces, axis=1)
        assert got.dtype == np.float16 and got.tobytes() == expected.tobytes(), cut


def test_source_rows_are_a_bounded_halo_around_the_scaled_rows():
    plan = RowResampling((100, 8, 8), (250, 8, 8), axis=None, order=1, do_separate_z=False, order_z=0)
    for r0 in range(0, 250, 7):
        lo, hi = plan.source_rows((r0, r0 + 5))
        assert hi - lo <= 4 and lo <= r0 * 100 // 250 + 1  # 5 output rows at 2.5x read at most 4 input rows


def test_spline_orders_are_refused_naming_the_order():
    with pytest.raises(UnsupportedModelError, match="order 3"):
        RowResampling((5, 5, 5), (7, 7, 7), axis=None, order=3, do_separate_z=False, order_z=0)
    with pytest.raises(UnsupportedModelError, match="order_z 1"):
        RowResampling((5, 5, 5), (7, 7, 11), axis=2, order=1, do_separate_z=True, order_z=1)
