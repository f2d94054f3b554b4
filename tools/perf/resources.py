"""CPU time and peak memory of a process tree during a measurement (psutil, sampled in a thread).

The tree is tritonserver plus its Python-backend stubs (one per model instance; the stub's command
line ends with ``<instance name> DEFAULT``, which labels it), or a baseline subprocess. CPU seconds
are the increase of user + system time of every process seen. Memory is sampled two ways:

- peak PSS, the memory measure: the largest sum over the samples of each process's proportional set size
  (``Pss`` of ``/proc/<pid>/smaps_rollup``), which charges a shared page (torch's libraries, a
  shared-memory tensor region) to each of the N processes mapping it by 1/N, so it counts once in the sum;
- peak RSS, kept for comparison with earlier tables: the largest sum of resident sets, which counts a
  shared page once per process that maps it (as ``ps`` would), overstating a multi-process tree.

The 1-minute load average before and after says how busy the machine was with other work.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import psutil

__all__ = ["ResourceUsage", "ProcessTreeSampler", "process_label", "pss_bytes"]

DEFAULT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class ResourceUsage:
    """What a sampler saw between start and stop."""

    wall_s: float
    cpu_s: float
    peak_rss_mib: float
    peak_rss_by_process_mib: dict[str, float] = field(default_factory=dict)
    peak_pss_mib: float = 0.0
    peak_pss_by_process_mib: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    loadavg_start: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loadavg_end: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def cpu_percent(self) -> float:
        """Average CPU use, 100 = one core busy the whole time."""
        return 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 3),
            "cpu_percent": round(self.cpu_percent, 1), "peak_rss_mib": round(self.peak_rss_mib, 1),
            "peak_rss_by_process_mib": {k: round(v, 1) for k, v in self.peak_rss_by_process_mib.items()},
            "peak_pss_mib": round(self.peak_pss_mib, 1),
            "peak_pss_by_process_mib": {k: round(v, 1) for k, v in self.peak_pss_by_process_mib.items()},
            "samples": self.samples, "loadavg_start": list(self.loadavg_start),
            "loadavg_end": list(self.loadavg_end),
        }


def pss_bytes(pid: int) -> int | None:
    """The process's proportional set size (``Pss:`` of ``/proc/<pid>/smaps_rollup``), None if unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError):
        return None
    return None


def process_label(process: psutil.Process) -> str:
    """``tritonserver``, the Triton model instance name of a Python stub, or the process name."""
    try:
        cmdline = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return f"pid{process.pid}"
    if cmdline and cmdline[0].endswith("triton_python_backend_stub") and len(cmdline) >= 2:
        return cmdline[-2]
    if cmdline and cmdline[0].endswith("tritonserver"):
        return "tritonserver"
    return process.name()


class ProcessTreeSampler:
    """Samples ``pid`` and all its descendants every ``interval_s`` until stopped (a context manager).

    ``include(label)`` selects processes by :func:`process_label` (e.g. only one system's stubs when
    two systems share one tritonserver); None counts every process of the tree.
    """

    def __init__(self, pid: int, *, interval_s: float = DEFAULT_INTERVAL_S,
                 include: Callable[[str], bool] | None = None) -> None:
        self._root = psutil.Process(pid)
        self._interval_s = interval_s
        self._include = include
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"sampler-{pid}", daemon=True)
        self._cpu_first: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._labels: dict[int, str] = {}
        self._peak_rss = 0
        self._peak_by_label: dict[str, int] = {}
        self._peak_pss = 0
        self._peak_pss_by_label: dict[str, int] = {}
        self._samples = 0
        self._start = 0.0
        self._loadavg_start = (0.0, 0.0, 0.0)
        self.usage: ResourceUsage | None = None

    def _processes(self) -> list[psutil.Process]:
        try:
            return [self._root, *self._root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sample(self) -> None:
        """Take one sample now (also called by the thread)."""
        total_rss = total_pss = 0
        for process in self._processes():
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    rss = process.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            pid = process.pid
            if pid not in self._labels:
                self._labels[pid] = process_label(process)
            if self._include is not None and not self._include(self._labels[pid]):
                continue
            cpu = times.user + times.system
            self._cpu_first.setdefault(pid, cpu)
            self._cpu_last[pid] = cpu
            total_rss += rss
            label = self._labels[pid]
            self._peak_by_label[label] = max(self._peak_by_label.get(label, 0), rss)
            pss = pss_bytes(pid)
            if pss is not None:
                total_pss += pss
                self._peak_pss_by_label[label] = max(self._peak_pss_by_label.get(label, 0), pss)
        self._peak_rss = max(self._peak_rss, total_rss)
        self._peak_pss = max(self._peak_pss, total_pss)
        self._samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    def start(self) -> ProcessTreeSampler:
        self._loadavg_start = os.getloadavg()
        self._start = time.perf_counter()
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> ResourceUsage:
        self._stop.set()
        self._thread.join()
        self.sample()
        wall = time.perf_counter() - self._start
        cpu = sum(self._cpu_last[pid] - self._cpu_first[pid] for pid in self._cpu_last)
        mib = 1.0 / 2**20
        self.usage = ResourceUsage(
            wall_s=wall, cpu_s=cpu, peak_rss_mib=self._peak_rss * mib,
            peak_rss_by_process_mib={k: v * mib for k, v in sorted(self._peak_by_label.items())},
            peak_pss_mib=self._peak_pss * mib,
            peak_pss_by_process_mib={k: v * mib for k, v in sorted(self._peak_pss_by_label.items())},
            samples=self._samples, loadavg_start=self._loadavg_start, loadavg_end=os.getloadavg(),
        )
        return self.usage

    def __enter__(self) -> ProcessTreeSampler:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
