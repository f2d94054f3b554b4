"""``server.deploy.service``: the typed deploy plan and its steps, without the command line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from deploy_support import REPO_ROOT, write_repository

from nnunet_triton.errors import DeployError
from nnunet_triton.server.deploy import service


def test_the_deploy_command_line_is_under_200_lines() -> None:
    lines = (REPO_ROOT / "src" / "nnunet_triton" / "cli" / "deploy.py").read_text().splitlines()
    assert len(lines) < 200


def test_deploy_plan_is_frozen(tmp_path: Path) -> None:
    plan = service.DeployPlan(target="k8s", out=tmp_path)
    assert plan.target is service.Target.K8S
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.out = tmp_path / "other"  # type: ignore[misc]


@pytest.mark.parametrize(("fields", "message"), [
    ({"target": "swarm"}, "--target must be one of ['embedded', 'docker', 'k8s'], got 'swarm'."),
    ({"max_replicas": 0}, "--max-replicas must be at least --min-replicas (1), got 0."),
    ({"tile_batch_size": 0}, "--tile-batch-size must be at least 1, got 0."),
    ({"max_volume": (64, 0, 64)}, "--max-volume must be three positive voxel counts, got [64, 0, 64]."),
])
def test_deploy_plan_refuses_a_value_naming_the_flag_its_rule_and_the_value(tmp_path, fields, message):
    with pytest.raises(DeployError) as error:
        service.DeployPlan(**{"target": "k8s", "out": tmp_path, **fields})
    assert str(error.value) == message


def test_deploy_service_renders_k8s_manifests_and_says_how_to_apply_them(tmp_path: Path) -> None:
    repo = write_repository(tmp_path / "repo")
    said: list[str] = []
    plan = service.DeployPlan(target="k8s", out=tmp_path / "k8s", repository=repo,
                              image="reg/nnunet-triton:1")
    service.deploy(plan, said.append)
    assert sorted(p.name for p in plan.out.iterdir()) == [
        "deployment.yaml", "grafana-dashboard.json", "hpa.yaml", "kustomization.yaml",
        "prometheus-adapter-values.yaml", "prometheus-rules.yaml", "service.yaml"]
    assert said[-2:] == [
        "apply (prometheus-adapter needs prometheus-adapter-values.yaml for the HPA metric):",
        f"  kubectl apply --kustomize {plan.out}"]


def test_deploy_service_refuses_endpoints_the_built_repository_does_not_hold(tmp_path: Path) -> None:
    plan = service.DeployPlan(target="k8s", out=tmp_path / "k8s", repository=write_repository(tmp_path / "r"),
                              names=("lung",))
    with pytest.raises(DeployError, match=r"has no endpoint\(s\) \['lung'\]"):
        service.deploy(plan, print)
    assert not plan.out.exists()
