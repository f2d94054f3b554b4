"""Shared memory that comes back: re-create a model whose Python stub's region grew, once the model is idle.

Every instance of a Python-backend model (``preprocess_model``, ``orchestrator_model``, ``stitch_model`` of
every endpoint and version) passes its tensors to and from tritonserver through one ``/dev/shm`` region
(``triton_python_backend_shm_region_*``, Boost.Interprocess). python_backend creates it at
``shm-default-byte-size`` and grows it by multiples of ``shm-growth-byte-size`` whenever a tensor does not
fit (``SharedMemoryManager::GrowIfNeeded``: ``ftruncate`` up, the old mappings kept); nothing shrinks it.
Triton copies a request's inputs into the region before the model's ``execute`` sees them, so one large
request, even one the model then refuses, leaves the region (tmpfs pages mapped by tritonserver and the
stub) at that size for the life of the instance. The region goes with its instance: the server side removes
it when the instance is destroyed.

:class:`ShmReclaimer` gives that memory back (the watchdog calls :meth:`ShmReclaimer.check` on every tick
with the stubs it scanned, in the embedded server and in containers alike):

* a stub whose region is larger than its own default (its argv) by more than ``policy.above_bytes`` marks
  its model grown;
* the model is idle once, for ``policy.idle_s``, the Triton statistics of every model of the server
  (inference, execution, success and failure counts; the restricted statistics API with the watchdog's
  token) stayed the same and the model's own stubs used at most :data:`BUSY_CPU_SHARE` of a core. Triton
  2.51 counts a request only once it is done and has no gauge of requests in flight; the two together
  see one: a request anywhere in a pipeline moves the fold models' counts tile batch by tile batch, and a
  long single step (resampling a large image) burns its stub's CPU;
* a grown, idle model is loaded again with the configuration Triton serves it with plus the parameter
  :data:`RELOAD_PARAMETER` (a counter). A configuration change re-creates the model: Triton loads new
  instances (fresh stubs, fresh regions of the default size) while the old ones keep serving, swaps them
  in, and destroys the old ones once their requests are done, which removes the grown regions. A request
  that arrives meanwhile is served by one or the other; a failed load leaves the old model serving and is
  retried with backoff (1, 2, 4 ... 30 s);
* every reclaim is logged and returned as a :class:`Reclaim`, which the watchdog appends to its events file
  (``{"event": "shm_reclaim", ...}``; ``nnunet-triton status`` counts them).

The configuration (environment, so a container entry point and the embedded launcher pass it alike):
``NNUNET_TRITON_SHM_RECLAIM_MIB`` (growth beyond the default that triggers a reclaim, default
:data:`DEFAULT_ABOVE_MIB`; 0 switches reclaiming off) and ``NNUNET_TRITON_SHM_RECLAIM_IDLE_S`` (default
:data:`DEFAULT_IDLE_S`). Only the standard library (the watchdog runs it in containers).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.errors import ServerError
from nnunet_triton.server.health import StubProcess
from nnunet_triton.server.model_control import ModelControl
from nnunet_triton.util.retry import RetryPolicy

__all__ = ["ABOVE_ENV", "IDLE_ENV", "RELOAD_PARAMETER", "Reclaim", "ReclaimPolicy", "ShmReclaimer",
           "region_bytes"]

LOGGER = logging.getLogger("nnunet_triton.server.shm_reclaim")
MiB = 2**20
ABOVE_ENV = "NNUNET_TRITON_SHM_RECLAIM_MIB"
IDLE_ENV = "NNUNET_TRITON_SHM_RECLAIM_IDLE_S"
DEFAULT_ABOVE_MIB = 256
DEFAULT_IDLE_S = 30.0  # the series of one study arrive seconds apart: one instance serves them
# the model-config parameter a reclaim changes (our models ignore it): a changed configuration re-creates
RELOAD_PARAMETER = "nnunet_shm_reclaim"
BUSY_CPU_SHARE = 0.02  # CPU time of a model's stubs, per second of the idle window, that counts as work
RETRY = RetryPolicy(backoff_s=1.0, max_delay_s=30.0)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ReclaimPolicy:
    """When a grown region is given back: grown beyond its default by more than ``above_bytes`` (0: never),
    its model idle for ``idle_s`` seconds."""

    above_bytes: int = DEFAULT_ABOVE_MIB * MiB
    idle_s: float = DEFAULT_IDLE_S

    def __post_init__(self) -> None:
        if self.above_bytes < 0 or self.idle_s < 0:
            raise ValueError(f"the shm reclaim threshold and idle time must be >= 0, got {self.above_bytes} "
                             f"bytes and {self.idle_s} s.")

    @property
    def enabled(self) -> bool:
        return self.above_bytes > 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReclaimPolicy:
        """``$NNUNET_TRITON_SHM_RECLAIM_MIB`` and ``$NNUNET_TRITON_SHM_RECLAIM_IDLE_S`` (absent: defaults);
        ValueError naming the variable and its value when one is not a number >= 0."""
        env = os.environ if env is None else env
        values: dict[str, float] = {}
        for name, default in ((ABOVE_ENV, float(DEFAULT_ABOVE_MIB)), (IDLE_ENV, DEFAULT_IDLE_S)):
            text = env.get(name, "").strip()
            try:
                values[name] = float(text) if text else default
            except ValueError:
                raise ValueError(f"${name} must be a number >= 0, got {text!r}.") from None
            if values[name] < 0:
                raise ValueError(f"${name} must be a number >= 0, got {text!r}.")
        return cls(above_bytes=round(values[ABOVE_ENV] * MiB), idle_s=values[IDLE_ENV])


@dataclass(frozen=True)
class Reclaim:
    """One reload of one model to give its grown shm region(s) back."""

    model: str
    regions: dict[str, int]  # instance name -> its region's bytes before
    default_bytes: int  # a fresh region's size
    detected_at: float  # time.time() when the model was first seen grown
    at: float  # time.time() when the load began (the model idle)
    seconds: float  # the load, until the new instances were ready
    ok: bool
    attempt: int = 1
    error: str | None = None
    event: str = "shm_reclaim"

    def to_event(self) -> dict[str, Any]:
        return asdict(self)


def region_bytes(stub: StubProcess, shm: str | Path = "/dev/shm") -> int | None:
    """The size of ``stub``'s region now (None: gone meanwhile)."""
    try:
        return (Path(shm) / stub.shm_region).stat().st_size
    except OSError:
        return None


