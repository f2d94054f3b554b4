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
from pipeline_support import SYNTHCT, probe_case, reference, shared_server

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

