"""A fake ``triton_python_backend_utils`` for unit tests (the real one lives in the Triton stub).

It offers what the serving code may use, and refuses what it must not: tensors travel by DLPack only
(``as_numpy`` and ``Tensor(name, ndarray)`` go through the stub's NumPy C API, wrong under NumPy 2).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest


class _Capsule:
    """A bare DLPack capsule offered to np.from_dlpack, which wants an object with ``__dlpack__``."""

    def __init__(self, capsule) -> None:
        self._capsule = capsule

    def __dlpack__(self, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)


class FakeTensor:
    """A host tensor of the stub, offering only what the models may use: DLPack both ways.

    ``as_numpy`` and ``Tensor(name, ndarray)`` go through the stub's NumPy C API (wrong under NumPy 2,
    ``serving.tensors``): the fake refuses both. Tests build their input tensors with ``FakeTensor.of``.
    """

    def __init__(self, name: str, array: np.ndarray, *, _by_dlpack: bool = False) -> None:
        if not _by_dlpack:
            raise AssertionError("pb_utils.Tensor(name, ndarray) goes through the stub's NumPy C API; "
                                 "use pb_utils.Tensor.from_dlpack")
        self._name, self._array = name, array

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> FakeTensor:
        return cls(name, np.require(array, requirements=("C", "W")), _by_dlpack=True)

    @classmethod
    def from_dlpack(cls, name: str, data) -> FakeTensor:
        if type(data).__name__ == "PyCapsule":  # the stub takes a capsule as it is
            data = _Capsule(data)
        # np.from_dlpack raises on what DLPack cannot carry (a read-only NumPy array, for one) as the stub
        # does; the copy stands for the stub's shared-memory copy (and is writeable, unlike the import)
        return cls(name, np.from_dlpack(data).copy(), _by_dlpack=True)

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    def name(self) -> str:
        return self._name

    def is_cpu(self) -> bool:
        return True

    def as_numpy(self) -> np.ndarray:
        raise AssertionError("Tensor.as_numpy goes through the stub's NumPy C API; use DLPack")

    def data(self) -> np.ndarray:
        """What the test reads back (not part of the stub's interface)."""
        return self._array


class FakeError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED = range(6)

    def __init__(self, message: str, code: int) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class FakeResponse:
    def __init__(self, output_tensors=(), error=None) -> None:
        self._outputs, self._error = list(output_tensors), error

    def output_tensors(self) -> list:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self):
        return self._error


class FakeRequest:
    """An incoming request: inputs and JSON parameters."""

    def __init__(self, inputs=(), parameters: str = "") -> None:
        self._inputs, self._parameters = list(inputs), parameters

    def inputs(self) -> list:
        return self._inputs

    def parameters(self) -> str:
        return self._parameters


class FakeBlsRequest:
    """``pb_utils.InferenceRequest``: records its keyword arguments, answers with ``response``."""

    response: FakeResponse | None = None

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs

    async def async_exec(self):
        return FakeBlsRequest.response


class FakeLogger:
    """``pb_utils.Logger``: keeps what was logged."""

    lines: list[tuple[str, str]] = []

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.lines.append(("info", message))

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.lines.append(("warn", message))

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.lines.append(("error", message))


def install(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Put the fake ``triton_python_backend_utils`` into ``sys.modules`` for one test."""
    FakeLogger.lines = []
    module = types.ModuleType("triton_python_backend_utils")
    module.Logger = FakeLogger
    module.Tensor = FakeTensor
    module.TritonError = FakeError
    module.InferenceResponse = FakeResponse
    module.InferenceRequest = FakeBlsRequest
    module.TritonModelException = RuntimeError
    module.TRITONSERVER_MEMORY_CPU, module.TRITONSERVER_MEMORY_GPU = 0, 2
    module.PreferredMemory = lambda kind, device_id: (kind, device_id)

    def by_name(tensors, name):
        return next((t for t in tensors if t.name() == name), None)

    module.get_input_tensor_by_name = lambda request, name: by_name(request.inputs(), name)
    module.get_output_tensor_by_name = lambda response, name: by_name(response.output_tensors(), name)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module


