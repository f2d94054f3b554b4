"""perf_analyzer (``make setup`` -> tools/install_perf_analyzer.py) runs against the embedded server.

Not a benchmark (no timing is asserted), but perf_analyzer's numbers must agree with each other: every
level measured from at least the windows' requests, and Little's law for a closed loop, concurrency =
throughput x average latency, within a factor the client's own time between requests cannot explain
away. perf_analyzer's default 10 % stability is rarely reached on a shared CPU machine; 50 % over its
last three windows still refuses a level whose windows disagree by half.

The launcher's token (its statistics API needs it) reaches perf_analyzer as ``-H name:PLACEHOLDER`` plus
``server.preload``'s library: another local user reading ``/proc/<pid>/cmdline`` during a measurement
once saw the token there.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nnunet_triton.server import preload
from nnunet_triton.server.model_control import CONTROL_HEADER
from tools.perf import analyzer

IDENTITY_SHAPES = ("INPUT_FP32:3,5,7", "INPUT_INT16:2,9,11")
WINDOW_REQUESTS = 20
STABILITY_PERCENT = 50
# concurrency / (throughput x mean latency): 1 in a closed loop (measured 1.00 at 1 and 2 here); above 1
# by the client's idle time between a response and the next request, below 1 only by window edges
LITTLE_RATIO_BOUNDS = (0.9, 1.5)


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    """The venv's perf_analyzer wrapper; skips with the reason when it cannot run here."""
    candidate = Path(sys.executable).parent / "perf_analyzer"
    path = candidate if candidate.is_file() else Path(shutil.which("perf_analyzer") or candidate)
    if not path.is_file():
        pytest.skip(f"perf_analyzer not installed at {candidate}; run `make setup`")
    probe = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60, check=False)
    if "error while loading shared libraries" in probe.stderr:
        pytest.skip(f"perf_analyzer cannot run: {probe.stderr.strip()} (see tools/install_perf_analyzer.py)")
    return path


def test_perf_analyzer_prints_usage_when_asked_for_help(perf_analyzer: Path) -> None:
    result = subprocess.run(
        [str(perf_analyzer), "--help"], capture_output=True, text=True, timeout=60, check=False
    )

    assert "--concurrency-range" in result.stdout + result.stderr
    assert "--measurement-mode" in result.stdout + result.stderr


def test_perf_analyzer_reports_each_concurrency_when_run_against_identity(
    perf_analyzer: Path, identity_server, tmp_path: Path
) -> None:
    csv_path = tmp_path / "identity.csv"
    command = [
        str(perf_analyzer),
        "-m",
        "identity",
        "-u",
        identity_server.http_url,
        "-i",
        "http",
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        str(WINDOW_REQUESTS),
        "--concurrency-range",
        "1:2",
        "--stability-percentage",
        str(STABILITY_PERCENT),
        "--max-trials",
        "20",
        "-f",
        str(csv_path),
        *(arg for shape in IDENTITY_SHAPES for arg in ("--shape", shape)),
        # its server-side statistics need the launcher's token (model_control.RESTRICTED_APIS): the
        # placeholder here, the token in the environment (server.preload)
        "-H", f"{CONTROL_HEADER}:{preload.PLACEHOLDER}",
    ]
    env = preload.environment(preload.library(tmp_path / "preload"), identity_server.control_token,
                              analyzer.PROGRAM)

    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=env)

    assert result.returncode == 0, f"perf_analyzer failed:\n{result.stdout}\n{result.stderr}"
    with csv_path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(int(row["Concurrency"]) for row in rows) == [1, 2]  # rows come sorted by throughput
    counts = [int(n) for n in re.findall(r"Client:\s*\n\s*Request count: (\d+)", result.stdout)]
    assert len(counts) == 2 and min(counts) >= 3 * WINDOW_REQUESTS, result.stdout  # 3 stable windows
    summary = {int(c): (float(x), float(us) / 1e6) for c, x, us in re.findall(
        r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec, latency (\d+) usec", result.stdout)}
    assert sorted(summary) == [1, 2], result.stdout
    low, high = LITTLE_RATIO_BOUNDS
    for row in rows:
        throughput, mean_latency_s = summary[int(row["Concurrency"])]
        assert float(row["Inferences/Second"]) == pytest.approx(throughput, rel=1e-3)  # CSV = stdout
        assert low <= int(row["Concurrency"]) / (throughput * mean_latency_s) <= high, (row, result.stdout)


def _watch(marker: str, stop: threading.Event) -> list[tuple[str, bytes, bytes | None]]:
    """(executable, cmdline, environ) of every process whose command line holds ``marker``, sampled every
    20 ms until ``stop``: what another local user (cmdline) and the owner (environ) can read."""
    samples: list[tuple[str, bytes, bytes | None]] = []
    while not stop.wait(0.02):
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if marker.encode() not in cmdline:
                    continue
                exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
                environ: bytes | None = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            samples.append((exe, cmdline, environ))
    return samples


def test_perf_analyzer_runs_with_the_token_out_of_its_command_line(perf_analyzer: Path, identity_server,
                                                                   tmp_path: Path) -> None:
    """tools/perf's run, as a benchmark makes it (``analyzer.run`` with the server's ``control_token``)."""
    data = {"data": [{"INPUT_FP32": {"content": [0.5] * 6, "shape": [1, 2, 3]},
                      "INPUT_INT16": {"content": [1], "shape": [1, 1, 1]}}]}
    (tmp_path / "input.json").write_text(json.dumps(data))
    settings = analyzer.AnalyzerSettings(
        model="identity", url=identity_server.http_url, protocol="http", input_data=tmp_path / "input.json",
        concurrency=1, measurement_request_count=10, measurement_interval_ms=500,
        control_token=identity_server.control_token)
    command = analyzer.command(settings, tmp_path / "run.csv", binary=perf_analyzer)
    assert f"{CONTROL_HEADER}:{preload.PLACEHOLDER}" in command
    assert not any(identity_server.control_token in arg for arg in command)
    stop = threading.Event()
    samples: list[tuple[str, bytes, bytes | None]] = []
    watcher = threading.Thread(target=lambda: samples.extend(_watch(str(tmp_path / "run.csv"), stop)))
    watcher.start()
    try:
        result = analyzer.run(settings, tmp_path, "run", timeout_s=300, binary=perf_analyzer)
    finally:
        stop.set()
        watcher.join(timeout=60)
    assert result.ok, result.log_path.read_text()  # the statistics API took the token from the environment
    token = identity_server.control_token.encode()
    measuring = [s for s in samples if s[0] == analyzer.PROGRAM]
    assert len(measuring) >= 3, samples  # seen while it measured
    assert all(token not in cmdline for _, cmdline, _ in samples)
    assert all(preload.PLACEHOLDER.encode() in cmdline for _, cmdline, _ in measuring)
    # its environment block no longer holds it once its main runs (the first sample may precede that)
    assert all(token not in environ for _, _, environ in measuring[1:] if environ is not None)
    assert token not in result.log_path.read_bytes()  # the log's copy of the command line
