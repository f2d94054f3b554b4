"""How many CPU threads each fold model uses, and how many fold models compute at once, decided where
the server runs so that the folds never use more threads than there are cores.

Two fold models with torch's default thread count (one per core) plus the Python models, all on the
same cores, spin-wait against each other: OpenMP's default ``OMP_WAIT_POLICY`` keeps idle workers
busy-polling after every parallel region, so each process steals the cores the others compute on.
Measured on the 2-core fixture (2 folds, mirroring on): 14.5 s per request without a budget, 7.1 s
with ``OMP_WAIT_POLICY=PASSIVE`` (nnUNetPredictor 8.3 s).

Every launcher of this project (the embedded server, ``make serve|deploy|demo``, the container
entry point for docker and Kubernetes) starts the server through :func:`plan_budget`: its
:meth:`ThreadBudget.environment` goes into the server's environment (inherited by every stub) and its
:meth:`ThreadBudget.server_args` onto the command line.

* CPUs really available: the process's affinity mask, capped by the cgroup CPU quota (``cpu.max`` of
  cgroup v2, ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` of v1; a container started with ``--cpus 4``
  or a pod with ``limits.cpu: 4`` sees 4 even on a 64-core host, where torch would start 64 threads
  per fold), never ``os.cpu_count()``.
* Fold instances: every Python fold-runner instance of the repository (the orchestrator sends each
  tile batch to all folds concurrently) and their largest input (channels x patch voxels).
* Threads per fold execution T and fold executions at once S (Triton's rate limiter: each fold
  execution holds one ``nnunet_fold_slot``; the server gets S of them), always T x S <= CPUs:

  - ``exact``: T = nnU-Net's own count (torch's default, capped at the CPUs: the stubs keep it), S = 1
    when T fills the CPUs. Logits bit-identical to nnUNetPredictor on any network. Best where one
    forward is long enough to scale over threads (measured, default-plans 3d_fullres, 5 folds, 2 CPUs:
    46.5 s per request vs 51.5 s with ``split``; nnUNetPredictor 47-57 s in the same day's runs).
  - ``split``: T = max(1, CPUs // fold instances), S = min(fold instances, CPUs // T): the folds
    compute side by side. Best for small networks, whose short parallel regions scale badly (measured
    on the fixture: 5.9 s vs 7.4 s with ``exact``; 0.16 vs 0.13 requests/s at concurrency 4). Logits
    bit-identical to nnUNetPredictor on every committed fixture (the parity tests run under it); on
    the default 3d_fullres network 1 instead of 2 threads moves logits by up to 1.2e-6 (oneDNN).
  - ``auto`` (default): ``exact`` when the largest fold input has at least ``AUTO_EXACT_VOXELS``
    (2^18) values, else ``split``. The threshold lies between the two measured networks (24,576 and
    2,293,760 values); nothing between them was measured.
* ``OMP_WAIT_POLICY=PASSIVE`` for every process of the server (idle OpenMP workers sleep).

Overrides, each read from the server's environment and recorded: ``NNUNET_TRITON_THREAD_POLICY``
(auto|exact|split), ``NNUNET_TRITON_FOLD_THREADS`` (1..CPUs), ``NNUNET_TRITON_FOLD_SLOTS`` (slots x
threads at most the CPUs), ``OMP_WAIT_POLICY`` (PASSIVE|ACTIVE). A fold model's own
``torch_num_threads`` config parameter (build option ``torch_threads``), when not 0, wins. A value that
cannot be honoured is refused at start with :class:`ThreadBudgetError` naming the setting and the value.

Command line (container entry point; Python 3.10 like the image's stub)::

    python3 -m nnunet_triton.server.thread_budget exec --model-repository /models -- tritonserver ...
    python3 -m nnunet_triton.server.thread_budget show --model-repository build/model_repository
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
from nnunet_triton.io_names import FOLD_SLOT_RESOURCE
from nnunet_triton.options import parse_int
from nnunet_triton.parameters import PARAM_TORCH_NUM_THREADS

__all__ = [
    "POLICY_ENV",
    "FOLD_THREADS_ENV",
    "FOLD_SLOTS_ENV",
    "BUDGET_ENV",
    "ThreadPolicy",
    "CpuQuota",
    "ThreadBudget",
    "available_cpus",
    "AUTO_EXACT_VOXELS",
    "FoldModels",
    "repository_folds",
    "plan_budget",
    "fold_threads_for_runner",
    "main",
]

POLICY_ENV = "NNUNET_TRITON_THREAD_POLICY"
FOLD_THREADS_ENV = "NNUNET_TRITON_FOLD_THREADS"
FOLD_SLOTS_ENV = "NNUNET_TRITON_FOLD_SLOTS"
BUDGET_ENV = "NNUNET_TRITON_THREAD_BUDGET"  # the whole plan as JSON, for logs and the fold stubs
_WAIT_ENV = "OMP_WAIT_POLICY"
# a Python fold runner's config (model_specs.python_fold_spec)
_FOLD_MARKER = f'key: "{PARAM_TORCH_NUM_THREADS}"'
_INSTANCE_COUNT = re.compile(r"instance_group\s*\{[^}]*?count:\s*(\d+)", re.S)
_INPUT_DIMS = re.compile(r"^input\s*\{(.*?)^\}", re.S | re.M)


class ThreadPolicy(str, Enum):  # noqa: UP042 - StrEnum is 3.11, the image stub runs 3.10
    AUTO = "auto"
    EXACT = "exact"
    SPLIT = "split"


AUTO_EXACT_VOXELS = 2**18  # auto: exact from this many input values per fold forward (C x patch voxels)


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


@dataclass(frozen=True)
class FoldModels:
    """The Python fold-runner models of a repository, as the launcher sees them."""

    instances: int  # fold instances that can compute at once
    largest_input: int  # values of the largest per-sample fold input (C x patch voxels); 0 if unknown


def repository_folds(model_repository: str | Path) -> FoldModels:
    """Python fold-runner instances in a repository and their largest input."""
    total, largest = 0, 0
    for config in sorted(Path(model_repository).glob("*/config.pbtxt")):
        text = config.read_text()
        if _FOLD_MARKER not in text:
            continue
        counts = _INSTANCE_COUNT.findall(text)
        total += sum(int(c) for c in counts) if counts else 1
        block = _INPUT_DIMS.search(text)
        if block:
            dims = [int(d) for d in re.findall(r"dims:\s*(-?\d+)", block.group(1))]
            if dims and min(dims) > 0:
                largest = max(largest, math.prod(dims))
    return FoldModels(total, largest)


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
    fold_slots: int = 1  # fold executions at once (Triton's rate limiter)

    def server_args(self) -> list[str]:
        """tritonserver flags that enforce ``fold_slots`` (each fold execution holds one slot)."""
        if self.fold_slots >= self.fold_instances:
            return []
        return ["--rate-limit=execution_count",
                f"--rate-limit-resource={FOLD_SLOT_RESOURCE}:{self.fold_slots}"]

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
    return parse_int(name, text, minimum=1, label=name, error=ThreadBudgetError)


def _policy(text: str) -> ThreadPolicy:
    try:
        return ThreadPolicy(text.strip().lower())
    except ValueError:
        choices = ", ".join(p.value for p in ThreadPolicy)
        raise ThreadBudgetError(f"{POLICY_ENV} must be one of {choices}, got {text!r}.") from None


def _checked_threads(name: str, text: str, quota: CpuQuota) -> int:
    threads = _positive_int(name, text)
    if threads > quota.cpus:
        raise ThreadBudgetError(f"{name}={threads} asks for more threads than the {quota.cpus} CPU(s) "
                                f"available ({quota.source}).")
    return threads


def _resolve_policy(policy: ThreadPolicy, folds: FoldModels) -> tuple[ThreadPolicy, str]:
    if policy is not ThreadPolicy.AUTO:
        return policy, f"policy {policy.value}"
    if folds.largest_input >= AUTO_EXACT_VOXELS:
        return ThreadPolicy.EXACT, (f"auto: fold input of {folds.largest_input} values >= "
                                    f"{AUTO_EXACT_VOXELS} (long forwards scale over threads)")
    return ThreadPolicy.SPLIT, (f"auto: fold input of {folds.largest_input} values < {AUTO_EXACT_VOXELS} "
                                "(short forwards run best side by side)")


def plan_budget(folds: FoldModels | int, *, env: Mapping[str, str] | None = None,
                quota: CpuQuota | None = None) -> ThreadBudget:
    """The budget for a repository's fold models (or a bare count of fold instances) under ``env``.

    Raises:
        ThreadBudgetError: a malformed override, or more fold threads than available CPUs.
    """
    env = os.environ if env is None else env
    quota = quota or available_cpus()
    folds = folds if isinstance(folds, FoldModels) else FoldModels(int(folds), 0)
    count = max(1, folds.instances)
    overrides = {k: env[k] for k in (POLICY_ENV, FOLD_THREADS_ENV, FOLD_SLOTS_ENV, _WAIT_ENV) if k in env}
    wait = env.get(_WAIT_ENV, "PASSIVE").strip().upper()
    if wait not in ("PASSIVE", "ACTIVE"):
        raise ThreadBudgetError(f"{_WAIT_ENV} must be PASSIVE or ACTIVE, got {env[_WAIT_ENV]!r}.")
    policy, why = _resolve_policy(_policy(env.get(POLICY_ENV, ThreadPolicy.AUTO.value)), folds)
    threads: int | None
    if FOLD_THREADS_ENV in env:
        threads = _checked_threads(FOLD_THREADS_ENV, env[FOLD_THREADS_ENV], quota)
        why, assumed = f"{FOLD_THREADS_ENV} set by the user", threads
    elif policy is ThreadPolicy.SPLIT:
        threads = assumed = max(1, quota.cpus // count)
    else:  # exact: each stub keeps nnU-Net's count (torch's default), at most the CPUs
        threads, assumed = None, quota.cpus
    slots = min(count, max(1, quota.cpus // assumed))
    if FOLD_SLOTS_ENV in env:
        slots = _positive_int(FOLD_SLOTS_ENV, env[FOLD_SLOTS_ENV])
        if slots * assumed > quota.cpus:
            raise ThreadBudgetError(
                f"{FOLD_SLOTS_ENV}={slots} fold executions x {assumed} thread(s) asks for more threads than "
                f"the {quota.cpus} CPU(s) available ({quota.source}).")
    per_fold = f"{threads} thread(s)" if threads is not None else f"nnU-Net's thread count (<= {quota.cpus})"
    reason = (f"{why}: {quota.cpus} CPU(s), {count} fold instance(s), {per_fold} per fold execution, "
              f"{slots} fold execution(s) at once")
    return ThreadBudget(policy=policy, cpus=quota.cpus, cpu_source=quota.source, fold_instances=count,
                        fold_threads=threads, omp_wait_policy=wait, reason=reason, overrides=overrides,
                        fold_slots=slots)


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
        return _checked_threads("torch_num_threads", str(configured), quota)
    if FOLD_THREADS_ENV in env:
        return _checked_threads(FOLD_THREADS_ENV, env[FOLD_THREADS_ENV], quota)
    return max(1, min(torch_default, quota.cpus))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nnunet_triton.server.thread_budget",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("show", "print the budget as JSON"),
                       ("exec", "set the budget's environment and exec the server command")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--model-repository", required=True, type=Path)
        if name == "exec":
            cmd.add_argument("--watchdog", action="store_true",
                             help="fork server.watchdog first: it reloads a model whose process dies "
                                  "(the server must run with --model-control-mode=explicit)")
            cmd.add_argument("server_command", nargs=argparse.REMAINDER, help="-- tritonserver ...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        budget = plan_budget(repository_folds(args.model_repository))
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
    command += budget.server_args()
    if args.watchdog:
        from nnunet_triton.server.watchdog import fork_for_exec

        command = fork_for_exec(command, args.model_repository)
    os.execvpe(command[0], command, {**os.environ, **budget.environment()})
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
