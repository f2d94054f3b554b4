"""The alert rules and the Grafana dashboard ``deploy --target k8s`` writes (``server.deploy.monitoring``):
``promtool check rules`` accepts the rule file (templates included) and every dashboard query, and
``promtool test rules`` drives each alert with synthetic series: it fires after its ``for`` on the condition
and stays silent on a healthy instance next to it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import k8s_spec, two_endpoints

from nnunet_triton.server.deploy import k8s, monitoring

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install prometheus; .ci/run installs it)",
)
JOB = "nnunet-triton"


def _promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
@pytest.mark.parametrize("variant", ["gpu target", "two endpoints", "cpu target"])
def test_promtool_checks_the_rendered_alert_rules(tmp_path: Path, variant: str) -> None:
    if variant == "two endpoints":
        spec = k8s_spec(two_endpoints(tmp_path / "repo"), built=True)
    else:
        spec = k8s_spec(tmp_path / "repo")
        if variant == "cpu target":
            from test_deploy_k8s_schemas import _cpu_spec

            spec = _cpu_spec(tmp_path / "cpu")
    (tmp_path / "rules.yaml").write_text(k8s.manifest_files(spec)["prometheus-rules.yaml"])
    result = _promtool("check", "rules", tmp_path / "rules.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = [r["alert"] for r in monitoring.alert_rules(spec)["groups"][0]["rules"]]
    gpu = ["NnunetTritonGpuMemoryNearPlan"] if variant != "cpu target" else []
    assert alerts == [
        "NnunetTritonDown",
        "NnunetTritonNotReady",
        "NnunetTritonLatencyHigh",
        "NnunetTritonRequestFailures",
        *gpu,
    ]
    assert f"{len(alerts)} rules found" in result.stdout


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    spec = k8s_spec(tmp_path / "repo")
    board = json.loads(k8s.manifest_files(spec)["grafana-dashboard.json"])
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"]) == 6
    # Grafana's variables, as Grafana substitutes them before sending the query
    rules = [
        {
            "record": f"nnunet:dashboard_query_{i}",
            "expr": e.replace("$__rate_interval", "1m").replace("$instance", ".*"),
        }
        for i, e in enumerate(exprs)
    ]
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    result = _promtool("check", "rules", tmp_path / "queries.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    # the first panel is the HPA's metric: the adapter's query, filled as the adapter fills it
    assert exprs[0] == monitoring.latency_expression(
        spec, label_matchers=f'job="{JOB}",instance=~"$instance"', group_by="instance"
    )


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def _alerts(name: str, eval_times: dict[str, list[dict[str, str]]]) -> list[dict[str, Any]]:
    return [
        {"eval_time": t, "alertname": name, "exp_alerts": [{"exp_labels": labels} for labels in alerts]}
        for t, alerts in eval_times.items()
    ]


@needs_promtool
def test_promtool_unit_tests_fire_each_alert_on_its_condition_only(tmp_path: Path) -> None:
    spec = k8s_spec(tmp_path / "repo")  # default latency target 4 s, startup 900 s
    rules = monitoring.alert_rules(spec)
    for rule in rules["groups"][0]["rules"]:
        rule.pop("annotations")  # promtool compares annotations exactly; check rules covers the templates
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    bad, good = {"job": JOB, "instance": "bad:8002"}, {"job": JOB, "instance": "good:8002"}
    orch = {"model": "orchestrator_model"}
    threshold = int(monitoring.planned_gpu_bytes(spec.info, spec.plan) * monitoring.GPU_MEMORY_FRACTION)
    n = "x80"  # 20 min of 15 s samples
    tests = [
        {
            "interval": "15s",
            "input_series": [_series("up", bad, f"0{n}"), _series("up", good, f"1{n}")],
            "alert_rule_test": _alerts(
                "NnunetTritonDown", {"4m": [], "6m": [{**bad, "severity": "critical"}]}
            ),
        },
        {
            "interval": "15s",  # bad answers but never loads its orchestrator; good has
            "input_series": [
                _series("up", bad, f"1{n}"),
                _series("up", good, f"1{n}"),
                _series("nv_inference_request_success", {**good, **orch}, f"0{n}"),
            ],
            "alert_rule_test": _alerts(
                "NnunetTritonNotReady", {"14m": [], "16m": [{**bad, "severity": "critical"}]}
            ),
        },
        {
            "interval": "15s",  # bad: 10 requests per 15 s that each took 6 s (target 4 s), good 2 s
            "input_series": [
                _series("nv_inference_request_duration_us", {**bad, **orch}, f"0+60000000{n}"),
                _series("nv_inference_request_success", {**bad, **orch}, f"0+10{n}"),
                _series("nv_inference_request_duration_us", {**good, **orch}, f"0+20000000{n}"),
                _series("nv_inference_request_success", {**good, **orch}, f"0+10{n}"),
            ],
            "alert_rule_test": _alerts(
                "NnunetTritonLatencyHigh", {"8m": [], "12m": [{**bad, "severity": "warning"}]}
            ),
        },
        {
            "interval": "15s",  # bad: half its answers INTERNAL; good: only client errors
            "input_series": [
                _series("nnunet_request_success_total", {**bad, **orch}, f"0+1{n}"),
                _series("nnunet_request_failure_total", {**bad, **orch, "code": "INTERNAL"}, f"0+1{n}"),
                _series("nnunet_request_success_total", {**good, **orch}, f"0+1{n}"),
                _series("nnunet_request_failure_total", {**good, **orch, "code": "INVALID_ARG"}, f"0+1{n}"),
            ],
            "alert_rule_test": _alerts(
                "NnunetTritonRequestFailures", {"3m": [], "7m": [{**bad, "severity": "critical"}]}
            ),
        },
        {
            "interval": "15s",
            "input_series": [
                _series("nv_gpu_memory_used_bytes", {**bad, "gpu_uuid": "GPU-1"}, f"{threshold + 1}{n}"),
                _series("nv_gpu_memory_used_bytes", {**good, "gpu_uuid": "GPU-2"}, f"{threshold}{n}"),
            ],
            "alert_rule_test": _alerts(
                "NnunetTritonGpuMemoryNearPlan",
                {"4m": [], "6m": [{**bad, "gpu_uuid": "GPU-1", "severity": "warning"}]},
            ),
        },
    ]
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "15s", "tests": tests})
    )
    result = _promtool("test", "rules", tmp_path / "tests.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_gpu_memory_plan_is_the_cuda_pool_plus_every_instances_fold_accumulators(tmp_path: Path) -> None:
    spec = k8s_spec(two_endpoints(tmp_path / "repo"), built=True)
    shares = dict(spec.plan.pipelines)
    accumulators = sum(
        shares[p.label]["device_all_folds_mib"] for p in spec.info.pipelines
    )  # 1 instance each
    assert (
        monitoring.planned_gpu_bytes(spec.info, spec.plan) == spec.plan.cuda_pool_bytes + accumulators * 2**20
    )
    assert accumulators > 0


def test_adapter_template_filled_like_prometheus_adapter_and_unknown_placeholders_refused() -> None:
    query = "sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>)"
    assert (
        monitoring.fill_adapter_template(
            query, series="s", label_matchers='namespace="a",pod=~"p1|p2"', group_by="pod"
        )
        == 'sum(rate(s{namespace="a",pod=~"p1|p2"}[1m])) by (pod)'
    )
    with pytest.raises(ValueError, match="placeholder"):
        monitoring.fill_adapter_template("<<.Resource>>", series="s", label_matchers="", group_by="pod")
