"""Self-healing on the real server: ``kill -9`` of each model's process under load.

The shared SynthCT server is started by the default launcher (explicit model control + the watchdog,
``nnunet_triton.server.watchdog``). For each Python model of the pipeline, while 4 clients (2 HTTP, 2 gRPC)
send the probe case without mirroring: the watchdog is paused (SIGSTOP) so that the broken state can be
observed, the model's stub is killed with SIGKILL (what the OOM killer does), the honest health check
(``server.health``) must say which model is broken while Triton's own endpoints still answer 200,
then the watchdog resumes and the endpoint must be healthy and answer correctly again within 30 s.
Every request must have got either nnU-Net's segmentation or a retryable error naming a model; no
request may hang; no stub process or ``/dev/shm`` region may be left behind.

Recovery times measured here are printed as ``recovery`` lines (docs/reliability.md's table).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import REPO_ROOT, SYNTHCT, build, probe_case, reference, shared_server
from recovery_support import (
    RECOVERY_LIMIT_S,
    REQUEST_TIMEOUT_S,
    SHM,
    Load,
    assert_recovers_under_load,
    paused,
    stubs_of,
    wait_until,
)

from nnunet_triton.client.client import NnunetClient
from nnunet_triton.server import health
from nnunet_triton.server.handle import ServerHandle


@pytest.fixture(scope="module")
def server(triton_server, request):
    return shared_server(SYNTHCT, triton_server, request)


@pytest.mark.parametrize("model", ["preprocess_model", "orchestrator_model", "fold_0", "stitch_model"])
def test_killed_model_process_is_reported_and_reloaded_and_answers_stay_correct_under_load(server, model,
                                                                                         record_property):
    probe = probe_case(SYNTHCT)
    load = Load(server, probe.image, probe.spacing, reference(SYNTHCT, probe.name, False).segmentation,
                options={"mirroring": False})
    record_property("recovery_s", round(assert_recovers_under_load(server, model, load), 2))
    if model == "fold_0":  # through the orchestrator's BLS call: the code is UNAVAILABLE, not INTERNAL
        assert {e.status for e in load.errors} <= {"503", "StatusCode.UNAVAILABLE"}, \
            {(e.status, str(e)) for e in load.errors}


def test_health_cli_exits_nonzero_naming_the_broken_model_until_the_watchdog_reloads_it(server):
    import subprocess
    import sys

    def cli() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "nnunet_triton.server.health", "--url", server.http_url,
             "--model-repository",
             server.model_repository, "--server-pid", str(server.pid)],
            capture_output=True, text=True, timeout=60, check=False)

    assert (cli().returncode, cli().stdout) == (0, "healthy\n")
    (victim,) = stubs_of(server, "fold_1")
    with paused(server.watchdog_pid):
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: "fold_1" in server.health().broken_models, "fold_1 reported broken", 10)
        broken = cli()
    assert broken.returncode == 1
    assert ("not healthy: model 'fold_1': 0 of 1 Python-backend processes alive (dead: fold_1_0_0)"
            in broken.stdout)
    wait_until(lambda: cli().returncode == 0, "health CLI healthy again", RECOVERY_LIMIT_S)


def test_model_repository_api_refuses_requests_without_the_launchers_token(server):
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    control = http.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException, match="This API is restricted"):
            control.unload_model("fold_0")
        assert control.is_model_ready("fold_0")
        index = control.get_model_repository_index(headers=server.control_headers)
        assert {m["name"] for m in index} >= {"fold_0", "preprocess_model", "nnunet"}
    finally:
        control.close()



def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == pid]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def test_container_entry_point_forks_a_watchdog_that_reloads_a_killed_model(tmp_path):
    """What the Docker image and the Kubernetes pod run (``deploy.docker.server_command``), minus Docker:
    ``thread_budget exec --watchdog --preload LIB -- tritonserver ...`` forks the watchdog and execs the
    server with the preload library: the token reaches Triton (the watchdog's reload works) but not its
    command line."""
    import subprocess
    import sys

    from nnunet_triton.server import preload
    from nnunet_triton.server.triton_install import prepare_home, server_env

    installation = prepare_home(os.environ.get("NNUNET_TRITON_HOME", REPO_ROOT / "build" / "triton-home"))
    repo = build(SYNTHCT)
    token = "container-entry-token-0123456789"
    http_port, grpc_port, metrics_port = _free_ports(3)
    command = [
        sys.executable, "-m", "nnunet_triton.server.thread_budget", "exec", "--watchdog",
        "--preload", str(preload.library(tmp_path / "preload")),
        "--model-repository", str(repo), "--", str(installation.server_bin), f"--model-repository={repo}",
        f"--backend-directory={installation.backend_dir}", f"--cache-directory={installation.cache_dir}",
        "--http-address=127.0.0.1", f"--http-port={http_port}", "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}", "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
        "--model-control-mode=explicit", "--load-model=*", "--disable-auto-complete-config",
        "--backend-config=python,stub-timeout-seconds=120", "--exit-timeout-secs=5",
    ]
    with open(tmp_path / "container.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**server_env(installation), "NNUNET_TRITON_CONTROL_TOKEN": token},
                                   start_new_session=True)
    url = f"127.0.0.1:{http_port}"
    try:
        def healthy() -> bool:
            return health.check_health(url, health.repository_models(repo), server_pid=process.pid).healthy

        wait_until(lambda: healthy() or process.poll() is not None, "the container's server healthy", 300)
        assert process.poll() is None, (tmp_path / "container.log").read_text()[-3000:]
        assert Path(f"/proc/{process.pid}/exe").resolve() == installation.server_bin.resolve()  # exec'd
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline and preload.PLACEHOLDER.encode() in cmdline
        (watchdog,) = [p for p in _children(process.pid)
                       if b"thread_budget" in Path(f"/proc/{p}/cmdline").read_bytes()]
        with pytest.raises(Exception, match="This API is restricted"):
            import tritonclient.http as http

            http.InferenceServerClient(url).unload_model("fold_0")

        (victim,) = [s for s in health.stub_processes(process.pid) if s.model == "fold_0"]
        os.kill(victim.pid, signal.SIGKILL)
        def reloaded() -> bool:
            pids = [s.pid for s in health.stub_processes(process.pid) if s.model == "fold_0"]
            return pids not in ([], [victim.pid]) and healthy()

        wait_until(reloaded, "fold_0 reloaded by the container's watchdog", RECOVERY_LIMIT_S)
        probe = probe_case(SYNTHCT)
        with NnunetClient(url, timeout_s=REQUEST_TIMEOUT_S) as client:
            result = client.segment(probe.image, probe.spacing, mirroring=False)
        np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, probe.name, False).segmentation)
        assert b"model 'fold_0' reloaded" in (tmp_path / "container.log").read_bytes()
    finally:
        process.terminate()  # docker stop: SIGTERM to PID 1
        process.wait(60)
    wait_until(lambda: _parent(watchdog) is None, "the watchdog exits with the server", 30)


def test_killed_detached_tritonserver_is_restarted_its_leftovers_removed_and_status_counts_the_restart(
        identity_model_repository, tmp_path, capsys):
    """``make serve`` / ``make deploy`` (embedded, detached): the watchdog removes what a SIGKILLed
    tritonserver leaves behind, starts it again on the same ports and repository, and ``status`` reports
    the restart."""
    import json

    from nnunet_triton.cli import serve as embedded_cli

    args = ["--home", str(tmp_path / "home")]
    start = [*args, "start", "--model-repository", str(identity_model_repository)]

    def status() -> dict:
        embedded_cli.main([*args, "status"])
        return json.loads(capsys.readouterr().out)

    try:
        assert embedded_cli.main(start) == 0
        started = json.loads(capsys.readouterr().out)
        stubs = health.stub_processes(started["pid"])
        assert stubs and all((SHM / s.shm_region).exists() for s in stubs)
        os.kill(started["pid"], signal.SIGKILL)  # the OOM killer's choice

        wait_until(lambda: status()["healthy"] and status()["pid"] != started["pid"], "restarted and healthy",
                   RECOVERY_LIMIT_S)
        after = status()
        assert (after["restarts"], after["http_port"], after["watchdog_pid"]) == (
            1, started["http_port"], started["watchdog_pid"])
        assert not any(_parent(s.pid) is not None for s in stubs), "a stub process outlived the server"
        assert not any((SHM / s.shm_region).exists() for s in stubs), "a shm region outlived the server"
        log_file = Path(started["log_file"]).with_name("tritonserver.watchdog.log")
        # the new pid is recorded before the server is ready; the watchdog logs after it saw it ready
        wait_until(lambda: f"tritonserver restarted as pid {after['pid']}: ready" in log_file.read_text(),
                   "the watchdog logged the restart", 30)
        assert f"tritonserver pid {started['pid']} exited without being stopped" in log_file.read_text()
        handle = ServerHandle.from_state_file(tmp_path / "home" / "run" / "server.json")
        assert handle.is_ready() and handle.health().healthy
    finally:
        embedded_cli.main([*args, "stop"])
    assert not health.pid_alive(after["pid"])


def test_watchdog_retries_a_failing_reload_with_backoff_until_the_model_loads(triton_server, tmp_path):
    import json

    from conftest import IDENTITY_MODEL, write_identity_repository

    repo = write_identity_repository(tmp_path / "repo")
    model_py = repo / IDENTITY_MODEL / "1" / "model.py"
    good = model_py.read_text()
    with triton_server(repo) as server:
        events = Path(server.events_file)
        (victim,) = stubs_of(server, IDENTITY_MODEL)
        with paused(server.watchdog_pid):
            os.kill(victim.pid, signal.SIGKILL)
            # the reload will fail, as a model whose initialize runs out of memory does
            broken = "    def initialize(self, args):\n        raise MemoryError('test')\n\n    def execute("
            model_py.write_text(good.replace("    def execute(", broken, 1))
        wait_until(lambda: events.is_file() and len(events.read_text().splitlines()) >= 2,
                   "two failed reloads", 60)
        failed = [json.loads(line) for line in events.read_text().splitlines()]
        assert [(e["model"], e["ok"], e["attempt"]) for e in failed[:2]] == [
            (IDENTITY_MODEL, False, 1), (IDENTITY_MODEL, False, 2)]
        assert "MemoryError" in failed[0]["error"] and failed[0]["dead"] == [victim.instance]
        report = server.health()
        assert not report.healthy and report.problems() == [f"tritonserver at {server.http_url} is not ready",
                                                            f"model {IDENTITY_MODEL!r} is not ready"]

        model_py.write_text(good)  # the cause goes away: the next try (backoff <= 30 s) loads it
        wait_until(lambda: server.health().healthy, "identity reloaded after the failures", 60)
        last = json.loads(events.read_text().splitlines()[-1])
        assert (last["ok"], last["attempt"] >= 3, last["error"]) == (True, True, None)


def test_killed_tritonserver_is_restarted_by_the_watchdog_and_the_same_repository_answers_within_30_s(
        triton_server, identity_model_repository):
    import json

    import tritonclient.http as http
    from conftest import IDENTITY_MODEL

    def answers(handle) -> bool:
        client = http.InferenceServerClient(handle.http_url)
        try:
            inputs = [http.InferInput("INPUT_FP32", [1, 1, 2], "FP32"),
                      http.InferInput("INPUT_INT16", [1, 1, 1], "INT16")]
            inputs[0].set_data_from_numpy(np.array([[[1.5, 2.5]]], np.float32))
            inputs[1].set_data_from_numpy(np.zeros((1, 1, 1), np.int16))
            result = client.infer(IDENTITY_MODEL, inputs)
            return result.as_numpy("OUTPUT_FP32").tolist() == [[[1.5, 2.5]]]
        finally:
            client.close()

    with triton_server(identity_model_repository) as handle:
        first = handle.pid
        os.kill(first, signal.SIGKILL)
        seconds = wait_until(lambda: handle.is_ready() and handle.pid != first, "tritonserver restarted", 30)
        print(f"restart: ready {seconds:.1f} s after SIGKILL")
        assert handle.restarts == 1 and handle.model_repository == str(identity_model_repository)
        assert answers(handle)
        assert handle.watchdog_running()
        events_file = Path(handle.events_file)  # written once the watchdog itself saw the server ready
        wait_until(lambda: events_file.is_file() and '"restart"' in events_file.read_text(),
                   "the watchdog recorded the restart", 30)
        events = [json.loads(line) for line in events_file.read_text().splitlines()]
        restarts = [(e["event"], e["pid"], e["ok"]) for e in events if e.get("event")]
        assert restarts == [("restart", handle.pid, True)]
    assert not health.pid_alive(handle.pid)
