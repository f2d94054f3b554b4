"""The one helper every BLS call goes through.

It checks *its own* response (the tutorials' Part 6 bug checked another variable) and raises
:class:`~nnunet_triton.errors.SubmodelError` naming the callee and carrying the callee's Triton error
code (as python_backend's ``bls_error_code`` example reads ``error.code()``), so the orchestrator fails
the request with a message that says which model broke and a code the client can act on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from nnunet_triton.errors import SubmodelError
from nnunet_triton.serving._pb import pb_utils
from nnunet_triton.serving.tensors import output_tensor, tensor_to_array
from nnunet_triton.util.retry import TritonCode, triton_code

__all__ = ["build_request", "callee_code", "infer"]


def build_request(
    model_name: str,
    inputs: Mapping[str, Any],
    output_names: Sequence[str],
    *,
    parameters: Mapping[str, Any] | None = None,
    timeout_us: int = 0,
    output_device: str | None = None,
    device_id: int = 0,
    parent: Any = None,
) -> Any:
    """Return a ``pb_utils.InferenceRequest``; ``inputs`` values are arrays or ``pb_utils.Tensor``.

    ``output_device`` ("cpu" / "gpu") sets ``preferred_memory`` for the callee's outputs; ``parent``
    (the incoming request) links the child into its trace.
    """
    pb = pb_utils()
    tensors = [
        value if isinstance(value, pb.Tensor) else output_tensor(name, value)
        for name, value in inputs.items()
    ]
    kwargs: dict[str, Any] = {
        "model_name": model_name,
        "inputs": tensors,
        "requested_output_names": list(output_names),
    }
    if timeout_us:
        kwargs["timeout"] = int(timeout_us)
    if parameters:
        kwargs["parameters"] = dict(parameters)
    if output_device is not None:
        kind = {"cpu": pb.TRITONSERVER_MEMORY_CPU, "gpu": pb.TRITONSERVER_MEMORY_GPU}.get(output_device)
        if kind is None:
            raise ValueError(f"output_device must be 'cpu' or 'gpu', got {output_device!r}.")
        kwargs["preferred_memory"] = pb.PreferredMemory(kind, device_id)
    if parent is not None:
        kwargs["trace"] = parent.trace()
    return pb.InferenceRequest(**kwargs)


async def infer(
    model_name: str,
    inputs: Mapping[str, Any],
    output_names: Sequence[str],
    *,
    xp: ModuleType | None = None,
    copy: bool = False,
    on_host: Callable[[str], None] | None = None,
    **request_options: Any,
) -> dict[str, Any]:
    """Run ``model_name`` through BLS (``async_exec``) and return ``{output name: array}``.

    Args:
        model_name: the callee (e.g. ``io_names.fold_model_name(0)``).
        inputs: ``{input name: array or pb_utils.Tensor}``.
        output_names: outputs to request; all must come back.
        xp: array module for the outputs (see ``tensor_to_array``).
        on_host: called with an output's name when it came back in host memory although
            ``output_device="gpu"`` was asked for. In r24.10 a GPU output does not fall back to host
            memory: when the CUDA memory pool is full the stub allocates it with ``cudaMalloc``, or the
            call fails; the hook guards a callee that answers in host memory by its own choice.
        copy: copy outputs out of the response's memory; a device copy is synchronized before the
            response is released (``tensors.copy_settled``).
        **request_options: passed to :func:`build_request` (parameters, timeout_us, output_device,
            device_id, parent).

    Raises:
        SubmodelError: the callee returned an error or lacks a requested output.
    """
    request = build_request(model_name, inputs, output_names, **request_options)
    response = await request.async_exec()
    watch = on_host if request_options.get("output_device") == "gpu" else None
    return _outputs(model_name, response, output_names, xp=xp, copy=copy, on_host=watch)


def callee_code(error: Any) -> str:
    """The name of a callee error's Triton code (``TritonError.code()``), UNAVAILABLE for a callee that
    is not running (``nnunet_triton.util.retry.triton_code``), INTERNAL when it has none."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    pb = pb_utils()
    names = {getattr(pb.TritonError, c.value): c for c in TritonCode if hasattr(pb.TritonError, c.value)}
    return triton_code(names.get(code, TritonCode.INTERNAL), error.message()).value


def _outputs(model_name: str, response: Any, output_names: Sequence[str], *, xp: ModuleType | None,
             copy: bool, on_host: Callable[[str], None] | None = None) -> dict[str, Any]:
    if response.has_error():
        error = response.error()
        raise SubmodelError(f"model {model_name!r} failed: {error.message()}", triton_code=callee_code(error))
    pb = pb_utils()
    result = {}
    for name in output_names:
        tensor = pb.get_output_tensor_by_name(response, name)
        if tensor is None:
            raise SubmodelError(f"model {model_name!r} returned no output {name!r}.")
        if on_host is not None and tensor.is_cpu():
            on_host(name)
        result[name] = tensor_to_array(tensor, xp=xp, copy=copy)
    return result
