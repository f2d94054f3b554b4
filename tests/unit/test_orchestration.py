"""Batching plan and the async per-fold loop of the BLS orchestrator."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest

from nnunet_triton.errors import SubmodelError
from nnunet_triton.numerics.sliding_window import (
    TileItem,
    average_folds,
    extract_batch,
    plan_tile_batches,
    predict_sliding_window,
)
from nnunet_triton.numerics.window import SlidingWindowSettings
from nnunet_triton.pipeline.orchestration import predict_fold_async, predict_folds_async

# --- batching plan ---------------------------------------------------------------------------------


def test_plan_tile_batches_keeps_tile_major_order_and_short_last_batch():
    assert plan_tile_batches(2, 3, 4) == [
        (TileItem(0, 0), TileItem(0, 1), TileItem(0, 2), TileItem(1, 0)),
        (TileItem(1, 1), TileItem(1, 2)),
    ]


def test_plan_tile_batches_gives_one_item_per_batch_when_batch_size_is_one():
    assert plan_tile_batches(2, 1, 1) == [(TileItem(0, 0),), (TileItem(1, 0),)]


@pytest.mark.parametrize("bad", [{"n_tiles": 0}, {"n_variants": 0}, {"batch_size": 0}])
def test_plan_tile_batches_raises_when_a_count_is_not_positive(bad):
    kwargs = {"n_tiles": 1, "n_variants": 1, "batch_size": 1} | bad
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be >= 1, got 0"):
        plan_tile_batches(**kwargs)


def test_extract_batch_flips_spatial_axes_of_each_tile_when_variant_is_mirrored():
    padded = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4)
    slicers = [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(2, 4))]
    variants = [(), (1,), (0, 1)]
    batch = extract_batch(padded, slicers, variants, [TileItem(0, 0), TileItem(1, 1), TileItem(1, 2)])
    expected = np.stack(
        [padded[:, 0:2, 0:2], padded[:, 2:4, 2:4][:, :, ::-1], padded[:, 2:4, 2:4][:, ::-1, ::-1]]
    )
    np.testing.assert_array_equal(batch, expected)
    assert batch.flags.c_contiguous and batch.dtype == np.float32


# --- the per-fold loop -------------------------------------------------------------------------------


def _fake_network(num_heads: int, num_channels: int, seed: int):
    """A per-sample (batch-independent) float32 'network': channel mixing plus a position-dependent ramp,
    so that mirroring changes the result."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(num_heads, num_channels)).astype(np.float32)

    def predict(x: np.ndarray) -> np.ndarray:
        ramp = np.cumsum(np.ones(x.shape[2:], dtype=np.float32), axis=-1) / np.float32(x.shape[-1])
        out = np.zeros((x.shape[0], num_heads, *x.shape[2:]), dtype=np.float32)
        for k in range(num_heads):
            for c in range(num_channels):
                out[:, k] += weights[k, c] * x[:, c]
            out[:, k] += np.float32(k + 1) * ramp
        return out

    return predict


def _async(predict, *, shuffle_seed: int | None = None, calls: list | None = None):
    """Wrap a network as an ``infer_batch`` coroutine that completes in random order."""
    rng = random.Random(shuffle_seed)

    async def infer(x):
        if calls is not None:
            calls.append(x.shape[0])
        await asyncio.sleep(rng.random() * 0.005 if shuffle_seed is not None else 0)
        return predict(x)

    return infer


CASES = [
    # (data shape, patch, mirror axes, step, batch size, max in flight)
    ((1, 20, 17, 23), (8, 8, 8), (0, 1, 2), 0.5, 1, 1),
    ((1, 20, 17, 23), (8, 8, 8), (0, 1, 2), 0.5, 5, 3),
    ((2, 13, 9, 30), (8, 8, 16), (0, 2), 0.7, 8, 4),
    ((1, 5, 6, 7), (8, 8, 8), None, 0.5, 2, 2),  # smaller than the patch: padded
    ((1, 3, 21, 18), (8, 8), (0, 1), 0.5, 3, 2),  # 2D configuration on 3D data
]


@pytest.mark.parametrize(("shape", "patch", "axes", "step", "batch_size", "inflight"), CASES)
def test_predict_fold_async_equals_predict_sliding_window_when_batches_complete_out_of_order(
    shape, patch, axes, step, batch_size, inflight
):
    data = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    net = _fake_network(3, shape[0], seed=1)
    window = SlidingWindowSettings(patch_size=patch, num_heads=3, mirror_axes=axes, tile_step_size=step)
    expected = predict_sliding_window(data, net, window)
    calls: list[int] = []
    result = asyncio.run(
        predict_fold_async(
            data, _async(net, shuffle_seed=2, calls=calls),
            dataclasses.replace(window, batch_size=batch_size, max_inflight=inflight),
        )
    )
    assert result.dtype == np.float16
    np.testing.assert_array_equal(result, expected)  # bit-identical
    assert max(calls) <= batch_size


