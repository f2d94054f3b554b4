"""nnU-Net's export resampling of logits, one range of output rows at a time, bit for bit.

The export resamples the fold-averaged logits with ``resample_data_or_seg`` (``resampling.py``), whose
interpolation is ``scipy.ndimage.zoom(..., order, mode='nearest', grid_mode=True)`` per channel (per slice
in-plane plus an order-0 gather along the anisotropic axis for separate z). For orders 0 and 1 each output
voxel reads a fixed neighbourhood of input voxels, so a range of output rows of the first axis needs only a
bounded range of input rows (:func:`source_rows`): the whole logits never have to exist at once.

:func:`zoom_rows` recomputes SciPy's zoom for a range of output rows with SciPy's own arithmetic (read
from ``ni_interpolation.c``, checked bitwise against ``ndimage.zoom`` in ``test_slab_resampling.py``):
per axis the coordinate ``cc = (k + 0.5) * (in / out) - 0.5`` in float64, ``start = floor(cc)`` (order 0:
``floor(cc + 0.5)``), weights ``w0 = 1 - (cc - start)`` and ``w1 = 1 - w0``, input indices clamped to the axis
(``mode='nearest'``), and per output voxel ``t = 0``, ``t += v * w_axis0 * w_axis1 * ...`` over the corners
with the last axis varying fastest.

``skimage``'s ``resize`` (nnU-Net's ``resize``) then clips to the input's minimum and maximum. That clip is
left out here, and it changes nothing: an order-0 or order-1 value is a convex combination of input values
computed in float64, so it lies within a few float64 ulps of the range of its own corners, which lies within
the input's range; rounded to the logits' float16 (or float32) dtype, as ``resample_data_or_seg`` stores it,
such a value becomes the corner value it is next to, exactly what the clip would have given.

Orders above 1 run a spline prefilter along whole axes and cannot be cut into row ranges exactly; they are
refused here (:func:`check_streamable`) and keep the whole-volume path.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from nnunet_triton.errors import UnsupportedModelError
from nnunet_triton.numerics._xp import get_array_module

__all__ = ["RowResampling", "check_streamable", "source_rows", "zoom_rows"]


def _coordinates(in_len: int, out_len: int, rows: tuple[int, int]) -> np.ndarray:
    zoom = np.divide(np.float64(in_len), np.float64(out_len))
    k = np.arange(rows[0], rows[1], dtype=np.float64)
    return ((k + 0.5) * zoom) - 0.5


def _axis_table(in_len: int, out_len: int, rows: tuple[int, int], order: int
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Input indices (clamped) and weights along one axis for output ``rows``: ``order + 1`` of each."""
    cc = _coordinates(in_len, out_len, rows)
    if order == 0:
        start = np.floor(cc + 0.5).astype(np.int64)
        return [np.clip(start, 0, in_len - 1)], []
    start_f = np.floor(cc)
    w0 = 1.0 - (cc - start_f)
    w1 = 1.0 - w0
    start = start_f.astype(np.int64)
    return [np.clip(start, 0, in_len - 1), np.clip(start + 1, 0, in_len - 1)], [w0, w1]


def source_rows(in_len: int, out_len: int, rows: tuple[int, int], order: int) -> tuple[int, int]:
    """The input rows ``[lo, hi)`` that output rows ``rows`` of an order-``order`` zoom read."""
    if rows[1] <= rows[0]:
        return (0, 0)
    indices, _ = _axis_table(in_len, out_len, rows, order)
    return int(min(i.min() for i in indices)), int(max(i.max() for i in indices)) + 1


def zoom_rows(block: Any, first_row: int, in_len: int, new_shape: Sequence[int], rows: tuple[int, int],
              order: int) -> Any:
    """``ndimage.zoom(image, new_shape / shape, order, mode='nearest', grid_mode=True)[r0:r1]``, float64.

    ``block`` holds input rows ``first_row .. first_row + len(block)`` of ``image`` (whose first axis has
    ``in_len`` rows; the other axes are whole) and must cover :func:`source_rows` of ``rows``.
    """
    xp = get_array_module(block)
    new_shape = tuple(int(s) for s in new_shape)
    nd = block.ndim
    tables = [_axis_table(in_len, new_shape[0], rows, order)]
    tables += [_axis_table(int(block.shape[d]), new_shape[d], (0, new_shape[d]), order) for d in range(1, nd)]
    lo, hi = source_rows(in_len, new_shape[0], rows, order)
    if lo < first_row or hi > first_row + block.shape[0]:
        raise ValueError(f"zoom_rows: output rows {rows} read input rows [{lo}, {hi}), the block holds "
                         f"[{first_row}, {first_row + block.shape[0]}).")

    indices = [[xp.asarray(i - (first_row if d == 0 else 0)) for i in tables[d][0]] for d in range(nd)]
    weights = [[xp.asarray(w.reshape([-1 if e == d else 1 for e in range(nd)])) for w in tables[d][1]]
               for d in range(nd)]
    # The corners in SciPy's order (last axis fastest), each gathered by one take per axis; a corner shares
    # the gathers of its first axes with the corner before it, so only the changed axes are gathered again.
    prefix: list[Any] = [None] * nd
    previous: tuple[int, ...] | None = None
    total = None
    for corner in itertools.product(range(order + 1), repeat=nd):
        first_changed = 0 if previous is None else next(d for d in range(nd) if corner[d] != previous[d])
        for d in range(first_changed, nd):
            source = block if d == 0 else prefix[d - 1]
            prefix[d] = xp.take(source, indices[d][corner[d]], axis=d)
        previous = corner
        value = prefix[nd - 1].astype(xp.float64, copy=True)
        for d, c in enumerate(corner):
            if order > 0:
                value *= weights[d][c]  # in place: the same bits as value * w
        if total is None:
            value += 0.0  # C: t = 0.0; t += coeff (turns -0.0 into 0.0)
            total = value
        else:
            total += value
    return total


