"""Triton Python-backend glue: the only code that touches ``triton_python_backend_utils``.

Imported only by the serving steps (``serving.steps``, which each repository's few-line ``model.py``
imports) running inside a Triton stub; ``pb_utils`` itself is
imported lazily (see ``_pb.py``) so unit tests can substitute a fake module.

API:
    input_array(request, name, *, xp=None, optional=False, copy=False) -> array | None
    tensor_to_array(pb_tensor, *, xp=None, copy=False) -> array
    output_tensor(name, array) -> pb_utils.Tensor
    request_parameters(request) -> dict;  model_parameters(args) -> {key: string_value}
    ok_response({name: array}) / error_response(exc) / internal_error_response(exc, logger)
    triton_error(exc) -> pb_utils.TritonError;  initialize_exception(model_name) -> TritonModelException
    await infer(model_name, inputs, output_names, *, ...) -> {name: array}  (raises SubmodelError)
    StepMetrics.create(args, config, counts=...) -> .observe(run, request) / await .observe_async(...)
        custom nnunet_* Prometheus metrics (see ``metrics.py``); RequestRecord.timed() / .add(...)
    InstanceDevice.from_args(args) -> .gpu, .torch_device, .memory, .array(a), .tensor(a)  (devices.py)
"""

from __future__ import annotations

from nnunet_triton.serving.bls import infer
from nnunet_triton.serving.devices import InstanceDevice
from nnunet_triton.serving.metrics import ORCHESTRATOR_COUNTS, RequestRecord, StepMetrics
from nnunet_triton.serving.responses import (
    error_response,
    initialize_exception,
    internal_error_response,
    ok_response,
    triton_error,
)
from nnunet_triton.serving.tensors import (
    declared_segmentation_dtype,
    image_array,
    input_array,
    model_parameters,
    output_tensor,
    request_parameters,
    tensor_to_array,
)

__all__ = [
    "infer",
    "InstanceDevice",
    "ORCHESTRATOR_COUNTS",
    "RequestRecord",
    "StepMetrics",
    "error_response",
    "initialize_exception",
    "internal_error_response",
    "ok_response",
    "triton_error",
    "declared_segmentation_dtype",
    "image_array",
    "input_array",
    "model_parameters",
    "output_tensor",
    "request_parameters",
    "tensor_to_array",
]
