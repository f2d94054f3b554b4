"""The quick benchmark path (``make perf QUICK=1``) runs end to end and writes its CSVs and report.

A run of the tooling, not a benchmark: one concurrency level, one-request windows, one baseline
repetition, gRPC only, on the fixture. No timing is asserted (2 shared cores), but the numbers must agree
with each other: perf_analyzer measured three windows, the server counted at least the requests the
client did and failed none, every fold model ran exactly the tiles those requests hold, the latency
percentiles are ordered, and the CSVs say what results.json says.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.perf import run
from tools.perf.workloads import fixture_model_dir

pytestmark = pytest.mark.slow

SYSTEMS = ("endpoint", "monolith", "predictor", "floor")


@pytest.fixture(scope="module")
def fixture_available() -> Path:
    try:
        return fixture_model_dir()
    except FileNotFoundError as exc:  # the fixtures are committed: a missing one fails
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def perf_analyzer_available() -> None:
    path = Path(sys.executable).parent / "perf_analyzer"
    if not path.is_file() and shutil.which("perf_analyzer") is None:
        pytest.skip(f"perf_analyzer not installed at {path}; run `make setup`")
    probe = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60, check=False)
    if "error while loading shared libraries" in probe.stderr:
        pytest.skip(f"perf_analyzer cannot run: {probe.stderr.strip()}")


@pytest.fixture(scope="module")
def quick_run(fixture_available, perf_analyzer_available, tmp_path_factory) -> Path:
    results_dir = tmp_path_factory.mktemp("perf-results")
    benchmarks_md = results_dir / "BENCHMARKS.md"
    code = run.main([
        "--quick", "--results-dir", str(results_dir), "--stem", "smoke",
        "--benchmarks-md", str(benchmarks_md),
        "--scenarios", "2folds-nomirror", "--protocols", "grpc", "--max-concurrency", "1",
        "--window-requests", "1", "--reps", "1", "--pa-timeout", "900", "--baseline-timeout", "900",
    ])
    assert code == 0
    return results_dir


def test_quick_run_measures_every_system_when_run_on_the_fixture(quick_run: Path) -> None:
    document = json.loads((quick_run / "smoke" / "results.json").read_text())

    rows = document["measurements"]
    assert sorted((r["system"], r["protocol"], r["concurrency"]) for r in rows) == [
        ("endpoint", "grpc", 1), ("floor", "inproc", 1), ("monolith", "grpc", 1), ("predictor", "inproc", 1)]
    assert document["meta"]["workloads"]["fixture"]["volumes"]["typical"]["tiles"] >= 1
    for row in rows:
        latency = row["latency_ms"]
        assert row["ok"] and 0 < latency["p50"] <= latency["p90"] <= latency["p95"] <= latency["p99"], row
        # at least 3 windows of one request / 1 repetition (perf_analyzer may count a request that ended
        # inside a window it then discarded for stability, so more than 3 is allowed, fewer is not)
        assert (row["requests"] >= 3) if row["protocol"] == "grpc" else (row["requests"] == 1), row
    by_system = {r["system"]: r for r in rows}
    endpoint, monolith = by_system["endpoint"], by_system["monolith"]
    assert (endpoint["folds"], endpoint["mirroring"]) == ([0, 1], False)
    served = endpoint["model_stats"]["nnunet"]
    assert served["requests"] >= endpoint["requests"] and served["failures"] == 0, served
    for fold in ("fold_0", "fold_1"):  # no mirroring: each fold runs every tile of every request once
        stats = endpoint["model_stats"][fold]
        assert stats["requests"] * stats["avg_batch"] == served["requests"] * endpoint["tiles"], stats
    assert monolith["model_stats"]["nnunet_monolith"]["requests"] >= monolith["requests"]


def test_quick_run_writes_perf_analyzer_csv_with_one_row_when_a_level_is_measured(quick_run: Path) -> None:
    csv_files = sorted((quick_run / "smoke" / "raw" / "fixture").glob("*.csv"))
    measured = {r["system"]: r for r in json.loads((quick_run / "smoke" / "results.json").read_text())[
        "measurements"]}

    assert [f.name for f in csv_files] == [
        "default-endpoint-2folds-nomirror-grpc-c1.csv", "default-monolith-2folds-nomirror-grpc-c1.csv"]
    for path, system in zip(csv_files, ("endpoint", "monolith"), strict=True):
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert [row["Concurrency"] for row in rows] == ["1"]
        row = measured[system]
        assert float(rows[0]["Inferences/Second"]) == row["resources"]["pa_throughput_rps"]
        assert float(rows[0]["p50 latency"]) / 1000 == pytest.approx(row["latency_ms"]["p50"], abs=1e-3)


def test_quick_run_writes_the_report_with_the_three_ratio_tables_when_done(quick_run: Path) -> None:
    report = (quick_run / "smoke.md").read_text()

    for heading in ("Endpoint latency / nnUNetPredictor", "Endpoint throughput / monolith",
                    "End-to-end / network floor", "## Per-model server statistics"):
        assert heading in report
    assert "| fold_0 |" in report  # the fold models behind the BLS orchestrator have their own stats
    assert not (quick_run / "BENCHMARKS.md").exists()  # only a full run updates BENCHMARKS.md
