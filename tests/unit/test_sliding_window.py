"""nnunet_triton.numerics.sliding_window against nnU-Net 2.8.1's nnUNetPredictor on the CPU.

Every comparison is ``np.array_equal`` on float16 logits (max abs diff 0), except the one test
that measures a real torch network's batch-1 vs batch-N outputs (oneDNN picks other conv kernels).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from nnunet_triton.errors import InputValidationError, NumericalError
from nnunet_triton.numerics._xp import get_ndimage, to_numpy
from nnunet_triton.numerics.gaussian import compute_gaussian
from nnunet_triton.numerics.sliding_window import (
    LogitAccumulator,
    average_folds,
    average_tta,
    mirror_combinations,
    predict_sliding_window,
)
from nnunet_triton.numerics.tiling import tile_slicers
from nnunet_triton.numerics.window import SlidingWindowSettings
from nnunet_triton.validate.oracle import nnunet_predictor
from tests.fixture_paths import ALL_FIXTURE_MODELS, require_fixture

try:
    from . import parity_support as ps
except ImportError:
    import parity_support as ps

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"



# ---------------------------------------------------------------- small pieces vs torch arithmetic


def test_mirror_combinations_follow_itertools_order_when_axes_given():
    assert mirror_combinations((0, 1, 2)) == [(0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]
    assert mirror_combinations((0, 1)) == [(0,), (1,), (0, 1)]
    assert mirror_combinations(None) == [] and mirror_combinations(()) == []
    with pytest.raises(InputValidationError):
        mirror_combinations((-1, 0))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_average_tta_equals_torch_inplace_sum_and_division_when_dtype_varies(dtype, xp):
    rng = np.random.default_rng(0)
    preds = [(rng.standard_normal((3, 6, 7, 5)) * 4).astype(dtype) for _ in range(8)]
    ref = torch.from_numpy(preds[0].copy())
    for p in preds[1:]:
        ref += torch.from_numpy(p)
    ref /= len(preds)
    ours = to_numpy(average_tta([xp.asarray(p) for p in preds]))
    assert ours.dtype == dtype and np.array_equal(ours, ref.numpy())
    assert np.array_equal(
        to_numpy(average_tta([xp.asarray(preds[0])])), preds[0]
    )  # identity only: no division


@pytest.mark.parametrize("n_folds", [2, 3, 5])
def test_average_folds_equals_torch_float16_mean_when_fold_count_varies(n_folds, xp):
    rng = np.random.default_rng(n_folds)
    folds = [(rng.standard_normal((2, 9, 8, 7)) * 6).astype(np.float16) for _ in range(n_folds)]
    ref = torch.from_numpy(folds[0].copy())
    for f in folds[1:]:
        ref += torch.from_numpy(f)
    ref /= n_folds
    ours = to_numpy(average_folds([xp.asarray(f) for f in folds]))
    assert ours.dtype == np.float16 and np.array_equal(ours, ref.numpy())


def test_average_folds_raises_when_dtype_or_shape_differ():
    with pytest.raises(InputValidationError):
        average_folds([])
    with pytest.raises(InputValidationError, match="index 1"):
        average_folds([np.zeros((2, 3), np.float16), np.zeros((2, 3), np.float32)])


def _torch_stitch(tiles, slicers, shape, patch, use_gaussian):
    """nnU-Net's _internal_predict_sliding_window_return_logits inner loop, on given tile outputs."""
    logits = torch.zeros((tiles[0].shape[0], *shape), dtype=torch.half)
    n_predictions = torch.zeros(shape, dtype=torch.half)
    gaussian = compute_gaussian(patch) if use_gaussian else None
    gaussian = torch.from_numpy(gaussian) if use_gaussian else 1
    for tile, sl in zip(tiles, slicers, strict=True):
        prediction = torch.from_numpy(tile.copy())
        if use_gaussian:
            prediction *= gaussian
        logits[(slice(None), *sl)] += prediction
        n_predictions[sl] += gaussian
    torch.div(logits, n_predictions, out=logits)
    return logits.numpy()


