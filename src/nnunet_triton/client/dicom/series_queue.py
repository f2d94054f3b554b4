"""The series queue of a DICOM node: what the receiving side hands the series worker, next to the spool.

The spool (:mod:`.spool`) holds the data: the receiving side places each instance in
``incoming/<series>/`` and the worker reads the series from there. The queue holds what is known about
those series in memory: one :class:`PendingSeries` per series in ``incoming/`` (its study, when it last
grew, its route, its attempts), the studies still arriving, the associations that deliver them and the
instances being stored now; and one lock per series folder (the receiving side fills it, the worker
clears it). A restart rebuilds the queue from the spool (:meth:`SeriesQueue.scan`).

Everything in the queue is read and written under :attr:`SeriesQueue.lock`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nnunet_triton.client.dicom.spool import Spool
from nnunet_triton.client.dicom.uids import valid_uid

__all__ = ["PendingSeries", "SeriesQueue", "route_entry", "ROUTE_KEYS"]

ROUTE_KEYS = ("called_ae", "model", "route")  # a series' route in its state and its record


@dataclass
class PendingSeries:
    """A series in ``incoming/``: its study, when it last grew, its instances and its attempts."""

    study: str
    last_seen: float
    count: int = 0
    attempts: int = 0
    next_attempt: float = 0.0
    first_failure: float | None = None
    routed: bool = False  # its route is recorded in its state (ROUTE_KEYS), and below
    called_ae: str | None = None
    model: str | None = None
    route: str = ""
    other_called: set[str] = field(default_factory=set)  # other called AE titles its instances came to
    round: frozenset[str] | None = None  # the instances the attempt in progress works on


def route_entry(entry: PendingSeries, state: Mapping[str, Any]) -> None:
    """Copy a series' recorded route (its state's ROUTE_KEYS) to its entry (under the queue's lock once the
    entry is in the queue)."""
    if "called_ae" not in state and not isinstance(state.get("model"), str):
        return
    called, model = state.get("called_ae"), state.get("model")
    entry.routed = True
    entry.called_ae = called if isinstance(called, str) else None
    entry.model = model if isinstance(model, str) else None
    entry.route = str(state.get("route") or "")


class SeriesQueue:
    """The series waiting in ``incoming/`` and what decides when one is complete (see :mod:`.node`, 3.)."""

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.lock = lock or threading.Lock()
        self.pending: dict[str, PendingSeries] = {}
        self.study_seen: dict[str, float] = {}  # study -> when an instance of it last arrived
        self.carrying: dict[int, set[str]] = {}  # association -> studies it delivered
        self.storing: set[tuple[str, str]] = set()  # (series, SOP instance) being stored now
        self._series_locks: dict[str, threading.Lock] = {}  # a series' folder: filled vs. cleared

    def series_lock(self, uid: str) -> threading.Lock:
        """The lock of a series' folder: no instance lands in it while the worker moves or clears it."""
        with self.lock:
            return self._series_locks.setdefault(uid, threading.Lock())

    def storing_now(self, uid: str) -> bool:
        """Whether an instance of series ``uid`` is being stored now (its file is linked once the series'
        lock is free)."""
        with self.lock:
            return any(series == uid for series, _ in self.storing)

    def scan(self, spool: Spool) -> None:
        """Pick up series in ``incoming/`` the queue does not know yet (a restart, ``requeue``): each gets a
        full idle timeout from now."""
        now = time.monotonic()
        for uid in spool.incoming_series():
            with self.lock:
                if uid in self.pending:
                    continue
            state = spool.state(uid)
            study = str(valid_uid(state.get("study")) or uid)
            entry = PendingSeries(study, now, count=spool.count(uid), attempts=int(state.get("attempts", 0)),
                                  first_failure=state.get("first_failure"))
            route_entry(entry, state)
            with self.lock:
                self.pending.setdefault(uid, entry)
                self.study_seen.setdefault(study, now)

    def due(self, idle_timeout_s: float, max_open_wait_s: float) -> str | None:
        """The series to work on now, the one idle longest: none of its study's instances arrived for
        ``idle_timeout_s``, no association that delivered its study is open (for at most
        ``max_open_wait_s``), none of its instances is being stored and its retry delay has passed."""
        now = time.monotonic()
        with self.lock:
            open_studies = set().union(*self.carrying.values()) if self.carrying else set()
            storing = {series for series, _ in self.storing}
            for uid, entry in sorted(self.pending.items(), key=lambda item: item[1].last_seen):
                if uid in storing:  # an instance is being stored: its place is counted, its file not there
                    continue
                idle = now - max(entry.last_seen, self.study_seen.get(entry.study, 0.0))
                held = entry.study in open_studies and idle < max_open_wait_s
                if idle >= idle_timeout_s and not held and now >= entry.next_attempt:
                    return uid
        return None

    def forget_idle(self, forget_after_s: float) -> None:
        """Forget the studies no series waits for (seen more than ``forget_after_s`` ago) and the locks of
        the series no longer queued."""
        now = time.monotonic()
        with self.lock:
            for uid in [u for u in self._series_locks if u not in self.pending]:
                del self._series_locks[uid]
            waiting = {entry.study for entry in self.pending.values()}
            for study, seen in list(self.study_seen.items()):
                if study not in waiting and now - seen > forget_after_s:
                    del self.study_seen[study]
