"""Sliding-window prediction with nnU-Net's exact dtype semantics (NumPy or CuPy).

Ports from ``nnunetv2/inference/predict_from_raw_data.py`` (class ``nnUNetPredictor``, v2.8.1):

- ``_internal_maybe_mirror_and_predict``: identity pass, then one pass per non-empty subset of the
  mirror axes in ``itertools.combinations`` order, summed in that order and divided by the count;
- ``_internal_predict_sliding_window_return_logits``: ``pred *= gaussian``,
  ``predicted_logits[sl] += pred`` and ``n_predictions[sl] += gaussian`` into float16 buffers in
  tile order, then ``predicted_logits /= n_predictions`` in float16 and a check for ``inf``;
- ``predict_sliding_window_return_logits``: pad to the patch, tile, crop the padding away;
- ``predict_logits_from_preprocessed_data``: fold results summed in float16 in fold order, ``/= n``.

Dtype rule (what torch does for ``a op= b`` on CPU and CUDA): the operation is computed in
``promote(a.dtype, b.dtype, float32)`` and the result is rounded to ``a.dtype``. So float32 network
output times the float16 Gaussian stays float32, and adding it to the float16 buffer is a float32
add rounded to float16 (a double rounding that differs from a correctly rounded fp16 sum). With
float16 network output (CUDA autocast) the same rule gives nnU-Net's fp16 TTA mean and products.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from nnunet_triton._xp import get_array_module
from nnunet_triton.errors import InputValidationError, NumericalError
from nnunet_triton.gaussian import compute_gaussian
from nnunet_triton.tiling import pad_to_patch, tile_slicers

__all__ = [
    "mirror_combinations",
    "average_tta",
    "average_folds",
    "LogitAccumulator",
    "predict_sliding_window",
]

PredictBatch = Callable[[Any], Any]


def _torch_op(a: Any, b: Any, op: Callable[[Any, Any], Any], xp: ModuleType) -> Any:
    """``a op b`` computed in ``promote(a, b, float32)`` and rounded to ``a.dtype`` (torch's ``a op= b``)."""
    b_dtype = b.dtype if hasattr(b, "dtype") else xp.float32
    compute = xp.promote_types(xp.promote_types(a.dtype, b_dtype), xp.float32)
    b_c = b.astype(compute, copy=False) if hasattr(b, "astype") else compute.type(b)
    return op(a.astype(compute, copy=False), b_c).astype(a.dtype, copy=False)


def mirror_combinations(mirror_axes: Sequence[int] | None) -> list[tuple[int, ...]]:
    """Non-empty subsets of ``mirror_axes`` (spatial axes, 0-based) in nnU-Net's TTA order.

    3D ``(0, 1, 2)`` gives ``(0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)``; ``None`` gives ``[]``.
    """
    if mirror_axes is None:
        return []
    axes = tuple(int(a) for a in mirror_axes)
    if any(a < 0 for a in axes):
        raise InputValidationError(f"mirror_axes must be non-negative spatial axes, got {axes}.")
    return [c for i in range(len(axes)) for c in itertools.combinations(axes, i + 1)]


def average_tta(predictions: Sequence[Any]) -> Any:
    """Mean of the un-flipped TTA outputs, summed in list order like ``_internal_maybe_mirror_and_predict``.

    ``predictions[0]`` is the identity pass. The sum and the division by ``len(predictions)`` keep
    the first prediction's dtype (float32 on CPU, float16 under CUDA autocast).
    """
    if not predictions:
        raise InputValidationError("average_tta needs at least one prediction, got none.")
    xp = get_array_module(*predictions)
    result = predictions[0]
    for p in predictions[1:]:
        if p.shape != result.shape:
            raise InputValidationError(
                f"TTA predictions must share one shape, got {result.shape} and {p.shape}."
            )
        result = _torch_op(result, p, operator.add, xp)
    if len(predictions) > 1:
        result = _torch_op(result, len(predictions), operator.truediv, xp)
    return result


def average_folds(fold_logits: Sequence[Any]) -> Any:
    """Mean of per-fold float16 logits: ``+=`` in fold order, then ``/= n`` (float16, as nnU-Net on CPU)."""
    if not fold_logits:
        raise InputValidationError("average_folds needs at least one fold's logits, got none.")
    xp = get_array_module(*fold_logits)
    for k, f in enumerate(fold_logits):
        if f.dtype != xp.float16 or f.shape != fold_logits[0].shape:
            raise InputValidationError(
                f"fold logits must all be float16 with shape {tuple(fold_logits[0].shape)}; fold index {k} "
                f"has {f.dtype} {tuple(f.shape)}."
            )
    result = fold_logits[0].copy()
    for f in fold_logits[1:]:
        result = _torch_op(result, f, operator.add, xp)
    if len(fold_logits) > 1:
        result = _torch_op(result, len(fold_logits), operator.truediv, xp)
    return result


class LogitAccumulator:
    """nnU-Net's float16 ``predicted_logits`` / ``n_predictions`` buffers for one fold.

    Call :meth:`add` once per tile in tile order, then :meth:`finalize` once. ``gaussian`` is an
    optional precomputed :func:`~nnunet_triton.gaussian.compute_gaussian` map (float16, patch shape)
    to share across folds and cases; ``use_gaussian=False`` weights every tile by 1 (nnU-Net's option).
    """

    def __init__(
        self,
        num_heads: int,
        padded_spatial_shape: Sequence[int],
        patch_size: Sequence[int],
        *,
        use_gaussian: bool = True,
        xp: ModuleType = np,
        gaussian: Any | None = None,
    ) -> None:
        self._xp = xp
        self._patch = tuple(int(p) for p in patch_size)
        shape = tuple(int(s) for s in padded_spatial_shape)
        self._logits = xp.zeros((int(num_heads), *shape), dtype=xp.float16)
        self._weights = xp.zeros(shape, dtype=xp.float16)
        if use_gaussian and gaussian is None:
            gaussian = compute_gaussian(self._patch, xp=xp)
        if gaussian is not None and (tuple(gaussian.shape) != self._patch or gaussian.dtype != xp.float16):
            raise InputValidationError(
                f"gaussian must be float16 with shape patch_size {self._patch}, "
                f"got {gaussian.dtype} {tuple(gaussian.shape)}."
            )
        self._gaussian = gaussian if use_gaussian else None
        self._finalized = False
        self.num_tiles = 0

    def add(self, tile_logits: Any, slicer: Sequence[Any]) -> None:
        """Weight one tile's (TTA-averaged) logits ``(K, *patch)`` and add them at spatial ``slicer``."""
        if self._finalized:
            raise RuntimeError("LogitAccumulator.add called after finalize.")
        expected = (self._logits.shape[0], *self._patch)
        if tuple(tile_logits.shape) != expected:
            raise InputValidationError(
                f"tile logits must have shape {expected}, got {tuple(tile_logits.shape)}."
            )
        xp = self._xp
        index = (slice(None), *slicer)
        region = self._logits[index]
        if tuple(region.shape) != expected:
            raise InputValidationError(
                f"slicer {tuple(slicer)} selects {tuple(region.shape)}, expected {expected}."
            )
        pred = tile_logits
        with np.errstate(over="ignore"):  # fp16 overflow gives inf, reported by finalize (as nnU-Net)
            if self._gaussian is not None:
                pred = _torch_op(pred, self._gaussian, operator.mul, xp)
            self._logits[index] = _torch_op(region, pred, operator.add, xp)
        weight = self._gaussian if self._gaussian is not None else 1
        self._weights[tuple(slicer)] = _torch_op(self._weights[tuple(slicer)], weight, operator.add, xp)
        self.num_tiles += 1

    def finalize(self, unpad_slicer: Sequence[slice] | None = None) -> Any:
        """Divide by the summed weights in float16, check for ``inf``, crop to ``unpad_slicer``."""
        if self._finalized:
            raise RuntimeError("LogitAccumulator.finalize called twice.")
        self._finalized = True
        xp = self._xp
        logits, weights = self._logits, self._weights
        self._logits = self._weights = None
        with np.errstate(divide="ignore", invalid="ignore"):
            for k in range(logits.shape[0]):  # per head: keeps the float32 temporaries small
                logits[k] = _torch_op(logits[k], weights, operator.truediv, xp)
        if bool(xp.isinf(logits).any()):
            raise NumericalError(
                "Encountered inf in the stitched float16 logits (nnU-Net aborts here too); the network "
                "output times the Gaussian overflowed float16."
            )
        if unpad_slicer is not None:
            logits = logits[(slice(None), *unpad_slicer)]
        return xp.ascontiguousarray(logits)


def predict_sliding_window(
    data: Any,
    predict_batch: PredictBatch,
    *,
    patch_size: Sequence[int],
    num_heads: int,
    mirror_axes: Sequence[int] | None,
    tile_step_size: float = 0.5,
    batch_size: int = 1,
    use_gaussian: bool = True,
) -> Any:
    """One fold's sliding-window logits, float16 ``(K, *data.shape[1:])`` (nnU-Net's per-fold loop).

    ``data`` is the preprocessed float32 volume ``(C, *spatial)``; ``predict_batch(x)`` maps
    ``(N, C, *patch)`` to ``(N, K, *patch)``. Tiles and their mirrored copies are sent in order,
    ``batch_size`` inputs per call (nnU-Net uses 1); batching does not change the arithmetic
    as long as ``predict_batch`` treats each sample independently.
    """
    patch = tuple(int(p) for p in patch_size)
    if data.ndim not in (len(patch) + 1, len(patch) + 2):
        raise InputValidationError(
            f"data shape {tuple(data.shape)} must be (C, *spatial) with {len(patch)} or {len(patch) + 1} "
            f"spatial axes for patch_size {patch}."
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputValidationError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    combos = mirror_combinations(mirror_axes)
    if combos and max(max(c) for c in combos) >= len(patch):
        raise InputValidationError(
            f"mirror_axes {tuple(mirror_axes)} out of range for a {len(patch)}D patch."
        )
    xp = get_array_module(data)
    padded, unpad = pad_to_patch(data, patch)
    slicers = tile_slicers(padded.shape[1:], patch, tile_step_size)
    acc = LogitAccumulator(num_heads, padded.shape[1:], patch, use_gaussian=use_gaussian, xp=xp)
    variants: list[tuple[int, ...]] = [(), *combos]
    pending: list[Any] = []

    def run(batch: list[tuple[int, tuple[int, ...], Any]]) -> None:
        out = predict_batch(xp.stack([x for _, _, x in batch]))
        expected = (len(batch), int(num_heads), *patch)
        if tuple(out.shape) != expected:
            raise InputValidationError(
                f"predict_batch returned shape {tuple(out.shape)}, expected {expected}."
            )
        for i, (tile, axes, _) in enumerate(batch):
            pending.append(xp.flip(out[i], axis=tuple(a + 1 for a in axes)) if axes else out[i])
            if len(pending) == len(variants):
                acc.add(average_tta(pending), slicers[tile])
                pending.clear()

    batch: list[tuple[int, tuple[int, ...], Any]] = []
    for t, sl in enumerate(slicers):
        tile = padded[(slice(None), *sl)]
        for axes in variants:
            batch.append((t, axes, xp.flip(tile, axis=tuple(a + 1 for a in axes)) if axes else tile))
            if len(batch) == batch_size:
                run(batch)
                batch = []
    if batch:
        run(batch)
    return acc.finalize(unpad)