@pytest.mark.parametrize("tile_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("use_gaussian", [True, False])
def test_logit_accumulator_equals_torch_float16_buffers_when_tiles_overlap(tile_dtype, use_gaussian, xp):
    shape, patch = (20, 27, 33), (16, 16, 16)
    slicers = tile_slicers(shape, patch, 0.25)
    rng = np.random.default_rng(7)
    tiles = [
        (rng.standard_normal((3, *patch)) * 10 ** rng.uniform(-3, 3)).astype(tile_dtype) for _ in slicers
    ]
    acc = LogitAccumulator(3, shape, patch, use_gaussian=use_gaussian, xp=xp)
    for tile, sl in zip(tiles, slicers, strict=True):
        acc.add(xp.asarray(tile), sl)
    ours = to_numpy(acc.finalize((slice(None),) * 3))
    ref = _torch_stitch(tiles, slicers, shape, patch, use_gaussian)
    assert ours.dtype == np.float16 and acc.num_tiles == len(slicers)
    assert np.array_equal(ours, ref, equal_nan=True)


def test_logit_accumulator_differs_from_correctly_rounded_sum_when_emulating_torch():
    """fp16 += fp32 is a float32 add rounded to float16 (double rounding), as torch does."""
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(100_000) * 5).astype(np.float16)
    b = (rng.standard_normal(100_000) * 3).astype(np.float32)
    t = torch.from_numpy(a.copy())
    t += torch.from_numpy(b)
    via_float32 = (a.astype(np.float32) + b).astype(np.float16)
    correctly_rounded = (a.astype(np.float64) + b.astype(np.float64)).astype(np.float16)
    assert np.array_equal(t.numpy(), via_float32) and not np.array_equal(t.numpy(), correctly_rounded)


def test_logit_accumulator_raises_when_logits_overflow_float16():
    acc = LogitAccumulator(1, (16, 16), (16, 16))
    acc.add(np.full((1, 16, 16), 1e5, np.float32), (slice(0, 16), slice(0, 16)))
    with pytest.raises(NumericalError, match="inf"):
        acc.finalize()


def test_logit_accumulator_guards_misuse_when_called_out_of_order():
    acc = LogitAccumulator(2, (16, 16), (8, 8))
    with pytest.raises(InputValidationError, match="shape"):
        acc.add(np.zeros((3, 8, 8), np.float32), (slice(0, 8), slice(0, 8)))
    with pytest.raises(InputValidationError, match="selects"):
        acc.add(np.zeros((2, 8, 8), np.float32), (slice(12, 20), slice(0, 8)))
    acc.add(np.zeros((2, 8, 8), np.float32), (slice(0, 8), slice(0, 8)))
    acc.finalize()
    with pytest.raises(RuntimeError, match="twice"):
        acc.finalize()
    with pytest.raises(RuntimeError, match="after finalize"):
        acc.add(np.zeros((2, 8, 8), np.float32), (slice(0, 8), slice(0, 8)))


# ---------------------------------------------------------------- deterministic fake network


