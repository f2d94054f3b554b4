"""Custom Prometheus metrics of the Python models, served on Triton's metrics port next to ``nv_*``.

Built on ``pb_utils.MetricFamily`` (python backend 2.51 has COUNTER, GAUGE and HISTOGRAM). Every
metric carries the labels ``model`` (the Triton model: ``preprocess_model``,
``liver__v2__orchestrator_model``, ...), ``endpoint`` and ``endpoint_version`` (the endpoint version the
model belongs to: ``liver``, ``2``; ``io_names.endpoint_of_model``), ``dataset`` (``Dataset901_SynthCT``)
and ``configuration`` (nnU-Net's results folder name ``<trainer>__<plans>__<configuration>``);
``dataset``/``configuration`` are the ``dataset_name`` and ``model_folder`` the builder recorded. Failures
also carry ``code``.

Every step (all three Python models):
    nnunet_request_success_total      counter    requests answered successfully
    nnunet_request_failure_total      counter    requests answered with an error, label ``code``
    nnunet_compute_duration_us_total  counter    cumulative microseconds of the step's numerics
                                                 (the library call), successful requests only
    nnunet_compute_latency_us         histogram  the same time per request (``_bucket/_sum/_count``)
Every step that reads tensors from another model (orchestrator, stitch, ensemble combine):
    nnunet_host_fallbacks_total       counter    tensors from another model that a KIND_GPU instance
                                                 received in host memory (label ``tensor``: PREPROCESSED,
                                                 OUTPUT__0, LOGITS, ...): an ensemble's tensors may be
                                                 handed over in host memory when the CUDA memory pool is
                                                 full (a BLS output such as OUTPUT__0 does not fall back in
                                                 r24.10: ``serving.bls``), so its label stays 0 unless a
                                                 fold answers on the host; 0 on KIND_CPU. Each instance
                                                 also logs the first fallback of each tensor.
``orchestrator_model`` only (successful requests):
    nnunet_tiles_total                counter    sliding-window tile positions (once per request,
                                                 independent of folds and mirroring)
    nnunet_network_forwards_total     counter    network inputs sent to fold models
                                                 (tiles x mirror variants x folds)
    nnunet_folds_total                counter    fold predictions (folds per request)
    nnunet_fold_calls_total           counter    BLS calls to fold models (batches of network inputs)

Use: :class:`nnunet_triton.serving.steps.base.Step` does it for every step, so a step only calls
``record.add(tiles=...)`` for its counts::

    self.metrics = StepMetrics.create(args, self.config, counts=self.counts)   # initialize
    return [self.metrics.observe(self._answer, r) for r in requests]          # execute
    def _answer(self, request, record):
        with record.timed():                                                   # around the numerics
            result = self.run(arrays, options, record)

Metrics never fail a request: a metrics error is logged once and switches that instance's metrics
off. Config parameter ``metrics`` = ``false`` switches them off (default on). Every increment is an
IPC round trip to the Triton process (~50 us measured on 2.51), so values are accumulated per request
in :class:`RequestRecord` and sent once when the request is answered.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.parameters import PipelineParameters
from nnunet_triton.serving._pb import pb_utils
from nnunet_triton.serving.tensors import model_parameters

__all__ = [
    "MetricSpec",
    "REQUEST_SUCCESS",
    "REQUEST_FAILURE",
    "COMPUTE_DURATION",
    "COMPUTE_LATENCY",
    "HOST_FALLBACKS",
    "LATENCY_BUCKETS_US",
    "ORCHESTRATOR_COUNTS",
    "RequestRecord",
    "StepMetrics",
    "metric_labels",
]

LOGGER = logging.getLogger(__name__)

_ERROR_CODES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
                "ALREADY_EXISTS", "CANCELLED")
_PRECREATED_FAILURE_CODES = ("INVALID_ARG", "INTERNAL")
# 1 ms .. 5 min: preprocessing of a small case takes ms, a 5-fold TTA orchestration minutes on CPU.
LATENCY_BUCKETS_US = (1e3, 2.5e3, 5e3, 1e4, 2.5e4, 5e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 5e6, 1e7, 2.5e7,
                      6e7, 1.2e8, 3e8)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: Prometheus name, ``pb_utils.MetricFamily`` kind name, HELP text."""

    name: str
    kind: str  # "COUNTER" | "GAUGE" | "HISTOGRAM"
    description: str


