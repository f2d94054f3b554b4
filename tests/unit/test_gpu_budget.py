"""The GPU check's budget: stages in order of value, none started without the time it needs, the exit status
says defect (1) before budget (3), and the watchdog fires when the time is spent."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tools import gpu_budget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stages_run_in_order_of_value_whatever_order_they_are_asked_in():
    assert gpu_budget.ordered_stages(["timings", "parity", "endpoint"]) == ["parity", "endpoint", "timings"]
    assert gpu_budget.ordered_stages("timings,parity".split(",")) == ["parity", "timings"]


def test_an_unknown_stage_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['timing'\].*'parity', 'endpoint', 'timings'"):
        gpu_budget.ordered_stages(["parity", "timing"])


def test_a_stage_starts_only_while_the_time_left_covers_its_minimum():
    clock = Clock()
    budget = gpu_budget.Budget(450.0, clock=clock)  # 435 s before the reserve
    assert budget.allows("timings")
    clock.now += 435.0 - gpu_budget.MIN_STAGE_SECONDS["timings"]
    assert budget.allows("timings")
    clock.now += 1.0
    assert not budget.allows("timings") and budget.allows("parity")


def test_a_budget_no_larger_than_the_reserve_is_refused_with_both_numbers():
    with pytest.raises(ValueError, match=r"--budget-s must exceed the reserve of 15 s .*got 10"):
        gpu_budget.Budget(10.0)


def test_exit_status_is_defect_before_budget_before_green():
    stopped, skipped = gpu_budget.BUDGET_STOPPED, gpu_budget.BUDGET_NOT_STARTED
    assert gpu_budget.exit_status(["ok", "skipped", "ok"]) == gpu_budget.EXIT_GREEN == 0
    assert gpu_budget.exit_status(["ok", stopped]) == gpu_budget.EXIT_BUDGET == 3
    assert gpu_budget.exit_status(["ok", skipped]) == 3
    assert gpu_budget.exit_status(["failed", stopped]) == gpu_budget.EXIT_DEFECT == 1


def test_the_watchdog_fires_once_the_budget_is_spent_and_not_without_a_budget():
    fired = threading.Event()
    timer = gpu_budget.Budget(16.0, reserve_s=15.9).watchdog(fired.set)
    assert fired.wait(timeout=30)
    timer.join(timeout=30)
    assert gpu_budget.Budget(None).watchdog(fired.set) is None


REPO_ROOT = Path(__file__).resolve().parents[2]

STOP = """
import subprocess, sys, types
from pathlib import Path
from tools import gpu_check
out = Path(sys.argv[1])
server = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a process group, as tritonserver's
(out / "server.pid").write_text(str(server.pid))
stages = [gpu_check.Stage("(a) parity", finished=True), gpu_check.Stage("(b) endpoint", rows=[{"a": 1}])]
def report():
    path = out / "gpu-check.md"
    path.write_text("\\n".join(f"{s.name}: {s.status}; {s.notes}" for s in stages))
    return path
gpu_check._stop_on_budget(stages, report, [types.SimpleNamespace(pid=server.pid)])
"""


def test_a_stage_cut_by_the_budget_is_written_as_stopped_its_server_killed_and_the_exit_status_is_3(tmp_path):
    proc = subprocess.run([sys.executable, "-c", STOP, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == gpu_budget.EXIT_BUDGET, proc.stderr[-2000:]
    report = (tmp_path / "gpu-check.md").read_text().splitlines()
    assert report[0] == "(a) parity: ok; []"
    assert report[1].startswith("(b) endpoint: stopped (budget); ['the budget ran out while this stage ran")
    pid = int((tmp_path / "server.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_the_check_starts_no_stage_its_budget_cannot_cover_and_says_how_to_rerun_it(tmp_path):
    # 44 s: 29 s before the reserve, less than parity's 30 s minimum, more than the check needs to get there
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--device", "cpu", "--stages",
                           "timings,parity", "--budget-s", "44", "--out", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == gpu_budget.EXIT_BUDGET, proc.stderr[-2000:]
    stages = json.loads((tmp_path / "gpu-check.json").read_text())["stages"]
    assert [(s["name"], s["status"]) for s in stages] == [
        ("(a) parity: NumPy vs device backend", "not started (budget)"),
        ("(c) timings", "not started (budget)")]
    assert "rerun it with --stages timings" in stages[1]["notes"][0]
