"""The Triton Python-model lifecycle every serving step shares, written once.

A step is a class with

* ``setup(self)``: constant work, once per instance (plans, parameters, device, networks);
* ``inputs(self, request, record) -> dict``: the request's arrays (cheap checks may refuse it here);
* ``run(self, arrays, options, record) -> dict``: the numerics, library calls only, timed for the metrics;
* ``outputs(self, result) -> dict``: where results leave for (host copies), outside the timing.

:class:`Step` owns the rest: ``pb_utils.Logger``, the model's folder, parameters and device, the custom
metrics (``serving.StepMetrics``), the per-request options (``RequestOptions.from_parameters``), answering
each request on its own with the error mapped to its Triton code (``serving.responses``), and an
``initialize`` failure that names the model. :func:`triton_model` turns a step class into the
``TritonPythonModel`` class Triton loads; the repository's ``model.py`` only imports it. Unit tests drive
a step with a fake ``triton_python_backend_utils`` (``tests/unit/fake_pb.py``).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.options import RequestOptions
from nnunet_triton.serving._pb import pb_utils
from nnunet_triton.serving.devices import InstanceDevice
from nnunet_triton.serving.metrics import MetricSpec, RequestRecord, StepMetrics
from nnunet_triton.serving.responses import (
    error_response,
    initialize_exception,
    internal_error_response,
    ok_response,
)
from nnunet_triton.serving.tensors import model_parameters, request_parameters

__all__ = ["Step", "AsyncStep", "triton_model"]


class Step:
    """One model of the pipeline inside its Triton stub (see the module docstring).

    Class attributes a step may set:
        counts: the names ``record.add`` accepts and their metric families.
        host_tensors: inputs from other models whose host-memory arrival is counted on KIND_GPU.
        reads_options: the step validates the request's options (every step does, so a bad option fails
            before expensive work; the fold runner, called by the orchestrator only, does not).
        has_metrics: the step exports the custom ``nnunet_*`` metrics (the fold runner's numbers are
            Triton's own ``nv_inference_*`` of the fold model).
    """

    counts: ClassVar[Mapping[str, MetricSpec]] = {}
    host_tensors: ClassVar[tuple[str, ...]] = ()
    reads_options: ClassVar[bool] = True
    has_metrics: ClassVar[bool] = True

    def __init__(self, args: Mapping[str, str]) -> None:
        self.args = dict(args)
        self.name = args["model_name"]
        self.logger = pb_utils().Logger
        # Triton's args: model_repository is the model's folder, model_version the folder of model.py
        self.model_dir = Path(args["model_repository"]) / args["model_version"]
        self.model_config: dict[str, Any] = json.loads(args["model_config"])
        self.parameters = model_parameters(args)
        self.device = InstanceDevice.from_args(args)
        self.config = InferenceConfig.load(self.model_dir)
        self.setup()
        self.metrics = (StepMetrics.create(args, self.config, counts=self.counts,
                                           host_tensors=self.host_tensors)
                        if self.has_metrics else StepMetrics({}, {}, {}, self.logger))

    # --- what a step implements -------------------------------------------------------------------------

    def setup(self) -> None:
        """Constant work for this instance (called once, from ``initialize``)."""

    def inputs(self, request: Any, record: RequestRecord) -> dict[str, Any]:
        raise NotImplementedError

    def run(self, arrays: Mapping[str, Any], options: RequestOptions | None, record: RequestRecord
            ) -> dict[str, Any]:
        raise NotImplementedError

    def outputs(self, result: dict[str, Any]) -> dict[str, Any]:
        """The response's arrays (default: ``run``'s result as it is)."""
        return result

    # --- the lifecycle ------------------------------------------------------------------------------------

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        return [self.metrics.observe(self._answer, request) for request in requests]

    def options(self, request: Any) -> RequestOptions | None:
        if not self.reads_options:
            return None
        return RequestOptions.from_parameters(request_parameters(request), self.config)

    def respond(self, compute: Callable[[], Mapping[str, Any]]) -> Any:
        """``compute()``'s arrays as a response; our errors with their Triton code, others INTERNAL
        (logged with the traceback)."""
        try:
            return ok_response(compute())
        except NnunetTritonError as exc:
            return error_response(exc)
        except Exception as exc:
            return internal_error_response(exc, self.logger)

    def _answer(self, request: Any, record: RequestRecord) -> Any:
        def compute() -> Mapping[str, Any]:
            options = self.options(request)
            arrays = self.inputs(request, record)
            with record.timed():
                result = self.run(arrays, options, record)
            return self.outputs(result)

        return self.respond(compute)


class AsyncStep(Step):
    """A step whose ``run`` awaits other models (BLS): Triton calls its ``async def execute``."""

    async def execute(self, requests: Sequence[Any]) -> list[Any]:  # type: ignore[override]
        return [await self.metrics.observe_async(self._answer_async, request) for request in requests]

    async def run(self, arrays: Mapping[str, Any], options: RequestOptions | None,  # type: ignore[override]
                  record: RequestRecord) -> dict[str, Any]:
        raise NotImplementedError

    async def respond_async(self, compute: Callable[[], Awaitable[Mapping[str, Any]]]) -> Any:
        try:
            return ok_response(await compute())
        except NnunetTritonError as exc:
            return error_response(exc)
        except Exception as exc:
            return internal_error_response(exc, self.logger)

    async def _answer_async(self, request: Any, record: RequestRecord) -> Any:
        async def compute() -> Mapping[str, Any]:
            options = self.options(request)
            arrays = self.inputs(request, record)
            with record.timed():
                result = await self.run(arrays, options, record)
            return self.outputs(result)

        return await self.respond_async(compute)


def _create(step_class: type[Step], args: Mapping[str, str]) -> Step:
    try:
        return step_class(args)
    except Exception:
        raise initialize_exception(args["model_name"]) from None


def triton_model(step_class: type[Step]) -> type:
    """The ``TritonPythonModel`` class Triton loads for ``step_class``."""
    if inspect.iscoroutinefunction(step_class.execute):
        class TritonPythonModel:
            def initialize(self, args: dict[str, str]) -> None:
                self.step = _create(step_class, args)

            async def execute(self, requests: list) -> list:
                return await self.step.execute(requests)
    else:
        class TritonPythonModel:  # type: ignore[no-redef]
            def initialize(self, args: dict[str, str]) -> None:
                self.step = _create(step_class, args)

            def execute(self, requests: list) -> list:
                return self.step.execute(requests)

    TritonPythonModel.__doc__ = step_class.__doc__
    TritonPythonModel.__qualname__ = "TritonPythonModel"
    return TritonPythonModel
