"""nnunet_triton.serving.metrics against a fake ``pb_utils.MetricFamily`` (the real one lives in the stub).

The real families are scraped from a running server in tests/triton/test_metrics.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest
from deploy_support import make_config

from nnunet_triton import serving
from nnunet_triton.serving import metrics


class FakeMetric:
    def __init__(self, family: FakeFamily, labels: dict, buckets: list | None) -> None:
        self.family, self.labels, self.buckets = family, labels, buckets
        self.values: list[float] = []

    def increment(self, value: float) -> None:
        if self.family.broken:
            raise RuntimeError("Failed to increment metric value")
        self.values.append(("inc", value))

    def observe(self, value: float) -> None:
        self.values.append(("obs", value))


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict[str, FakeFamily] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[FakeMetric] = []
        self.broken = False
        FakeFamily.created[name] = self

    def Metric(self, labels: dict, buckets: list | None = None) -> FakeMetric:  # noqa: N802 (stub API)
        if (self.kind == FakeFamily.HISTOGRAM) != (buckets is not None):
            raise ValueError("buckets are required for (and only for) histograms")
        metric = FakeMetric(self, dict(labels), buckets)
        self.metrics.append(metric)
        return metric


class FakeError:
    INTERNAL, INVALID_ARG, CANCELLED = 13, 3, 1

    def __init__(self, code: int) -> None:
        self._code = code

    def code(self) -> int:
        return self._code


class FakeResponse:
    def __init__(self, error: FakeError | None = None) -> None:
        self._error = error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> FakeError | None:
        return self._error


class FakeLogger:
    warnings: list[str] = []

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.warnings.append(message)


@pytest.fixture(autouse=True)
def pb(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    FakeFamily.created = {}
    FakeLogger.warnings = []
    module = types.ModuleType("triton_python_backend_utils")
    module.MetricFamily = FakeFamily
    module.TritonError = FakeError
    module.Logger = FakeLogger
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module


LABELS = {
    "model": "orchestrator_model",
    "endpoint": "nnunet",
    "endpoint_version": "1",
    "dataset": "Dataset903_Deploy",
    "configuration": "nnUNetTrainer__nnUNetPlans__3d_fullres",
}
STEP_FAMILIES = {
    "nnunet_request_success_total": "counter",
    "nnunet_request_failure_total": "counter",
    "nnunet_compute_duration_us_total": "counter",
    "nnunet_compute_latency_us": "histogram",
}
ORCHESTRATOR_FAMILIES = {
    "nnunet_tiles_total": "counter",
    "nnunet_network_forwards_total": "counter",
    "nnunet_folds_total": "counter",
    "nnunet_fold_calls_total": "counter",
}


def _args(model: str = "orchestrator_model", **parameters: str) -> dict[str, str]:
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    return {"model_name": model, "model_config": json.dumps(config)}


def _values(name: str, **labels: str) -> list:
    family = FakeFamily.created[name]
    return [v for m in family.metrics if m.labels == {**LABELS, **labels} for v in m.values]


def test_metric_labels_name_model_dataset_and_results_folder() -> None:
    assert metrics.metric_labels("orchestrator_model", make_config()) == LABELS


def test_metric_labels_name_the_endpoint_version_of_a_namespaced_model() -> None:
    labels = metrics.metric_labels("liver__v2__orchestrator_model", make_config())
    assert (labels["model"], labels["endpoint"], labels["endpoint_version"]) == (
        "liver__v2__orchestrator_model", "liver", "2")


def test_create_registers_step_and_count_families_with_zeroed_metrics() -> None:
    step = serving.StepMetrics.create(_args(), make_config(), counts=serving.ORCHESTRATOR_COUNTS)
    assert step.enabled
    assert {n: f.kind for n, f in FakeFamily.created.items()} == {**STEP_FAMILIES, **ORCHESTRATOR_FAMILIES}
    assert all(f.description for f in FakeFamily.created.values())
    created = {(n, tuple(sorted(m.labels.items()))) for n, f in FakeFamily.created.items() for m in f.metrics}
    expected = {(n, tuple(sorted(LABELS.items()))) for n in {**STEP_FAMILIES, **ORCHESTRATOR_FAMILIES}}
    expected -= {("nnunet_request_failure_total", tuple(sorted(LABELS.items())))}
    expected |= {
        ("nnunet_request_failure_total", tuple(sorted({**LABELS, "code": c}.items())))
        for c in ("INVALID_ARG", "INTERNAL")
    }
    assert created == expected
    histogram = FakeFamily.created["nnunet_compute_latency_us"].metrics[0]
    assert histogram.buckets == list(metrics.LATENCY_BUCKETS_US)


def test_observe_records_success_time_and_counts_once_per_request() -> None:
    step = serving.StepMetrics.create(_args(), make_config(), counts=serving.ORCHESTRATOR_COUNTS)

    def run(request: str, record: serving.RequestRecord) -> FakeResponse:
        record.elapsed_ns += 2_500  # what record.timed() adds
        record.add(forwards=4, fold_calls=1)
        record.add(forwards=4, fold_calls=1, tiles=1, folds=2)
        return FakeResponse()

    response = step.observe(run, "request")

    assert not response.has_error()
    assert _values("nnunet_request_success_total") == [("inc", 1)]
    assert _values("nnunet_compute_duration_us_total") == [("inc", 2.5)]
    assert _values("nnunet_compute_latency_us") == [("obs", 2.5)]
    assert _values("nnunet_network_forwards_total") == [("inc", 8)]
    assert _values("nnunet_fold_calls_total") == [("inc", 2)]
    assert _values("nnunet_tiles_total") == [("inc", 1)]
    assert _values("nnunet_folds_total") == [("inc", 2)]


def test_observe_async_counts_failure_by_code_and_skips_time_and_counts() -> None:
    step = serving.StepMetrics.create(_args(), make_config(), counts=serving.ORCHESTRATOR_COUNTS)

    async def run(request: str, record: serving.RequestRecord) -> FakeResponse:
        record.add(forwards=4)
        return FakeResponse(FakeError(FakeError.CANCELLED))

    asyncio.run(step.observe_async(run, "request"))

    assert _values("nnunet_request_failure_total", code="CANCELLED") == [("inc", 1)]
    assert _values("nnunet_request_failure_total", code="INVALID_ARG") == []
    assert _values("nnunet_request_success_total") == []
    assert _values("nnunet_network_forwards_total") == []
    assert _values("nnunet_compute_duration_us_total") == []


def test_observe_counts_internal_failure_and_reraises_when_run_raises() -> None:
    step = serving.StepMetrics.create(_args(), make_config())

    def run(request: str, record: serving.RequestRecord) -> FakeResponse:
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError):
        step.observe(run, "request")
    assert _values("nnunet_request_failure_total", code="INTERNAL") == [("inc", 1)]


def test_timed_adds_wall_time_of_the_block_even_when_it_raises() -> None:
    record = serving.RequestRecord()
    with record.timed():
        sum(range(1000))
    first = record.elapsed_ns
    with pytest.raises(ValueError), record.timed():
        raise ValueError("x")
    assert 0 < first < record.elapsed_ns


def test_metrics_error_is_logged_once_and_never_fails_the_request() -> None:
    step = serving.StepMetrics.create(_args(), make_config())
    FakeFamily.created["nnunet_request_success_total"].broken = True
    responses = [step.observe(lambda request, record: FakeResponse(), r) for r in range(3)]

    assert [r.has_error() for r in responses] == [False, False, False]
    assert not step.enabled
    assert len(FakeLogger.warnings) == 1
    assert "Failed to increment metric value" in FakeLogger.warnings[0]


def test_unknown_count_name_switches_metrics_off_without_failing_the_request() -> None:
    step = serving.StepMetrics.create(_args(), make_config())

    def run(request: str, record: serving.RequestRecord) -> FakeResponse:
        record.add(tiles=3)  # not a count of this model
        return FakeResponse()

    assert not step.observe(run, "request").has_error()
    assert not step.enabled
    assert "'tiles' is not one of this model's counts" in FakeLogger.warnings[0]


@pytest.mark.parametrize("value", ["false", "False", "0", "off"])
def test_metrics_parameter_off_creates_no_families_and_still_answers(value: str) -> None:
    step = serving.StepMetrics.create(_args(metrics=value), make_config())
    response = step.observe(lambda request, record: FakeResponse(), "request")
    assert (step.enabled, FakeFamily.created, response.has_error()) == (False, {}, False)


def test_create_logs_and_disables_when_metric_family_is_missing(pb: types.ModuleType) -> None:
    del pb.MetricFamily  # an older python backend
    step = serving.StepMetrics.create(_args(), make_config())
    assert not step.enabled
    assert step.observe(lambda request, record: "response", "request") == "response"
    assert len(FakeLogger.warnings) == 1


def test_host_fallbacks_are_counted_per_tensor_from_zero_and_logged_once_each() -> None:
    step = serving.StepMetrics.create(_args(), make_config(), host_tensors=("PREPROCESSED", "OUTPUT__0"))
    family = FakeFamily.created["nnunet_host_fallbacks_total"]
    assert family.kind == "counter"
    assert sorted(m.labels["tensor"] for m in family.metrics) == ["OUTPUT__0", "PREPROCESSED"]  # at 0

    def run(request, record):
        record.host_fallback("OUTPUT__0")
        record.host_fallback("OUTPUT__0")
        return FakeResponse()

    step.observe(run, object())
    step.observe(run, object())
    assert _values("nnunet_host_fallbacks_total", tensor="OUTPUT__0") == [("inc", 2), ("inc", 2)]
    assert _values("nnunet_host_fallbacks_total", tensor="PREPROCESSED") == []
    logged = [w for w in FakeLogger.warnings if "arrived in host memory" in w]
    assert len(logged) == 1 and "OUTPUT__0" in logged[0] and "--cuda-memory-pool-byte-size" in logged[0]


def test_a_failed_request_still_counts_its_host_fallbacks() -> None:
    step = serving.StepMetrics.create(_args(), make_config(), host_tensors=("LOGITS",))

    def run(request, record):
        record.host_fallback("LOGITS")
        return FakeResponse(FakeError(FakeError.INTERNAL))

    step.observe(run, object())
    assert _values("nnunet_host_fallbacks_total", tensor="LOGITS") == [("inc", 1)]


def test_models_without_tensors_from_others_have_no_host_fallback_family() -> None:
    serving.StepMetrics.create(_args("preprocess_model"), make_config())
    assert "nnunet_host_fallbacks_total" not in FakeFamily.created


def test_only_a_gpu_instance_watches_where_its_inputs_arrive() -> None:
    record = serving.RequestRecord()
    assert serving.InstanceDevice(gpu=False).watch(record) is None
    serving.InstanceDevice(gpu=True).watch(record)("LOGITS")
    assert record.host_fallbacks == {"LOGITS": 1}
