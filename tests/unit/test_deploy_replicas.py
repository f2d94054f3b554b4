"""``deploy --target docker --replicas N``: the balancer's nginx config (the project's one proxy renderer
with an ``upstream`` of N replicas), the replica and balancer command lines, and the ``--replicas`` refusals.
Nothing needs a container engine; nginx checks the rendered syntax. tests/triton/test_replicas.py runs it for
real.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from deploy_support import REPO_ROOT, docker_spec

from nnunet_triton.cli import deploy as tool
from nnunet_triton.cli.exit_codes import ExitCode
from nnunet_triton.errors import DeployError
from nnunet_triton.server.deploy import replicas, service
from nnunet_triton.server.proxy_config import (
    Balancer,
    ExposureError,
    ProxyConfig,
    ProxyError,
    TlsSettings,
    render_config,
)
from tests.tls_support import make_certificates

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
PORTS = ((41001, 41002, 41003), (41011, 41012, 41013))


def _group(**changes: object) -> replicas.ReplicaSet:
    values: dict[str, object] = {"name": "seg", "ports": PORTS, "listen_port": 8000, **changes}
    return replicas.ReplicaSet(**values)  # type: ignore[arg-type]


def _block(text: str, head: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == head)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "}")
    return [line.strip() for line in lines[start + 1:end]]


def test_balancer_config_sends_every_public_path_to_an_upstream_of_the_replicas_with_passive_checks() -> None:
    text = render_config(replicas.balancer_config(_group(), ("liver",)))
    assert _block(text, "upstream nnunet_replicas {") == [
        "server 127.0.0.1:41001 max_fails=1 fail_timeout=10s;",
        "server 127.0.0.1:41011 max_fails=1 fail_timeout=10s;"]  # the HTTP ports only
    forwards = {line.strip() for line in text.splitlines() if line.strip().startswith("proxy_pass")}
    assert forwards == {"proxy_pass http://nnunet_replicas$uri;"}
    lines = {line.strip() for line in text.splitlines()}
    # a failed attempt (refused, reset, 502, 503) goes on to the other replica, inference POSTs included
    assert "proxy_next_upstream error timeout http_502 http_503 non_idempotent;" in lines
    assert "proxy_next_upstream_tries 2;" in lines and "proxy_connect_timeout 5s;" in lines
    assert "listen 127.0.0.1:8000;" in lines and not any(line.startswith("ssl_") for line in lines)
    assert f"access_log {replicas.BALANCER_RUN_DIR}/nginx-access.log nnunet_balancer;" in lines
    assert any("$upstream_addr $upstream_status" in line for line in lines)
    # the same allow-list and guards as the TLS proxy: internal models and non-public APIs stay closed
    assert "location / { return 403; }" in lines
    assert any(line.startswith("if ($http_content_encoding") for line in lines)


def test_a_proxy_without_a_balancer_renders_as_before() -> None:
    config = replicas.balancer_config(_group(), ("liver",))
    plain = render_config(ProxyConfig(**{**config.__dict__, "balancer": None}))
    assert "upstream" not in plain.replace("$upstream", "") and "proxy_next_upstream" not in plain
    assert "proxy_pass http://127.0.0.1:41001$uri;" in plain


def test_balancer_with_tls_keeps_client_authentication_and_mounts_the_files_read_only(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-the-balancer\n")
    tls = TlsSettings(cert=certs.server_cert, key=certs.server_key, client_ca=certs.ca, token_file=token)
    group = _group(listen_host="0.0.0.0", listen_port=8443, tls=tls)
    lines = {line.strip() for line in render_config(replicas.balancer_config(group, ("liver",))).splitlines()}
    assert "listen 0.0.0.0:8443 ssl;" in lines and "ssl_verify_client on;" in lines
    assert f"ssl_client_certificate {certs.ca.absolute()};" in lines
    assert 'if ($http_authorization != "Bearer s3cret-token-of-the-balancer") { return 401; }' in lines
    run = replicas.balancer_run_command(group, image="img:1", run_dir=tmp_path, engine="podman")
    mounts = {run[i + 1] for i, part in enumerate(run) if part == "--volume"}
    assert mounts == {f"{tmp_path}:{replicas.BALANCER_RUN_DIR}",
                      *(f"{path.absolute()}:{path.absolute()}:ro"
                        for path in (certs.server_cert, certs.server_key, certs.ca, token))}


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_a_plain_http_balancer_beyond_loopback_is_refused(host: str) -> None:
    refusal = rf"would listen on '{re.escape(host)}' \(beyond loopback\) without TLS"
    with pytest.raises(ExposureError, match=refusal):
        replicas.balancer_config(_group(listen_host=host), ("liver",))


@pytest.mark.parametrize(("ports", "problem"), [((), "one or more"), ((8000, 8000), "distinct"),
                                                ((0,), "1-65535")])
def test_balancer_refuses_no_duplicate_or_invalid_replica_ports(ports, problem) -> None:
    with pytest.raises(ProxyError, match=problem):
        Balancer(ports=ports)


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx-light)")
def test_rendered_balancer_config_passes_nginx_syntax_check(tmp_path: Path) -> None:
    config = replicas.balancer_config(_group(listen_port=18000), ("liver",))
    config = ProxyConfig(**{**config.__dict__, "run_dir": tmp_path})
    (tmp_path / "nginx.conf").write_text(render_config(config, temp_dir=tmp_path))
    result = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e",
                             str(tmp_path / "error.log")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_each_replica_publishes_its_own_loopback_ports_without_tls_and_gpus_go_round_robin(tmp_path) -> None:
    spec = docker_spec(tmp_path, gpus=(0, 1))
    specs = replicas.replica_specs(spec, _group(ports=(*PORTS, (41021, 41022, 41023))))
    assert [(s.container_name, s.http_port, s.grpc_port, s.metrics_port, s.gpus) for s in specs] == [
        ("seg-0", 41001, 41002, 41003, (0,)), ("seg-1", 41011, 41012, 41013, (1,)),
        ("seg-2", 41021, 41022, 41023, (0,))]
    assert all(s.publish_host == "127.0.0.1" and s.tls is None and s.image_tag == spec.image_tag
               for s in specs)


def test_balancer_runs_nginx_of_the_image_on_the_host_network_with_its_run_folder(tmp_path: Path) -> None:
    run = replicas.balancer_run_command(_group(), image="img:1", run_dir=tmp_path, engine="podman")
    assert run == ("podman", "run", "--detach", "--name", "seg-balancer", "--restart", "on-failure:5",
                   "--network", "host", "--volume", f"{tmp_path}:{replicas.BALANCER_RUN_DIR}", "img:1",
                   "nginx", "-c", f"{replicas.BALANCER_RUN_DIR}/nginx.conf")
    check = replicas.balancer_run_command(_group(), image="img:1", run_dir=tmp_path, engine="podman",
                                          check_only=True)
    assert check[:3] == ("podman", "run", "--rm") and check[-1] == "-t"


def test_replica_set_refuses_a_port_used_twice() -> None:
    with pytest.raises(ValueError, match="must differ"):
        _group(listen_port=41001)


def test_the_state_file_lists_every_replica_and_the_balancer(tmp_path: Path) -> None:
    replicas.write_state(tmp_path, _group(), "podman")
    state = replicas.read_state(tmp_path)
    assert state == {"engine": "podman", "balancer": "seg-balancer", "url": "127.0.0.1:8000", "tls": False,
                     "replicas": [{"name": "seg-0", "http_port": 41001, "grpc_port": 41002,
                                   "metrics_port": 41003},
                                  {"name": "seg-1", "http_port": 41011, "grpc_port": 41012,
                                   "metrics_port": 41013}]}


@pytest.mark.parametrize("value", [0, -2])
def test_replicas_below_one_are_refused_naming_the_flag_the_rule_and_the_value(tmp_path, value) -> None:
    with pytest.raises(DeployError) as error:
        service.DeployPlan(target="docker", out=tmp_path, replicas=value)
    assert str(error.value) == (f"--replicas must be an integer of at least 1 (containers behind the "
                                f"balancer), got {value}.")


@pytest.mark.parametrize(("target", "hint"), [("k8s", "--min-replicas/--max-replicas"),
                                              ("embedded", "one process")])
def test_replicas_with_a_target_other_than_docker_are_refused(tmp_path, target, hint) -> None:
    with pytest.raises(DeployError) as error:
        service.DeployPlan(target=target, out=tmp_path, replicas=2)
    assert str(error.value).startswith(f"--replicas 2 (more than 1) runs containers behind an nginx balancer "
                                       f"with --target docker only, got --target {target} (")
    assert hint in str(error.value)
    service.DeployPlan(target=target, out=tmp_path, replicas=1)  # one: the target's own single server


def test_deploy_tool_refuses_replicas_zero_with_the_usage_exit_code(tmp_path, caplog) -> None:
    argv = ["--target", "docker", "--model-dir", str(FIXTURE), "--replicas", "0", "--dry-run"]
    assert tool.main(argv) == ExitCode.USAGE
    refusal = "--replicas must be an integer of at least 1 (containers behind the balancer), got 0."
    assert refusal in caplog.text


def test_deploy_tool_dry_run_prints_one_run_per_replica_and_the_balancer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NNUNET_TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(service, "local_torch_fits", lambda plan: False)
    assert tool.main(["--target", "docker", "--model-dir", str(FIXTURE), "--out", str(tmp_path / "repo"),
                      "--variant", "gpu", "--gpus", "0", "1", "--engine", "docker", "--replicas", "2",
                      "--dry-run"]) == 0
    printed = capsys.readouterr().out
    runs = [line.strip() for line in printed.splitlines() if line.startswith("  docker run --detach")]
    assert [re.search(r"--name (\S+)", line).group(1) for line in runs] == [  # type: ignore[union-attr]
        "nnunet-triton-0", "nnunet-triton-1", "nnunet-triton-balancer"]
    assert all("--publish 127.0.0.1:" in line for line in runs[:2])
    assert ["--gpus device=0" in runs[0], "--gpus device=1" in runs[1]] == [True, True]
    assert "--network host" in runs[2]
    assert "gRPC and metrics are not balanced" in printed
    assert not (tmp_path / "home").exists()  # nothing ran, nothing recorded


def test_undeploy_dry_run_says_the_recorded_replicas_and_keeps_the_record(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NNUNET_TRITON_HOME", str(tmp_path))
    folder = replicas.state_dir(tmp_path / "run", "seg")
    folder.mkdir(parents=True)
    replicas.write_state(folder, _group(), "docker")
    assert tool.main(["undeploy", "--target", "docker", "--engine", "docker", "--container-name", "seg",
                      "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"  docker {verb} {name}" for name in ("seg-balancer", "seg-0", "seg-1")
        for verb in ("stop --time 40", "rm")]
    assert replicas.read_state(folder) is not None  # nothing ran: still recorded
