"""What the BLS orchestrator does per request, without Triton: options, batching plan, per-fold loop.

The orchestrator ``model.py`` only moves tensors; this module holds the logic so it can be tested on
plain arrays with a fake network:

- :func:`parse_request_options` reads the per-request options. They travel as Triton *request
  parameters*: Triton 2.51 ensembles forward a request's parameters unchanged to every composing
  model (checked on the embedded server over HTTP and gRPC), so the client sets them once on the
  ``nnunet`` endpoint and preprocess, orchestrator and stitch all see them.
- :func:`plan_tile_batches` cuts (tile, mirror variant) work items into fold-model batches.
- :func:`predict_fold_async` runs nnU-Net's sliding window for one fold
  (``nnUNetPredictor.predict_sliding_window_return_logits`` and ``_internal_maybe_mirror_and_predict``,
  nnunetv2/inference/predict_from_raw_data.py) with an injected ``infer_batch`` coroutine, several
  batches in flight, and Gaussian accumulation in nnU-Net's tile order (fp16 sums are order-dependent).
- :func:`predict_folds_async` runs all folds concurrently and averages their logits in fold order
  (``predict_logits_from_preprocessed_data``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nnunet_triton._xp import get_array_module
from nnunet_triton.errors import InputValidationError, SubmodelError
from nnunet_triton.plans import InferenceConfig
from nnunet_triton.sliding_window import LogitAccumulator, average_folds, average_tta, mirror_combinations
from nnunet_triton.tiling import pad_to_patch, tile_slicers, validate_tile_step_size

__all__ = [
    "OPTION_MIRRORING",
    "OPTION_TILE_STEP_SIZE",
    "OPTION_FOLDS",
    "OPTION_PROBABILITIES",
    "OPTION_POSTPROCESSING",
    "DEFAULT_TILE_STEP_SIZE",
    "RequestOptions",
    "parse_request_options",
    "parse_fold_ids",
    "TileItem",
    "plan_tile_batches",
    "extract_batch",
    "predict_fold_async",
    "predict_folds_async",
    "gather_or_cancel",
]

LOGGER = logging.getLogger(__name__)

# Request parameter names (the public per-request options of the ``nnunet`` endpoint).
OPTION_MIRRORING = "mirroring"  # bool, default True (nnU-Net's use_mirroring)
OPTION_TILE_STEP_SIZE = "tile_step_size"  # float in (0, 1], default 0.5
OPTION_FOLDS = "folds"  # "0,1" / "all" / 0: subset of the deployed folds, averaged in the given order
OPTION_PROBABILITIES = "probabilities"  # bool, default False: stitch_model also returns PROBABILITIES
OPTION_POSTPROCESSING = "postprocessing"  # bool, default True: apply the deployed postprocessing.pkl (if any)
KNOWN_OPTIONS = (OPTION_MIRRORING, OPTION_TILE_STEP_SIZE, OPTION_FOLDS, OPTION_PROBABILITIES,
                 OPTION_POSTPROCESSING)
DEFAULT_TILE_STEP_SIZE = 0.5

Fold = int | str
InferBatch = Callable[[Any], Awaitable[Any]]


@dataclass(frozen=True)
class RequestOptions:
    """Per-request options after validation.

    Attributes:
        mirroring: test-time mirroring over the checkpoint's allowed axes (no-op if there are none).
        tile_step_size: sliding-window step as a fraction of the patch size, in (0, 1].
        folds: fold ids to run, in averaging order (a subset of the deployed folds).
        probabilities: return PROBABILITIES (softmax/sigmoid, float32) next to SEGMENTATION.
        postprocessing: apply the repository's postprocessing (nnU-Net's ``postprocessing.pkl``) to
            SEGMENTATION; no effect when none was deployed. PROBABILITIES are never postprocessed (as in
            nnU-Net).
    """

    mirroring: bool
    tile_step_size: float
    folds: tuple[Fold, ...]
    probabilities: bool
    postprocessing: bool = True


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InputValidationError(
        f"request parameter {name!r} must be a boolean (true/false), got {value!r}."
    )


def _fold_id(token: Any) -> Fold:
    if isinstance(token, bool):
        raise ValueError(token)
    if isinstance(token, int):
        return token
    text = str(token).strip()
    if text.isdigit():
        return int(text)
    if text == "all":
        return text
    raise ValueError(token)


def parse_fold_ids(value: Any, available: Sequence[Fold], *, name: str = OPTION_FOLDS) -> tuple[Fold, ...]:
    """Parse a fold selection (``"0,1"``, ``"all"``, ``1`` or a sequence) against the deployed folds.

    Raises:
        InputValidationError: empty, malformed, duplicate or not-deployed folds.
    """
    tokens = value.split(",") if isinstance(value, str) else (
        list(value) if isinstance(value, list | tuple) else [value]
    )
    try:
        folds = tuple(_fold_id(t) for t in tokens)
    except ValueError:
        raise InputValidationError(
            f"request parameter {name!r} must be a comma-separated list of fold ids (e.g. \"0,1\"), "
            f"got {value!r}."
        ) from None
    if not folds:
        raise InputValidationError(f"request parameter {name!r} must name at least one fold, got {value!r}.")
    duplicates = sorted({str(f) for f in folds if folds.count(f) > 1})
    if duplicates:
        raise InputValidationError(
            f"request parameter {name!r} lists folds {duplicates} twice, got {value!r}."
        )
    missing = [f for f in folds if f not in tuple(available)]
    if missing:
        raise InputValidationError(
            f"request parameter {name!r}: folds {missing} are not deployed (available: {list(available)}), "
            f"got {value!r}."
        )
    return folds


def parse_request_options(params: Mapping[str, Any], config: InferenceConfig) -> RequestOptions:
    """Validate the request parameters of one ``nnunet`` request.

    Args:
        params: ``json.loads(request.parameters())``; every key must be one of :data:`KNOWN_OPTIONS`
            (an unknown key is almost always a typo that would otherwise be ignored silently).
        config: the deployed model; its ``folds`` are the selectable folds.

    Raises:
        InputValidationError: unknown option or a value breaking its rule (the message names both).
    """
    unknown = sorted(set(params) - set(KNOWN_OPTIONS))
    if unknown:
        raise InputValidationError(
            f"unknown request parameters {unknown}; supported: {list(KNOWN_OPTIONS)}."
        )
    step: Any = params.get(OPTION_TILE_STEP_SIZE, DEFAULT_TILE_STEP_SIZE)
    if isinstance(step, bool) or not isinstance(step, int | float | str):
        raise InputValidationError(f"request parameter {OPTION_TILE_STEP_SIZE!r} must be a number in (0, 1], "
                                   f"got {step!r}.")
    try:
        step = validate_tile_step_size(step)
    except InputValidationError:
        raise InputValidationError(
            f"request parameter {OPTION_TILE_STEP_SIZE!r} must be a number in (0, 1], got {step!r}."
        ) from None
    folds = (
        parse_fold_ids(params[OPTION_FOLDS], config.folds) if OPTION_FOLDS in params else tuple(config.folds)
    )
    return RequestOptions(
        mirroring=_parse_bool(OPTION_MIRRORING, params.get(OPTION_MIRRORING, True)),
        tile_step_size=step,
        folds=folds,
        probabilities=_parse_bool(OPTION_PROBABILITIES, params.get(OPTION_PROBABILITIES, False)),
        postprocessing=_parse_bool(OPTION_POSTPROCESSING, params.get(OPTION_POSTPROCESSING, True)),
    )


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


def extract_batch(
    padded: Any, slicers: Sequence[tuple[Any, ...]], variants: Sequence[tuple[int, ...]],
    batch: Sequence[TileItem],
) -> Any:
    """Stack the network inputs of ``batch``: tile ``padded[:, *slicer]`` flipped by its variant.

    ``variants[0]`` must be ``()`` (identity). Returns a C-contiguous float32 array ``(N, C, *P)``.
    """
    xp = get_array_module(padded)
    tiles = []
    for item in batch:
        tile = padded[(slice(None), *slicers[item.tile])]
        combo = variants[item.variant]
        tiles.append(xp.flip(tile, _flip_axes(combo)) if combo else tile)
    return xp.ascontiguousarray(xp.stack(tiles).astype(xp.float32, copy=False))


class _TileCollector:
    """Collects un-flipped per-variant predictions and emits TTA-averaged tiles in tile order."""

    def __init__(self, variants: Sequence[tuple[int, ...]]) -> None:
        self._variants = list(variants)
        self._pending: dict[int, list[Any]] = {}

    def add(self, batch: Sequence[TileItem], output: Any) -> list[tuple[int, Any]]:
        xp = get_array_module(output)
        done = []
        for item, prediction in zip(batch, output, strict=True):
            combo = self._variants[item.variant]
            self._pending.setdefault(item.tile, []).append(
                xp.flip(prediction, _flip_axes(combo)) if combo else prediction
            )
            if len(self._pending[item.tile]) == len(self._variants):
                done.append((item.tile, average_tta(self._pending.pop(item.tile))))
        return done


def _check_output(output: Any, n_items: int, num_heads: int, patch_size: Sequence[int]) -> None:
    expected = (n_items, num_heads, *patch_size)
    if tuple(output.shape) != expected:
        raise SubmodelError(
            f"fold model returned shape {tuple(output.shape)} for a batch of {n_items} tiles, "
            f"expected {expected} (num_heads, *patch_size)."
        )


async def predict_fold_async(
    data: Any,
    infer_batch: InferBatch,
    *,
    patch_size: Sequence[int],
    num_heads: int,
    mirror_axes: Sequence[int] | None,
    tile_step_size: float = DEFAULT_TILE_STEP_SIZE,
    batch_size: int = 1,
    max_inflight: int = 1,
    use_gaussian: bool = True,
    gaussian: Any | None = None,
) -> Any:
    """Sliding-window logits of one fold, like ``predict_sliding_window_return_logits`` (CPU path).

    Args:
        data: preprocessed case ``(C, *spatial)`` float32 (NumPy or CuPy).
        infer_batch: ``await infer_batch(x)`` with ``x`` ``(N, C, *P)`` float32 returns ``(N, K, *P)``
            (the fold network; a BLS call in the orchestrator).
        patch_size: the configuration's patch size ``P``.
        num_heads: ``K``, the number of network outputs.
        mirror_axes: allowed mirroring axes, ``None``/empty for no TTA.
        tile_step_size: step as a fraction of ``P``.
        batch_size: network inputs per ``infer_batch`` call; mirrored copies are extra batch items.
        max_inflight: ``infer_batch`` calls awaited at once. Results are consumed in order, so memory
            is bounded by ``max_inflight`` batches.
        use_gaussian: Gaussian importance weighting (nnU-Net's default and only CLI choice).
        gaussian: precomputed ``compute_gaussian(patch_size, xp=xp)`` to reuse across calls.

    Returns:
        float16 logits ``(K, *spatial)``, bit-identical to nnU-Net's for the same network outputs.
    """
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}.")
    xp = get_array_module(data)
    padded, unpad = pad_to_patch(data, patch_size)
    slicers = tile_slicers(padded.shape[1:], patch_size, tile_step_size)
    combos = mirror_combinations(tuple(mirror_axes)) if mirror_axes else []
    if combos and max(max(c) for c in combos) >= len(patch_size):
        raise ValueError(
            f"mirror_axes {tuple(mirror_axes or ())} out of range for a {len(patch_size)}D patch."
        )
    variants: list[tuple[int, ...]] = [(), *combos]
    batches = plan_tile_batches(len(slicers), len(variants), batch_size)
    accumulator = LogitAccumulator(
        num_heads, padded.shape[1:], patch_size, use_gaussian=use_gaussian, xp=xp, gaussian=gaussian
    )
    collector = _TileCollector(variants)

    def launch(batch: tuple[TileItem, ...]) -> asyncio.Task[Any]:
        return asyncio.ensure_future(infer_batch(extract_batch(padded, slicers, variants, batch)))

    window: deque[tuple[tuple[TileItem, ...], asyncio.Task[Any]]] = deque()
    remaining = iter(batches)
    try:
        for batch in remaining:
            window.append((batch, launch(batch)))
            if len(window) >= max_inflight:
                break
        while window:
            batch, task = window.popleft()
            output = await task
            _check_output(output, len(batch), num_heads, patch_size)
            for tile, logits in collector.add(batch, output):
                accumulator.add(logits, slicers[tile])  # tiles complete in tile order
            following = next(remaining, None)
            if following is not None:
                window.append((following, launch(following)))
    finally:
        for _, task in window:
            task.cancel()
    return accumulator.finalize(unpad)


async def gather_or_cancel(*awaitables: Awaitable[Any]) -> list[Any]:
    """Like ``asyncio.gather`` but on the first failure cancel the others before re-raising it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _bounded(infer: InferBatch, semaphore: asyncio.Semaphore) -> InferBatch:
    async def call(x: Any) -> Any:
        async with semaphore:
            return await infer(x)

    return call


async def predict_folds_async(
    data: Any,
    fold_infer: Sequence[InferBatch],
    *,
    max_inflight: int = 1,
    **fold_kwargs: Any,
) -> Any:
    """Run :func:`predict_fold_async` for every fold concurrently, then average in the given fold order.

    Args:
        data: preprocessed case ``(C, *spatial)`` float32.
        fold_infer: one ``infer_batch`` per fold, in averaging order.
        max_inflight: ``infer_batch`` calls running at once over ALL folds (one shared semaphore; also
            each fold's read-ahead window).
        **fold_kwargs: the other keyword arguments of :func:`predict_fold_async`.

    Returns:
        float16 ``(K, *spatial)``: ``average_folds`` of the per-fold logits (fp16 sum, then / n).
    """
    if not fold_infer:
        raise ValueError("fold_infer must hold at least one fold.")
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}.")
    semaphore = asyncio.Semaphore(max_inflight)
    logits = await gather_or_cancel(
        *(
            predict_fold_async(data, _bounded(infer, semaphore), max_inflight=max_inflight, **fold_kwargs)
            for infer in fold_infer
        )
    )
    return average_folds(logits)
