"""A streaming :class:`~nnunet_triton.numerics.window.Merger`: one fold's logits in slabs of the first axis.

nnU-Net visits tiles with the first spatial axis outermost (``tiling.tile_slicers``), so the start of a
tile on that axis never decreases along the tile order. Once a tile starting at row ``z`` arrives, no
later tile touches a row before ``z``: those rows hold every weighted tile they will ever get, added in
tile order, and their float16 ``predicted_logits / n_predictions`` is final. :class:`SlabMerger` keeps
only a band of rows as wide as one tile on that axis (the whole-volume buffers of
``sliding_window.VolumeMerger`` shrink to ``W / Z`` of their size), divides each finished slab exactly as
``LogitAccumulator.finalize`` divides the whole volume, checks it for ``inf`` (padding rows included, as
nnU-Net checks the padded volume), crops it to the unpadded volume and hands it to a sink. Every voxel
sees the same float16 operations in the same order as in the whole-volume buffers, so the joined slabs
equal ``VolumeMerger``'s result bit for bit (``tests/unit/test_streaming_merger.py``).

A 2D configuration on 3D data (tiles ``(d, slice, slice)``) has bands one row wide.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from nnunet_triton.errors import InputValidationError, NumericalError
from nnunet_triton.numerics._xp import is_torch_module

if TYPE_CHECKING:
    from nnunet_triton.numerics.sliding_window import TileSplitter
    from nnunet_triton.numerics.window import MergerFactory, SlidingWindowSettings

__all__ = ["SlabMerger", "SlabSink", "slab_merger"]

SlabSink = Callable[[int, Any], None]
"""``sink(start, logits)``: float16 logits ``(K, n, *rest)`` of rows ``start .. start + n`` of the unpadded
volume's first spatial axis, called in row order, each row exactly once."""


def _rows(first: Any) -> tuple[int, int]:
    """The rows of the first spatial axis one tile's slicer entry covers: a slice, or one index (2D on 3D)."""
    if isinstance(first, slice):
        return int(first.start), int(first.stop)
    return int(first), int(first) + 1


def _copy(array: Any, xp: Any) -> Any:
    return array.clone() if is_torch_module(xp) else array.copy()


