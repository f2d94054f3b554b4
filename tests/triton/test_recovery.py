"""Self-healing on the real server: ``kill -9`` of each model's process under load.

The shared SynthCT server is started by the default launcher (explicit model control + the watchdog,
``nnunet_triton.watchdog``). For each Python model of the pipeline, while 4 clients (2 HTTP, 2 gRPC)
send the probe case without mirroring: the watchdog is paused (SIGSTOP) so that the broken state can be
observed, the model's stub is killed with SIGKILL (what the OOM killer does), the honest health check
(``nnunet_triton.health``) must say which model is broken while Triton's own endpoints still answer 200,
then the watchdog resumes and the endpoint must be healthy and answer correctly again within 30 s.
Every request must have got either nnU-Net's segmentation or a retryable error naming a model; no
request may hang; no stub process or ``/dev/shm`` region may be left behind.

Recovery times measured here are printed as ``recovery`` lines (docs/reliability.md's table).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import REPO_ROOT, SYNTHCT, build, probe_case, reference, shared_server

from nnunet_triton import health
from nnunet_triton.client import NnunetClient
from nnunet_triton.endpoint import is_unavailable
from nnunet_triton.errors import ClientError

RECOVERY_LIMIT_S = 30.0
REQUEST_TIMEOUT_S = 120.0
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def server(triton_server, request):
    return shared_server(SYNTHCT, triton_server, request)


@dataclass
class Load:
    """``clients`` threads sending the probe case until stopped; every outcome is kept."""

    server: object
    clients: int = 4
    answers: list[bool] = field(default_factory=list)  # True: nnU-Net's segmentation
    errors: list[ClientError] = field(default_factory=list)
    unexpected: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _run(self, protocol: str) -> None:
        probe = probe_case(SYNTHCT)
        expected = reference(SYNTHCT, probe.name, False).segmentation
        url = self.server.http_url if protocol == "http" else self.server.grpc_url
        with NnunetClient(url, protocol=protocol, timeout_s=REQUEST_TIMEOUT_S) as client:
            while not self._stop.is_set():
                try:
                    result = client.segment(probe.image, probe.spacing, mirroring=False)
                    self.answers.append(bool(np.array_equal(result.segmentation, expected)))
                except ClientError as exc:
                    self.errors.append(exc)
                    time.sleep(0.05)
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    self.unexpected.append(exc)
                    return

    def __enter__(self) -> Load:
        for i in range(self.clients):
            thread = threading.Thread(target=self._run, args=("http" if i % 2 == 0 else "grpc",), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in self._threads), "a client request hung"

    def wait_for_answers(self, count: int, timeout_s: float = 120.0) -> None:
        target = len(self.answers) + count
        _wait(lambda: len(self.answers) >= target or self.unexpected, f"{count} more answers", timeout_s)


def _wait(condition, what: str, timeout_s: float) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not reached after {timeout_s:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start


@contextlib.contextmanager
def _paused(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _shm_used_mib(since: float = 0.0) -> float:
    stats = os.statvfs(SHM)  # counts pages still mapped after their name was removed
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize / 2**20 - since


def _stubs_of(server, model: str) -> list[health.StubProcess]:
    return [s for s in health.stub_processes(server.pid) if s.model == model]


def _http_ok(server, path: str) -> bool:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{server.http_url}{path}", timeout=5) as response:
        return response.status == 200


@pytest.mark.parametrize("model", ["preprocess_model", "orchestrator_model", "fold_0", "stitch_model"])
def test_killed_model_process_is_reported_and_reloaded_and_answers_stay_correct_under_load(server, model,
                                                                                         record_property):
    assert server.health().healthy, server.health().problems()
    all_stubs = health.stub_processes(server.pid)
    regions_before = {s.shm_region for s in all_stubs}
    shm_before = _shm_used_mib()
    (victim,) = _stubs_of(server, model)
    with Load(server) as load:
        load.wait_for_answers(4)
        with _paused(server.watchdog_pid):
            os.kill(victim.pid, signal.SIGKILL)
            _wait(lambda: model in server.health().broken_models, f"{model} reported broken", 10)
            report = server.health()
            assert not report.healthy and any(f"model {model!r}" in p for p in report.problems())
            # what Triton itself says meanwhile: everything ready (why health.py exists)
            assert _http_ok(server, "/v2/health/ready") and _http_ok(server, f"/v2/models/{model}/ready")
            _wait(lambda: load.errors, "a request failing on the dead model", 30)
        recovery_s = _wait(lambda: server.health().healthy, f"{model} healthy again", RECOVERY_LIMIT_S)
        load.wait_for_answers(4)
    record_property("recovery_s", round(recovery_s, 2))
    print(f"recovery {model}: healthy {recovery_s:.2f} s after the watchdog resumed; "
          f"{len(load.answers)} answers, {len(load.errors)} errors")

    assert not load.unexpected, load.unexpected
    assert load.answers and all(load.answers), "a wrong answer"
    for error in load.errors:  # retryable, and saying which model broke
        assert is_unavailable(error), (error.status, str(error))
        assert model in str(error) or "'nnunet'" in str(error), str(error)
    if model == "fold_0":  # through the orchestrator's BLS call: the code is UNAVAILABLE, not INTERNAL
        assert {e.status for e in load.errors} <= {"503", "StatusCode.UNAVAILABLE"}, \
            {(e.status, str(e)) for e in load.errors}

    (replacement,) = _stubs_of(server, model)
    assert replacement.pid != victim.pid and replacement.instance == victim.instance
    assert len(health.stub_processes(server.pid)) == len(all_stubs)  # one live stub per instance, no more
    regions_after = {s.shm_region for s in health.stub_processes(server.pid)}
    assert victim.shm_region not in regions_after and len(regions_after) == len(regions_before)
    _wait(lambda: not (SHM / victim.shm_region).exists(), "the dead stub's shm region removed", 30)
    # Triton 2.51 keeps the dead instance (and its 16 MiB region's pages) mapped once requests failed on
    # it; the watchdog removes the name, so the pages go when tritonserver exits. At most that one region:
    grown = _shm_used_mib(shm_before)
    print(f"  /dev/shm used: {grown:+.0f} MiB")
    assert grown < 64, f"/dev/shm grew by {grown:.0f} MiB after one recovery"


def test_health_cli_exits_nonzero_naming_the_broken_model_until_the_watchdog_reloads_it(server):
    import subprocess
    import sys

    def cli() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "nnunet_triton.health", "--url", server.http_url, "--model-repository",
             server.model_repository, "--server-pid", str(server.pid)],
            capture_output=True, text=True, timeout=60, check=False)

    assert (cli().returncode, cli().stdout) == (0, "healthy\n")
    (victim,) = _stubs_of(server, "fold_1")
    with _paused(server.watchdog_pid):
        os.kill(victim.pid, signal.SIGKILL)
        _wait(lambda: "fold_1" in server.health().broken_models, "fold_1 reported broken", 10)
        broken = cli()
    assert broken.returncode == 1
    assert ("not healthy: model 'fold_1': 0 of 1 Python-backend processes alive (dead: fold_1_0_0)"
            in broken.stdout)
    _wait(lambda: cli().returncode == 0, "health CLI healthy again", RECOVERY_LIMIT_S)


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
    ``thread_budget exec --watchdog -- tritonserver ...`` forks the watchdog and execs the server."""
    import subprocess
    import sys

    from nnunet_triton.triton_install import prepare_home, server_env

    installation = prepare_home(os.environ.get("NNUNET_TRITON_HOME", REPO_ROOT / "build" / "triton-home"))
    repo = build(SYNTHCT)
    http_port, grpc_port, metrics_port = _free_ports(3)
    command = [
        sys.executable, "-m", "nnunet_triton.thread_budget", "exec", "--watchdog",
        "--model-repository", str(repo), "--", str(installation.server_bin), f"--model-repository={repo}",
        f"--backend-directory={installation.backend_dir}", f"--cache-directory={installation.cache_dir}",
        "--http-address=127.0.0.1", f"--http-port={http_port}", "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}", "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
        "--model-control-mode=explicit", "--load-model=*", "--disable-auto-complete-config",
        "--backend-config=python,stub-timeout-seconds=120", "--exit-timeout-secs=5",
    ]
    with open(tmp_path / "container.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=server_env(installation), start_new_session=True)
    url = f"127.0.0.1:{http_port}"
    try:
        _wait(lambda: health.check_health(url, health.repository_models(repo), server_pid=process.pid).healthy
              or process.poll() is not None, "the container's server healthy", 300)
        assert process.poll() is None, (tmp_path / "container.log").read_text()[-3000:]
        assert Path(f"/proc/{process.pid}/exe").resolve() == installation.server_bin.resolve()  # exec'd
        (watchdog,) = [p for p in _children(process.pid)
                       if b"thread_budget" in Path(f"/proc/{p}/cmdline").read_bytes()]
        with pytest.raises(Exception, match="This API is restricted"):
            import tritonclient.http as http

            http.InferenceServerClient(url).unload_model("fold_0")

        (victim,) = [s for s in health.stub_processes(process.pid) if s.model == "fold_0"]
        os.kill(victim.pid, signal.SIGKILL)
        def reloaded() -> bool:
            pids = [s.pid for s in health.stub_processes(process.pid) if s.model == "fold_0"]
            return pids not in ([], [victim.pid]) and health.check_health(
                url, health.repository_models(repo), server_pid=process.pid).healthy

        _wait(reloaded, "fold_0 reloaded by the container's watchdog", RECOVERY_LIMIT_S)
        probe = probe_case(SYNTHCT)
        with NnunetClient(url, timeout_s=REQUEST_TIMEOUT_S) as client:
            result = client.segment(probe.image, probe.spacing, mirroring=False)
        np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, probe.name, False).segmentation)
        assert b"model 'fold_0' reloaded" in (tmp_path / "container.log").read_bytes()
    finally:
        process.terminate()  # docker stop: SIGTERM to PID 1
        process.wait(60)
    _wait(lambda: _parent(watchdog) is None, "the watchdog exits with the server", 30)


