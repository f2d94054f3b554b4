"""Monitoring of a deployment: Prometheus alert rules and a Grafana dashboard, rendered from the same spec
as the manifests (``deploy --target k8s`` writes them next to the adapter values).

The alerts (one group, ``nnunet-triton``; every expression scoped to the scrape job, which a ServiceMonitor
names after the Service, ``K8sSpec.name``):

* ``NnunetTritonDown``: the metrics port does not answer (``up == 0``) for 5 min.
* ``NnunetTritonNotReady``: the port answers but no orchestrator model is loaded (Triton's per-model
  counters exist only for loaded models) for longer than the startup probe allows.
* ``NnunetTritonLatencyHigh``: the HPA's own metric (the adapter's query, :func:`adapter_query`) above its
  target for 10 min: the autoscaler is at its maximum or cannot add pods.
* ``NnunetTritonRequestFailures``: more than 5 % of the Python models' answers are server-side errors
  (``nnunet_request_failure_total`` except ``INVALID_ARG`` and ``CANCELLED``, the client's doing) for 5 min.
* ``NnunetTritonGpuMemoryNearPlan`` (gpu target): a GPU's used memory above 90 % of the plan's device
  budget (the CUDA pool plus every orchestrator instance's fold accumulators for all folds at once,
  :func:`planned_gpu_bytes`) for 5 min: the volumes are larger than the plan's or something else holds memory.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from nnunet_triton.server.deploy.sizing import MemoryPlan

if TYPE_CHECKING:
    from nnunet_triton.server.deploy.k8s import K8sSpec
    from nnunet_triton.server.deploy.repository_info import RepositoryInfo

__all__ = ["alert_rules", "dashboard", "fill_adapter_template", "planned_gpu_bytes", "latency_expression"]

MiB = 2**20
GPU_MEMORY_FRACTION = 0.9
FAILURE_RATIO = 0.05
_SERVER_ERRORS = 'code!~"INVALID_ARG|CANCELLED"'


def fill_adapter_template(query: str, *, series: str, label_matchers: str, group_by: str) -> str:
    """A prometheus-adapter ``metricsQuery`` as the adapter sends it: ``<<.Series>>``, ``<<.LabelMatchers>>``
    (``namespace="x",pod=~"a|b"`` on a cluster) and ``<<.GroupBy>>`` (``pod``) replaced."""
    filled = (
        query.replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", label_matchers)
        .replace("<<.GroupBy>>", group_by)
    )
    if "<<" in filled:
        raise ValueError(f"adapter query has a placeholder this filler does not know: {filled!r}.")
    return filled


def latency_expression(spec: K8sSpec, *, label_matchers: str, group_by: str) -> str:
    """The HPA's metric, the adapter rule of :func:`k8s.adapter_rules` filled for ``label_matchers``."""
    from nnunet_triton.server.deploy.k8s import adapter_rules

    rule = adapter_rules(spec)["rules"]["custom"][0]
    return fill_adapter_template(
        rule["metricsQuery"], series=rule["name"]["matches"], label_matchers=label_matchers, group_by=group_by
    )


def planned_gpu_bytes(info: RepositoryInfo, plan: MemoryPlan) -> int | None:
    """The plan's device memory per GPU: CUDA pool + all-fold accumulators of every orchestrator instance
    (None on a cpu target)."""
    if info.target != "gpu":
        return None
    shares = dict(plan.pipelines)
    accumulators = sum(
        p.orchestrator_instances * p.stages * shares[p.label].get("device_all_folds_mib", 0)
        for p in info.pipelines
    )
    return plan.cuda_pool_bytes + accumulators * MiB


def _job(spec: K8sSpec) -> str:
    return f'job="{spec.name}"'