class SlabMerger:
    """nnU-Net's float16 accumulation over a moving band of rows; finished rows go to ``sink``.

    Without a sink the slabs are collected and :meth:`finalize` returns them joined: the whole-volume result
    (the streaming path with one consumer that keeps everything).

    Attributes:
        band_rows: rows of the first spatial axis held at once (the widest tile on that axis).
        peak_rows: the most rows that were ever waiting in the band (for tests and memory reports).
    """

    def __init__(self, splitter: TileSplitter, window: SlidingWindowSettings,
                 sink: SlabSink | None = None) -> None:
        from nnunet_triton.numerics.sliding_window import (
            _torch_op,  # one definition of torch's in-place rounding
        )

        self._op = _torch_op
        self._xp = xp = splitter.xp
        self._slabs: list[Any] | None = [] if sink is None else None
        self._sink = sink if sink is not None else self._collect
        padded = tuple(int(s) for s in splitter.padded.shape[1:])
        self._rows_total = padded[0]
        spans = [_rows(s[0]) for s in splitter.slicers]
        starts = [lo for lo, _ in spans]
        if any(b < a for a, b in zip(starts, starts[1:], strict=False)):
            raise InputValidationError(
                "SlabMerger needs tiles in nnU-Net's order (first spatial axis outermost).")
        self.band_rows = max(hi - lo for lo, hi in spans)
        self.peak_rows = 0
        unpad = splitter.unpad
        first = unpad[0]
        self._keep = (0 if first.start is None else int(first.start),
                      self._rows_total if first.stop is None else int(first.stop))
        self._rest_crop = tuple(unpad[1:])
        shape = (self.band_rows, *padded[1:])
        heads = window.num_heads
        if is_torch_module(xp):
            like = splitter.padded
            self._logits = like.new_zeros((heads, *shape), dtype=xp.float16)
            self._weights = like.new_zeros(shape, dtype=xp.float16)
        else:
            self._logits = xp.zeros((heads, *shape), dtype=xp.float16)
            self._weights = xp.zeros(shape, dtype=xp.float16)
        gaussian = window.gaussian_map() if window.use_gaussian else None
        if gaussian is not None:
            gaussian = xp.as_tensor(gaussian, device=splitter.padded.device) if is_torch_module(xp) \
                else xp.asarray(gaussian)
        self._gaussian = gaussian
        self._patch = tuple(window.patch_size)
        self._inf_is_error = window.inf_is_error
        self._base = 0  # padded row held in band row 0
        self._held = 0  # rows base .. base + held have received a tile
        self._done = False

    # -- the Merger protocol ----------------------------------------------------------------------------
    def add(self, tile: int, slicer: tuple[Any, ...], logits: Any) -> None:
        if self._done:
            raise RuntimeError("SlabMerger.add called after finalize.")
        lo, hi = _rows(slicer[0])
        if lo < self._base:
            raise InputValidationError(
                f"tile {tile} starts at row {lo}, before the band at row {self._base}: tiles must come in "
                "nnU-Net's order.")
        if lo > self._base:
            self._emit(lo - self._base)
        self._held = max(self._held, hi - self._base)
        self.peak_rows = max(self.peak_rows, self._held)
        first = slice(lo - self._base, hi - self._base) if isinstance(slicer[0], slice) else lo - self._base
        local = (first, *slicer[1:])
        expected = (self._logits.shape[0], *self._patch)
        if tuple(logits.shape) != expected:
            raise InputValidationError(f"tile logits must have shape {expected}, got {tuple(logits.shape)}.")
        xp, index = self._xp, (slice(None), *local)
        weight = self._gaussian if self._gaussian is not None else 1
        if is_torch_module(xp):  # LogitAccumulator.add's torch branch, on the band
            region = self._logits[index]
            region += (logits * self._gaussian) if self._gaussian is not None else logits
            self._weights[local] += weight
        else:
            pred = logits
            with np.errstate(over="ignore"):
                if self._gaussian is not None:
                    pred = self._op(pred, self._gaussian, operator.mul, xp)
                self._logits[index] = self._op(self._logits[index], pred, operator.add, xp)
            self._weights[local] = self._op(self._weights[local], weight, operator.add, xp)

    def finalize(self) -> Any:
        """Hand on the rows still in the band; return the joined slabs (no sink) or ``None``."""
        if self._done:
            raise RuntimeError("SlabMerger.finalize called twice.")
        self._emit(self._rows_total - self._base)
        self._done = True
        self._logits = self._weights = None
        if self._slabs is None:
            return None
        xp, slabs = self._xp, self._slabs
        self._slabs = []
        joined = xp.cat(slabs, dim=1) if is_torch_module(xp) else xp.concatenate(slabs, axis=1)
        return joined.contiguous() if is_torch_module(xp) else xp.ascontiguousarray(joined)

    # -- internals ---------------------------------------------------------------------------------------
    def _emit(self, n: int) -> None:
        """Finish band rows ``0 .. n`` (padded rows ``base .. base + n``), pass their kept part on, shift."""
        xp = self._xp
        if n > self.band_rows:
            raise RuntimeError(f"SlabMerger: {n} rows to finish exceed the band of {self.band_rows} rows "
                               "(a gap between tiles).")
        n_band = n
        logits = _copy(self._logits[:, :n_band], xp)
        weights = self._weights[:n_band]
        if is_torch_module(xp):
            logits /= weights
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                for k in range(logits.shape[0]):
                    logits[k] = self._op(logits[k], weights, operator.truediv, xp)
        if self._inf_is_error and bool(xp.isinf(logits).any()):
            raise NumericalError(
                "Encountered inf in the stitched float16 logits (nnU-Net aborts here too); the network "
                "output times the Gaussian overflowed float16."
            )
        start, stop = max(self._base, self._keep[0]), min(self._base + n_band, self._keep[1])
        if stop > start:
            slab = logits[(slice(None), slice(start - self._base, stop - self._base), *self._rest_crop)]
            slab = slab.contiguous() if is_torch_module(xp) else xp.ascontiguousarray(slab)
            self._sink(start - self._keep[0], slab)
        # shift the band: rows n .. W move to the front, the freed tail is zeroed
        keep = self.band_rows - n_band
        if keep > 0:
            self._logits[:, :keep] = _copy(self._logits[:, n_band:], xp)  # source and target overlap
            self._weights[:keep] = _copy(self._weights[n_band:], xp)
        self._logits[:, keep:] = 0
        self._weights[keep:] = 0
        self._base += n
        self._held = max(0, self._held - n)

    def _collect(self, start: int, slab: Any) -> None:
        assert self._slabs is not None
        self._slabs.append(slab)


