"""How many CPU threads each fold model may use, decided where the server runs, never oversubscribed.

Two fold models with torch's default thread count (one per core) plus the Python models, all on the
same cores, spin-wait against each other: OpenMP's default ``OMP_WAIT_POLICY`` keeps idle workers
busy-polling after every parallel region, so each process steals the cores the others compute on.
Measured on the 2-core fixture (2 folds, mirroring on): 14.5 s per request without a budget, 7.1 s
with ``OMP_WAIT_POLICY=PASSIVE``, 6.0 s with PASSIVE and one thread per fold (nnUNetPredictor 8.3 s).

Every launcher of this project (the embedded server, ``make serve|deploy|demo``, the container
entry point for docker and Kubernetes) starts the server through :func:`plan_budget` +
:meth:`ThreadBudget.environment`:

* the CPUs really available: the process's affinity mask, capped by the cgroup CPU quota
  (``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` of v1; a container started
  with ``--cpus 4`` or a pod with ``limits.cpu: 4`` sees 4 even on a 64-core host, where torch would
  start 64 threads per fold), never ``os.cpu_count()``;
* the fold model instances that compute at once: every fold instance of the repository (the
  orchestrator sends each tile batch to all folds concurrently);
* policy ``split`` (default): ``max(1, cpus // fold_instances)`` threads per fold instance, so the
  folds together never use more threads than there are cores. Logits: bit-identical to
  nnUNetPredictor on every committed fixture network (the parity tests run under this budget);
  on nnU-Net's default 3d_fullres network one thread instead of two changes logits by at most
  1.2e-6 (oneDNN's reduction order; measured, see BENCHMARKS.md), label maps unchanged there.
  Policy ``nnunet``: nnU-Net's own thread count (torch's default, capped at the available CPUs) in
  every fold instance, bit-identical logits on any network whatever the thread count of the
  machine, at the price of more threads than cores when several folds compute at once (PASSIVE
  wait keeps that cheap: measured 7.1 s vs 6.0 s above);
* ``OMP_WAIT_POLICY=PASSIVE`` for every process of the server (idle OpenMP workers sleep).

Overrides, each read from the server's environment: ``NNUNET_TRITON_THREAD_POLICY`` (split|nnunet),
``NNUNET_TRITON_FOLD_THREADS`` (a positive int, at most the available CPUs), ``OMP_WAIT_POLICY``
(kept when set). A fold model's own ``torch_num_threads`` config parameter (build option
``torch_threads``), when not 0, wins over all of them. A value that cannot be honoured is refused at
start with :class:`ThreadBudgetError` naming the setting and the value.

Command line (container entry point; Python 3.10 like the image's stub)::

    python3 -m nnunet_triton.thread_budget exec --model-repository /models -- tritonserver ...
    python3 -m nnunet_triton.thread_budget show --model-repository build/model_repository
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from nnunet_triton.errors import ThreadBudgetError

__all__ = [
    "POLICY_ENV",
    "FOLD_THREADS_ENV",
    "BUDGET_ENV",
    "ThreadPolicy",
    "CpuQuota",
    "ThreadBudget",
    "available_cpus",
    "repository_fold_instances",
    "plan_budget",
    "fold_threads_for_runner",
    "main",
]

POLICY_ENV = "NNUNET_TRITON_THREAD_POLICY"
FOLD_THREADS_ENV = "NNUNET_TRITON_FOLD_THREADS"
BUDGET_ENV = "NNUNET_TRITON_THREAD_BUDGET"  # the whole plan as JSON, for logs and the fold stubs
_WAIT_ENV = "OMP_WAIT_POLICY"
_FOLD_MARKER = 'key: "torch_num_threads"'  # a Python fold runner's config (model_specs.python_fold_spec)
_INSTANCE_COUNT = re.compile(r"instance_group\s*\{[^}]*?count:\s*(\d+)", re.S)


class ThreadPolicy(str, Enum):  # noqa: UP042 - StrEnum is 3.11, the image stub runs 3.10
    SPLIT = "split"
    NNUNET = "nnunet"


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


def repository_fold_instances(model_repository: str | Path) -> int:
    """Python fold-runner instances in a repository: the fold computations that can run at once."""
    total = 0
    for config in sorted(Path(model_repository).glob("*/config.pbtxt")):
        text = config.read_text()
        if _FOLD_MARKER in text:
            counts = _INSTANCE_COUNT.findall(text)
            total += sum(int(c) for c in counts) if counts else 1
    return total


@dataclass(frozen=True)
class ThreadBudget:
    """What a launcher chose: threads per fold instance, the environment, and why."""

    policy: ThreadPolicy
    cpus: int
    cpu_source: str
    fold_instances: int
    fold_threads: int | None  # None: nnU-Net's own count (torch's default, capped at cpus) in each stub
    omp_wait_policy: str
    reason: str
    overrides: dict[str, str] = field(default_factory=dict)

    def environment(self) -> dict[str, str]:
        """Variables for the server process (inherited by every Python-backend stub)."""
        env = {_WAIT_ENV: self.omp_wait_policy, POLICY_ENV: self.policy.value,
               BUDGET_ENV: json.dumps(self.to_dict(), sort_keys=True)}
        if self.fold_threads is not None:
            env[FOLD_THREADS_ENV] = str(self.fold_threads)
        return env

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["policy"] = self.policy.value
        return data


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ThreadBudgetError(f"{name} must be a positive integer, got {text!r}.") from None
    if value < 1:
        raise ThreadBudgetError(f"{name} must be a positive integer, got {text!r}.")
    return value


def _policy(text: str) -> ThreadPolicy:
    try:
        return ThreadPolicy(text.strip().lower())
    except ValueError:
        choices = ", ".join(p.value for p in ThreadPolicy)
        raise ThreadBudgetError(f"{POLICY_ENV} must be one of {choices}, got {text!r}.") from None


def plan_budget(fold_instances: int, *, env: Mapping[str, str] | None = None,
                quota: CpuQuota | None = None) -> ThreadBudget:
    """The budget for ``fold_instances`` concurrent fold instances under ``env``'s overrides.

    Raises:
        ThreadBudgetError: a malformed override, or more fold threads than available CPUs.
    """
    env = os.environ if env is None else env
    quota = quota or available_cpus()
    policy = _policy(env.get(POLICY_ENV, ThreadPolicy.SPLIT.value))
    overrides = {k: env[k] for k in (POLICY_ENV, FOLD_THREADS_ENV, _WAIT_ENV) if k in env}
    wait = env.get(_WAIT_ENV, "PASSIVE")
    if wait.strip().upper() not in ("PASSIVE", "ACTIVE"):
        raise ThreadBudgetError(f"{_WAIT_ENV} must be PASSIVE or ACTIVE, got {wait!r}.")
    folds = max(1, fold_instances)
    if FOLD_THREADS_ENV in env:
        threads = _positive_int(FOLD_THREADS_ENV, env[FOLD_THREADS_ENV])
        if threads > quota.cpus:
            raise ThreadBudgetError(
                f"{FOLD_THREADS_ENV}={threads} asks for more threads than the {quota.cpus} CPU(s) "
                f"available ({quota.source})."
            )
        reason = f"{FOLD_THREADS_ENV} set by the user"
    elif policy is ThreadPolicy.SPLIT:
        threads = max(1, quota.cpus // folds)
        reason = (f"{quota.cpus} CPU(s) / {folds} fold instance(s) computing at once = {threads} "
                  "thread(s) each")
    else:
        threads = None
        reason = f"nnU-Net's thread count (torch's default, at most {quota.cpus}) in each fold instance"
    return ThreadBudget(policy=policy, cpus=quota.cpus, cpu_source=quota.source, fold_instances=folds,
                        fold_threads=threads, omp_wait_policy=wait.strip().upper(), reason=reason,
                        overrides=overrides)


def fold_threads_for_runner(configured: int, *, env: Mapping[str, str] | None = None,
                            torch_default: int, quota: CpuQuota | None = None) -> int:
    """Threads a fold stub sets: its config parameter, else the launcher's budget, else nnU-Net's count.

    ``configured`` is the model's ``torch_num_threads`` (0 = follow the budget). Without a launcher
    (a user's own ``tritonserver``), torch's default is still capped at the available CPUs.

    Raises:
        ThreadBudgetError: ``configured`` or the budget asks for more threads than available CPUs.
    """
    env = os.environ if env is None else env
    quota = quota or available_cpus()
    if configured < 0:
        raise ThreadBudgetError(f"torch_num_threads must be >= 0, got {configured}.")
    if configured:
        if configured > quota.cpus:
            raise ThreadBudgetError(
                f"torch_num_threads={configured} asks for more threads than the {quota.cpus} CPU(s) "
                f"available ({quota.source})."
            )
        return configured
    if FOLD_THREADS_ENV in env:
        threads = _positive_int(FOLD_THREADS_ENV, env[FOLD_THREADS_ENV])
        if threads > quota.cpus:
            raise ThreadBudgetError(
                f"{FOLD_THREADS_ENV}={threads} asks for more threads than the {quota.cpus} CPU(s) "
                f"available ({quota.source})."
            )
        return threads
    return max(1, min(torch_default, quota.cpus))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nnunet_triton.thread_budget",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("show", "print the budget as JSON"),
                       ("exec", "set the budget's environment and exec the server command")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--model-repository", required=True, type=Path)
        if name == "exec":
            cmd.add_argument("server_command", nargs=argparse.REMAINDER, help="-- tritonserver ...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        budget = plan_budget(repository_fold_instances(args.model_repository))
    except ThreadBudgetError as exc:
        sys.stderr.write(f"thread budget: {exc}\n")
        return 2
    if args.command == "show":
        sys.stdout.write(json.dumps(budget.to_dict(), indent=2, sort_keys=True) + "\n")
        return 0
    command = list(args.server_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.stderr.write("thread budget: no server command after --\n")
        return 2
    sys.stderr.write(f"thread budget: {json.dumps(budget.to_dict(), sort_keys=True)}\n")
    os.execvpe(command[0], command, {**os.environ, **budget.environment()})
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
