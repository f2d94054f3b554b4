"""The thread-budget check: a fold thread count is kept only where it gives nnU-Net's bits on this CPU.

The check's children are real processes running real TorchScript networks (``fake_networks``): one
whose output depends on the thread count (as oneDNN's convolutions do on AVX-512/AMX CPUs) and one
whose output does not.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from fake_networks import Elementwise, ThreadDependent, save

from nnunet_triton.builder.config_gen import write_config
from nnunet_triton.builder.model_specs import BuildOptions, python_fold_spec
from nnunet_triton.pipeline import threads
from nnunet_triton.server import exactness
from nnunet_triton.server import thread_budget as tb

CPUS = tb.available_cpus().cpus
needs_two_cpus = pytest.mark.skipif(CPUS < 2, reason="nnU-Net's count is 1 thread on a 1-CPU machine, "
                                                     "so no other count is ever checked")


def _quota(cpus: int) -> tb.CpuQuota:
    return tb.CpuQuota(cpus=cpus, affinity=cpus, quota=None, source="test")


def _repository(root: Path, network: type, *, folds: int = 2, options: BuildOptions | None = None) -> Path:
    from test_model_specs import _config

    config = _config()
    for k in range(folds):
        write_config(python_fold_spec(config, k, options or BuildOptions()), root / f"fold_{k}")
        save(network(config.labels.num_segmentation_heads), root / f"fold_{k}" / "1" / "model.pt")
    return root


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment the launcher gives the check (``OMP_WAIT_POLICY`` is in the cache key), with a
    cache of this module's own: each test run starts without one."""
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", exactness.CACHE_ENV: str(cache)}


@pytest.fixture()
def fresh_env(tmp_path: Path) -> dict[str, str]:
    """An empty cache: every run starts its child processes."""
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", exactness.CACHE_ENV: str(tmp_path / "cache")}


@pytest.fixture(scope="module")
def dependent(tmp_path_factory: pytest.TempPathFactory) -> tb.FoldModels:
    return tb.repository_folds(_repository(tmp_path_factory.mktemp("dependent"), ThreadDependent))


@pytest.fixture(scope="module")
def elementwise(tmp_path_factory: pytest.TempPathFactory) -> tb.FoldModels:
    return tb.repository_folds(_repository(tmp_path_factory.mktemp("elementwise"), Elementwise))


@pytest.mark.parametrize(("torch_default", "env", "expected"), [
    (2, {}, 2), (16, {}, 8), (16, {"nnUNet_def_n_proc": "12"}, 12), (4, {"nnUNet_def_n_proc": "1"}, 1)])
def test_nnunets_count_is_the_smaller_of_its_default_processes_and_torchs_default(
        torch_default: int, env: dict[str, str], expected: int) -> None:
    assert threads.nnunet_threads(torch_default, env) == expected


def test_a_malformed_nnunet_process_count_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="nnUNet_def_n_proc must be a positive integer, got 'many'"):
        threads.nnunet_threads(4, {"nnUNet_def_n_proc": "many"})


def test_the_reference_run_reports_nnunets_count_in_a_fresh_process_and_is_cached(tmp_path: Path,
                                                                                 fresh_env) -> None:
    networks = tb.repository_folds(_repository(tmp_path / "repo", Elementwise, folds=1)).networks
    first = exactness.reference_run(networks, env=fresh_env)
    assert first.threads == threads.nnunet_threads(first.torch_default, fresh_env) and not first.cached
    assert list(first.digests) == ["fold_0"]
    again = exactness.reference_run(networks, env=fresh_env)
    assert again.cached and again.digests == first.digests


def test_the_cache_does_not_answer_for_a_changed_network(tmp_path: Path, fresh_env) -> None:
    repo = _repository(tmp_path / "repo", Elementwise, folds=1)
    networks = tb.repository_folds(repo).networks
    before = exactness.reference_run(networks, env=fresh_env)
    save(ThreadDependent(3), repo / "fold_0" / "1" / "model.pt")
    after = exactness.reference_run(networks, env=fresh_env)
    assert not after.cached and after.digests != before.digests and after.fingerprint != before.fingerprint


