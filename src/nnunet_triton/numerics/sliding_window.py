"""Sliding-window prediction with nnU-Net's exact dtype semantics (NumPy or CuPy).

Ports from ``nnunetv2/inference/predict_from_raw_data.py`` (class ``nnUNetPredictor``, v2.8.1):

- ``_internal_maybe_mirror_and_predict``: identity pass, then one pass per non-empty subset of the
  mirror axes in ``itertools.combinations`` order, summed in that order and divided by the count;
- ``_internal_predict_sliding_window_return_logits``: ``pred *= gaussian``,
  ``predicted_logits[sl] += pred`` and ``n_predictions[sl] += gaussian`` into float16 buffers in
  tile order, then ``predicted_logits /= n_predictions`` in float16 and a check for ``inf``;
- ``predict_sliding_window_return_logits``: pad to the patch, tile, crop the padding away;
- ``predict_logits_from_preprocessed_data``: fold results summed in float16 in fold order, ``/= n``.

The loop is split the way MONAI's ``inferers/splitter.py`` + ``merger.py`` split it, and its settings are
one value, :class:`~nnunet_triton.numerics.window.SlidingWindowSettings` (patch, heads, mirror axes, tile
step, Gaussian, batching, the merger), handed whole to both sides: a :class:`TileSplitter` pads the
volume, lays out nnU-Net's tiles and cuts (tile, mirror variant) items into network batches; a
:class:`TileMerger` un-flips each returned batch, averages a tile's variants once they are all back and
gives each finished tile, in tile order, to the fold's :class:`~nnunet_triton.numerics.window.Merger`
(default :class:`VolumeMerger`: whole-volume accumulation, :class:`LogitAccumulator`). The synchronous
:func:`predict_sliding_window` here and the orchestrator's asynchronous
``pipeline.orchestration.predict_fold_async`` (several batches in flight) are both this pair.

Array types: NumPy (the reference path of the tests and the GPU parity check), CuPy, or torch tensors on any
device (the orchestrator's path on CPU and GPU: the data stays where it is, and torch's own ``op=``
arithmetic is nnU-Net's, so CPU tensors give the same bits as the NumPy emulation below).

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
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError, NumericalError
from nnunet_triton.numerics._xp import is_torch_module, tensor_namespace
from nnunet_triton.numerics.gaussian import compute_gaussian
from nnunet_triton.numerics.tiling import pad_to_patch, tile_slicers
from nnunet_triton.numerics.window import Merger, MergerFactory, SlidingWindowSettings

__all__ = [
    "mirror_combinations",
    "average_tta",
    "average_folds",
    "FoldAverage",
    "LogitAccumulator",
    "TileItem",
    "plan_tile_batches",
    "extract_batch",
    "TileSplitter",
    "VolumeMerger",
    "TileMerger",
    "predict_sliding_window",
]

PredictBatch = Callable[[Any], Any]


def _torch_op(a: Any, b: Any, op: Callable[[Any, Any], Any], xp: ModuleType) -> Any:
    """``a op b`` computed in ``promote(a, b, float32)`` and rounded to ``a.dtype`` (torch's ``a op= b``).

    NumPy/CuPy only: torch tensors use torch's in-place operators themselves (see ``_sum_then_divide``).
    """
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
    xp = tensor_namespace(*predictions)
    for p in predictions[1:]:
        if p.shape != predictions[0].shape:
            raise InputValidationError(
                f"TTA predictions must share one shape, got {predictions[0].shape} and {p.shape}."
            )
    return _sum_then_divide(predictions, xp)


def _sum_then_divide(arrays: Sequence[Any], xp: ModuleType) -> Any:
    """``r = arrays[0]; r += a for the rest; r /= len(arrays)``, in ``arrays[0]``'s dtype (one array is
    returned as it is; the inputs are never modified)."""
    if len(arrays) == 1:
        return arrays[0]
    if is_torch_module(xp):  # nnU-Net's own in-place statements (no float32 temporaries)
        result = arrays[0].clone()
        for a in arrays[1:]:
            result += a
        result /= len(arrays)
        return result
    result = arrays[0]
    for a in arrays[1:]:
        result = _torch_op(result, a, operator.add, xp)
    return _torch_op(result, len(arrays), operator.truediv, xp)


def average_folds(fold_logits: Sequence[Any], *, divide_each_fold: bool = False) -> Any:
    """Mean of per-fold float16 logits: ``+=`` in fold order, then ``/= n`` (float16, as nnU-Net on CPU);
    ``divide_each_fold``: nnU-Net 2.0's ``/= n`` after every fold (:class:`FoldAverage`)."""
    if not fold_logits:
        raise InputValidationError("average_folds needs at least one fold's logits, got none.")
    if is_torch_module(tensor_namespace(*fold_logits)):  # FoldAverage sums into its first fold's buffer
        fold_logits = [fold_logits[0].clone(), *fold_logits[1:]]
    average = FoldAverage(len(fold_logits), divide_each_fold=divide_each_fold)
    for logits in fold_logits:
        average.add(logits)
    return average.finalize()


