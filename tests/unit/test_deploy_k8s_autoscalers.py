"""The alternatives to the HPA + prometheus-adapter pair (``deploy --target k8s --autoscaler keda``,
``--kserve``): a KEDA ScaledObject and a KServe InferenceService scaling on the same per-pod metric
and target as the HPA. Their schemas are checked in test_deploy_k8s_schemas.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_support import k8s_spec, write_repository

from nnunet_triton.cli import deploy as tool
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.server.deploy import docker, k8s, monitoring


def test_keda_replaces_the_hpa_with_a_scaled_object_on_the_same_metric_and_target(tmp_path: Path) -> None:
    spec = k8s_spec(
        tmp_path,
        autoscaler="keda",
        namespace="imaging",
        min_replicas=2,
        max_replicas=6,
        latency_target_us=1_500_000,
        prometheus_url="http://prom.monitoring:9090",
    )
    assert list(k8s.manifests(spec)) == ["deployment.yaml", "service.yaml", "scaledobject.yaml"]
    scaled = k8s.scaled_object(spec)["spec"]
    hpa = k8s.autoscaler(spec)["spec"]
    assert scaled["scaleTargetRef"] == hpa["scaleTargetRef"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    assert scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    # AverageValue: KEDA divides the sum over the pods by the replicas, so the target is per pod as the HPA's
    assert scaled["triggers"] == [
        {
            "type": "prometheus",
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": "http://prom.monitoring:9090",
                "threshold": "1500000",
                "query": "sum("
                + monitoring.latency_expression(
                    spec, label_matchers='namespace="imaging",pod=~"nnunet-triton-.*"', group_by="pod"
                )
                + ")",
            },
        }
    ]
    files = k8s.manifest_files(spec)
    assert "prometheus-adapter-values.yaml" not in files and "hpa.yaml" not in files
    assert yaml.safe_load(files["kustomization.yaml"])["resources"] == [
        "deployment.yaml",
        "service.yaml",
        "scaledobject.yaml",
    ]


def test_kserve_inference_service_runs_our_server_on_the_triton_runtime(tmp_path: Path) -> None:
    spec = k8s_spec(tmp_path, autoscaler="keda", kserve=True, latency_target_us=1_000_000)
    assert list(k8s.manifests(spec)) == ["inferenceservice.yaml"]
    service = k8s.inference_service(spec)
    assert service["metadata"]["annotations"] == {
        "serving.kserve.io/deploymentMode": "RawDeployment",
        "serving.kserve.io/autoscalerClass": "keda",
    }
    predictor = service["spec"]["predictor"]
    model = predictor["model"]
    assert (model["modelFormat"], model["runtime"], model["storageUri"]) == (
        {"name": "triton", "version": "2"},
        "kserve-tritonserver",
        "oci://registry.example/nnunet-models:abc",
    )
    assert model["image"] == spec.image  # the runtime's stock tritonserver lacks the Python models' packages
    assert model["args"] == list(
        docker.server_command(spec.info, spec.plan, gpus=1, repository="/mnt/models")
    )
    assert model["ports"][0] == {"name": "http", "containerPort": 8000, "protocol": "TCP"}  # KServe's Service
    assert model["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "/mnt/models" in model["readinessProbe"]["exec"]["command"]
    assert [v["name"] for v in predictor["volumes"]] == ["dshm", "cupy-cache"]  # KServe mounts the models
    assert not any(m["name"] == "model-repository" for m in model["volumeMounts"])
    assert predictor["autoScaling"]["metrics"] == [
        {
            "type": "External",
            "external": {
                "metric": {
                    "backend": "prometheus",
                    "serverAddress": k8s.DEFAULT_PROMETHEUS_URL,
                    "query": k8s.keda_query(spec),
                },
                "target": {"type": "Value", "value": "1000000"},
            },
        }
    ]
    assert 'pod=~"nnunet-triton-predictor-.*"' in k8s.keda_query(spec)  # KServe's pod names
    pvc = k8s_spec(tmp_path / "pvc", autoscaler="keda", kserve=True, model_source=k8s.ModelSource("pvc", "m"))
    assert k8s.inference_service(pvc)["spec"]["predictor"]["model"]["storageUri"] == "pvc://m"


@pytest.mark.parametrize(
    "overrides",
    [
        {"kserve": True},  # autoscaler hpa
        {"kserve": True, "autoscaler": "keda", "tls_secret": "tls"},
        {"kserve": True, "autoscaler": "keda", "service_monitor": True},
    ],
)
def test_kserve_refuses_what_it_cannot_render(tmp_path: Path, overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="kserve: the InferenceService scales through KEDA"):
        k8s_spec(tmp_path, **overrides)


def test_unknown_autoscaler_and_bad_prometheus_url_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"autoscaler must be one of \['hpa', 'keda'\], got 'vpa'"):
        k8s_spec(tmp_path, autoscaler="vpa")
    with pytest.raises(ValueError, match="prometheus_url must be an http"):
        k8s_spec(tmp_path, autoscaler="keda", prometheus_url="prom:9090")


def test_deploy_tool_renders_keda_and_kserve(tmp_path: Path, capsys) -> None:
    repo = write_repository(tmp_path / "repo")
    base = ["--target", "k8s", "--repository", str(repo), "--image", "reg/nnunet-triton:1"]
    assert (
        tool.main(
            [
                *base,
                "--out",
                str(tmp_path / "keda"),
                "--autoscaler",
                "keda",
                "--prometheus-url",
                "http://prom:9090",
            ]
        )
        == 0
    )
    assert (tmp_path / "keda" / "scaledobject.yaml").exists() and not (
        tmp_path / "keda" / "hpa.yaml"
    ).exists()
    assert "KEDA queries http://prom:9090" in capsys.readouterr().out
    assert tool.main([*base, "--out", str(tmp_path / "kserve"), "--autoscaler", "keda", "--kserve"]) == 0
    assert sorted(p.name for p in (tmp_path / "kserve").iterdir()) == [
        "grafana-dashboard.json",
        "inferenceservice.yaml",
        "kustomization.yaml",
        "prometheus-rules.yaml",
    ]
    assert tool.main([*base, "--out", str(tmp_path / "bad"), "--kserve"]) == ExitCode.USAGE


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (Debian: apt-get install prometheus; .ci/run installs it)",
)
def test_promtool_parses_the_keda_query(tmp_path: Path) -> None:
    spec = k8s_spec(tmp_path, autoscaler="keda", namespace="imaging")
    rules = {"groups": [{"name": "q", "rules": [{"record": "nnunet:keda", "expr": k8s.keda_query(spec)}]}]}
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "q.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
