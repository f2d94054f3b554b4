"""The cpu serving image built and run for real with podman, and the Kubernetes Deployment under kube play.

``nnunet-triton deploy --target docker --variant cpu --tls-cert --tls-key --tls-ca`` (what ``make deploy
TARGET=docker`` runs on a host without a GPU, with the image's TLS proxy) builds the image from
docker/Dockerfile on the debootstrapped Debian base (its build-time check serves the fixture with the preload
library), builds the repository in the image's export stage, starts the container and waits until it is
healthy. Then: only the proxy's port is published, it refuses clients without a certificate of the CA and
non-public paths, its workers are not root, a killed nginx is started again by the container's watchdog,
tritonserver runs with the preload library and the placeholder instead of the token on its command line,
its /dev/shm regions are owner-only; the CLI's answer from the container (through the proxy, with a client
certificate) equals nnU-Net's; a killed model process inside the
container makes the container's health command fail naming the model and is reloaded by the watchdog; a
SIGKILLed tritonserver (PID 1) is restarted by the restart policy and answers correctly again; the
repository volume is read-only; a bad repository exits with one clear line, not an endless restart loop.
``--target k8s --kube-play`` runs the rendered Deployment (the repository from its PVC, a podman volume;
emptyDir volumes; host ports on loopback) under ``podman kube play``: its readiness command tells the
truth while a model is broken, the liveness healthcheck too, the watchdog heals it, and a killed server
is restarted by the pod's policy.

Skipped with the reason where podman cannot run (not root, no apt). Images and the base image stay in
podman's store and the wheels under build/containers, so only the first run builds (times are printed as
``containers:`` lines and recorded as properties).
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from pipeline_support import REPO_ROOT, SYNTHCT, cases, model_dir, probe_case, reference
from recovery_support import RECOVERY_LIMIT_S, REQUEST_TIMEOUT_S, paused, wait_until

from nnunet_triton.cli import deploy as deploy_tool
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.client.tls import ClientTls, client_tls
from nnunet_triton.server import health, preload
from nnunet_triton.server.deploy import container_proxy, entrypoint, service
from nnunet_triton.server.deploy.repository_info import RepositoryInfo
from tests.tls_support import Certificates, make_certificates
from tools import container_host

CONTAINER = "nnunet-triton-test"
POD = "nnunet-triton-kube"
POD_CONTAINER = f"{POD}-pod-0-tritonserver"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def podman(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


def _state(name: str) -> dict[str, str]:
    fields = "{{.State.Status}} {{.State.Pid}} {{.RestartCount}} {{.State.ExitCode}}"
    out = podman("inspect", "--format", fields, name).stdout.split()
    return dict(zip(("status", "pid", "restarts", "exit_code"), out, strict=False))


def _server_pid(name: str) -> int:
    """Host pid of the container's PID 1: tritonserver (the entry point execs it)."""
    return int(_state(name)["pid"])


def _watchdog_pid(server_pid: int) -> int:
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == server_pid]
    (watchdog,) = [p for p in children if b"thread_budget" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return watchdog


def _parent(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1])


def _healthy_in(name: str, command: list[str]) -> subprocess.CompletedProcess:
    return podman("exec", name, *command, timeout=60)


def _assert_probe_answers(url: str, tls: ClientTls | None = None) -> None:
    probe = probe_case(SYNTHCT)
    with NnunetClient(url, timeout_s=REQUEST_TIMEOUT_S, tls=tls) as client:
        result = client.segment(probe.image, probe.spacing, mirroring=False)
    np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, probe.name, False).segmentation)


@pytest.fixture(scope="module")
def engine() -> str:
    problem = container_host.ensure_podman()
    if problem:
        pytest.skip(f"podman cannot run here: {problem}")
    container_host.ensure_base_image("podman")  # deploy only checks that it is there
    return "podman"