class FixedConv:
    """Per-sample deterministic 'network': asymmetric 3x3(x3) correlation + position ramp, float32."""

    def __init__(self, n_in: int, n_out: int, ndim: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.w = rng.standard_normal((n_out, n_in) + (3,) * ndim).astype(np.float32)
        self.ndim = ndim
        self.calls: list[int] = []

    def __call__(self, x):
        xp = np if isinstance(x, np.ndarray) else __import__("cupy")
        ndimage = get_ndimage(xp)
        self.calls.append(int(x.shape[0]))
        out = xp.zeros((x.shape[0], self.w.shape[0], *x.shape[2:]), dtype=xp.float32)
        ramp = xp.arange(x.shape[-1], dtype=xp.float32) / 7
        for n, k, c in itertools.product(range(x.shape[0]), range(self.w.shape[0]), range(self.w.shape[1])):
            out[n, k] += ndimage.correlate(x[n, c], xp.asarray(self.w[k, c]), mode="constant")
        return out + ramp


class TorchWrapped(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return torch.from_numpy(self.fn(x.numpy()))


@pytest.mark.parametrize("batch_size", [2, 3, 8, 50])
def test_predict_sliding_window_is_batch_invariant_when_network_is_per_sample(batch_size, xp):
    data = xp.asarray(np.random.default_rng(1).standard_normal((2, 18, 21, 19)).astype(np.float32))
    net = FixedConv(2, 3, 3)
    kwargs = dict(patch_size=(12, 12, 12), num_heads=3, mirror_axes=(0, 1, 2), tile_step_size=0.5)
    one = to_numpy(predict_sliding_window(data, net, SlidingWindowSettings(batch_size=1, **kwargs)))
    n_inputs = sum(net.calls)
    net.calls.clear()
    many = to_numpy(predict_sliding_window(data, net, SlidingWindowSettings(batch_size=batch_size, **kwargs)))
    assert np.array_equal(one, many) and sum(net.calls) == n_inputs
    assert max(net.calls) == min(batch_size, n_inputs)


@pytest.mark.parametrize(
    "configuration, shape, patch, mirror",
    [
        (ps.CONFIG_NAME_3D, (2, 18, 21, 19), (12, 12, 12), (0, 1, 2)),
        (ps.CONFIG_NAME_3D, (2, 18, 21, 19), (12, 12, 12), (1, 2)),
        (ps.CONFIG_NAME_2D, (2, 3, 21, 19), (12, 12), (0, 1)),
    ],
)
def test_predict_sliding_window_equals_nnunet_when_network_is_fixed_conv(
    configuration, shape, patch, mirror, xp
):
    data = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    net = FixedConv(2, 3, len(patch))
    plans = ps.make_plans(
        patch_3d=patch if len(patch) == 3 else (16, 16, 16),
        patch_2d=patch if len(patch) == 2 else (16, 16),
        n_channels=2,
    )
    predictor = ps.make_predictor(
        plans, ps.make_dataset_json(n_channels=2), configuration, TorchWrapped(net), None, mirror_axes=mirror
    )
    ref = predictor.predict_sliding_window_return_logits(torch.from_numpy(data)).numpy()
    ours = to_numpy(
        predict_sliding_window(
            xp.asarray(data), net,
            SlidingWindowSettings(patch_size=patch, num_heads=3, mirror_axes=mirror, batch_size=3),
        )
    )
    assert np.array_equal(ours, ref)


def test_predict_sliding_window_raises_when_arguments_invalid():
    data = np.zeros((1, 16, 16, 16), np.float32)
    net = FixedConv(1, 2, 3)
    kwargs = dict(patch_size=(16, 16, 16), num_heads=2)
    with pytest.raises(InputValidationError, match="mirror_axes"):
        predict_sliding_window(data, net, SlidingWindowSettings(mirror_axes=(0, 3), **kwargs))
    with pytest.raises(InputValidationError, match="batch_size"):
        predict_sliding_window(data, net, SlidingWindowSettings(mirror_axes=None, batch_size=0, **kwargs))
    with pytest.raises(InputValidationError, match="data shape"):
        predict_sliding_window(data[0, 0], net, SlidingWindowSettings(mirror_axes=None, **kwargs))
    with pytest.raises(InputValidationError, match="predict_batch returned"):
        predict_sliding_window(data, lambda x: x, SlidingWindowSettings(mirror_axes=None, **kwargs))


# ---------------------------------------------------------------- real nnU-Net network (PlainConvUNet)


@pytest.fixture(scope="module")
def plans():
    return ps.make_plans()


@pytest.fixture(scope="module")
def net3d(plans):
    return ps.build_network(plans, ps.CONFIG_NAME_3D, 1, 3, seed=0)


def _nnunet_logits(
    plans, configuration, network, parameters, data, *, mirror_axes, step=0.5, use_mirroring=True
):
    predictor = ps.make_predictor(
        plans,
        ps.make_dataset_json(),
        configuration,
        network,
        parameters,
        mirror_axes=mirror_axes,
        tile_step_size=step,
        use_mirroring=use_mirroring,
    )
    return predictor.predict_logits_from_preprocessed_data(torch.from_numpy(data)).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("mirror", [(0, 1, 2), None])
@pytest.mark.parametrize("step", [0.5, 0.7])
def test_predict_sliding_window_equals_nnunet_when_real_3d_network(plans, net3d, mirror, step, xp):
    data = np.random.default_rng(0).standard_normal((1, 18, 22, 27)).astype(np.float32)
    ref = _nnunet_logits(
        plans,
        ps.CONFIG_NAME_3D,
        net3d,
        [net3d.state_dict()],
        data,
        mirror_axes=(0, 1, 2),
        step=step,
        use_mirroring=mirror is not None,
    )
    ours = to_numpy(
        predict_sliding_window(
            xp.asarray(data),
            ps.torch_predict_batch(net3d),
            SlidingWindowSettings(patch_size=(16, 16, 16), num_heads=3, mirror_axes=mirror,
                                  tile_step_size=step),
        )
    )
    assert ours.dtype == ref.dtype == np.float16 and np.array_equal(ours, ref)


def test_predict_sliding_window_equals_nnunet_when_input_smaller_than_patch(plans, net3d, xp):
    data = np.random.default_rng(4).standard_normal((1, 9, 16, 13)).astype(np.float32)
    ref = _nnunet_logits(plans, ps.CONFIG_NAME_3D, net3d, [net3d.state_dict()], data, mirror_axes=(0, 1, 2))
    ours = to_numpy(
        predict_sliding_window(
            xp.asarray(data),
            ps.torch_predict_batch(net3d),
            SlidingWindowSettings(patch_size=(16, 16, 16), num_heads=3, mirror_axes=(0, 1, 2)),
        )
    )
    assert ours.shape == (3, 9, 16, 13) and np.array_equal(ours, ref)


@pytest.mark.slow
def test_predict_sliding_window_equals_nnunet_when_2d_configuration_on_3d_data(plans, xp):
    net = ps.build_network(plans, ps.CONFIG_NAME_2D, 1, 3, seed=1)
    data = np.random.default_rng(5).standard_normal((1, 3, 20, 27)).astype(np.float32)
    ref = _nnunet_logits(plans, ps.CONFIG_NAME_2D, net, [net.state_dict()], data, mirror_axes=(0, 1))
    ours = to_numpy(
        predict_sliding_window(
            xp.asarray(data),
            ps.torch_predict_batch(net),
            SlidingWindowSettings(patch_size=(16, 16), num_heads=3, mirror_axes=(0, 1)),
        )
    )
    assert np.array_equal(ours, ref)


@pytest.mark.slow
@pytest.mark.parametrize("n_folds", [2, 3])
def test_fold_average_equals_nnunet_predict_logits_when_several_parameter_sets(plans, n_folds, xp):
    params = ps.fold_parameters(plans, ps.CONFIG_NAME_3D, 1, 3, seeds=range(10, 10 + n_folds))
    network = ps.build_network(plans, ps.CONFIG_NAME_3D, 1, 3, seed=99)
    data = np.random.default_rng(6).standard_normal((1, 18, 20, 24)).astype(np.float32)
    ref = _nnunet_logits(
        plans, ps.CONFIG_NAME_3D, network, params, data, mirror_axes=(0, 1, 2), use_mirroring=False
    )
    per_fold = []
    for p in params:
        network.load_state_dict(p)
        per_fold.append(
            predict_sliding_window(
                xp.asarray(data),
                ps.torch_predict_batch(network),
                SlidingWindowSettings(patch_size=(16, 16, 16), num_heads=3, mirror_axes=None),
            )
        )
    assert np.array_equal(to_numpy(average_folds(per_fold)), ref)


def test_torch_cpu_network_batch_n_matches_batch_1_only_without_onednn(net3d, record_property):
    """Measurement: oneDNN convs pick batch-size-dependent kernels on the CPU (ulp-level differences)."""
    data = np.random.default_rng(8).standard_normal((1, 20, 27, 33)).astype(np.float32)
    kwargs = dict(patch_size=(16, 16, 16), num_heads=3, mirror_axes=None)
    predict = ps.torch_predict_batch(net3d)
    batch_1 = SlidingWindowSettings(batch_size=1, **kwargs)
    batch_4 = SlidingWindowSettings(batch_size=4, **kwargs)
    with torch.backends.mkldnn.flags(enabled=False):
        one_ref = predict_sliding_window(data, predict, batch_1)
        four_ref = predict_sliding_window(data, predict, batch_4)
    assert np.array_equal(one_ref, four_ref)
    one = predict_sliding_window(data, predict, batch_1)
    four = predict_sliding_window(data, predict, batch_4)
    record_property("onednn_batch4_vs_batch1_max_abs_diff_fp16_logits", ps.max_abs_diff(one, four))
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: only the native kernels ran (equal at both batch sizes)")
    if np.array_equal(one, four):
        pytest.skip("oneDNN picked kernels that round alike at batch 1 and 4 on this CPU "
                    f"({torch.backends.cpu.get_cpu_capability()}): nothing differs to bound")
    assert 0 < ps.max_abs_diff(one, four) <= 1e-2  # fp16 ulp flips only (|logit| < 8 here: ulp <= 2**-8)


# ---------------------------------------------------------------- fixture models (tests/fixtures)


def _fixture_model_dirs() -> list[Path]:
    found = {  # fold_[0-9]*: the cascade fixture (fold_all only) is covered by test_cascade.py
        p.parent for p in FIXTURES.glob("**/plans.json") if any(p.parent.glob("fold_[0-9]*/checkpoint_*.pth"))
    }
    return sorted(found | {model.model_dir for model in ALL_FIXTURE_MODELS})  # these two always


@pytest.mark.slow
@pytest.mark.parametrize("model_dir", _fixture_model_dirs(), ids=lambda p: p.name)
def test_predict_sliding_window_equals_nnunet_when_fixture_model(model_dir):
    require_fixture(model_dir / "plans.json")
    predictor = nnunet_predictor(model_dir)
    patch = tuple(predictor.configuration_manager.patch_size)
    n_in = len(predictor.dataset_json["channel_names"])
    spatial = tuple(p + 3 for p in patch) if len(patch) == 3 else (2, *(p + 3 for p in patch))
    data = np.random.default_rng(9).standard_normal((n_in, *spatial)).astype(np.float32)
    ref = predictor.predict_logits_from_preprocessed_data(torch.from_numpy(data)).numpy()
    per_fold = []
    for params in predictor.list_of_parameters:
        predictor.network.load_state_dict(params)
        per_fold.append(
            predict_sliding_window(
                data,
                ps.torch_predict_batch(predictor.network.eval()),
                SlidingWindowSettings(patch_size=patch,
                                      num_heads=predictor.label_manager.num_segmentation_heads,
                                      mirror_axes=predictor.allowed_mirroring_axes),
            )
        )
    assert np.array_equal(average_folds(per_fold), ref)
