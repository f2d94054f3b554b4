"""``numerics.window.SlidingWindowSettings``: the sliding window's settings as one frozen value, refused on
construction when a field breaks its rule, built by the orchestrator from its parameters, taken whole by the
three loops, and its ``merger`` seam (a custom :class:`~nnunet_triton.numerics.window.Merger` gets every
tile once, in nnU-Net's order, and its result is the fold's)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
import re
from typing import Any

import numpy as np
import pytest

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics.gaussian import compute_gaussian
from nnunet_triton.numerics.model_folder import load_inference_config
from nnunet_triton.numerics.sliding_window import (
    TileMerger,
    TileSplitter,
    VolumeMerger,
    average_folds,
    predict_sliding_window,
)
from nnunet_triton.numerics.tiling import pad_to_patch, tile_slicers
from nnunet_triton.numerics.window import Merger, SlidingWindowSettings
from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE, RequestOptions
from nnunet_triton.parameters import OrchestratorParameters
from nnunet_triton.pipeline.orchestration import predict_fold_async, predict_folds_async, window_settings

try:
    from . import parity_support as ps
except ImportError:
    import parity_support as ps

BASE = {"patch_size": (8, 8, 8), "num_heads": 2}

# --- construction --------------------------------------------------------------------------------------

REFUSED = [
    # (field, value, rule the message states)
    ("patch_size", (), "a non-empty sequence of integers >= 1"),
    ("patch_size", (8, 0, 8), "a non-empty sequence of integers >= 1"),
    ("patch_size", "888", "a non-empty sequence of integers >= 1"),
    ("patch_size", (8.0, 8, 8), "a non-empty sequence of integers >= 1"),
    ("num_heads", 0, "an integer >= 1"),
    ("num_heads", True, "an integer >= 1"),
    ("mirror_axes", (0, 3), "None or distinct spatial axes in 0..2"),
    ("mirror_axes", (-1,), "None or distinct spatial axes in 0..2"),
    ("mirror_axes", (1, 1), "None or distinct spatial axes in 0..2"),
    ("mirror_axes", 0, "None or distinct spatial axes in 0..2"),
    ("tile_step_size", 0, "a number in (0, 1]"),
    ("tile_step_size", 1.5, "a number in (0, 1]"),
    ("tile_step_size", float("nan"), "a number in (0, 1]"),
    ("tile_step_size", "half", "a number in (0, 1]"),
    ("use_gaussian", "yes", "a bool"),
    ("sigma_scale", 0.0, "a finite number > 0"),
    ("sigma_scale", float("inf"), "a finite number > 0"),
    ("batch_size", 0, "an integer >= 1"),
    ("batch_size", 2.0, "an integer >= 1"),
    ("max_inflight", 0, "an integer >= 1"),
    ("merger", "VolumeMerger", "None or a callable (splitter, settings) -> Merger"),
]


@pytest.mark.parametrize(("name", "value", "rule"), REFUSED, ids=lambda v: repr(v)[:30])
def test_settings_refuse_a_field_that_breaks_its_rule_naming_field_rule_and_value(name, value, rule):
    with pytest.raises(InputValidationError) as caught:
        SlidingWindowSettings(**{**BASE, name: value})
    message = str(caught.value)
    pattern = rf"'{name}' must be {re.escape(rule)}.*, got {re.escape(repr(value))}\.$"
    assert re.search(pattern, message), message


@pytest.mark.parametrize("gaussian", [np.zeros((8, 8, 4), np.float16), np.zeros((8, 8, 8), np.float32)])
def test_settings_refuse_a_cached_gaussian_of_another_shape_or_dtype(gaussian):
    with pytest.raises(InputValidationError, match=r"'gaussian' must be None or a float16 map of shape "
                                                   r"patch_size \(8, 8, 8\), got 'float\d\d \(8, 8, \d\)'"):
        SlidingWindowSettings(**BASE, gaussian=gaussian)


def test_settings_are_frozen_normalised_and_compare_without_the_cached_map():
    window = SlidingWindowSettings(patch_size=[np.int64(8), 8, 8], num_heads=2, mirror_axes=[2, 0],
                                   tile_step_size="0.25")
    assert (window.patch_size, window.mirror_axes, window.tile_step_size) == ((8, 8, 8), (2, 0), 0.25)
    assert type(window.patch_size[0]) is int and window.variants_per_tile == 4
    assert SlidingWindowSettings(**BASE, mirror_axes=()).mirror_axes is None  # no TTA has one spelling
    defaults = SlidingWindowSettings(**BASE)
    assert (defaults.tile_step_size, defaults.use_gaussian, defaults.batch_size, defaults.max_inflight,
            defaults.merger, defaults.variants_per_tile) == (DEFAULT_TILE_STEP_SIZE, True, 1, 1, None, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.batch_size = 4  # type: ignore[misc]
    cached = SlidingWindowSettings(**BASE, gaussian=compute_gaussian((8, 8, 8)))
    assert cached == defaults and " gaussian=" not in repr(cached)
    assert np.array_equal(cached.gaussian_map(), defaults.gaussian_map())
    assert not np.array_equal(SlidingWindowSettings(**BASE, sigma_scale=0.25).gaussian_map(),
                              defaults.gaussian_map())


# --- the orchestrator's parameters -> settings ----------------------------------------------------------


def _config(mirror_axes):
    return load_inference_config(ps.make_plans(patch_3d=(16, 12, 8)), ps.make_dataset_json(n_labels=4),
                                 ps.CONFIG_NAME_3D, trainer_name="nnUNetTrainer", mirror_axes=mirror_axes,
                                 folds=(0, 1))


@pytest.mark.parametrize("mirroring", [True, False])
def test_window_settings_round_trip_the_orchestrators_config_parameters_and_request_options(mirroring):
    written = OrchestratorParameters(fold_models=("fold_0", "fold_1"), tile_batch_size=3, max_inflight=5)
    params = OrchestratorParameters.from_parameters(written.to_config())  # config.pbtxt and back
    config = _config((0, 2))
    options = RequestOptions.from_parameters({"mirroring": str(mirroring).lower(), "tile_step_size": "0.7"},
                                             config)
    gaussian = compute_gaussian(config.patch_size)
    window = window_settings(config, params, options, gaussian=gaussian)
    assert window == SlidingWindowSettings(
        patch_size=(16, 12, 8), num_heads=4, mirror_axes=(0, 2) if mirroring else None, tile_step_size=0.7,
        batch_size=written.tile_batch_size, max_inflight=written.max_inflight)
    assert window.gaussian is gaussian and window.merger is None
    assert window.variants_per_tile == (4 if mirroring else 1)


# --- the loops take the object, and no loose window keywords -------------------------------------------

WINDOW_FIELDS = {f.name for f in dataclasses.fields(SlidingWindowSettings)}
LOOPS = [predict_sliding_window, predict_fold_async, predict_folds_async, TileSplitter, TileMerger]


@pytest.mark.parametrize("function", LOOPS, ids=lambda f: f.__name__)
def test_loops_take_one_settings_object_and_no_loose_window_keywords(function):
    parameters = inspect.signature(function).parameters
    loose = sorted(WINDOW_FIELDS & set(parameters))
    assert loose == [], f"{function.__name__} still takes window settings one by one: {loose}"
    assert "window" in parameters
    assert parameters["window"].annotation in (SlidingWindowSettings, "SlidingWindowSettings")
    assert parameters["window"].default is inspect.Parameter.empty  # no hidden default window


def test_loops_refuse_anything_but_a_settings_object_as_window():
    data = np.zeros((1, 8, 8, 8), np.float32)
    with pytest.raises(InputValidationError, match="window must be a SlidingWindowSettings, got dict"):
        predict_sliding_window(data, lambda x: x, dict(BASE))  # type: ignore[arg-type]
    with pytest.raises(InputValidationError, match="window must be a SlidingWindowSettings, got dict"):
        asyncio.run(predict_folds_async(data, [None], dict(BASE)))  # type: ignore[arg-type,list-item]


# --- the merger seam -----------------------------------------------------------------------------------


class RecordingMerger:
    """A custom merger: records what it is given, lets the default merger do the arithmetic, and returns its
    result negated (exact in float16), so a test sees whether the loop returns *this* merger's result."""

    instances: list[RecordingMerger] = []

    def __init__(self, splitter: TileSplitter, window: SlidingWindowSettings) -> None:
        self.window = window
        self.tiles: list[int] = []
        self.slicers: list[tuple[Any, ...]] = []
        self.shapes: set[tuple[int, ...]] = set()
        self._inner = VolumeMerger(splitter, window)
        RecordingMerger.instances.append(self)

    def add(self, tile: int, slicer: tuple[Any, ...], logits: Any) -> None:
        self.tiles.append(tile)
        self.slicers.append(slicer)
        self.shapes.add(tuple(logits.shape))
        self._inner.add(tile, slicer, logits)

    def finalize(self) -> Any:
        return -self._inner.finalize()


