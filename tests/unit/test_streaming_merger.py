"""The streaming merger gives nnU-Net's whole-volume fold logits bit for bit while holding one tile's rows.

``SlabMerger`` against the default ``VolumeMerger`` (nnU-Net's float16 whole-volume accumulation, checked
against nnUNetPredictor elsewhere) through the same ``predict_sliding_window`` / ``predict_fold_async`` loops,
on a network whose large outputs make float16 rounding depend on the order of the sums.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import pytest

from nnunet_triton.errors import NumericalError
from nnunet_triton.numerics.sliding_window import TileSplitter, predict_sliding_window
from nnunet_triton.numerics.streaming import SlabMerger, slab_merger
from nnunet_triton.numerics.window import Merger, SlidingWindowSettings
from nnunet_triton.pipeline.orchestration import predict_fold_async

CASES = [  # data shape, patch, mirror axes, step, gaussian
    ((1, 29, 17, 23), (8, 8, 8), (0, 1, 2), 0.5, True),
    ((1, 30, 20, 12), (12, 8, 8), None, 0.33, True),  # tiles overlap three deep on the first axis
    ((1, 3, 21, 18), (8, 8), (0, 1), 0.5, True),  # 2D configuration on 3D data: one row per band
    ((1, 5, 9, 7), (8, 8, 8), None, 0.7, True),  # padded on every axis
    ((1, 19, 11, 14), (8, 8, 8), (0, 1, 2), 1.0, False),  # no overlap, no Gaussian
]


def _network(num_heads: int, scale: float = 40.0):
    rng = np.random.default_rng(5)
    weights = rng.normal(size=(num_heads,)).astype(np.float32) * np.float32(scale)

    def predict(x: np.ndarray) -> np.ndarray:
        position = np.cumsum(np.ones(x.shape[2:], np.float32), axis=0) / np.float32(7)
        return np.stack([w * np.sin(x[:, 0] * (k + 1)) + position for k, w in enumerate(weights)], axis=1)

    return predict


@pytest.mark.parametrize(("shape", "patch", "axes", "step", "gaussian"), CASES)
def test_joined_slabs_equal_the_whole_volume_logits_bit_for_bit(shape, patch, axes, step, gaussian):
    data = (np.random.default_rng(2).normal(size=shape) * 3).astype(np.float32)
    net = _network(4)
    window = SlidingWindowSettings(patch_size=patch, num_heads=4, mirror_axes=axes, tile_step_size=step,
                                   use_gaussian=gaussian)
    reference = predict_sliding_window(data, net, window)
    streamed = predict_sliding_window(data, net, dataclasses.replace(window, merger=slab_merger()))
    assert streamed.dtype == np.float16 and streamed.shape == reference.shape == (4, *shape[1:])
    assert streamed.tobytes() == reference.tobytes()


@pytest.mark.parametrize(("shape", "patch", "axes", "step", "gaussian"), CASES)
def test_slabs_reach_the_sink_in_row_order_once_each_while_one_tile_of_rows_is_held(
        shape, patch, axes, step, gaussian):
    data = (np.random.default_rng(4).normal(size=shape) * 3).astype(np.float32)
    net = _network(3)
    window = SlidingWindowSettings(patch_size=patch, num_heads=3, mirror_axes=axes, tile_step_size=step,
                                   use_gaussian=gaussian, batch_size=3, max_inflight=4)
    reference = predict_sliding_window(data, net, window)
    slabs: list[tuple[int, np.ndarray]] = []
    mergers: list[SlabMerger] = []

    def factory(splitter: TileSplitter, settings: SlidingWindowSettings) -> SlabMerger:
        mergers.append(SlabMerger(splitter, settings, lambda start, slab: slabs.append((start, slab))))
        return mergers[-1]

    rng = random.Random(1)

    async def infer(x):
        await asyncio.sleep(rng.random() * 0.002)  # batches complete out of order; tiles still merge in order
        return net(x)

    assert asyncio.run(predict_fold_async(data, infer, dataclasses.replace(window, merger=factory))) is None
    (merger,) = mergers
    assert isinstance(merger, Merger)
    rows = 1 if len(patch) == len(shape) - 2 else patch[0]
    assert merger.band_rows == rows and merger.peak_rows <= rows  # never more than one tile's rows
    starts = [start for start, _ in slabs]
    sizes = [slab.shape[1] for _, slab in slabs]
    assert starts == [sum(sizes[:i]) for i in range(len(sizes))] and sum(sizes) == shape[1]
    if shape[1] > rows:
        assert len(slabs) > 1  # streamed, not one slab at the end
    joined = np.concatenate([slab for _, slab in slabs], axis=1)
    assert joined.tobytes() == reference.tobytes()


def test_a_float16_overflow_is_refused_like_the_whole_volume_path():
    data = np.ones((1, 16, 8, 8), np.float32)
    window = SlidingWindowSettings(patch_size=(8, 8, 8), num_heads=1)

    def huge(x: np.ndarray) -> np.ndarray:
        return np.full((x.shape[0], 1, *x.shape[2:]), 60000, np.float32)

    with pytest.raises(NumericalError, match="inf"):
        predict_sliding_window(data, huge, window)
    with pytest.raises(NumericalError, match="inf"):
        predict_sliding_window(data, huge, dataclasses.replace(window, merger=slab_merger()))


def test_torch_tensors_stream_to_the_same_bits_as_their_whole_volume_path():
    torch = pytest.importorskip("torch")
    data = torch.from_numpy((np.random.default_rng(6).normal(size=(1, 21, 13, 10)) * 3).astype(np.float32))
    numpy_net = _network(2)

    def net(x):
        return torch.from_numpy(numpy_net(x.numpy()))

    window = SlidingWindowSettings(patch_size=(8, 8, 8), num_heads=2, mirror_axes=(0, 2))
    reference = predict_sliding_window(data, net, window)
    streamed = predict_sliding_window(data, net, dataclasses.replace(window, merger=slab_merger()))
    assert isinstance(streamed, torch.Tensor) and streamed.dtype == torch.float16
    assert torch.equal(streamed, reference)


def test_fold_slabs_averaged_as_they_arrive_equal_the_whole_volume_fold_mean_bit_for_bit():
    from nnunet_triton.numerics.sliding_window import average_folds
    from nnunet_triton.numerics.streaming import FoldSlabAverage
    from nnunet_triton.pipeline.orchestration import predict_folds_async

    data = (np.random.default_rng(8).normal(size=(1, 27, 12, 15)) * 3).astype(np.float16).astype(np.float32)
    nets = [_network(3), lambda x: _network(3, scale=25.0)(x) * np.float32(-0.7) + 3]
    window = SlidingWindowSettings(patch_size=(8, 8, 8), num_heads=3, mirror_axes=(0, 1), batch_size=2,
                                   max_inflight=2)
    expected = average_folds([predict_sliding_window(data, net, window) for net in nets])
    slabs: list[tuple[int, np.ndarray]] = []
    average = FoldSlabAverage(2, lambda start, slab: slabs.append((start, slab)))
    folds = iter(range(2))

    def factory(splitter: TileSplitter, settings: SlidingWindowSettings) -> SlabMerger:
        return SlabMerger(splitter, settings, average.sink(next(folds)))  # mergers are made in fold order

    rng = random.Random(3)

    def infer(net):
        async def call(x):
            await asyncio.sleep(rng.random() * 0.002)
            return net(x)
        return call

    streaming = dataclasses.replace(window, merger=factory)
    assert asyncio.run(predict_folds_async(data, [infer(n) for n in nets], streaming)) is None
    assert [s for s, _ in slabs] == sorted(s for s, _ in slabs) and len(slabs) > 1
    joined = np.concatenate([slab for _, slab in slabs], axis=1)
    assert joined.dtype == np.float16 and joined.tobytes() == expected.tobytes()
    assert average.peak_pending_rows < 2 * data.shape[1]  # folds advancing together never held both whole
