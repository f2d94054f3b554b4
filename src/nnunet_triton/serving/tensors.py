"""Triton tensors <-> arrays (NumPy on the host, CuPy/torch on the GPU), through DLPack only.

Every tensor enters and leaves a Python model by DLPack (``__dlpack__``/``pb_utils.Tensor.from_dlpack``),
never by ``Tensor.as_numpy()`` or ``pb_utils.Tensor(name, ndarray)``: those two go through NumPy's C API
inside the stub, and the stub of pytriton's tritonserver 2.51 is built with a pybind11 older than 2.12,
which reads NumPy's C structures with NumPy 1's layout (with NumPy 2 it takes a dtype's size from
another field and builds arrays with wrong strides; ``tests/triton/test_embedded_server.py`` checks the
DLPack round trip bit for bit, ``tests/unit/test_layering.py`` that no model uses the other route).
DLPack hands over pointer, shape and dtype without that API, so the models run with NumPy 2 (which CuPy
for CUDA 13 requires) as well as 1.x. Input tensors are freed when ``execute`` returns, so callers that
keep data beyond that must pass ``copy=True``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from nnunet_triton import io_names
from nnunet_triton.dtypes import numpy_dtype
from nnunet_triton.errors import InputValidationError, PlansError
from nnunet_triton.numerics._xp import is_torch_module
from nnunet_triton.serving._pb import pb_utils

__all__ = ["tensor_to_array", "copy_settled", "input_array", "image_array", "output_tensor",
           "request_parameters", "model_parameters", "declared_segmentation_dtype"]



def tensor_to_array(tensor: Any, *, xp: ModuleType | None = None, copy: bool = False) -> Any:
    """Return the data of a ``pb_utils.Tensor`` as an array, zero-copy through DLPack.

    Args:
        tensor: a ``pb_utils.Tensor`` (request input or BLS response output).
        xp: array module for the result (``numpy``, ``cupy`` or ``torch``); ``None`` means NumPy for
            CPU tensors and CuPy for GPU tensors (a GPU tensor never becomes NumPy).
        copy: copy the data so it outlives the request/response that owns it.
    """
    if is_torch_module(xp):
        array = xp.from_dlpack(tensor)
        return copy_settled(array, xp=xp) if copy else array
    if tensor.is_cpu():
        array = np.from_dlpack(tensor)
        if copy:
            array = array.copy()
        return array if xp is None or xp is np else xp.asarray(array)
    if xp is None or xp is np:
        import cupy

        xp = cupy
    array = xp.from_dlpack(tensor)
    return copy_settled(array, xp=xp) if copy else array


def copy_settled(array: Any, *, xp: ModuleType) -> Any:
    """Copy an array (torch tensor on any device, or CuPy array) and wait until a device copy has run.

    A copy that must outlive the Triton tensor it reads (a BLS response's output, a request's input)
    cannot be left in flight: ``clone()``/``copy()`` only enqueue a kernel on the current stream, and
    Triton's ``Tensor.__dlpack__`` ignores the ``stream`` it is given, so nothing orders the copy before
    the release. Releasing a BLS response tells the parent process to free that block of the CUDA memory
    pool, and the next fold response, written by another process, can land in the same block before the
    copy ran: a wrong answer under concurrency, without any error. Synchronizing the copy's stream
    before returning closes that window (one wait per fold batch; the copy is microseconds).

    Args:
        array: the device array imported by DLPack from the Triton tensor.
        xp: its module, ``torch`` or ``cupy``.
    """
    if is_torch_module(xp):
        copy = array.clone()
        if copy.is_cuda:
            xp.cuda.current_stream(copy.device).synchronize()
        return copy
    copy = array.copy()
    xp.cuda.get_current_stream().synchronize()
    return copy


def input_array(
    request: Any,
    name: str,
    *,
    xp: ModuleType | None = None,
    optional: bool = False,
    copy: bool = False,
    on_host: Callable[[str], None] | None = None,
) -> Any:
    """Return input ``name`` of ``request`` as an array (see :func:`tensor_to_array`).

    ``on_host(name)`` is called when the tensor arrived in host memory: a KIND_GPU instance passes
    ``RequestRecord.host_fallback`` for the tensors that should reach it in device memory.

    Raises:
        InputValidationError: if the input is missing and not ``optional`` (then ``None`` is returned).
    """
    tensor = pb_utils().get_input_tensor_by_name(request, name)
    if tensor is None:
        if optional:
            return None
        raise InputValidationError(f"request has no input tensor {name!r}; it is required.")
    if on_host is not None and tensor.is_cpu():
        on_host(name)
    return tensor_to_array(tensor, xp=xp, copy=copy)


def image_array(request: Any, *, xp: ModuleType | None = None) -> Any:
    """The request's IMAGE, whichever dtype input carries it (``io_names.IMAGE_DTYPES``), as sent.

    The typed endpoints (``nnunet_int16``, ...) map IMAGE onto ``IMAGE_INT16``, ...; a request reaching
    preprocess_model directly may use any one of them.

    Raises:
        InputValidationError: none or several of the IMAGE inputs are present.
    """
    names = [io_names.image_input(dtype) for dtype in io_names.IMAGE_DTYPES]
    present = [(name, tensor) for name in names
               if (tensor := pb_utils().get_input_tensor_by_name(request, name)) is not None]
    if len(present) != 1:
        raise InputValidationError(
            f"request must carry exactly one of the inputs {names} (the image in its own dtype), "
            f"got {[name for name, _ in present] or 'none'}."
        )
    return tensor_to_array(present[0][1], xp=xp)


# The Python backend (2.51) marks a DLPack capsule it consumed "used_dlpack"; DLPack's name for that is
# "used_dltensor", which is what NumPy's capsule destructor looks for: finding neither, it reports
# "ValueError: PyCapsule_GetPointer called with incorrect name" (as unraisable, once per tensor; nothing is
# leaked or freed twice, the consumer owns the tensor). Renaming the consumed capsule as DLPack says keeps
# the log free of that noise.
_TRITON_USED_CAPSULE = b"used_dlpack"
_DLPACK_USED_CAPSULE = b"used_dltensor"  # module-level: a capsule's name must outlive the capsule


@functools.cache
def _capsule_api() -> Any:
    import ctypes

    api = ctypes.PyDLL(None)  # this process's Python C API, with argument types of its own
    api.PyCapsule_IsValid.argtypes = (ctypes.py_object, ctypes.c_char_p)
    api.PyCapsule_IsValid.restype = ctypes.c_int
    api.PyCapsule_SetName.argtypes = (ctypes.py_object, ctypes.c_char_p)
    api.PyCapsule_SetName.restype = ctypes.c_int
    return api


def _host_tensor(name: str, array: np.ndarray) -> Any:
    """``pb_utils.Tensor.from_dlpack`` of a NumPy array's capsule, renamed as consumed the DLPack way."""
    capsule = array.__dlpack__()
    tensor = pb_utils().Tensor.from_dlpack(name, capsule)
    api = _capsule_api()
    if api.PyCapsule_IsValid(capsule, _TRITON_USED_CAPSULE):
        api.PyCapsule_SetName(capsule, _DLPACK_USED_CAPSULE)
    return tensor


