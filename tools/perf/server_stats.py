"""Per-model server statistics around a measurement: Triton's ``GET /v2/models/stats``, diffed.

Triton's counters are cumulative since load, so a snapshot before and after a perf_analyzer run
gives exactly that run's numbers for every model: the ensemble, its steps and the fold models the
BLS orchestrator calls (which the ensemble's own statistics do not show). ``avg_batch`` =
inferences / executions shows what the fold models' dynamic batcher achieved.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import asdict, dataclass

__all__ = ["ModelStats", "snapshot", "diff", "summary"]

_PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class ModelStats:
    """Cumulative counters of one model (durations in ns, summed over requests)."""

    name: str
    inference_count: int
    execution_count: int
    success_count: int
    success_ns: int
    fail_count: int
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int

    @classmethod
    def from_json(cls, entry: dict) -> ModelStats:
        stats = entry.get("inference_stats", {})
        phase = {name: stats.get(name, {}) for name in _PHASES}
        return cls(
            name=entry["name"],
            inference_count=int(entry.get("inference_count", 0)),
            execution_count=int(entry.get("execution_count", 0)),
            success_count=int(phase["success"].get("count", 0)),
            success_ns=int(phase["success"].get("ns", 0)),
            fail_count=int(phase["fail"].get("count", 0)),
            queue_ns=int(phase["queue"].get("ns", 0)),
            compute_input_ns=int(phase["compute_input"].get("ns", 0)),
            compute_infer_ns=int(phase["compute_infer"].get("ns", 0)),
            compute_output_ns=int(phase["compute_output"].get("ns", 0)),
        )


def snapshot(http_url: str, *, headers: dict[str, str] | None = None,
             timeout_s: float = 30.0) -> dict[str, ModelStats]:
    """Statistics of every loaded model from the HTTP endpoint ``host:port``; the statistics API needs the
    launcher's token (``ServerHandle.control_headers``)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://{http_url}/v2/models/stats", headers=headers or {})
    with opener.open(request, timeout=timeout_s) as response:
        document = json.loads(response.read())
    return {entry["name"]: ModelStats.from_json(entry) for entry in document.get("model_stats", [])}


def diff(before: dict[str, ModelStats], after: dict[str, ModelStats]) -> dict[str, ModelStats]:
    """``after - before`` per model (models without new requests are left out)."""
    result = {}
    for name, new in after.items():
        old = before.get(name)
        values = {key: value - (getattr(old, key) if old else 0)
                  for key, value in asdict(new).items() if key != "name"}
        if values["success_count"] or values["fail_count"]:
            result[name] = ModelStats(name=name, **values)
    return result


def summary(stats: ModelStats) -> dict[str, float]:
    """Per-request averages in ms, and inferences per execution."""
    requests = max(stats.success_count, 1)
    return {
        "requests": float(stats.success_count),
        "failures": float(stats.fail_count),
        "executions": float(stats.execution_count),
        "avg_batch": stats.inference_count / stats.execution_count if stats.execution_count else 0.0,
        "avg_request_ms": stats.success_ns / requests / 1e6,
        "avg_queue_ms": stats.queue_ns / requests / 1e6,
        "avg_compute_ms": (stats.compute_input_ns + stats.compute_infer_ns + stats.compute_output_ns)
        / requests / 1e6,
    }
