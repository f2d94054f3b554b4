"""CPU threads inside a fold model's process: how many CPUs there really are, nnU-Net's thread count, and
the count a Python fold runner sets (from its config, the launcher's budget, or nnU-Net's rule).

The launcher (``server.thread_budget``) decides the budget and passes it in the environment; this module
is what a fold model's stub needs to honour it, so the stub never imports the launcher.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.errors import ThreadBudgetError
from nnunet_triton.options import parse_int

__all__ = [
    "FOLD_THREADS_ENV",
    "EXPORT_THREADS_ENV",
    "BUDGET_ENV",
    "NNUNET_PROCESSES_ENV",
    "NNUNET_DEFAULT_PROCESSES",
    "CpuQuota",
    "available_cpus",
    "positive_int",
    "checked_threads",
    "nnunet_threads",
    "fold_threads_for_runner",
    "export_threads",
    "budget_note",
]

FOLD_THREADS_ENV = "NNUNET_TRITON_FOLD_THREADS"
EXPORT_THREADS_ENV = "NNUNET_TRITON_EXPORT_THREADS"  # the stitch model's export threads (default: all CPUs)
BUDGET_ENV = "NNUNET_TRITON_THREAD_BUDGET"  # the launcher's whole plan as JSON, for logs and the fold stubs
NNUNET_PROCESSES_ENV = "nnUNet_def_n_proc"  # nnunetv2.configuration.default_num_processes
NNUNET_DEFAULT_PROCESSES = 8


@dataclass(frozen=True)
class CpuQuota:
    """CPUs this process may use and where the number comes from."""

    cpus: int
    affinity: int
    quota: float | None  # cgroup CPU quota in CPUs, None when unlimited or unknown
    source: str


def _cgroup_quota(root: Path) -> tuple[float | None, str]:
    v2 = root / "sys/fs/cgroup/cpu.max"
    try:
        limit, period = v2.read_text().split()[:2]
        return (None if limit == "max" else int(limit) / int(period)), "cgroup v2 cpu.max"
    except (OSError, ValueError):
        pass
    v1 = root / "sys/fs/cgroup/cpu"
    try:
        quota = int((v1 / "cpu.cfs_quota_us").read_text())
        period = int((v1 / "cpu.cfs_period_us").read_text())
        return (None if quota <= 0 else quota / period), "cgroup v1 cpu.cfs_quota_us"
    except (OSError, ValueError):
        return None, "no cgroup CPU quota"


def available_cpus(root: str | Path = "/", affinity: int | None = None) -> CpuQuota:
    """CPUs really available: the affinity mask, capped by the cgroup quota (rounded up, at least 1)."""
    count = affinity if affinity is not None else len(os.sched_getaffinity(0))
    quota, where = _cgroup_quota(Path(root))
    if quota is not None and math.ceil(quota) < count:
        return CpuQuota(max(1, math.ceil(quota)), count, quota, f"{where} ({quota:g} CPUs)")
    return CpuQuota(count, count, quota, f"affinity mask ({count} CPUs; {where})")


def positive_int(name: str, text: str) -> int:
    return parse_int(name, text, minimum=1, label=name, error=ThreadBudgetError)


def checked_threads(name: str, text: str, quota: CpuQuota) -> int:
    threads = positive_int(name, text)
    if threads > quota.cpus:
        raise ThreadBudgetError(f"{name}={threads} asks for more threads than the {quota.cpus} CPU(s) "
                                f"available ({quota.source}).")
    return threads


def nnunet_threads(torch_default: int, env: Mapping[str, str] | None = None) -> int:
    """nnU-Net's thread count for forwards: ``min(default_num_processes, torch.get_num_threads())``."""
    env = os.environ if env is None else env
    processes = NNUNET_DEFAULT_PROCESSES
    if NNUNET_PROCESSES_ENV in env:
        processes = parse_int(NNUNET_PROCESSES_ENV, env[NNUNET_PROCESSES_ENV], minimum=1,
                              label=NNUNET_PROCESSES_ENV, error=ValueError)
    return max(1, min(processes, torch_default))


def fold_threads_for_runner(configured: int, *, env: Mapping[str, str] | None = None,
                            torch_default: int, quota: CpuQuota | None = None) -> int:
    """Threads a fold stub sets: its config parameter, else the launcher's budget, else nnU-Net's count.

    ``configured`` is the model's ``torch_num_threads`` (0 = follow the budget). Without a launcher
    (a user's own ``tritonserver``), nnU-Net's count is capped at the available CPUs. The launcher's
    count may exceed the CPUs only when it is nnU-Net's own (the one exact count, see
    ``server.thread_budget.decide_budget``).

    Raises:
        ThreadBudgetError: ``configured`` or the budget asks for more threads than allowed.
    """
    env = os.environ if env is None else env
    quota = quota or available_cpus()
    if configured < 0:
        raise ThreadBudgetError(f"torch_num_threads must be >= 0, got {configured}.")
    if configured:
        return checked_threads("torch_num_threads", str(configured), quota)
    own = nnunet_threads(torch_default, env)
    if FOLD_THREADS_ENV in env:
        threads = positive_int(FOLD_THREADS_ENV, env[FOLD_THREADS_ENV])
        return threads if threads == own else checked_threads(FOLD_THREADS_ENV, str(threads), quota)
    return max(1, min(own, quota.cpus))


def export_threads(env: Mapping[str, str] | None = None, quota: CpuQuota | None = None) -> int:
    """Threads the stitch model exports row ranges with: ``NNUNET_TRITON_EXPORT_THREADS``, else every
    available CPU (the export's bits do not depend on the count: each range writes its own rows).

    Raises:
        ThreadBudgetError: the variable is not a positive integer or asks for more threads than CPUs.
    """
    env = os.environ if env is None else env
    quota = quota or available_cpus()
    if EXPORT_THREADS_ENV in env:
        return checked_threads(EXPORT_THREADS_ENV, env[EXPORT_THREADS_ENV], quota)
    return quota.cpus


def budget_note(env: Mapping[str, str] | None = None) -> str:
    """What the launcher's budget says of exactness, for a stub's log line ("" without a launcher)."""
    env = os.environ if env is None else env
    try:
        budget = json.loads(env.get(BUDGET_ENV, "") or "{}")
    except ValueError:
        return f"{BUDGET_ENV} is not JSON"
    if not budget:
        return "no launcher budget (nnU-Net's count, capped at the CPUs)"
    verdict = {True: "exact", False: "NOT exact", None: "exactness not checked"}[budget.get("exact")]
    return f"{verdict}: {budget.get('exactness', '')}"
