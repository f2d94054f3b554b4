"""nnunet_triton.serving against a fake ``triton_python_backend_utils`` (the real one lives in the stub)."""

from __future__ import annotations

import asyncio
import json
import logging
import types

import numpy as np
import pytest
from fake_pb import FakeBlsRequest, FakeError, FakeRequest, FakeResponse, FakeTensor, install

from nnunet_triton import errors, serving


@pytest.fixture(autouse=True)
def pb(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return install(monkeypatch)


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (errors.InputValidationError("bad shape"), FakeError.INVALID_ARG, "bad shape"),
        (errors.UnsupportedModelError("cascade"), FakeError.UNSUPPORTED, "cascade"),
        (errors.ServerError("not ready"), FakeError.UNAVAILABLE, "not ready"),
        (errors.SubmodelError("gone", triton_code="UNAVAILABLE"), FakeError.UNAVAILABLE, "gone"),
        (errors.SubmodelError("fold_0 failed"), FakeError.INTERNAL, "fold_0 failed"),
        (KeyError("x"), FakeError.INTERNAL, "KeyError: 'x'"),
    ],
)
def test_error_response_maps_triton_code_when_given_exception(exc, code: int, message: str) -> None:
    response = serving.error_response(exc)
    assert (response.error().code(), response.error().message()) == (code, message)
    assert response.output_tensors() == []


def test_internal_error_response_logs_traceback_and_returns_internal(caplog) -> None:
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError as exc:
        response = serving.internal_error_response(exc, logging.getLogger("test"))
    error = response.error()
    assert (error.code(), error.message()) == (FakeError.INTERNAL, "ZeroDivisionError: boom")
    assert "Traceback" in caplog.text and "boom" in caplog.text


def test_ok_response_wraps_each_array_as_contiguous_tensor() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    response = serving.ok_response({"A": array, "B": np.uint8(3)})
    tensors = {t.name(): t.data() for t in response.output_tensors()}
    assert tensors["A"].flags.c_contiguous and np.array_equal(tensors["A"], array)
    assert tensors["B"] == 3


def test_a_read_only_array_is_copied_into_a_writeable_one_for_dlpack() -> None:
    array = np.arange(4, dtype=np.float32)
    array.flags.writeable = False  # NumPy refuses to export such an array by DLPack (BufferError)
    (tensor,) = serving.ok_response({"A": array}).output_tensors()
    assert np.array_equal(tensor.data(), array)


def test_torch_tensors_travel_by_dlpack_both_ways() -> None:
    import torch

    transposed = torch.arange(6, dtype=torch.float16).reshape(2, 3).T
    (tensor,) = serving.ok_response({"T": transposed}).output_tensors()
    assert tensor.data().dtype == np.float16 and tensor.data().tolist() == [[0, 3], [1, 4], [2, 5]]
    back = serving.tensor_to_array(tensor, xp=torch)
    assert isinstance(back, torch.Tensor) and back.tolist() == [[0, 3], [1, 4], [2, 5]]


def test_input_array_returns_none_when_optional_and_raises_when_required() -> None:
    request = FakeRequest(inputs=[FakeTensor.of("IMAGE", np.ones((2, 2), np.float32))])
    assert np.array_equal(serving.input_array(request, "IMAGE"), np.ones((2, 2), np.float32))
    assert serving.input_array(request, "FLAG", optional=True) is None
    with pytest.raises(errors.InputValidationError, match="request has no input tensor 'FLAG'"):
        serving.input_array(request, "FLAG")


def test_input_array_copies_when_asked() -> None:
    data = np.zeros(3, np.float32)
    copied = serving.input_array(FakeRequest(inputs=[FakeTensor.of("X", data)]), "X", copy=True)
    copied[0] = 1
    assert data[0] == 0


def test_request_parameters_parse_json_and_reject_garbage() -> None:
    assert serving.request_parameters(FakeRequest(parameters=json.dumps({"mirroring": False}))) == {
        "mirroring": False
    }
    assert serving.request_parameters(FakeRequest()) == {}
    with pytest.raises(errors.InputValidationError, match="request parameters must be JSON"):
        serving.request_parameters(FakeRequest(parameters="{not json"))


def test_model_parameters_return_string_values() -> None:
    config = {
        "parameters": {"tile_batch_size": {"string_value": "4"}, "fold_models": {"string_value": "fold_0"}}
    }
    assert serving.model_parameters({"model_config": json.dumps(config)}) == {
        "tile_batch_size": "4",
        "fold_models": "fold_0",
    }


def test_infer_returns_requested_outputs_when_callee_succeeds() -> None:
    FakeBlsRequest.response = FakeResponse([FakeTensor.of("OUTPUT__0", np.full(2, 7, np.float32))])
    result = asyncio.run(serving.infer("fold_0", {"INPUT__0": np.zeros(2, np.float32)}, ["OUTPUT__0"]))
    assert list(result) == ["OUTPUT__0"] and np.array_equal(result["OUTPUT__0"], [7, 7])


def test_infer_raises_submodel_error_naming_model_when_its_response_has_error() -> None:
    FakeBlsRequest.response = FakeResponse(error=FakeError("out of memory", FakeError.INTERNAL))
    with pytest.raises(errors.SubmodelError, match="model 'fold_1' failed: out of memory"):
        asyncio.run(serving.infer("fold_1", {"INPUT__0": np.zeros(2, np.float32)}, ["OUTPUT__0"]))