class FoldAverage:
    """``average_folds`` one fold at a time: nnU-Net's reduction (``predict_logits_from_preprocessed_data``)
    with only the running sum alive, so a fold's logits can be freed as soon as they are added.

    ``add`` takes the folds in averaging order; the first becomes the running float16 sum (a torch tensor
    is summed into in place: the caller hands it over), the others are added with torch's ``+=`` rule, and
    :meth:`finalize` divides by the number of folds (one fold is returned as it is, like nnU-Net). The bits
    are those of :func:`average_folds` over the same list. ``divide_each_fold`` reproduces nnU-Net 2.0,
    which divides the running sum by the number of folds after every fold (``numerics.releases``).
    """

    def __init__(self, num_folds: int, *, divide_each_fold: bool = False) -> None:
        if num_folds < 1:
            raise InputValidationError(f"FoldAverage needs at least one fold, got num_folds={num_folds}.")
        self.num_folds = int(num_folds)
        self.divide_each_fold = bool(divide_each_fold)  # nnU-Net 2.0 (numerics.releases)
        self.added = 0
        self._sum: Any = None

    def add(self, logits: Any) -> None:
        """Add the next fold's float16 logits ``(K, *spatial)`` (fold index :attr:`added`)."""
        if self.added >= self.num_folds:
            raise RuntimeError(f"FoldAverage.add called for fold index {self.added} of {self.num_folds}.")
        xp = tensor_namespace(logits)
        first = self._sum if self._sum is not None else logits
        if logits.dtype != xp.float16 or logits.shape != first.shape:
            raise InputValidationError(
                f"fold logits must all be float16 with shape {tuple(first.shape)}; fold index {self.added} "
                f"has {logits.dtype} {tuple(logits.shape)}."
            )
        if self._sum is None:
            self._sum = logits
        elif is_torch_module(xp):
            self._sum += logits
        else:
            self._sum = _torch_op(self._sum, logits, operator.add, xp)
        self.added += 1
        if self.divide_each_fold and self.num_folds > 1:  # 2.0: prediction /= n inside the fold loop
            self._sum = self._divided(self._sum)

    def finalize(self) -> Any:
        """The fold mean, float16 ``(K, *spatial)``, once every fold was added."""
        if self.added != self.num_folds:
            raise RuntimeError(f"FoldAverage.finalize after {self.added} of {self.num_folds} folds.")
        result, self._sum = self._sum, None
        if self.num_folds == 1 or self.divide_each_fold:
            return result
        return self._divided(result)

    def _divided(self, total: Any) -> Any:
        """``total /= num_folds`` with torch's float16 rule (in place for a torch tensor)."""
        if is_torch_module(tensor_namespace(total)):
            total /= self.num_folds
            return total
        return _torch_op(total, self.num_folds, operator.truediv, tensor_namespace(total))


