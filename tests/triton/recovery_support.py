"""Kill a model's process under load and check the recovery (test_recovery, ensemble and cascade tests).

``assert_recovers_under_load`` is the whole scenario: ``clients`` threads (half HTTP, half gRPC) send
one case; the server's watchdog is paused (SIGSTOP) so the broken state can be observed; the model's
stub gets SIGKILL (what the OOM killer does); ``nnunet_triton.server.health`` must name the model while
Triton's own ready endpoints still answer 200; a request must fail on it; then the watchdog resumes and
the endpoint must be healthy within ``RECOVERY_LIMIT_S`` and answer correctly. Every request got either
the expected segmentation or a retryable error naming a model; none hung; one live stub per instance
afterwards; the dead stub's ``/dev/shm`` region is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.client.client import NnunetClient
from nnunet_triton.client.endpoint import is_unavailable
from nnunet_triton.errors import ClientError
from nnunet_triton.server import health

RECOVERY_LIMIT_S = 30.0
REQUEST_TIMEOUT_S = 300.0
SHM = Path("/dev/shm")


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float) -> float:
    """Poll ``condition`` every 50 ms; return the seconds it took, TimeoutError after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not reached after {timeout_s:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def shm_used_mib(since: float = 0.0) -> float:
    stats = os.statvfs(SHM)  # counts pages still mapped after their name was removed
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize / 2**20 - since


def others_shm_mib(ours: set[str]) -> float:
    """MiB held by named /dev/shm objects that are not ``ours``: other servers on this machine (other test
    sessions, other users) grow and shrink them while a recovery is measured."""
    total = 0
    for entry in os.scandir(SHM):
        if entry.name not in ours:
            try:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:  # removed meanwhile
                pass
    return total / 2**20


def stubs_of(server: Any, model: str) -> list[health.StubProcess]:
    return [s for s in health.stub_processes(server.pid) if s.model == model]


def http_ok(server: Any, path: str) -> bool:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{server.http_url}{path}", timeout=5) as response:
        return response.status == 200


@dataclass
class Load:
    """``clients`` threads segmenting ``image`` until stopped; every outcome is kept."""

    server: Any
    image: np.ndarray
    spacing: Any
    expected: np.ndarray
    clients: int = 4
    options: dict[str, Any] = field(default_factory=dict)
    answers: list[bool] = field(default_factory=list)  # True: the expected segmentation
    errors: list[ClientError] = field(default_factory=list)
    unexpected: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _run(self, protocol: str) -> None:
        url = self.server.http_url if protocol == "http" else self.server.grpc_url
        with NnunetClient(url, protocol=protocol, timeout_s=REQUEST_TIMEOUT_S) as client:
            while not self._stop.is_set():
                try:
                    result = client.segment(self.image, self.spacing, **self.options)
                    self.answers.append(bool(np.array_equal(result.segmentation, self.expected)))
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

    def wait_for_answers(self, count: int, timeout_s: float = 300.0) -> None:
        target = len(self.answers) + count
        wait_until(lambda: len(self.answers) >= target or self.unexpected, f"{count} more answers", timeout_s)


def assert_recovers_under_load(server: Any, model: str, load: Load) -> float:
    """The scenario of the module docstring for ``model``; returns the seconds from the watchdog's
    resumption to a healthy endpoint."""
    assert server.health().healthy, server.health().problems()
    all_stubs = health.stub_processes(server.pid)
    regions_before = {s.shm_region for s in all_stubs}
    shm_before = shm_used_mib()
    others_before = others_shm_mib(regions_before)
    (victim,) = stubs_of(server, model)
    with load:
        load.wait_for_answers(load.clients)
        with paused(server.watchdog_pid):
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: model in server.health().broken_models, f"{model} reported broken", 10)
            report = server.health()
            assert not report.healthy and any(f"model {model!r}" in p for p in report.problems())
            # what Triton itself says meanwhile: everything ready (why health.py exists)
            assert http_ok(server, "/v2/health/ready") and http_ok(server, f"/v2/models/{model}/ready")
            wait_until(lambda: load.errors, "a request failing on the dead model", 60)
        recovery_s = wait_until(lambda: server.health().healthy, f"{model} healthy again", RECOVERY_LIMIT_S)
        load.wait_for_answers(load.clients)
    print(f"recovery {model}: healthy {recovery_s:.2f} s after the watchdog resumed; "
          f"{len(load.answers)} answers, {len(load.errors)} errors")

    assert not load.unexpected, load.unexpected
    assert load.answers and all(load.answers), "a wrong answer"
    for error in load.errors:  # retryable, and saying which model broke
        assert is_unavailable(error), (error.status, str(error))
        assert model in str(error) or "'nnunet'" in str(error), str(error)

    (replacement,) = stubs_of(server, model)
    assert replacement.pid != victim.pid and replacement.instance == victim.instance
    assert len(health.stub_processes(server.pid)) == len(all_stubs)  # one live stub per instance, no more
    regions_after = {s.shm_region for s in health.stub_processes(server.pid)}
    assert victim.shm_region not in regions_after and len(regions_after) == len(regions_before)
    wait_until(lambda: not (SHM / victim.shm_region).exists(), "the dead stub's shm region removed", 30)
    # Triton 2.51 keeps the dead instance (and its 16 MiB region's pages) mapped once requests failed on
    # it; the watchdog removes the name, so the pages go when tritonserver exits. At most that one region:
    # what this server added: the whole file system's growth less what other processes' named objects grew
    grown = shm_used_mib(shm_before) - (others_shm_mib(regions_before | regions_after) - others_before)
    print(f"  /dev/shm used by this server: {grown:+.0f} MiB")
    assert grown < 64, f"/dev/shm grew by {grown:.0f} MiB after one recovery"
    return recovery_s
