"""Device (or host) memory of the fold accumulators as a plan: ``numerics.limits.plan_fold_memory``,
the fold-order reduction ``sliding_window.FoldAverage`` and ``predict_folds_async(max_concurrent_folds=)``."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from nnunet_triton.errors import ResourceExhaustedError
from nnunet_triton.numerics.limits import FoldMemoryPlan, padded_voxels, plan_fold_memory
from nnunet_triton.numerics.sliding_window import FoldAverage, average_folds
from nnunet_triton.numerics.window import SlidingWindowSettings
from nnunet_triton.pipeline.orchestration import predict_folds_async

GiB = 2**30
CT = {"num_heads": 14, "voxels": 600 * 512 * 512, "channels": 1, "folds": 5}  # the sizing case


def test_plan_counts_each_fold_accumulator_and_the_request_once():
    plan = plan_fold_memory(**CT, instances=1, available_bytes=141 * GiB, memory="GPU 0 free memory")
    v = 600 * 512 * 512
    assert dataclasses.asdict(plan) == {**CT, "instances": 1, "available_bytes": 141 * GiB,
                                        "memory": "GPU 0 free memory"}
    assert plan.fold_bytes == 15 * v * 2  # fp16 logits (14 heads) + fp16 weights
    assert plan.fixed_bytes == v * 4 + 2 * 14 * v * 2  # padded input, running sum, a finishing fold's copy
    assert (plan.bytes_for(5), plan.bytes_for(1)) == (33_030_144_000, 14_155_776_000)  # 30.8 / 13.2 GiB
    assert plan.max_concurrent_folds == 5


@pytest.mark.parametrize(("folds_worth", "extra", "instances", "expected"), [
    (2, 0, 1, 2), (2, -1, 1, 1), (3, 0, 2, 3), (100, 0, 1, 5),
])
def test_plan_allows_as_many_folds_as_fit_the_instance_share(folds_worth, extra, instances, expected):
    one_request = FoldMemoryPlan(**CT, instances=1, available_bytes=0).bytes_for(folds_worth) + extra
    plan = plan_fold_memory(**CT, instances=instances, available_bytes=instances * one_request)
    assert plan.max_concurrent_folds == expected


def test_plan_refuses_a_request_when_one_fold_does_not_fit_and_names_the_numbers():
    with pytest.raises(ResourceExhaustedError, match=(
            r"fold-accumulator memory limit: 5 folds x 14 heads x 157286400 voxels need 30.76 GiB all at "
            r"once, 13.18 GiB one fold at a time; GPU 0 free memory 24.00 GiB / 2 instances = 12.00 GiB per "
            r"instance, less than the 13.18 GiB \(14155776000 bytes\) of one fold")) as info:
        plan_fold_memory(**CT, instances=2, available_bytes=24 * GiB, memory="GPU 0 free memory")
    assert info.value.triton_code == "UNAVAILABLE"


def test_padded_voxels_pads_each_axis_to_the_patch():
    assert padded_voxels((5, 40, 7), (8, 8, 8)) == 8 * 40 * 8
    assert padded_voxels((5, 40, 7), (8, 8)) == 5 * 40 * 8  # a 2D configuration on a 3D volume


@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_fold_average_one_fold_at_a_time_is_bitwise_the_all_at_once_average(xp):
    rng = np.random.default_rng(4)
    folds = [(rng.standard_normal((3, 9, 8, 7)) * 20).astype(np.float16) for _ in range(5)]
    as_xp = torch.from_numpy if xp == "torch" else np.asarray
    expected = np.asarray(average_folds([as_xp(f.copy()) for f in folds]))
    average = FoldAverage(len(folds))
    for f in folds:
        average.add(as_xp(f.copy()))
    result = np.asarray(average.finalize())
    assert result.dtype == np.float16 and result.tobytes() == expected.tobytes()


def test_fold_average_names_the_fold_that_breaks_the_rule():
    average = FoldAverage(2)
    average.add(np.zeros((2, 3), np.float16))
    with pytest.raises(Exception, match=r"fold index 1 has float32 \(2, 3\)"):
        average.add(np.zeros((2, 3), np.float32))


def _fold(weight: float, events: list[tuple[str, int]], index: int):
    async def infer(x: np.ndarray) -> np.ndarray:
        events.append(("call", index))
        await asyncio.sleep(0)  # let the other folds run
        events.append(("return", index))
        return np.stack([x[:, 0] * weight, x[:, 0] * -weight + 1], axis=1)

    return infer


@pytest.mark.parametrize("max_folds", [1, 2, None])
def test_predict_folds_keeps_at_most_max_concurrent_folds_alive_with_the_same_bits(max_folds):
    data = np.random.default_rng(5).normal(size=(1, 20, 17, 12)).astype(np.float32)
    window = SlidingWindowSettings(patch_size=(8, 8, 8), num_heads=2, mirror_axes=(0,), batch_size=2,
                                   max_inflight=4)
    weights = (1.5, -0.25, 3.0, 0.7)
    sequential = [_fold(w, [], i) for i, w in enumerate(weights)]
    reference = asyncio.run(predict_folds_async(data, sequential, window, max_concurrent_folds=1))
    events: list[tuple[str, int]] = []
    folds = [_fold(w, events, i) for i, w in enumerate(weights)]
    result = asyncio.run(predict_folds_async(data, folds, window, max_concurrent_folds=max_folds))
    assert result.tobytes() == reference.tobytes()
    alive, peak, calls = set(), 0, {i: sum(e == ("call", i) for e in events) for i in range(4)}
    returned = dict.fromkeys(range(4), 0)
    for kind, fold in events:
        if kind == "call":
            alive.add(fold)
        else:
            returned[fold] += 1
            if returned[fold] == calls[fold]:
                alive.discard(fold)
        peak = max(peak, len(alive))
    assert peak == (max_folds or 4)