def _deploy(argv: list[str], what: str) -> float:
    start = time.monotonic()
    code = deploy_tool.main(argv)
    took = time.monotonic() - start
    print(f"containers: {what} took {took:.1f} s")
    assert code == 0, f"{what} failed (see the captured output)"
    return took


@pytest.fixture(scope="module")
def cpu_container(engine, tmp_path_factory):
    ports = _free_ports(4)
    certs = make_certificates(tmp_path_factory.mktemp("certs"))
    argv = ["--target", "docker", "--model-dir", str(model_dir(SYNTHCT)), "--variant", "cpu",
            "--engine", engine,
            "--container-name", CONTAINER,
            "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
            "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
            "--tls-ca", str(certs.ca),
            "--proxy-port", str(ports[3]),
            "--max-volume", "64", "128", "128", "--execute"]
    took = _deploy(argv, "make deploy TARGET=docker (cpu image, podman, TLS proxy)")
    yield {"url": f"127.0.0.1:{ports[3]}", "deploy_s": took, "certs": certs,
           "tls": client_tls(certs.ca, certs.client_cert, certs.client_key)}
    assert deploy_tool.main(["undeploy", "--target", "docker", "--engine", engine,
                             "--container-name", CONTAINER]) == 0
    assert _state(CONTAINER) == {}, "undeploy left the container behind"


def test_cpu_image_container_answers_equal_nnunet_through_the_cli(cpu_container, tmp_path, record_property):
    import SimpleITK as sitk

    record_property("deploy_s", round(cpu_container["deploy_s"], 1))
    images = REPO_ROOT / "tests/fixtures" / SYNTHCT / "imagesTs"
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "nnunet_triton", "predict", "-i", str(images), "-o", str(out),
         "--url", cpu_container["url"], "--ca", str(cpu_container["certs"].ca),
         "--cert", str(cpu_container["certs"].client_cert), "--key", str(cpu_container["certs"].client_key)],
        capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for case in cases(SYNTHCT):
        served = sitk.GetArrayFromImage(sitk.ReadImage(str(out / f"{case.name}.nii.gz")))
        np.testing.assert_array_equal(served, reference(SYNTHCT, case.name, True).segmentation,
                                      err_msg=case.name)


def _https(url: str, certs: Certificates, path: str, client: tuple[Path, Path] | None) -> int:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=60)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def _nginx_master() -> int | None:
    """Host pid of the container's nginx master (started by its watchdog on the container's config; the
    watchdog's own command line names that config too)."""
    config = str(container_proxy.RUN_DIR / "nginx.conf").encode()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline, stat = Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm, state = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(") ", 1)[1][0]
        if comm == "nginx" and config in cmdline and state != "Z" and _uid(pid) == 0:
            return pid
    return None


def _uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def test_tls_container_publishes_only_its_proxy_refuses_strangers_and_keeps_the_token_off_argv(cpu_container):
    url, certs = cpu_container["url"], cpu_container["certs"]
    ports = podman("port", CONTAINER).stdout.split()
    assert ports == [f"{container_proxy.PROXY_PORT}/tcp", "->", url], ports  # Triton's ports: not published
    client = (certs.client_cert, certs.client_key)
    assert _https(url, certs, "/v2/health/ready", None) == 400  # nginx: "No required SSL certificate"
    assert _https(url, certs, "/v2/health/ready", (certs.stranger_cert, certs.stranger_key)) == 400
    assert _https(url, certs, "/v2/health/ready", client) == 200
    assert _https(url, certs, "/v2/models/stitch_model/config", client) == 403  # internal model
    assert _https(url, certs, "/v2/repository/index", client) == 403
    server = _server_pid(CONTAINER)
    cmdline = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
    restricted = [arg for arg in cmdline if b"restricted" in arg]
    placeholder = f"={preload.PLACEHOLDER}".encode()
    assert restricted and all(arg.endswith(placeholder) for arg in restricted), restricted
    assert str(entrypoint.PRELOAD_LIBRARY) in Path(f"/proc/{server}/maps").read_text()
    for stub in health.stub_processes(server):
        mode = podman("exec", CONTAINER, "stat", "-c", "%a", f"/dev/shm/{stub.shm_region}").stdout.strip()
        assert mode == "600", (stub.shm_region, mode)
    master = _nginx_master()
    assert master is not None
    workers = [p for p in (int(p) for p in os.listdir("/proc") if p.isdigit()) if _parent(p) == master]
    assert workers and all(_uid(w) != 0 for w in workers)  # nnunet-proxy, not root
    os.kill(master, signal.SIGKILL)  # its workers keep the port until the watchdog ends them
    def answers() -> bool:
        try:
            return _https(url, certs, "/v2/health/ready", client) == 200
        except OSError:
            return False

    took = wait_until(lambda: _nginx_master() not in (None, master) and answers(), "proxy restarted", 60)
    print(f"containers: killed nginx restarted by the container's watchdog in {took:.1f} s")