def slab_merger(sink: SlabSink | None = None) -> MergerFactory:
    """A :data:`~nnunet_triton.numerics.window.MergerFactory` of :class:`SlabMerger` s that hand slabs to
    ``sink`` (``None``: each fold's merger collects and returns its whole result)."""

    def factory(splitter: TileSplitter, window: SlidingWindowSettings) -> SlabMerger:
        return SlabMerger(splitter, window, sink)

    return factory


class FoldSlabAverage:
    """The fold mean of streamed slabs: rows go on once every fold has given them, summed in fold order.

    Each fold's :class:`SlabMerger` hands its slabs (in row order) to :meth:`sink` ``(fold)``; as soon as all
    folds have covered a row range, its mean (float16 ``+=`` in fold order, then ``/ n``: the arithmetic of
    ``sliding_window.average_folds``, per voxel) goes to ``sink(start, logits)``. Only rows some fold has
    given and another has not yet are held (:attr:`peak_pending_rows`): folds that advance together hold
    little, a fold run to the end before the next holds its whole result.
    """

    def __init__(self, num_folds: int, sink: SlabSink, *, divide_each_fold: bool = False) -> None:
        if num_folds < 1:
            raise InputValidationError(f"FoldSlabAverage needs at least one fold, got {num_folds}.")
        self._n = int(num_folds)
        self._divide_each_fold = bool(divide_each_fold)  # nnU-Net 2.0's fold fusion (numerics.releases)
        self._sink = sink
        self._pending: list[Any] = [None] * self._n  # rows [done, done + len) per fold
        self._done = 0
        self.peak_pending_rows = 0

    def sink(self, fold: int) -> SlabSink:
        """The ``sink`` for fold ``fold``'s merger."""
        if not 0 <= fold < self._n:
            raise InputValidationError(f"fold index must be in 0..{self._n - 1}, got {fold}.")

        def take(start: int, slab: Any) -> None:
            self._take(fold, start, slab)

        return take

    def _take(self, fold: int, start: int, slab: Any) -> None:
        from nnunet_triton.numerics._xp import tensor_namespace
        from nnunet_triton.numerics.sliding_window import average_folds

        xp = tensor_namespace(slab)
        held = self._pending[fold]
        expected = self._done + (0 if held is None else int(held.shape[1]))
        if start != expected:
            raise InputValidationError(f"fold {fold} slab starts at row {start}, expected row {expected}.")
        if held is None:
            self._pending[fold] = slab
        else:
            self._pending[fold] = xp.cat([held, slab], dim=1) if is_torch_module(xp) else \
                xp.concatenate([held, slab], axis=1)
        rows = [0 if p is None else int(p.shape[1]) for p in self._pending]
        self.peak_pending_rows = max(self.peak_pending_rows, sum(rows))
        ready = min(rows)
        if ready == 0:
            return
        parts = [p[:, :ready] for p in self._pending]
        self._pending = [None if int(p.shape[1]) == ready else p[:, ready:] for p in self._pending]
        start_row, self._done = self._done, self._done + ready
        self._sink(start_row, average_folds(parts, divide_each_fold=self._divide_each_fold))