class LogitAccumulator:
    """nnU-Net's float16 ``predicted_logits`` / ``n_predictions`` buffers for one fold.

    Call :meth:`add` once per tile in tile order, then :meth:`finalize` once. ``gaussian`` is an
    optional precomputed :func:`~nnunet_triton.numerics.gaussian.compute_gaussian` map (float16, patch shape)
    to share across folds and cases; ``use_gaussian=False`` weights every tile by 1 (nnU-Net's option).
    With ``xp=torch`` the buffers are ``like.new_zeros(...)`` (a torch tensor's type and device: the
    data's) and the updates are nnU-Net's in-place torch operations.
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
        like: Any = None,
        inf_is_error: bool = True,
    ) -> None:
        self._xp = xp
        self._inf_is_error = inf_is_error
        self._patch = tuple(int(p) for p in patch_size)
        shape = tuple(int(s) for s in padded_spatial_shape)
        if is_torch_module(xp):
            like = xp.empty(0) if like is None else like
            self._logits = like.new_zeros((int(num_heads), *shape), dtype=xp.float16)
            self._weights = like.new_zeros(shape, dtype=xp.float16)
        else:
            self._logits = xp.zeros((int(num_heads), *shape), dtype=xp.float16)
            self._weights = xp.zeros(shape, dtype=xp.float16)
        if use_gaussian and gaussian is None:
            gaussian = compute_gaussian(self._patch)
        if gaussian is not None:  # a map shared across requests (host or device), on the data's device
            torch_like = is_torch_module(xp)
            gaussian = xp.as_tensor(gaussian, device=like.device) if torch_like else xp.asarray(gaussian)
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
        weight = self._gaussian if self._gaussian is not None else 1
        if is_torch_module(xp):  # nnU-Net: pred *= gaussian; logits[sl] += pred; n[sl] += gaussian
            region += (tile_logits * self._gaussian) if self._gaussian is not None else tile_logits
            self._weights[tuple(slicer)] += weight
        else:
            pred = tile_logits
            with np.errstate(over="ignore"):  # fp16 overflow gives inf, reported by finalize (as nnU-Net)
                if self._gaussian is not None:
                    pred = _torch_op(pred, self._gaussian, operator.mul, xp)
                self._logits[index] = _torch_op(region, pred, operator.add, xp)
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
        if is_torch_module(xp):
            logits /= weights
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                for k in range(logits.shape[0]):  # per head: keeps the float32 temporaries small
                    logits[k] = _torch_op(logits[k], weights, operator.truediv, xp)
        if self._inf_is_error and bool(xp.isinf(logits).any()):
            raise NumericalError(
                "Encountered inf in the stitched float16 logits (nnU-Net aborts here too); the network "
                "output times the Gaussian overflowed float16."
            )
        if unpad_slicer is not None:
            logits = logits[(slice(None), *unpad_slicer)]
        return logits.contiguous() if is_torch_module(xp) else xp.ascontiguousarray(logits)


@dataclass(frozen=True)
class TileItem:
    """One network input: tile ``tile`` (index in nnU-Net's tile order) under mirror variant ``variant``
    (0 = identity, ``i`` = ``mirror_combinations(...)[i - 1]``)."""

    tile: int
    variant: int


def plan_tile_batches(n_tiles: int, n_variants: int, batch_size: int) -> list[tuple[TileItem, ...]]:
    """Cut all (tile, variant) items, tile-major, into consecutive batches of at most ``batch_size``.

    Tile-major order keeps a tile's variants together, so a tile is complete (and can be accumulated)
    as soon as the batch holding its last variant returns. The last batch may be smaller.
    """
    for name, value in (("n_tiles", n_tiles), ("n_variants", n_variants), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    items = [TileItem(t, v) for t in range(n_tiles) for v in range(n_variants)]
    return [tuple(items[i : i + batch_size]) for i in range(0, len(items), batch_size)]


def _flip_axes(combo: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a + 1 for a in combo)  # spatial axis -> axis of a (C, *P) tile


def _flip(array: Any, combo: tuple[int, ...], xp: ModuleType) -> Any:
    return xp.flip(array, _flip_axes(combo)) if combo else array


def extract_batch(
    padded: Any, slicers: Sequence[tuple[Any, ...]], variants: Sequence[tuple[int, ...]],
    batch: Sequence[TileItem],
) -> Any:
    """Stack the network inputs of ``batch``: tile ``padded[:, *slicer]`` flipped by its variant.

    ``variants[0]`` must be ``()`` (identity). Returns a C-contiguous float32 array ``(N, C, *P)`` of
    ``padded``'s type (and device).
    """
    xp = tensor_namespace(padded)
    tiles = [_flip(padded[(slice(None), *slicers[item.tile])], variants[item.variant], xp) for item in batch]
    if is_torch_module(xp):
        return xp.stack(tiles).to(xp.float32)  # stack makes a new contiguous tensor
    return xp.ascontiguousarray(xp.stack(tiles).astype(xp.float32, copy=False))


class TileSplitter:
    """The input side of one fold's sliding window: padding, nnU-Net's tiles, the mirror variants.

    Args:
        data: preprocessed case ``(C, *spatial)`` float32 (NumPy, CuPy or a torch tensor on any device).
        window: the settings; ``patch_size``, ``mirror_axes`` and ``tile_step_size`` are read here.

    Raises:
        InputValidationError: ``data`` is not ``(C, *spatial)`` for the patch size.
    """

    def __init__(self, data: Any, window: SlidingWindowSettings) -> None:
        patch = window.patch_size
        if data.ndim not in (len(patch) + 1, len(patch) + 2):
            raise InputValidationError(
                f"data shape {tuple(data.shape)} must be (C, *spatial) with {len(patch)} or {len(patch) + 1} "
                f"spatial axes for patch_size {patch}."
            )
        self.window = window
        self.xp = tensor_namespace(data)
        self.patch_size = patch
        self.padded, self.unpad = pad_to_patch(data, patch)
        self.slicers = tile_slicers(self.padded.shape[1:], patch, window.tile_step_size)
        self.variants: list[tuple[int, ...]] = [(), *mirror_combinations(window.mirror_axes)]

    def batches(self) -> list[tuple[TileItem, ...]]:
        """Every (tile, variant) item, tile-major, in batches of at most ``window.batch_size``."""
        return plan_tile_batches(len(self.slicers), len(self.variants), self.window.batch_size)

    def extract(self, batch: Sequence[TileItem]) -> Any:
        """The network input ``(N, C, *P)`` float32 of ``batch``."""
        return extract_batch(self.padded, self.slicers, self.variants, batch)


class VolumeMerger:
    """The default :class:`~nnunet_triton.numerics.window.Merger`: nnU-Net's whole-volume accumulation.

    One :class:`LogitAccumulator` over the padded volume (float16 ``predicted_logits`` / ``n_predictions``,
    allocated like ``splitter.padded``: same array type and device), the Gaussian map of ``window`` (its
    cached :attr:`~SlidingWindowSettings.gaussian` or one computed here), and at the end the float16
    division, the ``inf`` check and the crop to the unpadded volume.
    """

    def __init__(self, splitter: TileSplitter, window: SlidingWindowSettings) -> None:
        self._unpad = splitter.unpad
        self._accumulator = LogitAccumulator(
            window.num_heads, splitter.padded.shape[1:], window.patch_size, use_gaussian=window.use_gaussian,
            xp=splitter.xp, gaussian=window.gaussian_map() if window.use_gaussian else None,
            like=splitter.padded, inf_is_error=window.inf_is_error)

    def add(self, tile: int, slicer: tuple[Any, ...], logits: Any) -> None:
        self._accumulator.add(logits, slicer)

    def finalize(self) -> Any:
        """float16 logits ``(K, *spatial)`` of the unpadded volume (see :meth:`LogitAccumulator.finalize`)."""
        return self._accumulator.finalize(self._unpad)


class TileMerger:
    """The output side: un-flip, average a tile's variants (TTA), hand finished tiles to the fold's merger.

    Batches must be added in the order :meth:`TileSplitter.batches` gave them: tiles then complete in tile
    order, which nnU-Net's fp16 sums depend on, and each is given once to the
    :class:`~nnunet_triton.numerics.window.Merger` that ``window.merger`` makes (default
    :class:`VolumeMerger`); :meth:`finalize` returns that merger's result.
    """

    def __init__(self, splitter: TileSplitter, window: SlidingWindowSettings) -> None:
        self._splitter = splitter
        self.num_heads = window.num_heads
        factory: MergerFactory = window.merger if window.merger is not None else VolumeMerger
        self.merger: Merger = factory(splitter, window)
        self._pending: dict[int, list[Any]] = {}

    def expected_shape(self, batch: Sequence[TileItem]) -> tuple[int, ...]:
        """The shape the network must return for ``batch``: ``(N, K, *P)``."""
        return (len(batch), self.num_heads, *self._splitter.patch_size)

    def add(self, batch: Sequence[TileItem], output: Any) -> None:
        """Take the network output ``(N, K, *P)`` of ``batch``.

        Raises:
            InputValidationError: ``output`` does not have :meth:`expected_shape`.
        """
        if tuple(output.shape) != self.expected_shape(batch):
            raise InputValidationError(
                f"predict_batch returned shape {tuple(output.shape)}, expected {self.expected_shape(batch)}."
            )
        splitter = self._splitter
        for item, prediction in zip(batch, output, strict=True):
            variants = self._pending.setdefault(item.tile, [])
            variants.append(_flip(prediction, splitter.variants[item.variant], splitter.xp))
            if len(variants) == len(splitter.variants):
                tile_logits = average_tta(self._pending.pop(item.tile))
                self.merger.add(item.tile, splitter.slicers[item.tile], tile_logits)

    def finalize(self) -> Any:
        """The merger's result (:class:`VolumeMerger`: float16 logits ``(K, *spatial)``, unpadded)."""
        if self._pending:
            raise RuntimeError(f"TileMerger.finalize with tiles {sorted(self._pending)} still incomplete.")
        return self.merger.finalize()


def predict_sliding_window(data: Any, predict_batch: PredictBatch, window: SlidingWindowSettings) -> Any:
    """One fold's sliding-window logits, float16 ``(K, *data.shape[1:])`` (nnU-Net's per-fold loop).

    ``data`` is the preprocessed float32 volume ``(C, *spatial)``; ``predict_batch(x)`` maps
    ``(N, C, *patch)`` to ``(N, K, *patch)``. Tiles and their mirrored copies are sent in order,
    ``window.batch_size`` inputs per call (nnU-Net uses 1); batching does not change the arithmetic
    as long as ``predict_batch`` treats each sample independently. With a custom ``window.merger`` the
    result is that merger's.
    """
    if not isinstance(window, SlidingWindowSettings):
        raise InputValidationError(f"window must be a SlidingWindowSettings, got {type(window).__name__}.")
    splitter = TileSplitter(data, window)
    merger = TileMerger(splitter, window)
    for batch in splitter.batches():
        merger.add(batch, predict_batch(splitter.extract(batch)))
    return merger.finalize()