REQUEST_SUCCESS = MetricSpec(
    "nnunet_request_success_total", "COUNTER", "Requests the model answered successfully."
)
REQUEST_FAILURE = MetricSpec(
    "nnunet_request_failure_total", "COUNTER",
    "Requests the model answered with an error, by Triton error code (label code).",
)
COMPUTE_DURATION = MetricSpec(
    "nnunet_compute_duration_us_total", "COUNTER",
    "Cumulative microseconds of the model's numerics (the library call, without reading inputs and "
    "building outputs) over successful requests.",
)
COMPUTE_LATENCY = MetricSpec(
    "nnunet_compute_latency_us", "HISTOGRAM",
    "Microseconds of the model's numerics per successful request (same time as "
    "nnunet_compute_duration_us_total).",
)
HOST_FALLBACKS = MetricSpec(
    "nnunet_host_fallbacks_total", "COUNTER",
    "Tensors from another model that a KIND_GPU instance received in host memory, by tensor (label "
    "tensor): Triton copies through host memory when it cannot allocate device memory (a full CUDA memory "
    "pool, --cuda-memory-pool-byte-size). Always 0 on KIND_CPU instances.",
)
ORCHESTRATOR_COUNTS: Mapping[str, MetricSpec] = {
    "tiles": MetricSpec(
        "nnunet_tiles_total", "COUNTER",
        "Sliding-window tile positions of successful requests, counted once per request (independent "
        "of folds and mirroring): rate(nnunet_tiles_total) / rate(nnunet_request_success_total) is "
        "tiles per request.",
    ),
    "forwards": MetricSpec(
        "nnunet_network_forwards_total", "COUNTER",
        "Network inputs sent to the fold models for successful requests: tiles x mirror variants x folds.",
    ),
    "folds": MetricSpec(
        "nnunet_folds_total", "COUNTER", "Fold predictions of successful requests (folds per request)."
    ),
    "fold_calls": MetricSpec(
        "nnunet_fold_calls_total", "COUNTER",
        "BLS calls to the fold models for successful requests (batches of network inputs).",
    ),
}


def metric_labels(model_name: str, config: InferenceConfig) -> dict[str, str]:
    """Labels of every metric of ``model_name``: the Triton model, the endpoint version it belongs to and
    the nnU-Net model it serves."""
    endpoint, version = io_names.endpoint_of_model(model_name)
    return {
        "model": model_name,
        "endpoint": endpoint,
        "endpoint_version": str(version),
        "dataset": config.dataset_name,
        "configuration": f"{config.network.trainer_name}__{config.plans_name}__{config.configuration}",
    }


