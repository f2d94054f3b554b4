"""Two replicas of the cpu serving image behind the nginx balancer, for real: podman, nginx, tritonserver.

``nnunet-triton deploy --target docker --variant cpu --replicas 2`` (the image and the repository of
test_containers.py, cached in podman's store and under build/, so only a first run builds them) starts two
containers on loopback ports and the balancer container (nginx of the same image, host network) in front of
them. Four clients send the probe case through the balancer at once; one replica is killed (``podman kill``)
while they do. Every answer must equal nnU-Net's, no request may fail (the balancer retries a request that
failed on the killed replica on the live one: inference is idempotent), and the balancer's access log
(``$upstream_addr``, which replica each request went to) must show the killed replica marked down within
seconds and no request sent to it afterwards. ``undeploy`` then removes every replica and the balancer.

Numbers (requests, retried, seconds until the dead replica got no more traffic) are printed as
``replicas:`` lines and recorded as properties. Skipped with the reason where podman cannot run.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import SYNTHCT, model_dir, probe_case, reference
from recovery_support import REQUEST_TIMEOUT_S

from nnunet_triton.cli import deploy as deploy_tool
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.server.proxy_config import BALANCER_FAIL_TIMEOUT_S
from tools import container_host

CONTAINER = "nnunet-triton-replicas"
CLIENTS = 4
LOAD_AFTER_KILL_S = 6.0  # < the balancer's fail_timeout (10 s): mostly inside the window without re-tries
MIN_AFTER_KILL = 8  # answers after the kill, at least
LOG_LINE = re.compile(r'^(?P<msec>[\d.]+) (?P<status>\d{3}) (?P<addrs>[^\s,]+(?:, [^\s,]+)*) '
                      r'(?P<codes>[\d-]+(?:, [\d-]+)*) (?P<took>[\d.]+) "(?P<request>[^"]*)"$')


@dataclass(frozen=True)
class Forwarded:
    """One line of the balancer's access log: when it ended, its status, the replicas tried in order."""

    end: float
    took: float
    status: int
    tried: tuple[tuple[str, str], ...]  # (address, its status: 200, 502, - ...)
    request: str

    @property
    def start(self) -> float:
        return self.end - self.took


def _access_log(path: Path) -> list[Forwarded]:
    entries = []
    for line in path.read_text().splitlines():
        match = LOG_LINE.match(line)
        assert match, f"unexpected access log line: {line!r}"
        addrs, codes = match["addrs"].split(", "), match["codes"].split(", ")
        entries.append(Forwarded(end=float(match["msec"]), took=float(match["took"]),
                                 status=int(match["status"]), tried=tuple(zip(addrs, codes, strict=True)),
                                 request=match["request"]))
    return entries


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def engine() -> str:
    problem = container_host.ensure_podman()
    if problem:
        pytest.skip(f"podman cannot run here: {problem}")
    container_host.ensure_base_image("podman")
    return "podman"