def test_killed_tritonserver_is_reported_not_running_its_leftovers_removed_and_a_new_start_serves(
        identity_model_repository, tmp_path, capsys):
    """``make serve`` / ``make deploy`` (embedded, detached): nothing restarts a SIGKILLed tritonserver on a
    workstation; the watchdog removes what it leaves behind, ``status`` says so, a new start serves."""
    import json

    from nnunet_triton import embedded_server

    args = ["--home", str(tmp_path / "home")]
    start = [*args, "start", "--model-repository", str(identity_model_repository)]
    try:
        assert embedded_server.main(start) == 0
        started = json.loads(capsys.readouterr().out)
        stubs = health.stub_processes(started["pid"])
        assert stubs and all((SHM / s.shm_region).exists() for s in stubs)
        os.kill(started["pid"], signal.SIGKILL)  # the OOM killer's choice

        assert embedded_server.main([*args, "status"]) == 3
        status = json.loads(capsys.readouterr().out)
        assert (status["running"], status["healthy"], status["problems"]) == (
            False, False, ["tritonserver is not running"])
        with NnunetClient(f"127.0.0.1:{started['http_port']}", timeout_s=10) as client, \
                pytest.raises(ClientError, match="is not reachable"):
            client.check_ready()
        # the watchdog waits for the orphaned stubs to exit, removes their shm regions, and exits
        _wait(lambda: _parent(started["watchdog_pid"]) is None, "the watchdog exits", 120)
        assert not any(_parent(s.pid) is not None for s in stubs), "a stub process outlived the server"
        assert not any((SHM / s.shm_region).exists() for s in stubs), "a shm region outlived the server"
        log = Path(started["log_file"]).with_name("tritonserver.watchdog.log").read_text()
        assert f"tritonserver pid {started['pid']} died without being stopped" in log

        assert embedded_server.main(start) == 0
        again = json.loads(capsys.readouterr().out)
        assert embedded_server.main([*args, "status"]) == 0
        assert json.loads(capsys.readouterr().out)["pid"] == again["pid"] != started["pid"]
    finally:
        embedded_server.main([*args, "stop"])