@needs_two_cpus
def test_the_check_finds_a_network_whose_output_depends_on_the_thread_count(dependent, env) -> None:
    check = exactness.check_threads(exactness.reference_run(dependent.networks, env=env), 1, env=env)
    assert not check.identical and check.candidate == 1 and check.reference >= 2
    assert check.first_difference.startswith("fold_0: ")
    assert "values differ, max |diff|" in check.first_difference and "NOT bitwise equal" in check.summary()


@needs_two_cpus
def test_the_check_passes_a_network_whose_output_does_not_depend_on_threads(elementwise, env) -> None:
    reference = exactness.reference_run(elementwise.networks, env=env)
    check = exactness.check_threads(reference, 1, env=env)
    assert check.identical and check.networks == ("fold_0", "fold_1")
    assert exactness.check_threads(reference, 1, env=env).cached  # the second time from the cache


@needs_two_cpus
def test_auto_falls_back_to_nnunets_count_when_split_threads_change_the_logits(dependent, env) -> None:
    """The forced mismatch: on this CPU 1 thread per fold gives other bits than nnU-Net's count."""
    budget = tb.decide_budget(dependent, env=env, quota=_quota(CPUS))
    assert budget.policy is tb.ThreadPolicy.EXACT and budget.exact is True
    assert budget.fold_threads == budget.nnunet_threads >= 2
    assert budget.fold_slots == max(1, CPUS // budget.fold_threads)
    assert "split candidate 1 thread(s) NOT bitwise equal" in budget.exactness
    assert budget.environment()[tb.FOLD_THREADS_ENV] == str(budget.nnunet_threads)


@needs_two_cpus
def test_auto_keeps_split_threads_where_they_are_proven_bitwise_equal(elementwise, env) -> None:
    budget = tb.decide_budget(elementwise, env=env, quota=_quota(CPUS))
    assert (budget.policy, budget.fold_threads, budget.exact) == (
        tb.ThreadPolicy.SPLIT, max(1, CPUS // 2), True)
    assert "bitwise equal to nnU-Net's" in budget.exactness and budget.exactness in budget.reason


@needs_two_cpus
def test_a_split_policy_the_user_asks_for_is_kept_with_a_warning_when_not_exact(
        dependent, env, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=tb.__name__):
        budget = tb.decide_budget(dependent, env={**env, tb.POLICY_ENV: "split"}, quota=_quota(CPUS))
    assert (budget.policy, budget.fold_threads, budget.exact) == (
        tb.ThreadPolicy.SPLIT, max(1, CPUS // 2), False)
    assert "are NOT exact on this CPU" in caplog.text and "unset the override" in caplog.text


@needs_two_cpus
def test_a_models_own_thread_parameter_is_checked_and_warned_about(
        tmp_path: Path, env, caplog: pytest.LogCaptureFixture) -> None:
    repo = _repository(tmp_path / "repo", ThreadDependent, folds=1, options=BuildOptions(torch_threads=1))
    with caplog.at_level(logging.WARNING, logger=tb.__name__):
        budget = tb.decide_budget(tb.repository_folds(repo), env=env, quota=_quota(CPUS))
    assert "torch_num_threads=1 of fold_0 is not exact on this CPU" in caplog.text
    assert "torch_num_threads=1 of fold_0 is not exact" in budget.exactness


def _no_check(*args, **kwargs):
    raise AssertionError("no check is needed when the count is nnU-Net's own")


def _reference(threads: int, torch_default: int | None = None):
    def run(networks, env):
        return exactness.Reference(torch_default or threads, threads, {}, tuple(networks), ())
    return run


def test_nnunets_own_count_needs_no_check(tmp_path: Path) -> None:
    folds = tb.FoldModels(2, 10**7, (exactness.FoldNetwork("fold_0", str(tmp_path / "m.pt"), (1, 8), True),))
    budget = tb.decide_budget(folds, env={}, quota=_quota(4), run_reference=_reference(4), check=_no_check)
    assert (budget.policy, budget.fold_threads, budget.fold_slots, budget.exact) == (
        tb.ThreadPolicy.EXACT, 4, 1, True)
    assert budget.exactness == "4 thread(s) = nnU-Net's own count"


def test_exact_gives_the_folds_side_by_side_room_when_nnunets_count_leaves_cpus_free(tmp_path: Path) -> None:
    """16 CPUs, nnU-Net's 8 threads: two folds compute at once, each with nnU-Net's count."""
    folds = tb.FoldModels(5, 10**7, (exactness.FoldNetwork("fold_0", str(tmp_path / "m.pt"), (1, 8), True),))
    budget = tb.decide_budget(folds, env={}, quota=_quota(16), run_reference=_reference(8, 16),
                              check=_no_check)
    assert (budget.fold_threads, budget.fold_slots, budget.exact) == (8, 2, True)


def test_a_candidate_that_cannot_be_checked_falls_back_to_nnunets_count(tmp_path: Path) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("the check at 1 thread(s) failed (exit 1): no torch")

    folds = tb.FoldModels(2, 100, (exactness.FoldNetwork("fold_0", str(tmp_path / "m.pt"), (1, 8), True),))
    budget = tb.decide_budget(folds, env={}, quota=_quota(2), run_reference=_reference(2), check=broken)
    assert (budget.policy, budget.fold_threads, budget.exact) == (tb.ThreadPolicy.EXACT, 2, True)
    assert "not proven exact: the check could not run" in budget.exactness and "no torch" in budget.exactness


def test_without_torch_to_probe_auto_leaves_the_count_to_the_stubs_one_fold_at_a_time(tmp_path: Path) -> None:
    def no_torch(networks, env):
        raise RuntimeError("No module named 'torch'")

    folds = tb.FoldModels(2, 100, (exactness.FoldNetwork("fold_0", str(tmp_path / "m.pt"), (1, 8), True),))
    budget = tb.decide_budget(folds, env={}, quota=_quota(2), run_reference=no_torch, check=_no_check)
    assert (budget.policy, budget.fold_threads, budget.fold_slots, budget.exact) == (
        tb.ThreadPolicy.EXACT, None, 1, None)
    assert "could not be run at nnU-Net's thread count (No module named 'torch')" in budget.exactness


def test_a_repository_without_cpu_fold_networks_is_not_checked() -> None:
    budget = tb.decide_budget(tb.FoldModels(0, 0), env={}, quota=_quota(2), run_reference=_no_check,
                              check=_no_check)
    assert budget.exact is None and budget.exactness == "no CPU fold network in the repository"


def test_the_stub_accepts_nnunets_own_count_beyond_the_cpus_and_nothing_else_beyond() -> None:
    """A pod with 2 CPUs on a 16-core node: nnU-Net runs 8 threads there, so 8 is the one exact count."""
    env = {tb.FOLD_THREADS_ENV: "8"}
    assert threads.fold_threads_for_runner(0, env=env, torch_default=16, quota=_quota(2)) == 8
    with pytest.raises(tb.ThreadBudgetError, match="NNUNET_TRITON_FOLD_THREADS=4 asks for more threads"):
        threads.fold_threads_for_runner(0, env={tb.FOLD_THREADS_ENV: "4"}, torch_default=16, quota=_quota(2))


def test_cpu_identity_names_the_model_and_its_simd_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512_vnni amx_tile amx_bf16 rdrand\n\n"
                    "processor\t: 1\nmodel name\t: other\n")
    assert exactness.cpu_identity(info) == {
        "model": "Intel(R) Xeon(R) Platinum 8480+",
        "flags": "fpu sse sse2 avx avx2 fma avx512f avx512_vnni amx_tile amx_bf16 rdrand",
        "simd": "sse sse2 avx avx2 fma avx512f avx512_vnni amx_tile amx_bf16"}