class RequestRecord:
    """What one request measured: numerics time and counts, sent when the request is answered."""

    __slots__ = ("elapsed_ns", "counts", "host_fallbacks")

    def __init__(self) -> None:
        self.elapsed_ns = 0
        self.counts: dict[str, int] = {}
        self.host_fallbacks: dict[str, int] = {}

    def host_fallback(self, tensor: str) -> None:
        """Note that ``tensor`` (from another model) reached this GPU instance in host memory."""
        self.host_fallbacks[tensor] = self.host_fallbacks.get(tensor, 0) + 1

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Add the wall time of the ``with`` body (``time.perf_counter_ns``) to :attr:`elapsed_ns`."""
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.elapsed_ns += time.perf_counter_ns() - start

    def add(self, **counts: int) -> None:
        """Add to the named counts (names of the model's ``counts``, e.g. ``tiles=8``)."""
        for name, value in counts.items():
            self.counts[name] = self.counts.get(name, 0) + int(value)


class StepMetrics:
    """The metrics of one model instance. Create with :meth:`create` in ``initialize``."""

    def __init__(self, families: Mapping[str, Any], labels: Mapping[str, str],
                 counts: Mapping[str, MetricSpec], logger: Any, host_tensors: Sequence[str] = ()) -> None:
        self._families = dict(families)  # keep every MetricFamily alive as long as its Metrics
        self._labels = dict(labels)
        self._counts = dict(counts)
        self._host_tensors = tuple(host_tensors)
        self._fallbacks_logged: set[str] = set()
        self._logger = logger
        self._enabled = bool(families)
        self._metrics: dict[tuple[str, str], Any] = {}
        self._code_names: dict[Any, str] = {}
        if self._enabled:
            self._guard(self._prepare)

    @classmethod
    def create(cls, args: Mapping[str, str], config: InferenceConfig, *,
               counts: Mapping[str, MetricSpec] | None = None,
               host_tensors: Sequence[str] = ()) -> StepMetrics:
        """Metrics of the model ``args["model_name"]`` (``initialize``'s ``args``); never raises.

        ``counts`` maps the names :meth:`RequestRecord.add` accepts to their counters; ``host_tensors``
        names the tensors from other models whose host fallbacks are counted (created at 0). Returns
        disabled metrics when config parameter ``metrics`` is off or the families cannot be created
        (host fallbacks are then still logged).
        """
        counts = dict(counts or {})
        logger = _stub_logger()
        try:
            if not PipelineParameters.from_parameters(model_parameters(args)).metrics:
                return cls({}, {}, counts, logger, host_tensors)
            labels = metric_labels(args["model_name"], config)
            specs = (REQUEST_SUCCESS, REQUEST_FAILURE, COMPUTE_DURATION, COMPUTE_LATENCY, *counts.values(),
                     *((HOST_FALLBACKS,) if host_tensors else ()))
            return cls(_create_families(specs), labels, counts, logger, host_tensors)
        except Exception as exc:
            _log_warning(logger, f"custom metrics are off for this instance: {type(exc).__name__}: {exc}")
            return cls({}, {}, counts, logger, host_tensors)

    @property
    def enabled(self) -> bool:
        return self._enabled

    def observe(self, run: Callable[[Any, RequestRecord], Any], request: Any) -> Any:
        """Return ``run(request, record)`` (a response) after recording its outcome."""
        record = RequestRecord()
        try:
            response = run(request, record)
        except BaseException:
            self.finish(record, None)
            raise
        return self.finish(record, response)

    async def observe_async(self, run: Callable[[Any, RequestRecord], Awaitable[Any]], request: Any) -> Any:
        """Async :meth:`observe` for ``async def execute`` models."""
        record = RequestRecord()
        try:
            response = await run(request, record)
        except BaseException:
            self.finish(record, None)
            raise
        return self.finish(record, response)

    def finish(self, record: RequestRecord, response: Any) -> Any:
        """Record ``response`` (``None``: an exception escaped ``run``) and return it unchanged."""
        for tensor in sorted(set(record.host_fallbacks) - self._fallbacks_logged):
            self._fallbacks_logged.add(tensor)
            _log_warning(self._logger, f"{self._labels.get('model', 'this model')}: {tensor} arrived in host "
                                       "memory on a KIND_GPU instance (Triton found no device memory for it: "
                                       "is --cuda-memory-pool-byte-size too small?); counted in "
                                       f"{HOST_FALLBACKS.name}, logged once per tensor")
        if self._enabled:
            self._guard(self._record, record, response)
        return response

    # --- internals ----------------------------------------------------------------------------------

    def _prepare(self) -> None:
        pb = pb_utils()
        self._code_names = {getattr(pb.TritonError, n): n for n in _ERROR_CODES if hasattr(pb.TritonError, n)}
        # created at initialize (at 0) so every family shows up, and rate() works, before the first request
        for spec in (REQUEST_SUCCESS, COMPUTE_DURATION, COMPUTE_LATENCY, *self._counts.values()):
            self._metric(spec)
        for code in _PRECREATED_FAILURE_CODES:
            self._metric(REQUEST_FAILURE, code)
        for tensor in self._host_tensors:
            self._metric(HOST_FALLBACKS, tensor=tensor)

    def _metric(self, spec: MetricSpec, code: str = "", tensor: str = "") -> Any:
        key = (spec.name, code or tensor)
        metric = self._metrics.get(key)
        if metric is None:
            family = self._families[spec.name]
            extra = {"code": code} if code else {"tensor": tensor} if tensor else {}
            labels = {**self._labels, **extra}
            if spec.kind == "HISTOGRAM":
                metric = family.Metric(labels=labels, buckets=list(LATENCY_BUCKETS_US))
            else:
                metric = family.Metric(labels=labels)
            self._metrics[key] = metric
        return metric

    def _record(self, record: RequestRecord, response: Any) -> None:
        for tensor, value in record.host_fallbacks.items():  # whatever the answer: the copy happened
            self._metric(HOST_FALLBACKS, tensor=tensor).increment(value)
        code = self._error_code(response)
        if code is not None:
            self._metric(REQUEST_FAILURE, code).increment(1)
            return
        self._metric(REQUEST_SUCCESS).increment(1)
        elapsed_us = record.elapsed_ns / 1000.0
        self._metric(COMPUTE_DURATION).increment(elapsed_us)
        self._metric(COMPUTE_LATENCY).observe(elapsed_us)
        for name, value in record.counts.items():
            spec = self._counts.get(name)
            if spec is None:
                raise KeyError(f"count {name!r} is not one of this model's counts {sorted(self._counts)}.")
            if value:
                self._metric(spec).increment(value)

    def _error_code(self, response: Any) -> str | None:
        """``None`` for a successful response, else the name of its Triton error code."""
        if response is None:
            return "INTERNAL"
        if not response.has_error():
            return None
        code = getattr(response.error(), "code", None)  # a method in the stub
        code = code() if callable(code) else code
        return self._code_names.get(code, "UNKNOWN")

    def _guard(self, func: Callable[..., None], *args: Any) -> None:
        try:
            func(*args)
        except Exception as exc:
            self._enabled = False
            _log_warning(
                self._logger,
                f"custom metrics of {self._labels.get('model', '?')} are off after an error: "
                f"{type(exc).__name__}: {exc}",
            )


def _create_families(specs: Sequence[MetricSpec]) -> dict[str, Any]:
    family = pb_utils().MetricFamily
    return {
        spec.name: family(name=spec.name, description=spec.description, kind=getattr(family, spec.kind))
        for spec in specs
    }


def _stub_logger() -> Any:
    try:
        return pb_utils().Logger
    except Exception:
        return LOGGER


def _log_warning(logger: Any, message: str) -> None:
    if hasattr(logger, "log_warn"):
        logger.log_warn(message)
    else:
        logger.warning("%s", message)
