"""How many CPU threads each fold model uses, and how many fold models compute at once, decided where
the server runs so that the folds never use more threads than there are cores, and never other bits than
nnU-Net's.

Two fold models with torch's default thread count (one per core) plus the Python models, all on the
same cores, spin-wait against each other: OpenMP's default ``OMP_WAIT_POLICY`` keeps idle workers
busy-polling after every parallel region, so each process steals the cores the others compute on.
Measured on the 2-core fixture (2 folds, mirroring on): 14.5 s per request without a budget, 7.1 s
with ``OMP_WAIT_POLICY=PASSIVE`` (nnUNetPredictor 8.3 s).

Every launcher of this project (the embedded server, ``make serve|deploy|demo``, the container
entry point for docker and Kubernetes) starts the server through :func:`decide_budget`: its
:meth:`ThreadBudget.environment` goes into the server's environment (inherited by every stub) and its
:meth:`ThreadBudget.rate_limits` into the server's ``server_config.TritonServerConfig``
(:meth:`ThreadBudget.applied_to`, a ``dataclasses.replace``), whose ``to_args`` renders the command once.

* CPUs really available: the process's affinity mask, capped by the cgroup CPU quota (``cpu.max`` of
  cgroup v2, ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` of v1; a container started with ``--cpus 4``
  or a pod with ``limits.cpu: 4`` sees 4 even on a 64-core host, where torch would start 64 threads
  per fold), never ``os.cpu_count()``.
* Fold instances: every fold instance of the repository, Python runner or libtorch on CPU (the
  orchestrator sends each tile batch to all folds concurrently), and their largest input (channels x
  patch voxels). libtorch folds run inside tritonserver: their threads come from ``OMP_NUM_THREADS`` of
  the server process, their executions hold fold slots like the Python runner's, and the check loads
  their model.pt with the same libtorch (the backend is built against this environment's torch).
* nnU-Net's thread count R (``server.exactness.nnunet_threads``): what ``nnUNetPredictor`` sets for its
  forwards, ``min($nnUNet_def_n_proc or 8, torch's default)``, probed in a fresh process.
* Threads per fold execution T and fold executions at once S (Triton's rate limiter: each fold
  execution holds one ``nnunet_fold_slot``; the server gets S of them), T x S <= CPUs unless only
  nnU-Net's own count is exact:

  - ``exact``: T = R (capped at the CPUs when that cap is proven exact), S = CPUs // T. Logits
    bit-identical to nnUNetPredictor on any network. Best where one forward is long enough to scale over
    threads (measured, default-plans 3d_fullres, 5 folds, 2 CPUs: 46.5 s per request vs 51.5 s with
    ``split``; nnUNetPredictor 47-57 s in the same day's runs).
  - ``split``: T = max(1, CPUs // fold instances), S = min(fold instances, CPUs // T): the folds
    compute side by side. Best for small networks, whose short parallel regions scale badly (measured
    on the fixture: 5.9 s vs 7.4 s with ``exact``; 0.16 vs 0.13 requests/s at concurrency 4). Whether
    its logits are nnU-Net's depends on the CPU: identical on an AMD EPYC (AVX2) for every committed
    fixture, different on an Intel Xeon with AVX-512/AMX (1 vs 2 threads: 1.3e-5).
  - ``auto`` (default): ``exact`` when the largest fold input has at least ``AUTO_EXACT_VOXELS``
    (2^18) values, else ``split`` -- kept only where the check proves it bitwise equal.
* **The check** (``server.exactness.check_threads``): whenever T differs from R, one tile of every fold
  network runs at T and at R in child processes started like the stubs; ``auto`` and ``exact`` keep T
  only when every output is bitwise equal and otherwise fall back to T = R. A ``split`` policy or a
  thread count the user set explicitly is kept, with a warning when it is not exact on this CPU.
  The verdict is in ``ThreadBudget.exactness`` (logged, in the server's state file, ``show``).
* ``OMP_WAIT_POLICY=PASSIVE`` for every process of the server (idle OpenMP workers sleep).

Overrides, each read from the server's environment and recorded: ``NNUNET_TRITON_THREAD_POLICY``
(auto|exact|split), ``NNUNET_TRITON_FOLD_THREADS`` (1..CPUs), ``NNUNET_TRITON_FOLD_SLOTS`` (slots x
threads at most the CPUs), ``OMP_WAIT_POLICY`` (PASSIVE|ACTIVE). A fold model's own
``torch_num_threads`` config parameter (build option ``torch_threads``), when not 0, wins (and is
checked, with a warning when not exact). A value that cannot be honoured is refused at start with
:class:`ThreadBudgetError` naming the setting and the value.

Command line (container entry point; Python 3.10 like the image's stub)::

    python3 -m nnunet_triton.server.thread_budget exec --model-repository /models --server-config JSON
    python3 -m nnunet_triton.server.thread_budget exec --model-repository /models -- tritonserver ...
    python3 -m nnunet_triton.server.thread_budget show --model-repository build/model_repository

``exec`` takes the server as a serialised ``TritonServerConfig`` (``--server-config``: the JSON of its
``to_dict``, what the container entry point hands on after reading its command once) or as a command line
(read by ``server_config.from_args``, the one parser); it applies the budget and, with ``--watchdog``, the
restricted APIs (``watchdog.fork_for_exec``) to that config and execs what ``to_args`` renders.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from nnunet_triton.errors import ThreadBudgetError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.io_names import FOLD_SLOT_RESOURCE, VERSION_DIR
from nnunet_triton.parameters import PARAM_TORCH_NUM_THREADS, FoldRunnerParameters
from nnunet_triton.pipeline.threads import (
    BUDGET_ENV,
    FOLD_THREADS_ENV,
    CpuQuota,
    available_cpus,
    checked_threads,
    positive_int,
)
from nnunet_triton.repository import ModelRepository
from nnunet_triton.server.exactness import (
    FoldNetwork,
    Reference,
    ThreadCheck,
    check_threads,
    reference_run,
)
from nnunet_triton.server.server_config import TritonServerConfig, from_args, rate_limit_args

if TYPE_CHECKING:
    from nnunet_triton.repository.config import ModelConfigInfo

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
    "decide_budget",
    "main",
]

POLICY_ENV = "NNUNET_TRITON_THREAD_POLICY"
FOLD_SLOTS_ENV = "NNUNET_TRITON_FOLD_SLOTS"
_WAIT_ENV = "OMP_WAIT_POLICY"
LOGGER = logging.getLogger(__name__)
# torch's intra-op pool (OpenMP) of the tritonserver process, where the PyTorch backend runs
_OMP_THREADS_ENV = "OMP_NUM_THREADS"


class ThreadPolicy(str, Enum):  # noqa: UP042 - StrEnum is 3.11, the image stub runs 3.10
    AUTO = "auto"
    EXACT = "exact"
    SPLIT = "split"


AUTO_EXACT_VOXELS = 2**18  # auto: exact from this many input values per fold forward (C x patch voxels)


@dataclass(frozen=True)
class FoldModels:
    """The fold models of a repository (Python runner and libtorch), as the launcher sees them."""

    instances: int  # fold instances that can compute at once
    largest_input: int  # values of the largest per-sample fold input (C x patch voxels); 0 if unknown
    networks: tuple[FoldNetwork, ...] = ()  # the CPU ones with their TorchScript file, for the check
    libtorch: bool = False  # CPU fold models on Triton's PyTorch backend (threads of the server process)


def _cpu_dims(config: ModelConfigInfo) -> tuple[int, ...] | None:
    """The first input's dims of a CPU model with a fixed shape; None for a GPU forward (threads do not
    change it) or a variable shape (no tile to run)."""
    dims = config.first_input_dims
    if config.on_gpu or not dims or min(dims) <= 0:
        return None
    return dims


def _network(folder: Path, config: ModelConfigInfo) -> FoldNetwork | None:
    dims = _cpu_dims(config)
    if dims is None:
        return None
    try:
        params = FoldRunnerParameters.from_parameters(dict(config.parameters))
    except ValueError:
        return None  # the stub refuses it when it loads, naming the parameter
    return FoldNetwork(model=config.name, path=str(folder / VERSION_DIR / params.model_filename),
                       sample_shape=dims, per_sample_forward=params.per_sample_forward,
                       configured_threads=params.torch_num_threads)


def _libtorch_network(folder: Path, config: ModelConfigInfo) -> FoldNetwork | None:
    """A CPU libtorch fold as the check runs it: the same model.pt through the same libtorch library (the
    backend is built against this environment's torch) with torch.jit.load, one tile per forward when its
    ``max_batch_size`` is 1 (the exact default), otherwise the whole batch in one forward."""
    dims = _cpu_dims(config)
    if dims is None:
        return None
    return FoldNetwork(model=config.name,
                       path=str(folder / VERSION_DIR / (config.default_model_filename or "model.pt")),
                       sample_shape=dims, per_sample_forward=config.max_batch_size == 1,
                       configured_threads=int(config.parameters.get("INTRA_OP_THREAD_COUNT", "0") or 0))


def repository_folds(repository: str | Path) -> FoldModels:
    """Fold-model instances in a repository (Python runner and libtorch), their largest input and their CPU
    networks (a config that cannot be read is skipped with a warning: Triton refuses that model itself)."""
    repository = ModelRepository(repository)
    total, largest, networks, libtorch = 0, 0, [], False
    for model, config in repository.readable_configs("thread budget"):
        # a Python fold runner's config (model_specs.python_fold_spec), a libtorch fold's (libtorch_fold_spec)
        on_libtorch = config.platform == "pytorch_libtorch"
        if PARAM_TORCH_NUM_THREADS not in config.parameters and not on_libtorch:
            continue
        libtorch = libtorch or (on_libtorch and not config.on_gpu)
        total += config.instance_count
        dims = config.first_input_dims
        if dims and min(dims) > 0:
            largest = max(largest, math.prod(dims))
        folder = repository.model_folder(model)
        network = _libtorch_network(folder, config) if on_libtorch else _network(folder, config)
        if network is not None:
            networks.append(network)
    return FoldModels(total, largest, tuple(networks), libtorch)


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
    nnunet_threads: int | None = None  # nnU-Net's count here (None: not probed, no torch)
    exact: bool | None = None  # fold logits proven bitwise nnU-Net's on this machine (None: not checked)
    exactness: str = "not checked"  # how ``exact`` was decided
    libtorch_folds: bool = False  # CPU libtorch folds: their threads are the server process's OpenMP pool

    def rate_limits(self) -> tuple[tuple[str, int], ...]:
        """Rate-limiter resources that enforce ``fold_slots`` (each fold execution holds one slot)."""
        return () if self.fold_slots >= self.fold_instances else ((FOLD_SLOT_RESOURCE, self.fold_slots),)

    def server_args(self) -> list[str]:
        """tritonserver flags of :meth:`rate_limits` (``server.server_config`` renders them)."""
        return rate_limit_args(self.rate_limits())

    def applied_to(self, server: TritonServerConfig) -> TritonServerConfig:
        """``server`` with this budget's :meth:`rate_limits` (unchanged when it needs none)."""
        return server.with_rate_limits(self.rate_limits())

    def environment(self) -> dict[str, str]:
        """Variables for the server process (inherited by every Python-backend stub)."""
        env = {_WAIT_ENV: self.omp_wait_policy, POLICY_ENV: self.policy.value,
               BUDGET_ENV: json.dumps(self.to_dict(), sort_keys=True)}
        if self.fold_threads is not None:
            env[FOLD_THREADS_ENV] = str(self.fold_threads)
            if self.libtorch_folds:
                # the PyTorch backend runs inside tritonserver, whose libtorch sizes its intra-op pool from
                # OMP_NUM_THREADS (a config's INTRA_OP_THREAD_COUNT is fixed at build time; the budget is
                # decided where the server runs); the Python stubs set their own count from the budget
                env[_OMP_THREADS_ENV] = str(self.fold_threads)
        return env

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["policy"] = self.policy.value
        return data


def _policy(text: str) -> ThreadPolicy:
    try:
        return ThreadPolicy(text.strip().lower())
    except ValueError:
        choices = ", ".join(p.value for p in ThreadPolicy)
        raise ThreadBudgetError(f"{POLICY_ENV} must be one of {choices}, got {text!r}.") from None


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
        threads = checked_threads(FOLD_THREADS_ENV, env[FOLD_THREADS_ENV], quota)
        why, assumed = f"{FOLD_THREADS_ENV} set by the user", threads
    elif policy is ThreadPolicy.SPLIT:
        threads = assumed = max(1, quota.cpus // count)
    else:  # exact: each stub keeps nnU-Net's count (torch's default), at most the CPUs
        threads, assumed = None, quota.cpus
    slots = min(count, max(1, quota.cpus // assumed))
    if FOLD_SLOTS_ENV in env:
        slots = positive_int(FOLD_SLOTS_ENV, env[FOLD_SLOTS_ENV])
        if slots * assumed > quota.cpus:
            raise ThreadBudgetError(
                f"{FOLD_SLOTS_ENV}={slots} fold executions x {assumed} thread(s) asks for more threads than "
                f"the {quota.cpus} CPU(s) available ({quota.source}).")
    per_fold = f"{threads} thread(s)" if threads is not None else f"nnU-Net's thread count (<= {quota.cpus})"
    reason = (f"{why}: {quota.cpus} CPU(s), {count} fold instance(s), {per_fold} per fold execution, "
              f"{slots} fold execution(s) at once")
    return ThreadBudget(policy=policy, cpus=quota.cpus, cpu_source=quota.source, fold_instances=count,
                        fold_threads=threads, omp_wait_policy=wait, reason=reason, overrides=overrides,
                        fold_slots=slots, libtorch_folds=folds.libtorch)


def _check_networks(reference: Reference, threads: int, env: Mapping[str, str],
                    check: Callable[..., ThreadCheck]) -> tuple[ThreadCheck | None, list[str]]:
    """The check of the networks that follow the budget at ``threads`` (None when that is nnU-Net's own
    count), and warnings for networks whose own ``torch_num_threads`` is not exact."""
    following = [n for n in reference.networks if not n.configured_threads]
    outcome = (check(reference, threads, networks=following, env=env)
               if following and threads != reference.threads else None)
    warnings = []
    for count in sorted({n.configured_threads for n in reference.networks} - {0, reference.threads}):
        own = check(reference, count, env=env,
                    networks=[n for n in reference.networks if n.configured_threads == count])
        if not own.identical:
            warnings.append(f"torch_num_threads={count} of {', '.join(own.networks)} is not exact on this "
                            f"CPU: {own.summary()}")
    return outcome, warnings


def _at_threads(budget: ThreadBudget, threads: int, reference: int, env: Mapping[str, str], *,
                exact: bool | None, exactness: str, reason: str | None = None) -> ThreadBudget:
    """``budget`` at ``threads`` per fold execution, with as many fold executions at once as fit."""
    slots = min(budget.fold_instances, max(1, budget.cpus // threads))
    if FOLD_SLOTS_ENV in env:
        slots = min(slots, positive_int(FOLD_SLOTS_ENV, env[FOLD_SLOTS_ENV]))
    if reason is None:
        reason = (f"{exactness}: nnU-Net's {threads} thread(s) per fold execution, {slots} fold "
                  f"execution(s) at once ({budget.cpus} CPU(s), {budget.fold_instances} fold instance(s))")
    return replace(budget, policy=ThreadPolicy.EXACT if threads == reference else budget.policy,
                   fold_threads=threads, fold_slots=slots, reason=reason, nnunet_threads=reference,
                   exact=exact, exactness=exactness)


def _child_env(budget: ThreadBudget, env: Mapping[str, str]) -> dict[str, str]:
    """The check's environment: the server's, without the budget's thread count (the reference run reads
    nnU-Net's count from torch's default; the budget's OMP_NUM_THREADS for libtorch folds would make it T)."""
    child_env = {**env, **budget.environment()}
    child_env.pop(FOLD_THREADS_ENV, None)
    if _OMP_THREADS_ENV not in env:
        child_env.pop(_OMP_THREADS_ENV, None)
    return child_env


def decide_budget(folds: FoldModels, *, env: Mapping[str, str] | None = None, quota: CpuQuota | None = None,
                  run_reference: Callable[..., Reference] = reference_run,
                  check: Callable[..., ThreadCheck] = check_threads) -> ThreadBudget:
    """:func:`plan_budget`, then keep its thread count only where it gives nnU-Net's bits here.

    ``auto`` and ``exact`` fall back to nnU-Net's own count R when the check finds a difference or
    cannot run; a ``split`` policy or ``NNUNET_TRITON_FOLD_THREADS`` the user set is kept, with a
    warning when it is not exact. ``run_reference``/``check`` are ``server.exactness``'s (tests pass
    others).

    Raises:
        ThreadBudgetError: as :func:`plan_budget`.
    """
    env = os.environ if env is None else env
    quota = quota or available_cpus()
    budget = plan_budget(folds, env=env, quota=quota)
    if not folds.networks:
        return replace(budget, exactness="no CPU fold network in the repository")
    explicit = FOLD_THREADS_ENV in env or (budget.policy is ThreadPolicy.SPLIT and POLICY_ENV in env)
    child_env = _child_env(budget, env)
    try:
        ran = run_reference(folds.networks, env=child_env)
    except (RuntimeError, OSError, ValueError) as exc:
        why = f"the fold networks could not be run at nnU-Net's thread count ({exc})"
        LOGGER.warning("thread budget: %s; fold logits are not proven exact", why)
        if explicit or budget.policy is ThreadPolicy.EXACT:
            return replace(budget, exactness=why)
        return replace(budget, policy=ThreadPolicy.EXACT, fold_threads=None, fold_slots=1, exactness=why,
                       reason=f"{why}; so the stubs keep nnU-Net's count, 1 fold execution at once")
    reference = ran.threads
    threads = budget.fold_threads if budget.fold_threads is not None else min(reference, quota.cpus)
    try:
        outcome, warnings = _check_networks(ran, threads, child_env, check)
    except (RuntimeError, OSError, ValueError) as exc:
        why = f"{threads} thread(s) not proven exact: the check could not run ({exc})"
        LOGGER.warning("thread budget: %s", why)
        if explicit:
            return replace(budget, fold_threads=threads, nnunet_threads=reference, exactness=why)
        return _at_threads(budget, reference, reference, env, exact=True, exactness=why)
    for warning in warnings:
        LOGGER.warning("thread budget: %s", warning)
    notes = "".join(f"; {w}" for w in warnings)
    if outcome is None:  # the budget's count is nnU-Net's own
        if explicit:
            return replace(budget, nnunet_threads=reference, exact=True,
                           exactness=f"{threads} thread(s) = nnU-Net's own count{notes}")
        return _at_threads(budget, threads, reference, env, exact=True,
                           exactness=f"{threads} thread(s) = nnU-Net's own count{notes}")
    summary = outcome.summary() + notes
    if outcome.identical:
        if budget.policy is ThreadPolicy.EXACT and not explicit:  # nnU-Net's count capped at the CPUs
            return _at_threads(budget, threads, reference, env, exact=True, exactness=summary,
                               reason=f"{budget.reason}; {summary}")
        return replace(budget, nnunet_threads=reference, exact=True, exactness=summary,
                       reason=f"{budget.reason}; {summary}")
    if explicit:
        LOGGER.warning("thread budget: %d thread(s) set by the user are NOT exact on this CPU (%s): fold "
                       "logits differ from nnUNetPredictor's; unset the override for nnU-Net's bits",
                       threads, outcome.summary())
        return replace(budget, nnunet_threads=reference, exact=False, exactness=summary,
                       reason=f"{budget.reason}; {summary}")
    LOGGER.info("thread budget: %s", summary)
    return _at_threads(budget, reference, reference, env, exact=True,
                       exactness=f"{budget.policy.value} candidate {summary}")


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
            cmd.add_argument("--preload", type=Path, default=None,
                             help="with --watchdog, required: server.preload's library (the token goes to "
                                  "tritonserver through it, never on its command line)")
            cmd.add_argument("--proxy-config", type=Path, default=None,
                             help="with --watchdog: the TLS proxy's nginx.conf, started and kept running "
                                  "by the watchdog")
            cmd.add_argument("--server-config", default=None, metavar="JSON",
                             help="the server: a serialised server_config.TritonServerConfig (its to_dict), "
                                  "instead of a command after --")
            cmd.add_argument("server_command", nargs=argparse.REMAINDER, help="-- tritonserver ...")
    return parser


def _server(args: argparse.Namespace) -> TritonServerConfig:
    """The server to exec: ``--server-config`` or the command after ``--`` (ValueError naming the problem)."""
    command = list(args.server_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if (args.server_config is None) == (not command):
        raise ValueError("give the server either as --server-config JSON or as a command after --, "
                         "exactly one")
    if command:
        return from_args(command)
    try:
        return TritonServerConfig.from_dict(json.loads(args.server_config))
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--server-config is not a serialised TritonServerConfig: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="thread budget: %(message)s", stream=sys.stderr)
    try:
        budget = decide_budget(repository_folds(args.model_repository))
    except ThreadBudgetError as exc:
        sys.stderr.write(f"thread budget: {exc}\n")
        return ExitCode.USAGE
    if args.command == "show":
        sys.stdout.write(json.dumps(budget.to_dict(), indent=2, sort_keys=True) + "\n")
        return ExitCode.OK
    try:
        server = budget.applied_to(_server(args))
    except ValueError as exc:
        sys.stderr.write(f"thread budget: {exc}\n")
        return ExitCode.USAGE
    sys.stderr.write(f"thread budget: {json.dumps(budget.to_dict(), sort_keys=True)}\n")
    environment = {**os.environ, **budget.environment()}
    if args.watchdog:
        from nnunet_triton.server.watchdog import fork_for_exec

        try:
            server, added = fork_for_exec(server, args.model_repository, preload=args.preload,
                                          proxy_config=args.proxy_config)
        except ValueError as exc:
            sys.stderr.write(f"thread budget: {exc}\n")
            return ExitCode.USAGE
        environment.update(added)
    elif args.proxy_config is not None:
        sys.stderr.write("thread budget: --proxy-config needs --watchdog (it keeps the proxy running)\n")
        return ExitCode.USAGE
    command = server.to_args()  # rendered once, budget and restricted APIs included
    os.execvpe(command[0], command, environment)
    return ExitCode.OK  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