def _network(num_heads: int):
    rng = np.random.default_rng(11)
    weights = rng.normal(size=(num_heads,)).astype(np.float32)

    def predict(x: np.ndarray) -> np.ndarray:
        ramp = np.cumsum(np.ones(x.shape[2:], np.float32), axis=-1) / np.float32(x.shape[-1])
        return np.stack([w * x[:, 0] + k * ramp for k, w in enumerate(weights)], axis=1)

    return predict


def _shuffled(predict, seed: int):
    rng = random.Random(seed)

    async def infer(x):
        await asyncio.sleep(rng.random() * 0.003)  # batches complete out of order
        return predict(x)

    return infer


CASES = [  # data shape, patch, mirror axes, step
    ((1, 20, 17, 23), (8, 8, 8), (0, 1, 2), 0.5),
    ((1, 3, 21, 18), (8, 8), (0, 1), 0.5),  # 2D configuration on 3D data: slices first
    ((1, 5, 9, 7), (8, 8, 8), None, 0.7),  # padded
]


def _expected_order(shape, patch, step):
    padded, _ = pad_to_patch(np.zeros(shape, np.float32), patch)
    return tile_slicers(padded.shape[1:], patch, step)


@pytest.mark.parametrize(("shape", "patch", "axes", "step"), CASES)
def test_custom_merger_receives_every_tile_once_in_nnunet_order_and_its_result_is_returned(
        shape, patch, axes, step):
    data = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    net = _network(3)
    default = SlidingWindowSettings(patch_size=patch, num_heads=3, mirror_axes=axes, tile_step_size=step)
    custom = dataclasses.replace(default, merger=RecordingMerger, batch_size=5, max_inflight=3)
    expected_slicers = _expected_order(shape, patch, step)
    reference = predict_sliding_window(data, net, default)
    for run in (lambda: predict_sliding_window(data, net, custom),
                lambda: asyncio.run(predict_fold_async(data, _shuffled(net, 2), custom))):
        RecordingMerger.instances.clear()
        result = run()
        (merger,) = RecordingMerger.instances
        assert isinstance(merger, Merger) and merger.window is custom
        assert merger.tiles == list(range(len(expected_slicers)))
        assert merger.slicers == expected_slicers
        assert merger.shapes == {(3, *patch)}  # TTA-averaged tiles, not batch items
        assert result.dtype == np.float16 and np.array_equal(result, -reference)  # the merger's result


def test_custom_merger_is_made_per_fold_and_its_results_are_averaged_in_fold_order():
    data = np.random.default_rng(3).normal(size=(1, 19, 11, 14)).astype(np.float32)
    nets = [_network(2), lambda x: _network(2)(x) * np.float32(-0.5) + 1]
    default = SlidingWindowSettings(patch_size=(8, 8, 8), num_heads=2, mirror_axes=(0, 1, 2),
                                    batch_size=4, max_inflight=3)
    expected = average_folds([predict_sliding_window(data, n, default) for n in nets])
    RecordingMerger.instances.clear()
    result = asyncio.run(predict_folds_async(data, [_shuffled(n, i) for i, n in enumerate(nets)],
                                             dataclasses.replace(default, merger=RecordingMerger)))
    assert len(RecordingMerger.instances) == 2
    assert all(m.tiles == list(range(len(m.tiles))) for m in RecordingMerger.instances)
    assert np.array_equal(result, -expected)
