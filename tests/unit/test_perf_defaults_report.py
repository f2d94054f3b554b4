"""The default-launch benchmark's report: every goal judged from the numbers, the block replaced in place."""

from __future__ import annotations

from pathlib import Path

from tools.perf import benchmarks_md, defaults


def _results(latency_ratio: float, folder_ratio: float) -> dict:
    return {
        "date": "2026-12-01T10:00:00", "cpus": 2, "loadavg_start": [0.5, 0, 0], "loadavg_end": [1.5, 0, 0],
        "cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cpu_simd": "avx2 avx512f amx_tile",
        "build_fixture_s": 8.0,
        "first_answer_fixture": {"ready_s": 2.0, "first_request_s": 6.0, "second_request_s": 6.5},
        "latency_fixture": {"endpoint_median_s": 8.0 * latency_ratio, "predictor_median_s": 8.0,
                            "ratio": latency_ratio},
        "throughput_fixture_c4": {"endpoint_req_s": 0.15, "predictor_back_to_back_req_s": 0.1, "ratio": 1.5},
        "folder_fixture": {"cases": 6, "cli_s": 60.0, "nnunetv2_predict_s": 60.0 * folder_ratio,
                           "throughput_ratio": folder_ratio, "label_maps_identical": True},
        "thread_budget": {"reason": "auto: because", "exact": True},
    }


def test_report_judges_each_goal_from_its_ratio():
    text = defaults.report(_results(latency_ratio=1.1, folder_ratio=1.4))
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    latency = "fixture latency, concurrency 1 (2 folds, mirroring): endpoint / nnUNetPredictor"
    assert "**missed**" in lines[latency]
    assert "**met**" in lines["fixture throughput, concurrency 4 vs nnUNetPredictor back to back"]
    assert "**1.4x**" in text and "thread budget chosen for the fixture server (exact): auto: because" in text
    assert "on 2 CPUs (Intel(R) Xeon(R) Platinum 8480+; SIMD: avx2 avx512f amx_tile)" in text
    assert "realistic" not in text  # a run without the realistic workload reports none


def test_benchmarks_block_is_replaced_between_its_markers(tmp_path: Path):
    page = tmp_path / "BENCHMARKS.md"
    begin, end = benchmarks_md.markers(defaults.BLOCK)
    page.write_text(f"intro\n{begin}\nold\n{end}\nrest\n")
    defaults.update_benchmarks_md("new table\n", page)
    assert page.read_text() == f"intro\n{begin}\nnew table\n{end}\nrest\n"
