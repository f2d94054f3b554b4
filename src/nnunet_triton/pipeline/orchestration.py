"""What the BLS orchestrator does per request, without Triton: the per-fold loop and the fold average.

The orchestrator's serving step (``serving.steps.orchestrator``) only moves tensors; this module holds
the logic so it can be tested on plain arrays with a fake network:

- :func:`predict_fold_async` runs nnU-Net's sliding window for one fold (``numerics.sliding_window``'s
  ``TileSplitter`` + ``TileMerger``, configured by one ``numerics.window.SlidingWindowSettings``)
  (``nnUNetPredictor.predict_sliding_window_return_logits`` and ``_internal_maybe_mirror_and_predict``,
  nnunetv2/inference/predict_from_raw_data.py) with an injected ``infer_batch`` coroutine, several
  batches in flight, and Gaussian accumulation in nnU-Net's tile order (fp16 sums are order-dependent).
- :func:`predict_folds_async` runs the folds concurrently, at most ``max_concurrent_folds`` of them alive at
  once (``numerics.limits.plan_fold_memory`` chooses it), and averages their logits in fold order
  (``predict_logits_from_preprocessed_data``) as each fold's turn comes, so finished folds are freed.
- :func:`window_settings` builds a request's settings from the deployed model, the orchestrator's config
  parameters and the request's options.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from nnunet_triton.errors import InputValidationError, SubmodelError
from nnunet_triton.numerics.sliding_window import FoldAverage, TileItem, TileMerger, TileSplitter
from nnunet_triton.numerics.window import SlidingWindowSettings

if TYPE_CHECKING:
    from nnunet_triton.numerics.plans import InferenceConfig
    from nnunet_triton.options import RequestOptions
    from nnunet_triton.parameters import OrchestratorParameters

__all__ = [
    "predict_fold_async",
    "predict_folds_async",
    "window_settings",
    "gather_or_cancel",
]

LOGGER = logging.getLogger(__name__)

InferBatch = Callable[[Any], Awaitable[Any]]


def _check_output(output: Any, expected: tuple[int, ...]) -> None:
    if tuple(output.shape) != expected:  # the fold model's fault, not the request's
        raise SubmodelError(
            f"fold model returned shape {tuple(output.shape)} for a batch of {expected[0]} tiles, "
            f"expected {expected} (num_heads, *patch_size)."
        )


async def predict_fold_async(data: Any, infer_batch: InferBatch, window: SlidingWindowSettings) -> Any:
    """Sliding-window logits of one fold, like ``predict_sliding_window_return_logits`` (CPU path).

    Args:
        data: preprocessed case ``(C, *spatial)`` float32 (NumPy, CuPy, or a torch tensor on any device).
        infer_batch: ``await infer_batch(x)`` with ``x`` ``(N, C, *P)`` float32 returns ``(N, K, *P)``
            (the fold network; a BLS call in the orchestrator).
        window: the sliding window's settings; ``window.batch_size`` inputs per ``infer_batch`` call
            (mirrored copies are extra batch items), ``window.max_inflight`` calls awaited at once (results
            are consumed in order, so memory is bounded by that many batches), ``window.merger`` the merger.

    Returns:
        float16 logits ``(K, *spatial)``, bit-identical to nnU-Net's for the same network outputs (with a
        custom ``window.merger``: that merger's result).
    """
    _check_window(window)
    return await _predict_fold(TileSplitter(data, window), infer_batch)


def _check_window(window: Any) -> None:
    if not isinstance(window, SlidingWindowSettings):
        raise InputValidationError(f"window must be a SlidingWindowSettings, got {type(window).__name__}.")


async def _predict_fold(splitter: TileSplitter, infer_batch: InferBatch) -> Any:
    """One fold's loop over ``splitter``'s tiles (the padded volume and tile grid can be shared by folds)."""
    window = splitter.window
    merger = TileMerger(splitter, window)
    batches = splitter.batches()

    def launch(batch: tuple[TileItem, ...]) -> asyncio.Task[Any]:
        return asyncio.ensure_future(infer_batch(splitter.extract(batch)))

    in_flight: deque[tuple[tuple[TileItem, ...], asyncio.Task[Any]]] = deque()
    remaining = iter(batches)
    try:
        for batch in remaining:
            in_flight.append((batch, launch(batch)))
            if len(in_flight) >= window.max_inflight:
                break
        while in_flight:
            batch, task = in_flight.popleft()
            output = await task
            _check_output(output, merger.expected_shape(batch))
            merger.add(batch, output)  # in batch order: tiles complete in tile order
            following = next(remaining, None)
            if following is not None:
                in_flight.append((following, launch(following)))
    finally:
        for _, task in in_flight:
            task.cancel()
    return merger.finalize()


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


async def _first_in_order(running: deque[asyncio.Task[Any]]) -> Any:
    """Pop and return the oldest fold's logits; a later fold's failure is raised as soon as it happens."""
    head = running[0]
    while not head.done():
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for task in running:
            if task.done() and not task.cancelled() and task.exception() is not None:
                task.result()
    running.popleft()
    return head.result()


async def predict_folds_async(
    data: Any,
    fold_infer: Sequence[InferBatch],
    window: SlidingWindowSettings,
    *,
    max_concurrent_folds: int | None = None,
    divide_each_fold: bool = False,
) -> Any:
    """Run :func:`predict_fold_async` for the folds concurrently and average them in the given fold order.

    The folds share one :class:`TileSplitter` (one padded copy of ``data``, one tile grid) and the settings
    ``window``; each fold has its own merger. Folds start in fold order; fold ``i + max_concurrent_folds``
    starts once fold ``i`` was added to the fold-order sum (:class:`FoldAverage`), so at most
    ``max_concurrent_folds`` accumulators (or finished folds waiting for their turn) are alive at once. The
    sum's order, and so every bit of the result, does not depend on it.

    Args:
        data: preprocessed case ``(C, *spatial)`` float32.
        fold_infer: one ``infer_batch`` per fold, in averaging order.
        window: as in :func:`predict_fold_async`; ``window.max_inflight`` bounds the ``infer_batch`` calls
            running at once over ALL folds (one shared semaphore; also each fold's read-ahead window).
        max_concurrent_folds: folds alive at once (``None``: all; 1: nnUNetPredictor's one at a time): the
            request's memory plan (``numerics.limits.plan_fold_memory``), not a window setting.
        divide_each_fold: nnU-Net 2.0's fold fusion (``numerics.releases``; :class:`FoldAverage`).

    Returns:
        float16 ``(K, *spatial)``: the fold mean (fp16 sum in fold order, then / n), as ``average_folds``;
        ``None`` when every fold's merger handed its slabs on (``numerics.streaming.FoldSlabAverage``).
    """
    if not fold_infer:
        raise ValueError("fold_infer must hold at least one fold.")
    _check_window(window)
    alive = len(fold_infer) if max_concurrent_folds is None else max_concurrent_folds
    if alive < 1:
        raise ValueError(f"max_concurrent_folds must be >= 1 or None, got {max_concurrent_folds}.")
    splitter = TileSplitter(data, window)
    semaphore = asyncio.Semaphore(window.max_inflight)
    average = FoldAverage(len(fold_infer), divide_each_fold=divide_each_fold)
    streamed = 0  # folds whose merger handed its result on itself (finalize returned None)

    def add(result: Any) -> None:
        nonlocal streamed
        if result is None:
            streamed += 1
        else:
            average.add(result)

    running: deque[asyncio.Task[Any]] = deque()
    try:
        for infer in fold_infer:
            if len(running) >= alive:
                add(await _first_in_order(running))
            running.append(asyncio.ensure_future(_predict_fold(splitter, _bounded(infer, semaphore))))
        while running:
            add(await _first_in_order(running))
    except BaseException:  # the first failure cancels the other folds before it is raised
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        raise
    if streamed:  # a streaming merger (numerics.streaming) averages its slabs itself
        if streamed != len(fold_infer):
            raise ValueError(f"{streamed} of {len(fold_infer)} folds streamed their result: all or none.")
        return None
    return average.finalize()


def window_settings(config: InferenceConfig, params: OrchestratorParameters, options: RequestOptions, *,
                    gaussian: Any = None) -> SlidingWindowSettings:
    """The orchestrator's :class:`SlidingWindowSettings` for one request.

    From the deployed model (``config``: patch size, heads, mirror axes), the orchestrator's config
    parameters (``params``: ``tile_batch_size`` network inputs per fold call, ``max_inflight`` calls in
    flight) and the request's options (``options``: mirroring, tile step), with the instance's cached
    Gaussian map (on its device).
    """
    return SlidingWindowSettings.for_request(config, options, batch_size=params.tile_batch_size,
                                             max_inflight=params.max_inflight, gaussian=gaussian)
