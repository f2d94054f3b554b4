"""The GPU path's code on CPU tensors: the orchestrator's fold loop keeps every hop on the device backend's
tensor type (torch, on the data's device) and equals nnU-Net; InstanceDevice moves arrays where the
instance computes.

A hop that hands on a NumPy array (``np.asarray(tensor)``, ``tensor.numpy()``) fails here: the data is a
:class:`StrictTensor`, a torch tensor whose conversions to NumPy raise, and the fake network refuses
anything else. The CUDA cases run where torch sees a GPU and skip with the reason elsewhere.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np
import pytest
import torch

from nnunet_triton.numerics._xp import tensor_namespace, to_numpy
from nnunet_triton.numerics.gaussian import compute_gaussian
from nnunet_triton.numerics.sliding_window import average_folds, predict_sliding_window
from nnunet_triton.numerics.tiling import pad_to_patch
from nnunet_triton.numerics.window import SlidingWindowSettings
from nnunet_triton.pipeline.orchestration import predict_folds_async
from nnunet_triton.serving.devices import InstanceDevice

try:
    from . import parity_support as ps
except ImportError:
    import parity_support as ps


class NumpyHopError(AssertionError):
    pass


class StrictTensor(torch.Tensor):
    """A torch tensor that refuses to become a NumPy array (results of torch ops stay StrictTensor)."""

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise NumpyHopError("a hop converted a device-path tensor to a NumPy array")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise NumpyHopError("a hop called .numpy() on a device-path tensor")

    def tolist(self) -> Any:
        raise NumpyHopError("a hop called .tolist() on a device-path tensor")


def _strict(array: np.ndarray, device: str) -> StrictTensor:
    return torch.from_numpy(array).to(device).as_subclass(StrictTensor)


def _devices() -> list[Any]:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
    return ["cpu", pytest.param("cuda", marks=cuda)]


def _strict_network(network: torch.nn.Module, device: str, seen: list[Any]):
    """``infer_batch`` of a fold: refuses input that is not a StrictTensor on ``device``; output likewise."""

    async def infer(x: Any) -> Any:
        seen.append(type(x))
        if not isinstance(x, StrictTensor) or x.device.type != device:
            raise NumpyHopError(f"fold input is {type(x).__name__} on {getattr(x, 'device', 'host')}")
        with torch.inference_mode():  # on plain tensors, one tile per forward as nnU-Net (oneDNN rounding)
            plain = torch.Tensor(x)
            out = torch.cat([network(plain[i:i + 1]) for i in range(plain.shape[0])])
        await asyncio.sleep(0)
        return out.as_subclass(StrictTensor)

    return infer


@pytest.fixture(scope="module")
def plans():
    return ps.make_plans()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("mirror", [(0, 1, 2), None])
def test_fold_loop_keeps_every_hop_on_the_device_tensor_type_and_equals_nnunet(plans, mirror, device):
    params = ps.fold_parameters(plans, ps.CONFIG_NAME_3D, 1, 3, seeds=(21, 22))
    networks = []
    for p in params:
        net = ps.build_network(plans, ps.CONFIG_NAME_3D, 1, 3, seed=0)
        net.load_state_dict(p)
        networks.append(net.to(device))
    data = np.random.default_rng(3).standard_normal((1, 14, 20, 23)).astype(np.float32)  # padded: 14 < 16
    seen: list[Any] = []
    logits = asyncio.run(predict_folds_async(
        _strict(data, device), [_strict_network(n, device, seen) for n in networks],
        SlidingWindowSettings(patch_size=(16, 16, 16), num_heads=3, mirror_axes=mirror, batch_size=3,
                              max_inflight=2, gaussian=compute_gaussian((16, 16, 16))),
    ))
    assert isinstance(logits, StrictTensor) and logits.device.type == device and logits.dtype == torch.float16
    assert seen and set(seen) == {StrictTensor}
    if device == "cpu":  # nnU-Net's CPU predictor is the oracle; on CUDA its convolutions round differently
        network = ps.build_network(plans, ps.CONFIG_NAME_3D, 1, 3, seed=0)
        predictor = ps.make_predictor(plans, ps.make_dataset_json(), ps.CONFIG_NAME_3D, network, params,
                                      mirror_axes=(0, 1, 2), use_mirroring=mirror is not None)
        ref = predictor.predict_logits_from_preprocessed_data(torch.from_numpy(data)).numpy()
        assert np.array_equal(torch.Tensor(logits).numpy(), ref)


@pytest.mark.parametrize("device", _devices())
def test_sliding_window_on_tensors_equals_the_numpy_path_bit_for_bit(device):
    rng = np.random.default_rng(5)
    data = rng.standard_normal((2, 18, 21, 19)).astype(np.float32)
    weight = torch.from_numpy(rng.standard_normal((3, 2, 3, 3, 3)).astype(np.float32))

    def network(x: Any) -> Any:  # per-sample float32 convolution, computed on the host for both paths
        host = torch.from_numpy(x) if isinstance(x, np.ndarray) else torch.Tensor(x).cpu()
        out = torch.nn.functional.conv3d(host, weight, padding=1)
        return out.numpy() if isinstance(x, np.ndarray) else out.to(x.device).as_subclass(StrictTensor)

    window = SlidingWindowSettings(patch_size=(12, 12, 12), num_heads=3, mirror_axes=(0, 1, 2),
                                   tile_step_size=0.5, batch_size=4)
    ours = predict_sliding_window(_strict(data, device), network, window)
    ref = predict_sliding_window(data, network, window)
    assert isinstance(ours, StrictTensor)
    assert np.array_equal(torch.Tensor(ours).cpu().numpy(), ref)


def test_fold_average_and_padding_keep_the_tensor_type_when_given_tensors():
    rng = np.random.default_rng(7)
    folds = [rng.standard_normal((2, 5, 6)).astype(np.float16) for _ in range(3)]
    ours = average_folds([_strict(f, "cpu") for f in folds])
    assert isinstance(ours, StrictTensor) and np.array_equal(torch.Tensor(ours).numpy(), average_folds(folds))
    padded, unpad = pad_to_patch(_strict(folds[0], "cpu"), (8, 9))
    ref_padded, ref_unpad = pad_to_patch(folds[0], (8, 9))
    assert isinstance(padded, StrictTensor) and unpad == ref_unpad
    assert np.array_equal(torch.Tensor(padded).numpy(), ref_padded)
    assert tensor_namespace(padded) is torch and tensor_namespace(folds[0]) is np


# --- InstanceDevice: where a model instance computes ---------------------------------------------------


def test_instance_device_reads_kind_and_device_id_when_triton_initializes():
    gpu = InstanceDevice.from_args({"model_instance_kind": "GPU", "model_instance_device_id": "3"})
    assert (gpu.gpu, gpu.index, gpu.torch_device, gpu.memory) == (True, 3, "cuda:3", "gpu")
    for kind in ("CPU", "MODEL"):
        cpu = InstanceDevice.from_args({"model_instance_kind": kind, "model_instance_device_id": "0"})
        assert (cpu.gpu, cpu.torch_device, cpu.memory) == (False, "cpu", "cpu")


def test_cpu_instance_gives_numpy_arrays_and_writable_cpu_tensors_when_given_either():
    cpu = InstanceDevice()
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    array = cpu.array(tensor)
    assert isinstance(array, np.ndarray) and np.array_equal(array, to_numpy(tensor))
    read_only = np.arange(4, dtype=np.float32)
    read_only.flags.writeable = False
    moved = cpu.tensor(read_only)
    assert isinstance(moved, torch.Tensor) and moved.device.type == "cpu"
    moved += 1  # a copy: the request's read-only buffer is not written
    assert np.array_equal(read_only, np.arange(4)) and cpu.array(None) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_gpu_instance_moves_host_arrays_to_its_device_once():
    gpu = InstanceDevice(gpu=True, index=0)
    moved = gpu.tensor(np.ones((2, 2), np.float32))
    assert moved.device == torch.device("cuda:0") and gpu.tensor(moved) is moved
    cupy = ps.cupy_or_skip()
    as_cupy = gpu.array(np.ones(3, np.float32))
    assert isinstance(as_cupy, cupy.ndarray) and gpu.array(as_cupy) is as_cupy


def test_cupy_parity_fails_instead_of_skipping_when_cupy_cannot_import_but_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(pytest.fail.Exception, match="torch sees a CUDA device but CuPy is not usable"):
        ps.cupy_or_skip(torch_sees_gpu=lambda: True)


def test_cupy_parity_skips_with_the_reason_when_cupy_cannot_import_and_torch_sees_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(pytest.skip.Exception, match="no usable CuPy and torch sees no GPU"):
        ps.cupy_or_skip(torch_sees_gpu=lambda: False)