def test_container_health_command_names_a_killed_model_until_the_watchdog_reloads_it(cpu_container):
    health_cmd = list(deploy_tool.docker.health_probe())
    assert _healthy_in(CONTAINER, health_cmd).returncode == 0
    server = _server_pid(CONTAINER)
    (victim,) = [s for s in health.stub_processes(server) if s.model == "fold_0"]
    with paused(_watchdog_pid(server)):
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: _healthy_in(CONTAINER, health_cmd).returncode == 1, "health command fails", 30)
        broken = _healthy_in(CONTAINER, health_cmd)
        assert "model 'fold_0': 0 of 1 Python-backend processes alive" in broken.stdout, broken.stdout
        assert podman("healthcheck", "run", CONTAINER).returncode != 0  # docker's --health-cmd, run now
    took = wait_until(lambda: _healthy_in(CONTAINER, health_cmd).returncode == 0, "reloaded",
                      RECOVERY_LIMIT_S)
    print(f"containers: fold_0 reloaded by the container's watchdog in {took:.1f} s")
    assert podman("healthcheck", "run", CONTAINER).returncode == 0
    _assert_probe_answers(cpu_container["url"], cpu_container["tls"])


def test_killed_tritonserver_in_the_container_is_restarted_by_the_restart_policy(cpu_container):
    before = _state(CONTAINER)
    os.kill(int(before["pid"]), signal.SIGKILL)  # what the OOM killer does to PID 1
    start = time.monotonic()
    wait_until(lambda: _state(CONTAINER).get("restarts") == str(int(before["restarts"]) + 1), "restarted", 60)
    wait_until(lambda: _healthy_in(CONTAINER, list(deploy_tool.docker.health_probe())).returncode == 0,
               "healthy after the restart", 300)
    print(f"containers: SIGKILLed tritonserver restarted and healthy in {time.monotonic() - start:.1f} s")
    assert _state(CONTAINER)["pid"] != before["pid"]
    _assert_probe_answers(cpu_container["url"], cpu_container["tls"])


def test_repository_volume_is_read_only_inside_the_container(cpu_container):
    written = podman("exec", CONTAINER, "touch", "/models/written-by-the-container")
    assert written.returncode != 0 and "Read-only file system" in written.stderr
    _assert_probe_answers(cpu_container["url"], cpu_container["tls"])