@pytest.mark.parametrize(
    ("message", "code", "expected"),
    [
        ("overloaded", FakeError.UNAVAILABLE, "UNAVAILABLE"),
        ("bad tile", FakeError.INVALID_ARG, "INVALID_ARG"),
        ("unsupported", FakeError.UNSUPPORTED, "UNSUPPORTED"),
        ("out of memory", FakeError.INTERNAL, "INTERNAL"),
        ("Stub process 'fold_0_0_0' is not healthy.", FakeError.INTERNAL, "UNAVAILABLE"),
        ("Failed for execute the inference request. Model 'fold_0' is not ready.", FakeError.INTERNAL,
         "UNAVAILABLE"),
        ("Request for unknown model: 'fold_0' has no available versions", FakeError.NOT_FOUND, "UNAVAILABLE"),
    ],
)
def test_submodel_error_keeps_callee_code_and_makes_a_callee_that_is_not_running_unavailable(
        message: str, code: int, expected: str, pb: types.ModuleType) -> None:
    FakeBlsRequest.response = FakeResponse(error=FakeError(message, code))
    with pytest.raises(errors.SubmodelError) as info:
        asyncio.run(serving.infer("fold_0", {"INPUT__0": np.zeros(2, np.float32)}, ["OUTPUT__0"]))
    assert info.value.triton_code == expected
    response = serving.error_response(info.value)  # what the orchestrator answers
    assert response.error().code() == getattr(FakeError, expected)
    assert response.error().message() == f"model 'fold_0' failed: {message}"


def test_submodel_error_without_callee_code_is_internal(pb: types.ModuleType) -> None:
    class OldError:  # a TritonError without code() (python_backend before 23.x)
        def message(self) -> str:
            return "boom"

    FakeBlsRequest.response = FakeResponse(error=OldError())
    with pytest.raises(errors.SubmodelError) as info:
        asyncio.run(serving.infer("fold_0", {"INPUT__0": np.zeros(2, np.float32)}, ["OUTPUT__0"]))
    assert info.value.triton_code == "INTERNAL"


def test_infer_raises_submodel_error_when_an_output_is_missing() -> None:
    FakeBlsRequest.response = FakeResponse([])
    with pytest.raises(errors.SubmodelError, match="model 'fold_0' returned no output 'OUTPUT__0'"):
        asyncio.run(serving.infer("fold_0", {"INPUT__0": np.zeros(2, np.float32)}, ["OUTPUT__0"]))


def test_build_request_passes_options_through() -> None:
    request = serving.bls.build_request("fold_0", {"INPUT__0": np.zeros(1, np.float32)}, ["OUTPUT__0"],
                                        parameters={"a": 1}, timeout_us=5)
    assert {k: v for k, v in request.kwargs.items() if k != "inputs"} == {
        "model_name": "fold_0", "requested_output_names": ["OUTPUT__0"], "parameters": {"a": 1}, "timeout": 5,
    }
    assert [t.name() for t in request.kwargs["inputs"]] == ["INPUT__0"]


def test_an_input_that_arrived_in_host_memory_is_reported_to_the_watcher() -> None:
    seen: list[str] = []
    request = FakeRequest(inputs=[FakeTensor.of("LOGITS", np.ones(2, np.float16))])
    serving.input_array(request, "LOGITS", on_host=seen.append)
    assert seen == ["LOGITS"]


@pytest.mark.parametrize(("device", "reported"), [("gpu", ["OUTPUT__0"]), ("cpu", [])])
def test_a_bls_output_asked_for_in_gpu_memory_but_returned_on_the_host_is_reported(device, reported) -> None:
    FakeBlsRequest.response = FakeResponse([FakeTensor.of("OUTPUT__0", np.zeros(2, np.float32))])
    seen: list[str] = []
    asyncio.run(serving.infer("fold_0", {"INPUT__0": np.zeros(2, np.float32)}, ["OUTPUT__0"],
                              output_device=device, on_host=seen.append))
    assert seen == reported


class _FakeCuda:
    """A CUDA runtime on the CPU: copies and stream synchronizations become entries in ``events``."""

    def __init__(self, name: str) -> None:
        self.events: list[str] = []
        self.module = types.ModuleType(name)  # "torch" or "cupy": the module tensor_to_array is given
        stream = types.SimpleNamespace(synchronize=lambda: self.events.append("sync"))
        self.module.cuda = types.SimpleNamespace(current_stream=lambda device: stream,
                                                 get_current_stream=lambda: stream)
        self.module.from_dlpack = lambda tensor: self._array()

    def _array(self) -> types.SimpleNamespace:
        def copy() -> types.SimpleNamespace:
            self.events.append("copy")  # enqueued on the stream, not yet run
            return self._array()

        return types.SimpleNamespace(is_cuda=True, device="cuda:0", shape=(2,), clone=copy, copy=copy)


@pytest.mark.parametrize("module", ["torch", "cupy"])
def test_a_device_copy_of_a_bls_output_has_run_before_the_response_is_released(
        module: str, pb: types.ModuleType) -> None:
    cuda = _FakeCuda(module)

    class DeviceTensor(FakeTensor):
        def is_cpu(self) -> bool:
            return False

    class Response(FakeResponse):
        def __del__(self) -> None:  # the parent frees the output's pool block on release
            cuda.events.append("release")

    class Request(FakeBlsRequest):
        async def async_exec(self):
            return Response([DeviceTensor.of("OUTPUT__0", np.zeros(2, np.float32))])

    pb.InferenceRequest = Request
    result = asyncio.run(serving.infer("fold_0", {"INPUT__0": np.zeros(2, np.float32)}, ["OUTPUT__0"],
                                       xp=cuda.module, copy=True, output_device="gpu"))
    assert result["OUTPUT__0"].shape == (2,)
    assert cuda.events == ["copy", "sync", "release"]