def _activity(statistics: Mapping[str, Any]) -> tuple[int, ...]:
    """What changes while a model works: its counts, summed over its versions."""
    counts = [0, 0, 0, 0]
    for version in statistics.get("model_stats", []):
        stats = version.get("inference_stats", {})
        for i, value in enumerate((version.get("inference_count", 0), version.get("execution_count", 0),
                                   stats.get("success", {}).get("count", 0),
                                   stats.get("fail", {}).get("count", 0))):
            counts[i] += int(value)
    return tuple(counts)


@dataclass
class _Watch:
    """A grown model: its counts and since when they stayed the same; when a failed reload is tried next."""

    activity: tuple[int, ...] | None = None
    cpu_ticks: int = 0  # the model's stubs' CPU time when the quiet began (clock ticks)
    quiet_since: float = 0.0  # time.monotonic()
    attempt: int = 1
    retry_at: float = 0.0  # time.monotonic()
    detected_at: float = 0.0  # time.time()


class ShmReclaimer:
    """Reload the models whose stubs' regions grew beyond ``policy`` once idle (see the module doc)."""

    def __init__(self, api: ModelControl, policy: ReclaimPolicy | None = None, *,
                 shm: str | Path = "/dev/shm", proc: str | Path = "/proc") -> None:
        self.api = api
        self.policy = policy or ReclaimPolicy()
        self.shm = Path(shm)
        self.proc = Path(proc)
        self.reclaims = 0  # successful ones
        self._watch: dict[str, _Watch] = {}
        self._retiring: set[int] = set()  # pids of stubs replaced by a reclaim, still finishing requests

    def grown(self, stubs: Sequence[StubProcess]) -> dict[str, dict[str, int]]:
        """``{model: {instance: region bytes}}`` of the stubs grown beyond the policy (retiring ones
        aside)."""
        live = {s.pid for s in stubs}
        self._retiring &= live
        found: dict[str, dict[str, int]] = {}
        for stub in stubs:
            if stub.pid in self._retiring or stub.shm_default_bytes <= 0:
                continue
            size = region_bytes(stub, self.shm)
            if size is not None and size - stub.shm_default_bytes > self.policy.above_bytes:
                found.setdefault(stub.model, {})[stub.instance] = size
        return found

    def check(self, stubs: Sequence[StubProcess]) -> list[Reclaim]:
        """One look at ``stubs`` (one server's, those of models being recovered left out); reload each
        grown model that has been idle long enough. Returns the reclaims attempted."""
        if not self.policy.enabled:
            return []
        grown = self.grown(stubs)
        for model in set(self._watch) - set(grown):
            del self._watch[model]
        done = []
        for model, regions in grown.items():
            watch = self._watch.setdefault(model, _Watch(detected_at=time.time()))
            own = [s for s in stubs if s.model == model]
            if self._idle(own, watch) and time.monotonic() >= watch.retry_at:
                done.append(self._reclaim(model, regions, own, watch))
        return done

    def _cpu_ticks(self, stubs: Sequence[StubProcess]) -> int:
        """User + system CPU time of ``stubs`` (clock ticks; a stub gone meanwhile counts 0)."""
        total = 0
        for stub in stubs:
            try:
                fields = (self.proc / str(stub.pid) / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (proc(5) fields 14 and 15)
        return total

    def _idle(self, stubs: Sequence[StubProcess], watch: _Watch) -> bool:
        try:
            activity = _activity(self.api.statistics())  # every model: a pipeline request moves the folds'
        except ServerError as exc:  # not reachable meanwhile: look again next time
            LOGGER.debug("no statistics: %s", exc)
            watch.activity = None
            return False
        now, cpu = time.monotonic(), self._cpu_ticks(stubs)
        busy_ticks = max(2.0, BUSY_CPU_SHARE * self.policy.idle_s * _CLOCK_TICKS)
        if activity != watch.activity or cpu - watch.cpu_ticks > busy_ticks:
            watch.activity, watch.cpu_ticks, watch.quiet_since = activity, cpu, now
        return now - watch.quiet_since >= self.policy.idle_s

    def _reclaim(self, model: str, regions: dict[str, int], stubs: Sequence[StubProcess],
                 watch: _Watch) -> Reclaim:
        default = max(s.shm_default_bytes for s in stubs)
        LOGGER.warning("model %r: shared-memory region(s) grown to %s MiB (default %.0f MiB) and idle for "
                       "%.0f s: loading it again to give the memory back", model,
                       ", ".join(f"{b / MiB:.0f}" for b in regions.values()), default / MiB,
                       self.policy.idle_s)
        start, at = time.monotonic(), time.time()
        error = None
        try:
            config = self.api.config(model)
            parameters = config.setdefault("parameters", {})
            previous = str(parameters.get(RELOAD_PARAMETER, {}).get("string_value", "0"))
            generation = int(previous) + 1 if previous.isdigit() else 1
            parameters[RELOAD_PARAMETER] = {"string_value": str(generation)}
            self.api.load(model, config=config)
        except ServerError as exc:
            error = str(exc)
        reclaim = Reclaim(model=model, regions=dict(regions), default_bytes=default,
                          detected_at=watch.detected_at, at=at, seconds=round(time.monotonic() - start, 3),
                          ok=error is None, attempt=watch.attempt, error=error)
        if reclaim.ok:
            self.reclaims += 1
            self._retiring |= {s.pid for s in stubs}
            del self._watch[model]
            LOGGER.warning("model %r loaded again in %.1f s: its old instance(s) and their %.0f MiB of "
                           "shared memory go once their requests are done", model, reclaim.seconds,
                           sum(regions.values()) / MiB)
        else:
            delay = RETRY.delay(watch.attempt - 1)
            watch.attempt, watch.retry_at = watch.attempt + 1, time.monotonic() + delay
            LOGGER.error("loading model %r again to give its shared memory back failed (attempt %d): %s; the "
                         "model keeps serving as it was; next try in %.0f s", model, reclaim.attempt, error,
                         delay)
        return reclaim