@pytest.fixture(scope="module")
def replica_set(engine, tmp_path_factory):
    from nnunet_triton.server.deploy import replicas

    home = tmp_path_factory.mktemp("home")
    port = replicas.free_loopback_ports(1)[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NNUNET_TRITON_HOME", str(home))  # the balancer's run folder and the state file
        argv = ["--target", "docker", "--model-dir", str(model_dir(SYNTHCT)), "--variant", "cpu",
                "--engine", engine, "--container-name", CONTAINER, "--http-port", str(port),
                "--replicas", "2", "--max-volume", "64", "128", "128", "--execute"]
        start = time.monotonic()
        code = deploy_tool.main(argv)
        took = time.monotonic() - start
        print(f"replicas: deploy --replicas 2 took {took:.1f} s")
        folder = replicas.state_dir(home / "run", CONTAINER)
        try:
            assert code == 0, "deploy --replicas 2 failed (see the captured output)"
            yield {"state": replicas.read_state(folder), "folder": folder, "deploy_s": took}
        finally:
            state = replicas.read_state(folder)
            assert deploy_tool.main(["undeploy", "--target", "docker", "--engine", engine,
                                     "--container-name", CONTAINER]) == 0
            names = ([state["balancer"], *(r["name"] for r in state["replicas"])] if state else [])
            left = [name for name in names if podman("container", "exists", name).returncode == 0]
            assert left == [], f"undeploy left {left} behind"
            assert replicas.read_state(folder) is None


def test_two_replicas_answer_exactly_and_a_killed_one_loses_no_request(replica_set, record_property):
    state, log = replica_set["state"], replica_set["folder"] / "nginx-access.log"
    assert [r["name"] for r in state["replicas"]] == [f"{CONTAINER}-0", f"{CONTAINER}-1"]
    address = {r["name"]: f"127.0.0.1:{r['http_port']}" for r in state["replicas"]}
    for replica in state["replicas"]:  # Triton's ports of each replica: loopback only
        published = podman("port", replica["name"]).stdout
        assert published and all("127.0.0.1:" in line for line in published.splitlines()), published
    probe = probe_case(SYNTHCT)
    expected = reference(SYNTHCT, probe.name, False).segmentation
    answers: list[tuple[float, np.ndarray]] = []
    errors: list[str] = []
    stop = threading.Event()

    def client_loop() -> None:
        with NnunetClient(state["url"], timeout_s=REQUEST_TIMEOUT_S) as client:
            while not stop.is_set():
                try:
                    result = client.segment(probe.image, probe.spacing, mirroring=False)
                    answers.append((time.time(), result.segmentation))
                except Exception as exc:  # noqa: BLE001 - every failure is a lost request: counted
                    errors.append(f"{time.time():.3f} {exc!r}")

    def answered_by(name: str) -> int:
        return sum(1 for e in _access_log(log)
                   if "/infer" in e.request and e.tried[-1] == (address[name], "200"))

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 180
        while min(answered_by(name) for name in address) < 2:  # both replicas serve before the kill
            assert time.monotonic() < deadline, "the balancer did not use both replicas within 180 s"
            assert not errors, errors
            time.sleep(0.2)
        dead, live = state["replicas"][0]["name"], state["replicas"][1]["name"]
        killed_at = time.time()
        assert podman("kill", dead).returncode == 0
        before = len(answers)
        deadline = time.monotonic() + 180
        while time.time() < killed_at + LOAD_AFTER_KILL_S or len(answers) - before < MIN_AFTER_KILL:
            assert time.monotonic() < deadline, f"{len(answers) - before} answers in 180 s after the kill"
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S)
    assert errors == [], f"{len(errors)} of {len(answers) + len(errors)} requests lost: {errors[:3]}"
    for _, segmentation in answers:
        np.testing.assert_array_equal(segmentation, expected)

    infers = [e for e in _access_log(log) if "/infer" in e.request]
    assert all(e.status == 200 for e in infers), [e for e in infers if e.status != 200][:3]
    failed_on_dead = [e for e in infers if any(a == address[dead] and c != "200" for a, c in e.tried)]
    assert failed_on_dead, "no request met the killed replica: the kill came too late to test anything"
    marked_down = min(e.end for e in failed_on_dead)  # max_fails=1: the first failure marks it down
    # until fail_timeout has passed nginx sends it nothing (then one request tries it, and goes on on failure)
    after = [e for e in infers if marked_down < e.start < marked_down + BALANCER_FAIL_TIMEOUT_S - 0.5]
    to_dead = [e for e in after if any(a == address[dead] for a, _ in e.tried)]
    assert after and to_dead == [], f"requests still sent to the killed replica: {to_dead[:3]}"
    assert all(e.tried == ((address[live], "200"),) for e in after)
    retried = [e for e in failed_on_dead if e.tried[-1] == (address[live], "200")]
    assert len(retried) == len(failed_on_dead)  # every request that failed there was answered by the live one
    left_s = max(0.0, marked_down - killed_at)
    after_kill = sum(1 for t, _ in answers if t > killed_at)
    print(f"replicas: {len(answers)} requests by {CLIENTS} clients, {after_kill} after the kill, 0 lost; "
          f"{len(retried)} retried by the balancer on the live replica; the killed replica got no request "
          f"{left_s:.2f} s after the kill (its first failed attempt marked it down); "
          f"{len(after)} requests after that within its fail_timeout, all to the live one")
    record_property("requests", len(answers))
    record_property("requests_after_kill", after_kill)
    record_property("retried_by_balancer", len(retried))
    record_property("seconds_until_traffic_left_dead_replica", round(left_s, 2))
    record_property("deploy_s", round(replica_set["deploy_s"], 1))
