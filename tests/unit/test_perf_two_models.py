"""The two-model benchmark's pure parts: plan, input data, merged rounds, ratios, report, BENCHMARKS.md block.

No server and no timing: the numbers below are made up; ``make perf-two-models`` measures the real ones.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from nnunet_triton import io_names
from tools.perf import analyzer, benchmarks_md, two_models
from tools.perf.workloads import Case


def _row(model: str, situation: str, *, round_: int = 0, p50: float, avg: float | None = None,
         p95: float | None = None, rps: float, requests: int = 10, ok: bool = True) -> dict:
    server = f"two-{model}" if situation == "two-servers" else "one"
    return {"round": round_, "situation": situation, "model": model, "server": server,
            "triton_model": "nnunet" if situation == "two-servers" else model, "concurrency": 2,
            "requests": requests if ok else 0, "throughput_rps": rps if ok else 0.0,
            "latency_ms": {"p50": p50, "p95": p95 or 1.5 * p50, "avg": avg or p50} if ok else {},
            "loadavg_start": [0.5, 0.4, 0.3], "loadavg_end": [2.1, 1.0, 0.5], "started_s": 0.01,
            "wall_s": 50.0,
            "command": f"perf_analyzer -m {model}", "ok": ok, "error": "" if ok else "perf_analyzer exit 99"}


def _rows() -> list[dict]:
    return [
        _row("ct", "alone", p50=1000, rps=2.0), _row("multi", "alone", p50=200, rps=8.0),
        _row("ct", "both", p50=1500, rps=1.2), _row("multi", "both", p50=400, rps=4.0),
        _row("ct", "two-servers", p50=2000, rps=1.0), _row("multi", "two-servers", p50=500, rps=3.0),
    ]


def _meta(mode: str = "full", rounds: int = 1) -> dict:
    budget = {"policy": "split", "fold_slots": 2, "fold_threads": 1, "reason": "auto: short forwards"}
    return {
        "stem": "2026-12-03-vm-two-models", "mode": mode, "started": "2026-12-03T10:00:00",
        "command": "python -m tools.perf.two_models",
        "host": {"host": "vm", "cpus": 2, "cpu_model": "AMD EPYC 9R14"},
        "loadavg_start": [0.25, 0.2, 0.1], "loadavg_servers_ready": [0.4, 0.2, 0.1],
        "loadavg_end": [2.5, 1.0, 1.0],
        "settings": {"concurrency": 2, "window_s": 15.0, "rounds": rounds, "mirroring": False},
        "models": {"ct": {"model_folder": "tests/fixtures/Dataset901_SynthCT/x", "folds": [0, 1],
                          "channels": 1, "cases": [{}, {}, {}]},
                   "multi": {"model_folder": "tests/fixtures/Dataset903_SynthMulti/x", "folds": [0],
                             "channels": 2, "cases": [{}, {}]}},
        "servers": {"one": {"thread_budget": budget}, "two-ct": {"thread_budget": budget},
                    "two-multi": {"thread_budget": {**budget, "reason": "auto: alone"}}},
    }


def test_every_round_measures_each_model_alone_then_both_on_one_and_on_two_servers_order_alternating():
    first, second = two_models.schedule(0), two_models.schedule(1)
    assert first == [("alone", ("ct",)), ("alone", ("multi",)), ("both", ("ct", "multi")),
                     ("two-servers", ("ct", "multi"))]
    assert second == first[::-1]


def test_input_data_holds_every_case_with_its_own_shape():
    cases = [Case("a", np.arange(24, dtype=np.float32).reshape(2, 2, 3, 2), (1.0, 2.0, 3.0)),
             Case("b", np.ones((2, 3, 3, 3), dtype=np.float64), (0.5, 0.5, 0.5))]
    document = two_models.input_document(cases)
    assert [entry[io_names.IMAGE]["shape"] for entry in document["data"]] == [[2, 2, 3, 2], [2, 3, 3, 3]]
    first = document["data"][0]
    image = np.frombuffer(base64.b64decode(first[io_names.IMAGE]["content"]["b64"]), dtype="<f4")
    np.testing.assert_array_equal(image, np.arange(24, dtype=np.float32))
    spacing = np.frombuffer(base64.b64decode(first[io_names.SPACING]["content"]["b64"]), dtype="<f8")
    assert spacing.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="at least one case"):
        two_models.input_document([])


def test_rounds_merge_weighted_by_requests_and_failed_runs_are_left_out():
    rows = [_row("ct", "alone", p50=1000, avg=1100, rps=2.0, requests=30),
            _row("ct", "alone", round_=1, p50=2000, avg=2100, rps=1.0, requests=10),
            _row("ct", "both", round_=1, p50=9, rps=9, ok=False)]
    summary = two_models.summarize(rows)
    assert summary == {"ct": {"alone": {"rounds": 2, "requests": 40, "throughput_rps": 1.5, "p50_ms": 1250.0,
                                        "p95_ms": 1875.0, "avg_ms": 1350.0}}}


def test_ratios_compare_both_with_alone_and_one_server_with_two_and_add_up_throughput():
    result = two_models.ratios(two_models.summarize(_rows()))
    ct = result["per_model"]["ct"]
    assert ct["both_vs_alone"] == {"p50_ms": 1.5, "p95_ms": 1.5, "avg_ms": 1.5, "throughput_rps": 0.6}
    assert ct["one_vs_two_servers"] == {"p50_ms": 0.75, "p95_ms": 0.75, "avg_ms": 0.75, "throughput_rps": 1.2}
    assert result["per_model"]["multi"]["both_vs_alone"]["p50_ms"] == 2.0
    assert result["total_throughput_rps"] == {"both": 5.2, "two-servers": 4.0, "one_vs_two_servers": 1.3}


def test_a_missing_situation_gives_no_ratio_instead_of_a_wrong_one():
    rows = [r for r in _rows() if not (r["model"] == "multi" and r["situation"] == "two-servers")]
    result = two_models.ratios(two_models.summarize(rows))
    assert "one_vs_two_servers" not in result["per_model"]["multi"]
    assert result["total_throughput_rps"]["two-servers"] is None
    assert result["total_throughput_rps"]["one_vs_two_servers"] is None


def test_per_round_ratios_show_the_spread():
    rows = _rows() + [{**r, "round": 1, "latency_ms": {**r["latency_ms"], "p50": r["latency_ms"]["p50"] * (
        2 if r["situation"] == "both" else 1)}} for r in _rows()]
    spread = two_models.round_ratios(rows)
    assert [(r["round"], r["both_vs_alone"], r["one_vs_two_servers"]) for r in spread["ct"]] == [
        (0, 1.5, 0.75), (1, 3.0, 1.5)]


def test_section_names_machine_load_cpu_budgets_and_every_situation():
    text = two_models.render_section(_meta(), _rows())
    assert "2 CPUs (AMD EPYC 9R14)" in text
    assert "Load average (1 min) 0.25 before the servers started, 0.40 once they were up and warmed" in text
    assert "2.50 at the end" in text
    assert "together up to 4 fold threads at once on 2 CPUs, against 2 for the one server" in text
    assert "server of `multi` alone (default name `nnunet`): split: 2 fold execution(s) at once x 1 " in text
    lines = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in text.splitlines()
             if line.startswith("| `")}
    both = lines[("`ct`", "both loaded, one server")]
    assert both.endswith("| 1.500 | 2.250 | 1.500 | 1.200 | 10 | 0.50 -> 2.10 |")
    ratio_row = "| `ct` | 1.500 | 1.500 | 1.500 | 0.600 | 0.750 | 0.750 | 0.750 | 1.200 |"
    assert lines[("`ct`", "1.500")] == ratio_row
    assert "5.200 req/s on one server, 4.000 req/s on two servers (one / two = **1.300**)" in text
    assert "mirroring off" in text and "concurrency 2 per model" in text
    assert "per round" not in text  # one round: nothing to spread


def test_failed_measurements_are_shown_not_hidden():
    rows = [r if r["situation"] != "both" or r["model"] != "multi" else
            _row("multi", "both", p50=0, rps=0, ok=False) for r in _rows()]
    text = two_models.render_section(_meta(rounds=2), rows)
    assert "| `multi` | both loaded, one server | failed |" in text
    assert "**1 measurement(s) failed**: round 1 both `multi`: perf_analyzer exit 99" in text
    assert "p50 ratios per round:" in text
    report = two_models.render_report(_meta(), rows)
    assert "failed: perf_analyzer exit 99" in report and "- `perf_analyzer -m ct`" in report


def test_only_a_full_run_without_failures_rewrites_benchmarks_md(tmp_path: Path):
    page = tmp_path / "BENCHMARKS.md"
    begin, end = benchmarks_md.markers(two_models.BLOCK)
    original = f"top\n{begin}\nnot measured yet\n{end}\n"
    page.write_text(original)
    two_models._finish(_meta(mode="quick"), _rows(), tmp_path, page)
    assert page.read_text() == original and (tmp_path / "report.md").is_file()
    failed = [*_rows()[:-1], _row("multi", "two-servers", p50=0, rps=0, ok=False)]
    two_models._finish(_meta(), failed, tmp_path, page)
    assert page.read_text() == original
    two_models._finish(_meta(), _rows(), tmp_path, page)
    assert "not measured yet" not in page.read_text() and "| `multi` | both loaded, two servers |" in \
        page.read_text()


def test_time_windows_reach_perf_analyzer_and_other_modes_are_refused(tmp_path: Path):
    settings = analyzer.AnalyzerSettings(model="ct", url="127.0.0.1:8001", protocol="grpc",
                                         input_data=tmp_path / "in.json", concurrency=2,
                                         measurement_request_count=1, measurement_interval_ms=15000,
                                         measurement_mode="time_windows")
    args = analyzer.command(settings, tmp_path / "out.csv", binary=Path("perf_analyzer"))
    assert args[args.index("--measurement-mode") + 1] == "time_windows"
    assert args[args.index("--measurement-interval") + 1] == "15000"
    default = analyzer.AnalyzerSettings(model="ct", url="u", protocol="grpc", input_data=Path("i"),
                                        concurrency=1, measurement_request_count=3)
    command = analyzer.command(default, tmp_path / "o.csv", binary=Path("pa"))
    assert command[command.index("--measurement-mode") + 1] == "count_windows"
    with pytest.raises(ValueError, match="measurement_mode"):
        analyzer.AnalyzerSettings(model="ct", url="u", protocol="grpc", input_data=Path("i"), concurrency=1,
                                  measurement_request_count=1, measurement_mode="periodic")