def test_bad_repository_container_exits_with_a_clear_line_instead_of_restarting_forever(cpu_container,
                                                                                          tmp_path):
    repo = tmp_path / "bad"
    shutil.copytree(REPO_ROOT / service.CPU_IMAGE_OUT, repo, ignore=shutil.ignore_patterns("fold_1"))
    spec = deploy_tool.docker.replace_spec(
        service._docker_spec(_plan(), RepositoryInfo.from_repository(REPO_ROOT / service.CPU_IMAGE_OUT),
                             variant="cpu", engine="podman"),
        repository=str(repo), container_name=f"{CONTAINER}-bad", http_port=_free_ports(1)[0],
        grpc_port=_free_ports(1)[0], metrics_port=_free_ports(1)[0])
    podman("rm", "-f", spec.container_name)
    try:
        assert podman(*deploy_tool.docker.docker_run_command(spec)[1:]).returncode == 0
        wait_until(lambda: _state(spec.container_name).get("status") == "exited"
                   and _state(spec.container_name).get("restarts") == "5", "exited after 5 restarts", 120)
        time.sleep(3)
        state = _state(spec.container_name)
        assert (state["status"], state["restarts"], state["exit_code"]) == ("exited", "5", "78")
        logs = podman("logs", spec.container_name).stderr + podman("logs", spec.container_name).stdout
        line = ("nnunet-triton: cannot serve the model repository /models: repository '/models' disagrees "
                "with its repository_metadata.json: models without config.pbtxt ['fold_1']")
        assert logs.count(line) == 6, logs[-2000:]  # the first start and 5 restarts, each saying why
    finally:
        podman("rm", "-f", spec.container_name)


def _plan() -> service.DeployPlan:
    args = deploy_tool._parser(False).parse_args([])
    args.out = REPO_ROOT / service.CPU_IMAGE_OUT
    return deploy_tool._plan(args, undeploy=False)


def test_kube_play_runs_the_deployment_with_truthful_probes_a_healed_kill_and_a_restart(
        engine, cpu_container, tmp_path, record_property):
    ports = _free_ports(3)
    out = tmp_path / "k8s"
    argv = ["--target", "k8s", "--model-dir", str(model_dir(SYNTHCT)), "--kube-play", "--out", str(out),
            "--container-name", POD,
            "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
            "--max-volume", "64", "128", "128"]
    try:
        record_property("kube_play_s", round(_deploy(argv, "podman kube play of the Deployment"), 1))
        url = f"127.0.0.1:{ports[0]}"
        _assert_probe_answers(url)
        pod = yaml.safe_load((out / "deployment.yaml").read_text())["spec"]["template"]["spec"]
        container = pod["containers"][0]
        readiness = container["readinessProbe"]["exec"]["command"]
        assert container["livenessProbe"]["exec"]["command"] == readiness
        assert pod["volumes"][1]["persistentVolumeClaim"]["readOnly"] is True  # a podman volume here
        assert _healthy_in(POD_CONTAINER, readiness).returncode == 0
        # the repository came from the PVC (a podman volume), mounted read-only
        assert podman("exec", POD_CONTAINER, "touch", "/models/x").returncode != 0

        server = _server_pid(POD_CONTAINER)
        (victim,) = [s for s in health.stub_processes(server) if s.model == "stitch_model"]
        with paused(_watchdog_pid(server)):
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: _healthy_in(POD_CONTAINER, readiness).returncode == 1, "readiness fails", 30)
            assert "model 'stitch_model'" in _healthy_in(POD_CONTAINER, readiness).stdout
            assert podman("healthcheck", "run", POD_CONTAINER).returncode != 0  # the liveness probe
        took = wait_until(lambda: _healthy_in(POD_CONTAINER, readiness).returncode == 0, "healed",
                          RECOVERY_LIMIT_S)
        print(f"containers: kube play pod healed by its watchdog in {took:.1f} s")
        _assert_probe_answers(url)

        before = _state(POD_CONTAINER)
        os.kill(int(before["pid"]), signal.SIGKILL)
        start = time.monotonic()
        wait_until(lambda: _state(POD_CONTAINER).get("pid") not in (None, "0", before["pid"])
                   and _healthy_in(POD_CONTAINER, readiness).returncode == 0, "pod container restarted", 300)
        print(f"containers: kube play container restarted (restartPolicy Always) and ready in "
              f"{time.monotonic() - start:.1f} s")
        _assert_probe_answers(url)
    finally:
        deploy_tool.main(["undeploy", "--target", "k8s", "--kube-play", "--out", str(out)])
    assert podman("pod", "exists", f"{POD}-pod-0").returncode != 0