def output_tensor(name: str, array: Any) -> Any:
    """Wrap an array (NumPy, CuPy or torch, any device) as a ``pb_utils.Tensor`` named ``name``, by DLPack.

    DLPack needs C-contiguous data, and NumPy exports only writeable arrays, so those are made first
    (a copy only where the array is not already so).
    """
    if isinstance(array, np.ndarray | np.generic):
        return _host_tensor(name, np.require(array, requirements=("C", "W")))
    if hasattr(array, "is_contiguous"):  # torch, host or device
        array = array.detach().contiguous()
    elif hasattr(array, "flags") and not array.flags.c_contiguous:  # cupy
        import cupy

        array = cupy.ascontiguousarray(array)
    return pb_utils().Tensor.from_dlpack(name, array)


def request_parameters(request: Any) -> dict[str, Any]:
    """Return the request's parameters (``request.parameters()`` is a JSON string) as a dict."""
    text = request.parameters()
    if not text:
        return {}
    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputValidationError(
            f"request parameters must be JSON text ({exc}), got {text[:200]!r}."
        ) from None
    return dict(params)


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """Return the ``parameters`` of the model's config.pbtxt as ``{key: string_value}``.

    ``args`` is the dict Triton passes to ``initialize``; ``args["model_config"]`` is JSON text.
    """
    config = json.loads(args["model_config"])
    return {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}


def declared_segmentation_dtype(model_config: Mapping[str, Any]) -> np.dtype:
    """NumPy dtype of the SEGMENTATION output the model's config.pbtxt declares (UINT8 or UINT16).

    ``model_config`` is ``json.loads(args["model_config"])`` of ``initialize``.
    """
    for output in model_config.get("output", []):
        if output["name"] == io_names.SEGMENTATION:
            dtype = numpy_dtype(output["data_type"])
            if dtype not in (np.uint8, np.uint16):
                raise PlansError(
                    f"output {io_names.SEGMENTATION!r} must be TYPE_UINT8 or TYPE_UINT16, "
                    f"got {output['data_type']!r}."
                )
            return dtype
    raise PlansError(f"config.pbtxt declares no output {io_names.SEGMENTATION!r}.")
