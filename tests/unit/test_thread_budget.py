"""The thread budget: CPUs from affinity and cgroup quota, per-fold threads, overrides, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nnunet_triton.builder.model_specs import BuildOptions, python_fold_spec
from nnunet_triton.errors import ThreadBudgetError
from nnunet_triton.pipeline import threads
from nnunet_triton.server import thread_budget as tb

REPO_ROOT = Path(__file__).resolve().parents[2]


def _cgroup_v2(root: Path, text: str) -> Path:
    (root / "sys/fs/cgroup").mkdir(parents=True)
    (root / "sys/fs/cgroup/cpu.max").write_text(text)
    return root


def test_cgroup_v2_quota_caps_the_affinity_mask_rounded_up(tmp_path: Path) -> None:
    quota = tb.available_cpus(_cgroup_v2(tmp_path, "250000 100000\n"), affinity=64)
    assert (quota.cpus, quota.affinity, quota.quota) == (3, 64, 2.5)
    assert "cpu.max" in quota.source


def test_unlimited_cgroup_v2_keeps_the_affinity_mask(tmp_path: Path) -> None:
    quota = tb.available_cpus(_cgroup_v2(tmp_path, "max 100000\n"), affinity=6)
    assert (quota.cpus, quota.quota) == (6, None)


def test_cgroup_v1_quota_is_read_when_v2_is_absent(tmp_path: Path) -> None:
    cpu = tmp_path / "sys/fs/cgroup/cpu"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("100000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    assert tb.available_cpus(tmp_path, affinity=16).cpus == 1


def test_a_fraction_of_a_cpu_still_gives_one(tmp_path: Path) -> None:
    assert tb.available_cpus(_cgroup_v2(tmp_path, "20000 100000"), affinity=8).cpus == 1


def _allowed_cpus_from_proc() -> int:
    """The affinity mask counted from ``/proc/self/status`` (independent of ``os.sched_getaffinity``)."""
    text = Path("/proc/self/status").read_text()
    ranges = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("Cpus_allowed_list:"))
    return sum(int(b) - int(a) + 1 if "-" in part else 1
               for part in ranges.split(",") for a, _, b in [part.partition("-")])


def test_this_machine_is_never_read_from_os_cpu_count() -> None:
    assert tb.available_cpus().affinity == _allowed_cpus_from_proc()
    # pinned to one CPU, the count must follow the pin, which os.cpu_count() does not
    if (os.cpu_count() or 1) < 2:
        pytest.skip("this machine has one CPU: a pin to one CPU cannot tell the mask from os.cpu_count()")
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from nnunet_triton.server import thread_budget as tb; q = tb.available_cpus(); "
            "print(q.cpus, q.affinity)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["1", "1"]


def _quota(cpus: int) -> tb.CpuQuota:
    return tb.CpuQuota(cpus=cpus, affinity=cpus, quota=None, source="test")


@pytest.mark.parametrize(("cpus", "folds", "threads", "slots"),
                         [(2, 2, 1, 2), (16, 5, 3, 5), (4, 1, 4, 1), (2, 5, 1, 2)])
def test_split_policy_never_gives_the_folds_more_threads_than_cpus(cpus: int, folds: int, threads: int,
                                                                   slots: int) -> None:
    budget = tb.plan_budget(folds, env={tb.POLICY_ENV: "split"}, quota=_quota(cpus))
    assert (budget.fold_threads, budget.fold_slots) == (threads, slots)
    assert budget.fold_threads * budget.fold_slots <= cpus
    env = budget.environment()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env[tb.FOLD_THREADS_ENV] == str(threads)
    assert json.loads(env[tb.BUDGET_ENV])["reason"] == budget.reason


def test_the_rate_limiter_is_asked_for_only_when_fewer_slots_than_fold_instances() -> None:
    limited = tb.plan_budget(5, env={tb.POLICY_ENV: "split"}, quota=_quota(2))
    assert limited.server_args() == ["--rate-limit=execution_count",
                                     "--rate-limit-resource=nnunet_fold_slot:2"]
    assert tb.plan_budget(2, env={tb.POLICY_ENV: "split"}, quota=_quota(2)).server_args() == []


def test_exact_policy_keeps_nnunets_count_and_lets_one_fold_compute_at_a_time() -> None:
    budget = tb.plan_budget(2, env={tb.POLICY_ENV: "exact"}, quota=_quota(8))
    assert budget.fold_threads is None and tb.FOLD_THREADS_ENV not in budget.environment()
    assert budget.fold_slots == 1 and budget.server_args()[-1] == "--rate-limit-resource=nnunet_fold_slot:1"
    env = budget.environment()
    assert threads.fold_threads_for_runner(0, env=env, torch_default=32, quota=_quota(8)) == 8
    assert threads.fold_threads_for_runner(0, env=env, torch_default=4, quota=_quota(8)) == 4


@pytest.mark.parametrize(("largest", "policy"), [(24 * 32 * 32, "split"), (112 * 160 * 128, "exact"),
                                                 (tb.AUTO_EXACT_VOXELS, "exact")])
def test_auto_policy_picks_exact_for_long_forwards_and_split_for_short_ones(largest: int, policy: str
                                                                            ) -> None:
    budget = tb.plan_budget(tb.FoldModels(instances=2, largest_input=largest), env={}, quota=_quota(2))
    assert budget.policy.value == policy and budget.reason.startswith("auto:")


def test_user_overrides_win_and_are_recorded() -> None:
    env = {tb.FOLD_THREADS_ENV: "2", "OMP_WAIT_POLICY": "active", tb.FOLD_SLOTS_ENV: "1"}
    budget = tb.plan_budget(4, env=env, quota=_quota(4))
    assert (budget.fold_threads, budget.fold_slots, budget.omp_wait_policy) == (2, 1, "ACTIVE")
    assert budget.overrides == env and "set by the user" in budget.reason


@pytest.mark.parametrize(("env", "message"), [
    ({tb.FOLD_THREADS_ENV: "many"}, "NNUNET_TRITON_FOLD_THREADS must be a positive integer, got 'many'"),
    ({tb.FOLD_THREADS_ENV: "0"}, "NNUNET_TRITON_FOLD_THREADS must be a positive integer, got '0'"),
    ({tb.FOLD_THREADS_ENV: "3"}, "NNUNET_TRITON_FOLD_THREADS=3 asks for more threads than the 2 CPU(s)"),
    ({tb.POLICY_ENV: "fast"}, "NNUNET_TRITON_THREAD_POLICY must be one of auto, exact, split, got 'fast'"),
    ({tb.FOLD_SLOTS_ENV: "3"}, "NNUNET_TRITON_FOLD_SLOTS=3 fold executions x 1 thread"),
    ({tb.FOLD_SLOTS_ENV: "-1"}, "NNUNET_TRITON_FOLD_SLOTS must be a positive integer, got '-1'"),
    ({"OMP_WAIT_POLICY": "sometimes"}, "OMP_WAIT_POLICY must be PASSIVE or ACTIVE, got 'sometimes'"),
])
def test_settings_that_cannot_be_honoured_are_refused_naming_them(env: dict[str, str], message: str) -> None:
    with pytest.raises(ThreadBudgetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tb.plan_budget(2, env=env, quota=_quota(2))


def test_a_fold_models_own_thread_parameter_wins_but_not_beyond_the_cpus() -> None:
    env = {tb.FOLD_THREADS_ENV: "1"}
    assert threads.fold_threads_for_runner(2, env=env, torch_default=2, quota=_quota(2)) == 2
    assert threads.fold_threads_for_runner(0, env=env, torch_default=2, quota=_quota(2)) == 1
    with pytest.raises(ThreadBudgetError, match="torch_num_threads=3 asks for more threads than the 2 CPU"):
        threads.fold_threads_for_runner(3, env=env, torch_default=2, quota=_quota(2))


def _repository(tmp_path: Path, folds: int, instances: int) -> Path:
    from test_model_specs import _config

    from nnunet_triton.builder.config_gen import write_config

    for k in range(folds):
        write_config(python_fold_spec(_config(), k, BuildOptions(fold_instances=instances)),
                     tmp_path / f"fold_{k}")
    (tmp_path / "nnunet").mkdir()
    (tmp_path / "nnunet" / "config.pbtxt").write_text('name: "nnunet"\nplatform: "ensemble"\n')
    return tmp_path


def test_fold_instances_and_input_size_are_read_from_the_generated_configs(tmp_path: Path) -> None:
    folds = tb.repository_folds(_repository(tmp_path, folds=3, instances=2))
    assert folds.instances == 6
    assert folds.largest_input == 2 * 16 * 24 * 32  # C x patch of test_model_specs' plans


def test_container_entry_point_execs_the_server_with_the_budget(tmp_path: Path) -> None:
    from fake_networks import Elementwise, save

    repo = _repository(tmp_path, folds=2, instances=1)
    for k in range(2):  # networks the check can run (their bits do not depend on the thread count)
        save(Elementwise(3), repo / f"fold_{k}" / "1" / "model.pt")
    server = tmp_path / "tritonserver"  # stands in for tritonserver: prints what it was started with
    server.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{k: os.environ.get(k) "
                      "for k in ('OMP_WAIT_POLICY', 'NNUNET_TRITON_FOLD_THREADS', "
                      "'NNUNET_TRITON_THREAD_POLICY')}))\nprint(json.dumps(sys.argv))\n")
    server.chmod(0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "NNUNET_TRITON_"))}
    env["PYTHONPATH"] = str(REPO_ROOT / "src")
    result = subprocess.run(
        [sys.executable, "-m", "nnunet_triton.server.thread_budget", "exec",
         "--model-repository", str(repo), "--",
         str(server), f"--model-repository={repo}", "--http-port=8000"],
        capture_output=True, text=True, timeout=120, check=True, env=env)
    seen = json.loads(result.stdout.splitlines()[0])
    cpus = tb.available_cpus().cpus
    assert seen == {"OMP_WAIT_POLICY": "PASSIVE", "NNUNET_TRITON_FOLD_THREADS": str(max(1, cpus // 2)),
                    "NNUNET_TRITON_THREAD_POLICY": "split"}  # auto: the test plans' small patch, proven exact
    assert "thread budget:" in result.stderr and "bitwise equal to nnU-Net's" in result.stderr


def test_container_entry_point_refuses_a_bad_setting_before_starting_anything(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), tb.FOLD_THREADS_ENV: "lots"}
    result = subprocess.run(
        [sys.executable, "-m", "nnunet_triton.server.thread_budget", "exec",
         "--model-repository", str(tmp_path),
         "--", "false"], capture_output=True, text=True, timeout=60, check=False, env=env)
    assert result.returncode == 2
    assert "NNUNET_TRITON_FOLD_THREADS must be a positive integer, got 'lots'" in result.stderr


def test_cpu_fold_models_hold_one_fold_slot_per_execution_and_gpu_ones_none(tmp_path: Path) -> None:
    from test_model_specs import _config

    from nnunet_triton.builder.config_gen import render_config
    from nnunet_triton.builder.model_specs import fold_spec

    cpu = render_config(python_fold_spec(_config(), 0, BuildOptions()))
    assert 'rate_limiter {\n    resources {\n      name: "nnunet_fold_slot"\n      count: 1' in cpu
    gpu = render_config(fold_spec(_config(), 0, BuildOptions(target="gpu")))
    assert "rate_limiter" not in gpu


def test_libtorch_cpu_folds_are_in_the_budget_with_slots_threads_and_the_check(tmp_path: Path) -> None:
    from fake_networks import Elementwise, save
    from test_model_specs import _config

    from nnunet_triton.builder.config_gen import render_config, write_config
    from nnunet_triton.builder.model_specs import libtorch_fold_spec

    options = BuildOptions(fold_runner="libtorch", fold_instances=2)
    for k in range(2):
        write_config(libtorch_fold_spec(_config(), k, options), tmp_path / f"fold_{k}")
        save(Elementwise(3), tmp_path / f"fold_{k}" / "1" / "model.pt")
    folds = tb.repository_folds(tmp_path)
    seen: list[dict] = []

    def reference(networks, *, env):  # the real run, recording the environment nnU-Net's count is read in
        seen.append(dict(env))
        return tb.reference_run(networks, env=env)

    budget = tb.decide_budget(folds, env={}, quota=_quota(2), run_reference=reference)

    assert (folds.instances, folds.largest_input, folds.libtorch) == (4, 2 * 16 * 24 * 32, True)
    assert [(n.model, n.per_sample_forward) for n in folds.networks] == [("fold_0", True), ("fold_1", True)]
    assert (budget.fold_threads, budget.exact, budget.server_args()) == (
        1, True, ["--rate-limit=execution_count", "--rate-limit-resource=nnunet_fold_slot:2"])
    assert budget.environment()["OMP_NUM_THREADS"] == "1"  # the server process's libtorch pool
    assert "OMP_NUM_THREADS" not in seen[0]  # nnU-Net's count is torch's default, not the budget's T
    gpu = render_config(libtorch_fold_spec(_config(), 0, BuildOptions(target="gpu")))
    assert "rate_limiter" not in gpu
    assert 'rate_limiter {\n    resources {\n      name: "nnunet_fold_slot"\n      count: 1' in render_config(
        libtorch_fold_spec(_config(), 0, options))


def test_the_export_takes_every_cpu_unless_told_and_never_more_than_there_are() -> None:
    assert threads.export_threads({}, _quota(2)) == 2
    assert threads.export_threads({threads.EXPORT_THREADS_ENV: "1"}, _quota(2)) == 1
    with pytest.raises(ThreadBudgetError, match="EXPORT_THREADS=3 asks for more threads than the 2"):
        threads.export_threads({threads.EXPORT_THREADS_ENV: "3"}, _quota(2))
    with pytest.raises(ThreadBudgetError, match="NNUNET_TRITON_EXPORT_THREADS.*positive integer.*'two'"):
        threads.export_threads({threads.EXPORT_THREADS_ENV: "two"}, _quota(2))
