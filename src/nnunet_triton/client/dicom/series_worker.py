"""The series worker of a DICOM node: it takes complete series from the spool and turns each into a sent
DICOM-SEG, retrying what may pass and setting aside what cannot (see :mod:`.node`, 3. to 6.).

It needs no network listener: it reads the series from the spool (``incoming/``; :mod:`.spool`) as the
:class:`~.series_queue.SeriesQueue` says they are complete, runs a round on each
(:class:`~.series_round.SeriesRound`: assemble, segment, write, send), and records the outcome: the
series' instances move to ``done/`` with its record, or the attempt is retried with backoff, or the series
moves to ``failed/`` with ``error.txt``. The receiving side (:class:`~.node.DicomNode`) fills the spool and
the queue; both report to the same :class:`~.node_health.NodeHealth`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydicom

from nnunet_triton.client.dicom.node_config import NodeConfig
from nnunet_triton.client.dicom.node_health import NodeHealth
from nnunet_triton.client.dicom.phi import describe
from nnunet_triton.client.dicom.series_queue import ROUTE_KEYS, PendingSeries, SeriesQueue
from nnunet_triton.client.dicom.series_round import SeriesRound, seg_sop
from nnunet_triton.client.dicom.spool import Spool, durable_json, durable_output
from nnunet_triton.client.dicom.uids import valid_uid
from nnunet_triton.client.endpoint import is_unavailable
from nnunet_triton.errors import ClientError, NnunetTritonError, PacsError
from nnunet_triton.util.durable import TEMP_MARKER

__all__ = ["SeriesWorker", "WorkerFatal"]

LOGGER = logging.getLogger("nnunet_triton.client.dicom.node")  # one logger for the node's story


class WorkerFatal(Exception):
    """The worker cannot go on (the spool's folders are gone)."""


class SeriesWorker:
    """Works off the series of ``spool`` that ``queue`` holds, with the models and retries of ``config``.

    ``queue`` and ``health`` are shared with the receiving side when there is one (a node); alone, the
    worker makes its own and works off what the spool holds (:meth:`resume`, then :meth:`step`). It does
    not lock the spool: its owner does (one node per spool, :class:`~.node.DicomNode`)."""

    def __init__(self, config: NodeConfig, spool: Spool, queue: SeriesQueue | None = None,
                 health: NodeHealth | None = None) -> None:
        self.config, self.spool = config, spool
        self.queue = queue if queue is not None else SeriesQueue()
        self.health = health if health is not None else NodeHealth(self.queue.lock)
        self.rounds = SeriesRound(config, spool, self.queue, self.health)
        self._last_scan = self._last_sweep = time.monotonic()

    # --- resume: what an earlier run left in the spool ---------------------------------------------
    def resume(self) -> None:
        """Clear what was being received or written, queue the series in ``incoming/`` and adopt the SEGs
        left alone in ``outgoing/`` (one node per spool: nothing is being written now)."""
        self.spool.clear_tmp()
        for folder in (self.spool.incoming, self.spool.outgoing, self.spool.done):
            for leftover in folder.rglob(f".*{TEMP_MARKER}*"):
                leftover.unlink(missing_ok=True)
        self.queue.scan(self.spool)
        for seg in sorted(self.spool.outgoing.glob("*.dcm")):
            self._adopt_outgoing(seg)
        if self.queue.pending:
            LOGGER.info("resuming %d spooled series", len(self.queue.pending))

    def _adopt_outgoing(self, seg: Path) -> None:
        """A SEG in ``outgoing/``: part of a series in incoming/ (handled with it), sent already (removed),
        or on its own: sent when it is a readable DICOM-SEG, set aside when it is not."""
        uid = valid_uid(seg.stem)
        if uid is None or uid in self.queue.pending:
            return
        record = self.spool.record(uid)
        sop = seg_sop(seg)
        if sop is not None and sop == record.get("sop_uid"):
            self.spool.remove_tree(seg)  # stored by the PACS and recorded; only the cleanup was missing
        elif sop is None:
            self._set_aside_outgoing(uid, seg)
        else:
            self.queue.pending[uid] = PendingSeries(uid, time.monotonic() - self.config.idle_timeout_s)

    def _set_aside_outgoing(self, uid: str, seg: Path) -> None:
        target = self.spool.unique_failed(uid)
        try:
            self.spool.move(seg, target / "nnunet_seg.dcm.unsent")
            with durable_output(target / "error.txt") as temp:
                temp.write_text(f"series {uid}: the DICOM-SEG in outgoing/ is not a readable DICOM file "
                                "(empty or damaged); it was not sent. Requeue the series' instances to "
                                "segment it again.\n")
        except OSError as exc:
            LOGGER.error("series %s: could not set aside an unreadable SEG: %s", uid, describe(exc))
            return
        self.health.outcome(uid, "failed: unreadable DICOM-SEG in outgoing/", None)
        LOGGER.error("series %s: the DICOM-SEG in outgoing/ is unreadable; moved to %s", uid, target)

    # --- the loop ----------------------------------------------------------------------------------
    def run(self, stop: threading.Event, on_fatal: Callable[[str], None]) -> None:
        """Work every ``poll_s`` until ``stop`` is set; when it cannot go on, call ``on_fatal(why)``, end."""
        self._last_scan = self._last_sweep = time.monotonic()
        try:
            while not stop.wait(self.config.poll_s):
                self.step()
        except BaseException as exc:  # noqa: BLE001 - recorded, then the node stops accepting
            on_fatal(str(exc) if isinstance(exc, WorkerFatal) else f"worker failed: {describe(exc)}")

    def step(self) -> str | None:
        """Check the spool, rescan and sweep it when due, and make one attempt at the series that is due;
        its UID, or None when none was. Raises :class:`WorkerFatal` when the spool's folders are gone."""
        problem = self.spool.check()
        if problem:
            raise WorkerFatal(problem)
        now = time.monotonic()
        if now - self._last_scan >= self.config.rescan_s:
            self.queue.scan(self.spool)
            self._last_scan = now
        if now - self._last_sweep >= self.config.sweep_s:
            self._sweep()
            self._last_sweep = now
        uid = self.queue.due(self.config.idle_timeout_s, self.config.max_open_wait_s)
        if uid is not None:
            self._attempt(uid)
        return uid

    def _sweep(self) -> None:
        try:
            removed = self.spool.sweep()
        except OSError as exc:
            LOGGER.error("retention sweep failed: %s", describe(exc))
            return
        for path in removed:
            LOGGER.info("retention: removed %s/%s", path.parent.name, path.name)
        self.queue.forget_idle(self.config.idle_timeout_s + self.config.max_open_wait_s)

    def _attempt(self, uid: str) -> None:
        with self.queue.lock:
            entry = self.queue.pending[uid]
            entry.attempts += 1
            attempt = entry.attempts
        self.health.busy = (uid, time.time())
        try:
            result = self.rounds.run(uid, entry)
            if result.seg is None:  # a SEG left alone in outgoing/ was sent
                self._forget(uid)
                self.spool.remove_tree(self.spool.seg_file(uid))
            else:
                self._finish(uid, result.seg, list(result.names))
        except ClientError as exc:  # a PACS or the endpoint unreachable or busy may answer later
            if isinstance(exc, PacsError) or exc.status is None or is_unavailable(exc):
                self.health.set_degraded("destination", f"series {uid}: {self._describe(uid, exc)}")
                self._retry_or_fail(uid, attempt, self._describe(uid, exc))
            else:  # the endpoint refused this series (e.g. INVALID_ARG): it would refuse it again
                self._fail(uid, self._describe(uid, exc), unless_grown=True)
        except OSError as exc:  # a full disk, a spool folder in trouble: may pass
            self.health.set_degraded("disk", f"series {uid}: {self._describe(uid, exc)}")
            self._retry_or_fail(uid, attempt, self._describe(uid, exc))
        except NnunetTritonError as exc:  # the series as it is cannot be segmented: no retry helps
            self._fail(uid, self._describe(uid, exc), unless_grown=True)
        except Exception as exc:  # noqa: BLE001 - a bug must not stop the node; the series is kept aside
            LOGGER.error("series %s: unexpected error %s", uid, self._describe(uid, exc))
            self._fail(uid, self._describe(uid, exc), unless_grown=True)
        finally:
            self.health.busy = None
            entry.round = None

    def _describe(self, uid: str, exc: BaseException) -> str:
        """``describe(exc)`` with the patient/study values of the series' first instance redacted too."""
        headers = []
        for folder in (self.spool.series_dir(uid), self.spool.done_dir(uid)):
            for path in self.spool.instances(folder)[:1]:
                with contextlib.suppress(Exception):
                    headers.append(pydicom.dcmread(path, stop_before_pixels=True, defer_size=1 << 16))
        return describe(exc, headers)

    # --- outcomes: sent, retried, set aside --------------------------------------------------------
    def _finish(self, uid: str, seg: dict[str, Any], names: list[str]) -> None:
        """Record what was sent (and the route), keep the instances for late ones, clear the round."""
        route = {k: v for k, v in self.spool.state(uid).items() if k in ROUTE_KEYS}
        record = {"seg_series_uid": seg["series_uid"], "sop_uid": seg["sop_uid"],
                  "instance_number": seg["instance_number"], "covers": names, "sent_at": time.time(), **route}
        if seg.get("volume"):  # the volume's instances: late ones that leave it as it is give no new SEG
            record["volume"] = seg["volume"]
        if seg.get("rt_sop_uid"):
            record.update(rt_series_uid=seg.get("rt_series_uid"), rt_sop_uid=seg["rt_sop_uid"])
        durable_json(self.spool.record_file(uid), record)
        folder = self.spool.series_dir(uid)
        self.spool.merge_into(folder, self.spool.done_dir(uid), names=set(names))
        self.spool.remove_tree(self.spool.seg_file(uid))
        self.spool.remove_tree(self.spool.rtstruct_file(uid))
        with self.queue.series_lock(uid):  # no instance lands in the folder while it is found empty, removed
            with self.queue.lock:
                remaining = self.spool.instances(folder)
                entry = self.queue.pending[uid]
                if remaining:  # instances arrived while segmenting: another round, for the whole series
                    entry.attempts, entry.first_failure, entry.count = 0, None, len(remaining) + len(names)
                else:
                    self.queue.pending.pop(uid, None)
            if not remaining:
                self.spool.remove_tree(folder)
        if remaining:
            self.spool.write_state(uid, {"seg_series_uid": seg["series_uid"], "study": entry.study, **route})
        self.health.outcome(uid, "sent", route.get("model"))
        LOGGER.info("series %s: DICOM-SEG sent (model %s)", uid, route.get("model") or "unknown")

    def _forget(self, uid: str) -> None:
        with self.queue.lock:
            entry = self.queue.pending.pop(uid, None)
        self.health.outcome(uid, "sent", entry.model if entry else None)
        LOGGER.info("series %s: DICOM-SEG sent", uid)

    def _retry_or_fail(self, uid: str, attempt: int, message: str) -> None:
        config = self.config
        with self.queue.lock:
            entry = self.queue.pending[uid]
            entry.first_failure = entry.first_failure or time.time()
            first = entry.first_failure
        over_window = time.time() - first >= config.retry_window_s
        if over_window or (config.retries is not None and attempt > config.retries):
            window = f", {time.time() - first:.0f} s after the first failure" if over_window else ""
            self._fail(uid, f"{message} (after {attempt} attempts{window})")
            return
        delay = config.retry_policy.delay(attempt - 1)
        with self.queue.lock:
            entry.next_attempt = time.monotonic() + delay
        if self.spool.series_dir(uid).is_dir():
            try:
                state = self.spool.state(uid)
                state.update(attempts=attempt, first_failure=first, last_error=message)
                self.spool.write_state(uid, state)
            except OSError as exc:  # a full disk: the attempts are kept in memory meanwhile
                LOGGER.error("series %s: could not record the attempt: %s", uid, describe(exc))
        LOGGER.warning("series %s: attempt %d failed (%s); retrying in %.1f s", uid, attempt, message, delay)

    def _fail(self, uid: str, message: str, *, unless_grown: bool = False) -> None:
        """Move the series (instances, state, unsent SEG) to ``failed/`` with ``error.txt``.

        ``unless_grown``: the series' data made the attempt fail (a partial volume, a refusal of the
        endpoint); when instances arrived meanwhile (a PACS sending the series again after a restart) it
        is tried again with them after the idle timeout instead, so the instances acknowledged during the
        attempt are not set aside with a verdict on data they were not part of."""
        target = self.spool.unique_failed(uid)
        folder = self.spool.series_dir(uid)
        seg = self.spool.seg_file(uid)
        with self.queue.lock:
            entry = self.queue.pending.get(uid)
            model, route = (entry.model, entry.route) if entry is not None else (None, "")
        routed = f"model: {model} ({route})\n" if model else ""
        try:
            with self.queue.series_lock(uid):
                if unless_grown and self._grown(uid, entry, folder):
                    LOGGER.warning("series %s: %s; instances arrived during the attempt: it is tried again "
                                   "with them", uid, message)
                    return
                if folder.is_dir():
                    self.spool.move(folder, target)
                else:
                    target.mkdir(parents=True)
            if seg.exists():
                self.spool.move(seg, target / "nnunet_seg.dcm.unsent")
            if self.spool.rtstruct_file(uid).exists():
                self.spool.move(self.spool.rtstruct_file(uid), target / "nnunet_rtstruct.dcm.unsent")
            with durable_output(target / "error.txt") as temp:
                temp.write_text(message + "\n" + routed)
        except OSError as exc:  # a full disk: keep the series where it is and try again later
            LOGGER.error("series %s: could not move it to failed/ (%s); trying again later", uid,
                         describe(exc))
            with self.queue.lock:
                entry = self.queue.pending.get(uid)
                if entry is not None:
                    entry.next_attempt = time.monotonic() + max(self.config.retry_delay_s, 1.0)
            return
        with self.queue.lock:
            self.queue.pending.pop(uid, None)
        self.rounds.kept.pop(uid, None)
        self.health.outcome(uid, f"failed: {message}", model)
        LOGGER.error("series %s: moved to %s: %s", uid, target, message)

    def _grown(self, uid: str, entry: PendingSeries | None, folder: Path) -> bool:
        """Whether instances arrived in the series' folder during the attempt in progress (then the entry
        is made ready for another round, after the idle timeout; called under the series' lock)."""
        if entry is None or entry.round is None or not folder.is_dir():
            return False
        storing = self.queue.storing_now(uid)  # linked into the folder once the series' lock is free
        if not storing and not {p.name for p in self.spool.instances(folder)} - entry.round:
            return False
        with self.queue.lock:
            entry.attempts, entry.first_failure, entry.next_attempt = 0, None, 0.0
        self.rounds.kept.pop(uid, None)
        return True
