"""Kubernetes manifests (validated offline with kubernetes-validate's bundled schemas) and ``nnunet-triton
deploy`` (k8s rendering, printed docker commands, undeploy, several endpoints behind one server with
``--name`` / ``make deploy NAME=...``) without a cluster or Docker.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from deploy_support import REPO_ROOT, k8s_spec, two_endpoints, write_repository
from test_makefile_variables import _make, _value

from nnunet_triton import io_names
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.cli import deploy as tool
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.numerics.model_folder import read_model_folder
from nnunet_triton.server.deploy import docker, k8s, service, sizing
from nnunet_triton.server.deploy.repository_info import RepositoryInfo

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny"

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
    assert list(manifests) == ["deployment.yaml", "service.yaml", "hpa.yaml", "servicemonitor.yaml",
                               "prometheusrule.yaml"]
    for name, manifest in manifests.items():
        if manifest["apiVersion"] != "monitoring.coreos.com/v1":  # CRDs: test_deploy_k8s_schemas.py
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
    spec = k8s_spec(tmp_path, min_replicas=2, max_replicas=6, latency_target_us=500_000)
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
    assert k8s.ORCHESTRATOR_MODELS in rule["seriesQuery"]
    assert "nv_inference_request_success" in rule["metricsQuery"]
    # request time and requests of the same models: the orchestrators
    assert rule["metricsQuery"].count(k8s.ORCHESTRATOR_MODELS) == 2
    assert "nv_inference_request_duration_us" in rule["metricsQuery"]
    assert "nv_inference_queue_duration_us" not in rule["metricsQuery"]  # the orchestrator never queues


def test_k8s_queue_metric_covers_the_orchestrator_of_every_endpoint_version_and_nothing_else(
    tmp_path: Path,
) -> None:
    spec = k8s_spec(two_endpoints(tmp_path / "two"), built=True)
    pattern = re.fullmatch(r'model=~"(.+)"', k8s.ORCHESTRATOR_MODELS).group(1)  # Prometheus anchors it
    matched = [m for m in spec.info.models if re.fullmatch(pattern, m)]
    assert matched == ["liver__v1__orchestrator_model", "lung__v1__orchestrator_model"]

    default = k8s_spec(tmp_path / "one").info.models
    assert [m for m in default if re.fullmatch(pattern, m)] == ["orchestrator_model"]
    other = k8s_spec(tmp_path / "other")  # the HPA and its adapter rule do not depend on the endpoints
    assert k8s.autoscaler(spec) == k8s.autoscaler(other)
    assert k8s.adapter_rules(spec) == k8s.adapter_rules(other)


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
        "grafana-dashboard.json",
        "hpa.yaml",
        "kustomization.yaml",
        "prometheus-adapter-values.yaml",
        "prometheus-rules.yaml",
        "service.yaml",
    ]
    assert f"kubectl apply --kustomize {tmp_path / 'k8s'}" in capsys.readouterr().out


def test_deploy_tool_refuses_k8s_when_export_torch_is_newer(tmp_path: Path, caplog) -> None:
    repo = write_repository(tmp_path / "repo", torch_version="2.15.0")
    argv = ["--target", "k8s", "--repository", str(repo), "--out", str(tmp_path / "k8s")]
    assert tool.main(argv) == ExitCode.USAGE
    assert "exported with torch 2.15.0, newer than torch 2.14" in caplog.text
    assert not (tmp_path / "k8s").exists()


def _printed_commands(printed: str, engine: str = "docker") -> list[str]:
    return [line.strip() for line in printed.splitlines() if line.startswith(f"  {engine} ")]


def test_deploy_tool_prints_export_build_and_run_commands_when_docker_target(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(service, "local_torch_fits", lambda plan: False)  # whatever torch here: a container
    out = tmp_path / "repo_gpu"
    assert tool.main(["--target", "docker", "--model-dir", str(FIXTURE), "--out", str(out), "--gpus", "1",
                      "--variant", "gpu", "--engine", "docker", "--dry-run"]) == 0
    lines = _printed_commands(capsys.readouterr().out)
    assert [line.split()[:3] for line in lines] == [
        ["docker", "run", "--rm"],
        ["docker", "build", "--file"],
        ["docker", "run", "--detach"],
    ]
    assert (f"bash /src/docker/export_in_container.sh --model-dir /models/{FIXTURE.name} --target gpu "
            "--precision fp16") in lines[0]
    assert "--serving-torch 2.14" in lines[0]  # the image's libtorch: the builder there checks its torch
    assert lines[0].endswith("--endpoint nnunet")
    assert f"--volume {out}:/models:ro" in lines[2] and "--gpus device=1" in lines[2]
    options = BuildOptions(target="gpu", fold_precision="fp16")
    planned = RepositoryInfo.planned(read_model_folder(FIXTURE), options)
    assert re.findall(r"--load-model=(\S+)", lines[2]) == list(planned.models)
    assert not out.exists()  # nothing ran


def test_deploy_tool_with_two_names_exports_each_endpoint_and_starts_one_container_for_both(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(service, "local_torch_fits", lambda plan: False)
    out = tmp_path / "repo_gpu"
    assert tool.main(["--target", "docker", "--model-dir", str(FIXTURE), str(FIXTURE),
                      "--endpoint", "liver", "lung",
                      "--out", str(out), "--variant", "gpu", "--engine", "docker", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    lines = _printed_commands(printed)
    assert [line.split()[:3] for line in lines] == [["docker", "run", "--rm"]] * 2 + [
        ["docker", "build", "--file"], ["docker", "run", "--detach"]]
    assert [line.split()[-2:] for line in lines[:2]] == [["--endpoint", "liver"], ["--endpoint", "lung"]]
    assert all(f"REPOSITORY_OUT=/out/{out.name}" in line for line in lines[:2])  # one repository
    loaded = re.findall(r"--load-model=(\S+)", lines[3])
    for name in ("liver", "lung"):
        assert set(io_names.public_endpoints(name)) | {f"{name}__v1__orchestrator_model"} <= set(loaded)
    options = BuildOptions(target="gpu", fold_precision="fp16")
    one = RepositoryInfo.planned(read_model_folder(FIXTURE), options, name="liver")
    assert len(loaded) == 2 * len(one.models)
    shm = int(re.search(r"--shm-size=(\d+)m", lines[3]).group(1))
    alone = sizing.plan_memory(one, sizing.VolumeSpec(shape=(600, 512, 512))).shm_mib
    assert shm == 2 * (alone - 256) + 256  # both endpoints' stubs, the margin once
    assert "2 endpoint(s) on one server" in printed and "http://127.0.0.1:8000/v2/models/lung" in printed
    assert not out.exists()


def test_deploy_tool_with_two_names_builds_both_in_the_cpu_images_export_stage(
    tmp_path, capsys
) -> None:
    out = tmp_path / "repo_cpu"
    assert tool.main(["--target", "docker", "--model-dir", str(FIXTURE), str(FIXTURE),
                      "--endpoint", "liver", "lung",
                      "--out", str(out), "--variant", "cpu", "--engine", "podman", "--dry-run",
                      "--base-image", "localhost/debian:bookworm"]) == 0
    lines = _printed_commands(capsys.readouterr().out, "podman")
    exports = [line for line in lines if " -m repository.build " in line]
    assert [line.split()[-2:] for line in exports] == [["--endpoint", "liver"], ["--endpoint", "lung"]]
    assert all(f"--model-repository /out/{out.name}" in line and "-export python3 -m repository.build" in line
               for line in exports)
    (run,) = [line for line in lines if line.startswith("podman run --detach")]
    assert {"--load-model=liver", "--load-model=lung"} <= set(run.split())


@pytest.mark.parametrize(("argv", "message"), [
    (["--endpoint", "liver", "lung", "kidney"],
     r"--endpoint takes one name .* or one name per --model-dir folder .*: got 3 names "
     r"\['liver', 'lung', 'kidney'\] for 2 --model-dir folder\(s\) \['/m/a', '/m/b'\]\."),
    (["--endpoint", "liver", "liver"], r"gives the endpoint name\(s\) \['liver'\] more than once"),
    (["--configuration", "2d", "3d_lowres", "3d_fullres"],
     r"--configuration takes one value or one per --model-dir folder \(2: \['/m/a', '/m/b'\]\), got "
     r"\['2d', "),
])
def test_deploy_tool_refuses_names_or_configurations_that_do_not_pair_with_the_models(
    tmp_path: Path, caplog, argv: list[str], message: str
) -> None:
    for target in ("embedded", "docker", "k8s"):
        caplog.clear()
        assert tool.main(["--target", target, "--model-dir", "/m/a", "/m/b", *argv,
                          "--out", str(tmp_path / "o"),
                          "--dry-run"]) == ExitCode.USAGE
        assert re.search(message, caplog.text), caplog.text
    assert not (tmp_path / "o").exists()


def test_endpoint_plans_pair_names_with_models_or_keep_one_endpoint() -> None:
    a, b = Path("/m/a"), Path("/m/b")
    assert tool.endpoint_plans([a, b], ["liver", "lung"], ["3d_fullres"]) == (
        tool.EndpointPlan("liver", (a,), ("3d_fullres",)), tool.EndpointPlan("lung", (b,), ("3d_fullres",)))
    assert tool.endpoint_plans([a, b]) == (tool.EndpointPlan("nnunet", (a, b), (None, None)),)  # an ensemble
    assert tool.endpoint_plans([a, b], ["liver"], ["2d", "3d_fullres"]) == (
        tool.EndpointPlan("liver", (a, b), ("2d", "3d_fullres")),)
    assert tool.endpoint_plans([], ["liver"]) == ()  # k8s with a built --repository


def test_make_deploy_passes_names_that_pair_with_the_models(tmp_path: Path) -> None:
    (deploy,) = _make(tmp_path, "deploy", "MODEL=/m/a /m/b", "NAME=liver lung")
    assert deploy[:3] == ["-m", "nnunet_triton.cli", "deploy"]
    assert _value(deploy, "--model-dir") == ["/m/a", "/m/b"]
    assert _value(deploy, "--endpoint") == ["liver", "lung"]
    args = tool._parser(undeploy=False).parse_args(deploy[3:])
    assert tool.endpoint_plans(args.model, args.name) == (
        tool.EndpointPlan("liver", (Path("/m/a"),), (None,)),
        tool.EndpointPlan("lung", (Path("/m/b"),), (None,)))
    (plain,) = _make(tmp_path, "deploy", "MODEL=/m/a")
    assert "--endpoint" not in plain
    help_text = _make_help()
    assert 'NAME="liver lung"' in help_text.split("\n  deploy ", 1)[1].splitlines()[0]


def _make_help() -> str:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO_ROOT), "help"], check=True,
                          capture_output=True, text=True, timeout=60).stdout


def test_deploy_tool_renders_one_deployment_for_every_endpoint_of_a_repository(
    tmp_path: Path, capsys
) -> None:
    yaml = pytest.importorskip("yaml")
    repo = two_endpoints(tmp_path / "repo")
    assert tool.main(["--target", "k8s", "--repository", str(repo), "--out", str(tmp_path / "k8s"),
                      "--endpoint", "liver", "lung", "--image", "reg/nnunet-triton:1"]) == 0
    info = RepositoryInfo.from_repository(repo)
    (deployment,) = list(yaml.safe_load_all((tmp_path / "k8s" / "deployment.yaml").read_text()))
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"] == {"nnunet-triton/input-hash": info.input_hash,
                                                   "nnunet-triton/endpoints": "liver,lung"}
    (container,) = template["spec"]["containers"]
    loaded = [a.removeprefix("--load-model=") for a in container["args"] if a.startswith("--load-model=")]
    assert loaded == list(info.models)
    plan = sizing.plan_memory(info, sizing.VolumeSpec(shape=(600, 512, 512)))
    assert container["resources"]["limits"]["memory"] == f"{plan.host_memory_mib}Mi"
    shm = next(v for v in template["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["sizeLimit"] == f"{plan.shm_mib}Mi" == "11872Mi"  # both endpoints
    assert f"nnunet-triton-models:{info.input_hash[:12]}" in capsys.readouterr().out
    hpa = yaml.safe_load((tmp_path / "k8s" / "hpa.yaml").read_text())
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == k8s.LATENCY_METRIC


def test_deploy_tool_refuses_k8s_names_the_repository_does_not_hold(tmp_path: Path, caplog) -> None:
    repo = two_endpoints(tmp_path / "repo")
    assert tool.main(["--target", "k8s", "--repository", str(repo), "--out", str(tmp_path / "k8s"),
                      "--endpoint", "liver", "kidney"]) == ExitCode.USAGE
    assert f"the repository {repo} has no endpoint(s) ['kidney'] (it holds ['liver', 'lung'])" in caplog.text
    assert not (tmp_path / "k8s").exists()


def test_deploy_tool_refuses_k8s_when_the_repository_mixes_targets(tmp_path: Path, caplog) -> None:
    repo = tmp_path / "repo"
    write_repository(repo, name="liver")
    write_repository(repo, BuildOptions(target="cpu"), name="lung")
    argv = ["--target", "k8s", "--repository", str(repo), "--out", str(tmp_path / "k8s")]
    assert tool.main(argv) == ExitCode.USAGE
    assert "the repository mixes targets ['cpu', 'gpu'] (liver v1: gpu, lung v1: cpu)" in caplog.text
    assert "build every endpoint with the same --target" in caplog.text
    assert not (tmp_path / "k8s").exists()


def test_deploy_tool_undeploy_prints_docker_stop_and_remove(capsys) -> None:
    assert tool.main(["undeploy", "--target", "docker", "--engine", "docker", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "  docker stop --time 40 nnunet-triton",
        "  docker rm nnunet-triton",
    ]


def test_deploy_tool_refuses_k8s_when_repository_targets_cpu(tmp_path: Path, caplog) -> None:
    repo = write_repository(tmp_path / "repo", BuildOptions(target="cpu"))
    argv = ["--target", "k8s", "--repository", str(repo), "--out", str(tmp_path / "k8s")]
    assert tool.main(argv) == ExitCode.USAGE
    assert "was built for target 'cpu'; the pods get one GPU each" in caplog.text