def test_predict_folds_async_averages_folds_in_given_order_when_run_concurrently():
    data = np.random.default_rng(3).normal(size=(1, 19, 11, 14)).astype(np.float32)
    nets = [_fake_network(2, 1, seed=s) for s in (10, 11, 12)]
    kwargs = {"patch_size": (8, 8, 8), "num_heads": 2, "mirror_axes": (0, 1, 2), "tile_step_size": 0.5}
    expected = average_folds([predict_sliding_window(data, n, SlidingWindowSettings(**kwargs)) for n in nets])
    result = asyncio.run(
        predict_folds_async(
            data, [_async(n, shuffle_seed=i) for i, n in enumerate(nets)],
            SlidingWindowSettings(batch_size=4, max_inflight=3, **kwargs),
        )
    )
    np.testing.assert_array_equal(result, expected)


def test_predict_folds_async_bounds_inflight_calls_over_all_folds_when_max_inflight_set():
    running = 0
    peak = 0
    net = _fake_network(2, 1, seed=0)

    async def infer(x):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001)
        running -= 1
        return net(x)

    data = np.zeros((1, 24, 24, 24), dtype=np.float32)
    asyncio.run(
        predict_folds_async(
            data, [infer, infer, infer],
            SlidingWindowSettings(patch_size=(8, 8, 8), num_heads=2, mirror_axes=(0,), batch_size=2,
                                  max_inflight=2),
        )
    )
    assert peak == 2


def test_predict_folds_async_raises_submodel_error_and_cancels_others_when_one_fold_fails():
    calls = {"started": 0, "cancelled": 0}

    async def good(x):  # answers only when cancelled: a fold still running when another one failed
        calls["started"] += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            calls["cancelled"] += 1
            raise

    async def bad(x):
        raise SubmodelError("model 'fold_1' failed: boom")

    async def run() -> set[asyncio.Task]:
        data = np.zeros((1, 32, 32, 32), dtype=np.float32)
        with pytest.raises(SubmodelError, match="model 'fold_1' failed: boom"):
            await predict_folds_async(data, [bad, good], SlidingWindowSettings(
                patch_size=(8, 8, 8), num_heads=2, mirror_axes=None, batch_size=1, max_inflight=2))
        # the error reaches the caller only once no fold call is left running (plain gather leaves the
        # good fold's loop and its calls pending here)
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(run()) == set()
    assert calls["started"] >= 1 and calls["cancelled"] == calls["started"]


def test_predict_fold_async_raises_submodel_error_when_network_returns_wrong_shape():
    async def wrong(x):
        return np.zeros((x.shape[0], 5, 8, 8, 8), dtype=np.float32)

    match = r"fold model returned shape \(1, 5, 8, 8, 8\) .* expected \(1, 2"
    with pytest.raises(SubmodelError, match=match):
        asyncio.run(
            predict_fold_async(
                np.zeros((1, 8, 8, 8), np.float32), wrong,
                SlidingWindowSettings(patch_size=(8, 8, 8), num_heads=2, mirror_axes=None),
            )
        )


def test_predict_fold_async_matches_nnunet_predictor_when_network_is_a_torch_module():
    torch = pytest.importorskip("torch")
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.LeakyReLU(), torch.nn.Conv3d(4, 3, 1)
    ).eval()
    patch = (8, 8, 8)
    predictor = nnUNetPredictor(
        tile_step_size=0.5, use_gaussian=True, use_mirroring=True, perform_everything_on_device=False,
        device=torch.device("cpu"), verbose=False, allow_tqdm=False,
    )
    predictor.network = net
    predictor.configuration_manager = SimpleNamespace(patch_size=list(patch))
    predictor.label_manager = SimpleNamespace(num_segmentation_heads=3)
    predictor.allowed_mirroring_axes = (0, 1, 2)
    data = torch.from_numpy(np.random.default_rng(5).normal(size=(1, 13, 10, 17)).astype(np.float32))
    with torch.no_grad():
        expected = predictor.predict_sliding_window_return_logits(data).numpy()

    async def infer(x):
        with torch.no_grad():
            return net(torch.from_numpy(x)).numpy()

    result = asyncio.run(
        predict_fold_async(
            data.numpy(), infer,
            SlidingWindowSettings(patch_size=patch, num_heads=3, mirror_axes=(0, 1, 2), batch_size=1),
        )
    )
    np.testing.assert_array_equal(result, expected)
