"""perf_analyzer (``make setup`` -> tools/install_perf_analyzer.py) runs against the embedded server.

This is a smoke test of the tool and the server, not a benchmark: on a shared CPU machine the windows
are never within perf_analyzer's default 10 % stability, so any three windows count as stable here.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

IDENTITY_SHAPES = ("INPUT_FP32:3,5,7", "INPUT_INT16:2,9,11")


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
        "20",
        "--concurrency-range",
        "1:2",
        "--stability-percentage",
        "1000",
        "-f",
        str(csv_path),
        *(arg for shape in IDENTITY_SHAPES for arg in ("--shape", shape)),
        # its server-side statistics need the launcher's token (model_control.RESTRICTED_APIS)
        *(arg for header in identity_server.control_headers.items() for arg in ("-H", ":".join(header))),
    ]

    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)

    assert result.returncode == 0, f"perf_analyzer failed:\n{result.stdout}\n{result.stderr}"
    with csv_path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(int(row["Concurrency"]) for row in rows) == [1, 2]  # rows come sorted by throughput
    assert all(float(row["Inferences/Second"]) > 0 for row in rows)