def check_streamable(order: int, order_z: int) -> None:
    """Refuse interpolation orders whose prefilter spans whole axes (no exact row ranges)."""
    if order not in (0, 1) or order_z not in (0,):
        raise UnsupportedModelError(
            f"export resampling with order {order} and order_z {order_z} cannot be computed in row ranges "
            "exactly (only order 0 or 1 with order_z 0: spline prefilters span whole axes); it runs on the "
            "whole volume.")


class RowResampling:
    """``resample_data_or_seg(data, new_shape, is_seg=False, axis, order, do_separate_z, order_z)`` by rows.

    Attributes:
        in_shape: spatial shape of the data (logits) being resampled.
        new_shape: spatial shape of the result.
        identity: ``True`` when the shapes are equal (nnU-Net returns the data itself).
    """

    def __init__(self, in_shape: Sequence[int], new_shape: Sequence[int], *, axis: int | None, order: int,
                 do_separate_z: bool, order_z: int) -> None:
        self.in_shape = tuple(int(s) for s in in_shape)
        self.new_shape = tuple(int(s) for s in new_shape)
        if len(self.in_shape) != len(self.new_shape):
            raise ValueError(f"RowResampling: {self.in_shape} and {self.new_shape} differ in rank.")
        self.identity = self.in_shape == self.new_shape
        self.separate_z = bool(do_separate_z) and not self.identity
        if self.separate_z and axis is None:
            raise ValueError("RowResampling: separate z needs the anisotropic axis, got axis=None.")
        self.axis = axis
        self.order, self.order_z = int(order), int(order_z)
        if not self.identity:
            check_streamable(self.order, self.order_z if self.separate_z else 0)

    def source_rows(self, rows: tuple[int, int]) -> tuple[int, int]:
        """Input rows of the first axis that output ``rows`` read."""
        if self.identity:
            return rows
        if self.separate_z and self.axis == 0:  # in-plane per slice; order-0 gather along the rows
            if self.in_shape[0] == self.new_shape[0]:
                return rows
            return source_rows(self.in_shape[0], self.new_shape[0], rows, 0)
        return source_rows(self.in_shape[0], self.new_shape[0], rows, self.order)

    def rows(self, block: Any, first_row: int, rows: tuple[int, int]) -> Any:
        """Output rows ``rows`` of every channel, in ``block``'s dtype; ``block`` is ``(C, n, ...)`` holding
        input rows ``first_row .. first_row + n``."""
        xp = get_array_module(block)
        if self.identity:
            return block[:, rows[0] - first_row:rows[1] - first_row]
        out = xp.zeros((block.shape[0], rows[1] - rows[0], *self.new_shape[1:]), dtype=block.dtype)
        for c in range(block.shape[0]):
            channel = block[c].astype(xp.float64, copy=False)
            out[c] = self._channel(channel, first_row, rows)
        return out

    def _channel(self, channel: Any, first_row: int, rows: tuple[int, int]) -> Any:
        xp = get_array_module(channel)
        if not self.separate_z:
            return zoom_rows(channel, first_row, self.in_shape[0], self.new_shape, rows, self.order)
        axis = self.axis
        assert axis is not None
        if axis == 0:
            if self.in_shape[0] == self.new_shape[0]:
                slices = np.arange(rows[0], rows[1])
            else:
                (slices,), _ = _axis_table(self.in_shape[0], self.new_shape[0], rows, 0)
            plane = self.new_shape[1:]
            out = xp.zeros((len(slices), *plane), dtype=xp.float64)
            for i, s in enumerate(slices.tolist()):
                sl = channel[s - first_row]
                out[i] = zoom_rows(sl, 0, sl.shape[0], plane, (0, plane[0]), self.order)
            return out
        # the anisotropic axis is another one: per slice along it, in-plane rows of axis 0, then a gather
        in_plane = tuple(s for d, s in enumerate(self.new_shape) if d != axis)
        n_slices = channel.shape[axis]
        tmp = [rows[1] - rows[0], *self.new_shape[1:]]
        tmp[axis] = n_slices
        reshaped = xp.zeros(tmp, dtype=xp.float64)
        for s in range(n_slices):
            index = (slice(None),) * axis + (s,)
            reshaped[index] = zoom_rows(channel[index], first_row, self.in_shape[0], in_plane, rows,
                                        self.order)
        if n_slices == self.new_shape[axis]:
            return reshaped
        (gather,), _ = _axis_table(n_slices, self.new_shape[axis], (0, self.new_shape[axis]), 0)
        return xp.take(reshaped, xp.asarray(gather), axis=axis)
