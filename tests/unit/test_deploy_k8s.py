"""Kubernetes manifests (validated offline with kubernetes-validate's bundled schemas) and ``nnunet-triton
deploy`` (k8s rendering, printed docker commands, undeploy) without a cluster or Docker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_support import GPU_OPTIONS, k8s_spec, make_config, write_repository

from nnunet_triton.server.deploy import docker, k8s
from nnunet_triton.server.deploy.repository_info import RepositoryInfo

# --- Kubernetes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source", [k8s.ModelSource("image", "reg/models:1"), k8s.ModelSource("pvc", "models")]
)
def test_k8s_manifests_validate_against_kubernetes_schemas(tmp_path: Path, source: k8s.ModelSource) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate not installed (pip install kubernetes-validate==1.37.0)",
    )
    manifests = k8s.manifests(
        k8s_spec(tmp_path, model_source=source, namespace="imaging", service_monitor=True)
    )
    assert list(manifests) == ["deployment.yaml", "service.yaml", "hpa.yaml", "servicemonitor.yaml"]
    for name, manifest in manifests.items():
        if manifest["kind"] != "ServiceMonitor":  # a CRD: no schema in the bundle, checked below
            assert kubernetes_validate.validate(manifest, "1.30", strict=True) == "1.30", name


def test_k8s_deployment_has_gpu_shm_probes_and_repository_volume(tmp_path: Path) -> None:
    spec = k8s_spec(tmp_path, startup_timeout_s=1200)
    pod = k8s.deployment(spec)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "4", "memory": f"{spec.plan.host_memory_mib}Mi", "nvidia.com/gpu": 1},
        "limits": {"cpu": "4", "memory": f"{spec.plan.host_memory_mib}Mi", "nvidia.com/gpu": 1},
    }
    probe = {"port": "http"}
    health = ["python3", "-m", "nnunet_triton.server.health", "--url", "127.0.0.1:8000",
              "--model-repository", "/models"]
    assert (container["startupProbe"], container["livenessProbe"], container["readinessProbe"]) == (
        {
            "httpGet": {"path": "/v2/health/ready", **probe},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 120,
        },
        {
            "exec": {"command": health},
            "periodSeconds": 10,
            "timeoutSeconds": 10,
            "failureThreshold": 6,
        },
        {
            "exec": {"command": health},
            "periodSeconds": 5,
            "timeoutSeconds": 10,
            "failureThreshold": 2,
        },
    )
    assert pod["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "6064Mi"}},
        {"name": "model-repository", "emptyDir": {}},
        {"name": "cupy-cache", "emptyDir": {}},  # compiled CuPy kernels survive container restarts
    ]
    assert {"name": "cupy-cache", "mountPath": "/var/cache/cupy"} in container["volumeMounts"]
    assert pod["initContainers"][0]["image"] == "registry.example/nnunet-models:abc"
    assert container["args"] == list(docker.server_command(spec.info, spec.plan, gpus=1))
    assert container["args"][:6] == ["python3", "-m", "nnunet_triton.server.deploy.entrypoint",
                                     "--model-repository", "/models", "--"]
    assert "--load-model=fold_1" in container["args"]


def test_k8s_cpu_deployment_has_no_gpu_and_publishes_host_ports_on_loopback(tmp_path: Path) -> None:
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.server.deploy import sizing

    info = RepositoryInfo.from_repository(write_repository(tmp_path, BuildOptions(target="cpu")))
    spec = k8s.K8sSpec(info=info, plan=sizing.plan_memory(info, sizing.VolumeSpec()), image="img:1",
                       model_source=k8s.ModelSource("image", "models:1"), gpus=0,
                       host_ports=(18000, 18001, 18002))
    pod = k8s.deployment(spec)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert [(p["containerPort"], p.get("hostPort"), p.get("hostIP")) for p in container["ports"]] == [
        (8000, 18000, "127.0.0.1"), (8001, 18001, "127.0.0.1"), (8002, 18002, "127.0.0.1")]
    assert "--allow-gpu-metrics=false" in container["args"]
    assert pod["initContainers"][0]["command"][0] == "/bin/sh"  # an imported image has no PATH
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    assert kubernetes_validate.validate(k8s.deployment(spec), "1.30", strict=True) == "1.30"
    with pytest.raises(ValueError, match="1 GPU for a target gpu repository or 0 for target cpu"):
        k8s.K8sSpec(info=info, plan=spec.plan, image="img:1", model_source=spec.model_source, gpus=1)


def test_k8s_hpa_scales_on_the_metric_the_adapter_rule_defines(tmp_path: Path) -> None:
    spec = k8s_spec(tmp_path, min_replicas=2, max_replicas=6, queue_target_us=500_000)
    hpa = k8s.autoscaler(spec)["spec"]
    rule = k8s.adapter_rules(spec)["rules"]["custom"][0]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "nnunet-triton"}
    assert hpa["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": rule["name"]["as"]},
                "target": {"type": "AverageValue", "averageValue": "500000"},
            },
        }
    ]
    assert (
        'model="orchestrator_model"' in rule["seriesQuery"]
        and "nv_inference_request_success" in rule["metricsQuery"]
    )


def test_k8s_manifest_files_round_trip_through_yaml_and_list_every_resource(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    spec = k8s_spec(tmp_path, service_monitor=True)
    files = k8s.manifest_files(spec)
    manifests = k8s.manifests(spec)
    assert {name: yaml.safe_load(files[name]) for name in manifests} == manifests
    assert yaml.safe_load(files["kustomization.yaml"])["resources"] == list(manifests)
    monitor = manifests["servicemonitor.yaml"]
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert monitor["spec"]["selector"]["matchLabels"] == k8s.service(spec)["spec"]["selector"]


# --- nnunet-triton deploy --------------------------------------------------------------------------------


def test_deploy_tool_renders_k8s_files_when_repository_is_built(tmp_path: Path, capsys) -> None:
    from nnunet_triton.cli import deploy as tool

    repo = write_repository(tmp_path / "repo")
    assert (
        tool.main(
            [
                "--target",
                "k8s",
                "--repository",
                str(repo),
                "--out",
                str(tmp_path / "k8s"),
                "--image",
                "reg/nnunet-triton:1",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "k8s").iterdir()) == [
        "deployment.yaml",
        "hpa.yaml",
        "kustomization.yaml",
        "prometheus-adapter-values.yaml",
        "service.yaml",
    ]
    assert f"kubectl apply --kustomize {tmp_path / 'k8s'}" in capsys.readouterr().out


def test_deploy_tool_refuses_k8s_when_export_torch_is_newer(tmp_path: Path, caplog) -> None:
    from nnunet_triton.cli import deploy as tool

    repo = write_repository(tmp_path / "repo", torch_version="2.14.1")
    assert tool.main(["--target", "k8s", "--repository", str(repo), "--out", str(tmp_path / "k8s")]) == 1
    assert "exported with torch 2.14.1, newer than torch 2.5" in caplog.text
    assert not (tmp_path / "k8s").exists()


def test_deploy_tool_prints_export_build_and_run_commands_when_docker_target(
    tmp_path, monkeypatch, capsys
) -> None:
    from nnunet_triton.cli import deploy as tool

    monkeypatch.setattr(tool, "_read_config", lambda args: make_config())
    monkeypatch.setattr(
        tool, "_local_torch_fits", lambda args: False
    )  # torch 2.14 here: export in a container
    out = tmp_path / "repo_gpu"
    assert tool.main(["--target", "docker", "--model", str(tmp_path), "--out", str(out), "--gpus", "1",
                      "--variant", "gpu", "--engine", "docker", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    lines = [line.strip() for line in printed.splitlines() if line.startswith("  docker ")]
    assert [line.split()[:3] for line in lines] == [
        ["docker", "run", "--rm"],
        ["docker", "build", "--file"],
        ["docker", "run", "--detach"],
    ]
    assert (f"bash /src/docker/export_in_container.sh --model /models/{tmp_path.name} --target gpu "
            "--precision fp16") in lines[0]
    assert "--serving-torch 2.5" in lines[0]  # the image's libtorch: the builder there checks its torch
    assert f"--volume {out}:/models:ro" in lines[2] and "--gpus device=1" in lines[2]
    assert all(
        f"--load-model={name}" in lines[2]
        for name in RepositoryInfo.planned(make_config(), GPU_OPTIONS).models
    )
    assert not out.exists()  # nothing ran


def test_deploy_tool_undeploy_prints_docker_stop_and_remove(capsys) -> None:
    from nnunet_triton.cli import deploy as tool

    assert tool.main(["undeploy", "--target", "docker", "--engine", "docker", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "  docker stop --time 40 nnunet-triton",
        "  docker rm nnunet-triton",
    ]


def test_deploy_tool_refuses_k8s_when_repository_targets_cpu(tmp_path: Path, caplog) -> None:
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.cli import deploy as tool

    repo = write_repository(tmp_path / "repo", BuildOptions(target="cpu"))
    assert tool.main(["--target", "k8s", "--repository", str(repo), "--out", str(tmp_path / "k8s")]) == 1
    assert "was built for target 'cpu'; the pods get one GPU each" in caplog.text