def alert_rules(spec: K8sSpec) -> dict[str, Any]:
    """A Prometheus rule file (``groups:``) with the alerts of the module docstring."""
    job = _job(spec)
    orchestrators = f'{job},model=~".*orchestrator_model"'
    failures = f"sum by (job, instance) (rate(nnunet_request_failure_total{{{job},{_SERVER_ERRORS}}}[5m]))"
    answers = (
        f"sum by (job, instance) (rate(nnunet_request_success_total{{{job}}}[5m])) + "
        f"sum by (job, instance) (rate(nnunet_request_failure_total{{{job}}}[5m]))"
    )
    startup_min = max(5, math.ceil(spec.startup_timeout_s / 60))
    rules: list[dict[str, Any]] = [
        {
            "alert": "NnunetTritonDown",
            "expr": f"up{{{job}}} == 0",
            "for": "5m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "nnU-Net Triton {{ $labels.instance }}: metrics port not answering",
                "description": "Prometheus has not scraped the server for 5 minutes.",
            },
        },
        {
            "alert": "NnunetTritonNotReady",
            "expr": f"up{{{job}}} == 1 unless on (job, instance) "
            f"count by (job, instance) (nv_inference_request_success{{{orchestrators}}})",
            "for": f"{startup_min}m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "nnU-Net Triton {{ $labels.instance }}: no orchestrator model loaded",
                "description": f"The server answers but has loaded no orchestrator model for "
                f"{startup_min} minutes (longer than the startup probe allows).",
            },
        },
        {
            "alert": "NnunetTritonLatencyHigh",
            "expr": f"{latency_expression(spec, label_matchers=job, group_by='job, instance')} "
            f"> {spec.latency_target_us}",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "nnU-Net Triton {{ $labels.instance }}: time per request above the HPA target",
                "description": f"Requests waited {{{{ $value | humanize }}}} us on average in the "
                f"models' queues for 10 minutes (target {spec.latency_target_us} us): "
                f"the autoscaler is at max_replicas ({spec.max_replicas}) or "
                "cannot schedule pods.",
            },
        },
        {
            "alert": "NnunetTritonRequestFailures",
            "expr": f"({failures}) / ({answers}) > {FAILURE_RATIO}",
            "for": "5m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "nnU-Net Triton {{ $labels.instance }}: requests failing",
                "description": f"More than {FAILURE_RATIO:.0%} of the models' answers were server "
                "errors (INTERNAL, UNAVAILABLE, ...) for 5 minutes; "
                "nnunet_request_failure_total{code} says which.",
            },
        },
    ]
    planned = planned_gpu_bytes(spec.info, spec.plan)
    if planned is not None:
        threshold = int(planned * GPU_MEMORY_FRACTION)
        rules.append(
            {
                "alert": "NnunetTritonGpuMemoryNearPlan",
                "expr": f"nv_gpu_memory_used_bytes{{{job}}} > {threshold}",
                "for": "5m",
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": "nnU-Net Triton {{ $labels.instance }}: GPU memory near the plan",
                    "description": f"GPU {{{{ $labels.gpu_uuid }}}} uses {{{{ $value | humanize1024 }}}}B, "
                    f"above {GPU_MEMORY_FRACTION:.0%} of the plan's "
                    f"{planned // MiB} MiB (CUDA pool + fold accumulators) for 5 "
                    "minutes: larger volumes than planned, or a leak.",
                },
            }
        )
    return {"groups": [{"name": "nnunet-triton", "rules": rules}]}


def _panel(
    panel_id: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int
) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
            }
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard(spec: K8sSpec) -> dict[str, Any]:
    """A Grafana dashboard (JSON model, schemaVersion 39) of the same signals as the alerts, per instance."""
    job = _job(spec)
    sel = f'{job},instance=~"$instance"'
    queue = latency_expression(spec, label_matchers=sel, group_by="instance")
    panels = [
        _panel(
            1,
            "Queue time per request (HPA metric)",
            "µs",
            [(queue, "{{instance}}"), (f"vector({spec.latency_target_us})", "HPA target")],
            0,
            0,
        ),
        _panel(
            2,
            "Answers per second",
            "reqps",
            [
                (
                    f'sum by (instance) (rate(nnunet_request_success_total{{{sel},model=~".*stitch_model"}}'
                    "[$__rate_interval]))",
                    "{{instance}} segmentations",
                ),
                (
                    f"sum by (instance, code) (rate(nnunet_request_failure_total{{{sel}}}"
                    "[$__rate_interval]))",
                    "{{instance}} failures {{code}}",
                ),
            ],
            12,
            0,
        ),
        _panel(
            3,
            "Compute latency per model (p50, p95)",
            "µs",
            [
                (
                    f"histogram_quantile({q}, sum by (le, model) "
                    f"(rate(nnunet_compute_latency_us_bucket{{{sel}}}[$__rate_interval])))",
                    f"{{{{model}}}} p{p}",
                )
                for q, p in (("0.5", 50), ("0.95", 95))
            ],
            0,
            8,
        ),
        _panel(
            4,
            "Requests waiting or running (Triton pending)",
            "short",
            [
                (
                    f"sum by (instance, model) (nv_inference_pending_request_count{{{sel}}})",
                    "{{instance}} {{model}}",
                )
            ],
            12,
            8,
        ),
    ]
    planned = planned_gpu_bytes(spec.info, spec.plan)
    if planned is not None:
        panels.append(
            _panel(
                5,
                "GPU memory used (and the plan)",
                "bytes",
                [
                    (f"nv_gpu_memory_used_bytes{{{sel}}}", "{{instance}} {{gpu_uuid}}"),
                    (f"vector({planned})", "plan"),
                ],
                0,
                16,
            )
        )
        panels.append(
            _panel(
                6,
                "GPU utilization",
                "percentunit",
                [(f"nv_gpu_utilization{{{sel}}}", "{{instance}} {{gpu_uuid}}")],
                12,
                16,
            )
        )
    return {
        "title": f"nnU-Net Triton ({spec.name})",
        "uid": f"nnunet-triton-{spec.name}"[:40],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["nnunet-triton"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "instance",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": f"label_values(up{{{job}}}, instance)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }
