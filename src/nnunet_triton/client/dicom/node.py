"""A DICOM node (``nnunet-triton listen``): receive series by C-STORE, segment them, send the DICOM-SEG on.

A PACS routes studies to the node's AE title. What happens, in order:

1. **Association.** Connections are admitted first (:mod:`.admission`: hosts, per-host limit, a deadline
   for the TLS handshake and the A-ASSOCIATE-RQ, its size). Only the senders of the
   :class:`~.access.AccessPolicy` are accepted (called AE title: the node's or one its routes map to a
   model; calling AE title and host, TLS, a limit per host); the others get an A-ASSOCIATE-RJ. Only image
   storage SOP classes in uncompressed transfer syntaxes are accepted by default.
2. **C-STORE.** pynetdicom writes the dataset to a temporary file in the spool's ``tmp/`` as it arrives
   (never whole in memory, counted by the quota's recount, removed at the next start after a crash); an
   association that sends more than ``max_instance_bytes`` for one instance is aborted. The instance is
   copied (a Deflate one inflated in chunks, with the same limit) into the spool's ``tmp/``, its header read
   without pixel data, its UIDs checked against the UID rule (:mod:`.uids`) and the C-STORE request, the
   quota and the per-series limit checked and its place in the series' count reserved (under one lock, so
   parallel associations cannot pass the limit), and it is hard-linked to ``incoming/<series>/<sop>.dcm``
   (an exclusive create) with file and folder ``fsync``: only then is the C-STORE answered with success. An
   instance the node has already is acknowledged and not stored again, one that another association is
   storing at that moment is answered 0xA700: a sender cannot replace a slice, concurrently or not.
3. **Completeness.** A series is complete when no instance of its *study* arrived for ``idle_timeout_s``
   and no association that delivered instances of the study is still open (it is held back at most
   ``max_open_wait_s``), the rule of Orthanc's stable studies plus the sender's own end of transfer. An
   instance the spool has already counts as arriving too: a PACS that sends a series again after a
   restart keeps it open until its re-send ends. At start, every series in ``incoming/`` gets a full
   ``idle_timeout_s``.
4. **Segmenting.** The series goes to the model (endpoint) of its route (:mod:`.routing`): the called AE
   title of its first instance's association, else the first rule its attributes match, else the default;
   the route is decided when the first instance is kept and recorded in the series' state (a restart keeps
   it; later instances follow it, also those sent to another called AE title, which is logged). A series
   nothing routes, or whose Modality does not fit its model (:mod:`.modality`), is refused. The SEG's UIDs
   are minted once and stored in the series' state before the SEG is written (durably) to ``outgoing/``;
   its SeriesInstanceUID stays the same for every round of the same source series.
5. **Sending.** The SEG goes to the destination (C-STORE or STOW-RS). A retry sends the same file, without
   inference: killed after the PACS stored the SEG but before it answered, the node sends the same SOP
   instance again and the PACS keeps one. Failures that may pass (PACS or endpoint unreachable, refused,
   busy, a full disk) are retried with exponential backoff (``retry_delay_s`` doubling up to
   ``max_retry_delay_s``) for ``retry_window_s`` (an hour by default; ``retries`` may cap the attempts);
   then, or at once for a series that cannot be segmented, the series moves to ``failed/`` with
   ``error.txt`` (unless instances arrived during that attempt: then it is tried again with them).
   :func:`requeue` (``nnunet-triton requeue``) puts it back.
6. **Late instances.** A sent series' instances are kept in ``done/`` for ``done_retention_s``. An instance
   that arrives later brings them back: the whole series is segmented again and the new SEG is a new
   instance (next InstanceNumber) of the same SEG series, which replaces the earlier one for a viewer
   that shows a series' latest instance. Sending the same instances again changes nothing, and late
   instances that leave the volume as it is (a localizer, another SOP class the reader skips) give no
   inference and no new SEG (logged).
7. **Health.** A monitor thread writes ``status.json`` every ``heartbeat_s`` (:func:`read_status`,
   ``nnunet-triton node-status``). Every error of a series is caught and recorded; if the node cannot go
   on (its spool gone, its worker dead), it refuses new associations, says so in the status and
   :attr:`DicomNode.fatal`, and ``listen`` exits non-zero. A series in progress for longer than
   ``max_busy_s`` (a hung endpoint) makes the node degraded with ``worker_stuck`` (``node-status`` exits
   1) and instances of new series are answered 0xA700 until it ends. :meth:`DicomNode.stop` (SIGTERM)
   aborts the associations still open, so an idle one does not keep the node for its network timeout.

Logs and error files name series by UID only; exception texts of other libraries are redacted
(:mod:`.phi`). The spool is locked: one node per spool.

The parts (each its own module): :class:`DicomNode` here is the node's lifecycle and its DICOM SCP side
(listening, admission, associations, status); it receives with :class:`~.receiving_routes.RoutedReceiving`
(:mod:`.receiving`: checks and keeps every instance in the spool; routes recorded on the first instance).
The spool (:mod:`.spool`) and the :class:`~.series_queue.SeriesQueue` (what is known about its series in
memory, when one is complete) sit between that side and the :class:`~.series_worker.SeriesWorker`, which
works the complete series off the spool (:class:`~.series_round.SeriesRound`: assemble, segment, write,
send; then record, retry or set aside) and needs no listener. Both sides report to one
:class:`~.node_health.NodeHealth`. What the node is configured with: :mod:`.node_config`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from nnunet_triton.client.dicom.access import VERIFICATION
from nnunet_triton.client.dicom.admission import Admission, AdmittingServer
from nnunet_triton.client.dicom.destination import DicomWebDestination, StoreDestination, parse_destination
from nnunet_triton.client.dicom.node_admin import read_status, requeue
from nnunet_triton.client.dicom.node_config import NodeConfig, NodeModel
from nnunet_triton.client.dicom.node_health import NodeHealth
from nnunet_triton.client.dicom.phi import describe
from nnunet_triton.client.dicom.receiving import receive_into
from nnunet_triton.client.dicom.receiving_routes import RoutedReceiving
from nnunet_triton.client.dicom.routing import Routes
from nnunet_triton.client.dicom.series_queue import SeriesQueue
from nnunet_triton.client.dicom.series_worker import SeriesWorker
from nnunet_triton.client.dicom.spool import Spool, durable_json
from nnunet_triton.errors import PacsError

# the destinations, the configuration and the spool commands are importable from here too (one module for
# the node)
__all__ = ["StoreDestination", "DicomWebDestination", "parse_destination", "NodeConfig", "NodeModel",
           "DicomNode", "Routes", "read_status", "requeue"]

LOGGER = logging.getLogger(__name__)
ABORT_GRACE_S = 2.0  # stop: how long the aborted associations' handlers may take to end


class DicomNode(RoutedReceiving):
    """The listening AE (the receiving side), its series worker and their monitor, over one spool."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        config.spool.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._lock_spool(config.spool)
        self.spool = Spool(config.spool, config.limits)
        self.incoming, self.outgoing = self.spool.incoming, self.spool.outgoing
        self.failed = self.spool.failed
        self.queue = SeriesQueue()
        self.health = NodeHealth(self.queue.lock)
        self.worker = SeriesWorker(config, self.spool, self.queue, self.health)
        self._lock = self.queue.lock  # one lock for the node
        self._rx_bytes: dict[int, int] = {}  # association -> bytes received since its last C-STORE
        self._called_ae: dict[int, str] = {}  # association -> its called AE title (for the routes)
        self._stop = threading.Event()
        self._server: Any = None
        self._server_closed = False
        self._threads: list[threading.Thread] = []
        self._fatal: str | None = None
        self._dead = threading.Event()  # set once a fatal error is handled: status written, server closed

    @property
    def processed(self) -> list[tuple[str, str]]:
        """(series UID, ``"sent"`` | ``"failed: ..."``) in order, the last ``PROCESSED_KEPT`` of them."""
        return list(self.health.processed)

    @property
    def fatal(self) -> str | None:
        """Why the node stopped working (it refuses associations then), or None while it works."""
        return self._fatal

    @staticmethod
    def _lock_spool(spool: Path) -> Any:
        handle = (spool / ".lock").open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise PacsError(f"spool {spool} is in use by another node (one node per spool).") from None
        return handle

    def _refuses_new_series(self) -> str | None:
        """New series are refused while the worker is stuck (see :meth:`.receiving.Receiving._keep`)."""
        return self.health.stuck(self.config.max_busy_s)

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume the spool, start listening, the worker and the monitor.

        Sets pynetdicom's process-wide ``STORE_RECV_CHUNKED_DATASET`` (datasets are received to a file) and
        makes it write those files into the spool's ``tmp/`` (:func:`.receiving.receive_into`).
        """
        from pynetdicom import AE, _config, evt

        self.worker.resume()
        _config.STORE_RECV_CHUNKED_DATASET = True
        receive_into(self.spool.tmp)
        access = self.config.access
        ae = AE(ae_title=self.config.ae_title)
        ae.require_called_aet = False  # decided in _on_requested, with a reason in the log
        ae.maximum_associations = access.max_associations
        ae.network_timeout = ae.acse_timeout = ae.dimse_timeout = self.config.network_timeout_s
        for uid in access.storage_classes:
            ae.add_supported_context(uid, list(access.transfer_syntaxes))
        ae.add_supported_context(VERIFICATION)
        handlers = [(evt.EVT_C_STORE, self._on_store), (evt.EVT_REQUESTED, self._on_requested),
                    (evt.EVT_DATA_RECV, self._on_data), (evt.EVT_CONN_CLOSE, self._on_closed)]
        admission = Admission(access, listening_host=self.config.host,
                              network_timeout_s=self.config.network_timeout_s,
                              ssl_context=access.tls.server_context() if access.tls is not None else None)
        self._server = ae.make_server((self.config.host, self.config.port), evt_handlers=handlers,
                                      server_class=AdmittingServer, admission=admission)
        ae._servers.append(self._server)  # as AE.start_server does: server.shutdown() removes it
        accepting = threading.Thread(target=self._server.serve_forever, name="nnunet-triton-accept",
                                     daemon=True)
        accepting.start()
        self._write_status()
        for target, name in ((self._run, "nnunet-triton-node"), (self._monitor, "nnunet-triton-monitor")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        LOGGER.info("listening as %s on %s:%d%s, spool %s", self.config.ae_title, self.config.host,
                    self.config.port, " (TLS)" if access.tls else "", self.config.spool)
        routes = self.config.routes
        LOGGER.info("routes: called AE titles %s, %d rule(s), default %s; models %s",
                    dict(routes.called_ae_titles) or "none", len(routes.rules), routes.default,
                    ", ".join(self.config.served))

    def stop(self) -> None:
        """Stop listening and abort the associations still open (within ``ABORT_GRACE_S``); the series
        being processed finishes first, nothing spooled is removed."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._close_server()
        self._abort_associations()
        receive_into(None, previous=self.spool.tmp)
        for thread in self._threads:
            thread.join(timeout=600)
        self._write_status()
        self._lock_file.close()

    def _run(self) -> None:
        """The worker thread: the series worker's loop until ``stop``; when it cannot go on, the node dies."""
        self.worker.run(self._stop, self._die)

    def _close_server(self) -> None:
        """Stop accepting associations (once; the worker and ``stop`` may both ask)."""
        with self._lock:
            server = None if self._server_closed else self._server
            self._server_closed = True
        if server is not None:
            with contextlib.suppress(Exception):
                server.shutdown()

    def _abort_associations(self) -> None:
        """Abort every association still open, so that ``stop`` (SIGTERM) does not wait for an idle one
        to time out (pynetdicom's reader thread keeps the process alive for ``network_timeout_s``).

        Nothing acknowledged is lost: a C-STORE is answered only once its instance is durable in the spool.
        An instance being received when the A-ABORT goes out is not answered, so its sender keeps it and
        sends it again (and one stored meanwhile is acknowledged as known). The C-STORE handlers still
        running are waited for (``ABORT_GRACE_S``); a peer that does not close its end after the A-ABORT
        has its connection closed."""
        server = self._server
        if server is None:
            return
        open_associations = list(server.active_associations)
        for assoc in open_associations:
            with contextlib.suppress(Exception):
                assoc.abort(block=False)  # the A-ABORT is queued; its reader thread sends it
        deadline = time.monotonic() + ABORT_GRACE_S
        for assoc in open_associations:
            assoc.join(max(0.0, deadline - time.monotonic()))
        for assoc in open_associations:
            dul = assoc.dul
            if dul.is_alive():
                LOGGER.warning("an association from %s did not end %g s after the A-ABORT; its connection "
                               "is closed", assoc.requestor.address, ABORT_GRACE_S)
                dul.kill_dul()
                with contextlib.suppress(Exception):
                    dul.socket.close()
            dul.join(max(0.0, deadline + 1.0 - time.monotonic()))
        if open_associations:
            LOGGER.info("stopped: aborted %d open association(s)", len(open_associations))

    def wait_fatal(self, timeout_s: float | None = None) -> str | None:
        """Wait until the node cannot go on and has said so (returns why) or ``timeout_s`` passed (None)."""
        self._dead.wait(timeout_s)
        return self._fatal

    def _die(self, reason: str) -> None:
        if self._fatal is None:
            self._fatal = reason
            LOGGER.critical("the DICOM node cannot go on: %s; it refuses new associations", reason)
        self._close_server()
        self._write_status()
        self._dead.set()

    # --- health ------------------------------------------------------------------------------------
    def _monitor(self) -> None:
        checked = None
        while not self._stop.wait(self.config.heartbeat_s):
            worker = self._threads[0] if self._threads else None
            if worker is not None and not worker.is_alive() and not self._stop.is_set():
                self._die("the worker thread ended")
            if checked is None or time.monotonic() - checked >= self.config.endpoint_check_s:
                self.health.check_endpoints(self.config)
                checked = time.monotonic()
            self._write_status()

    def status(self) -> dict[str, Any]:
        """What ``status.json`` holds: state ``ok`` | ``degraded`` | ``unhealthy``, the reasons, counts;
        ``worker_stuck`` when a series has been in progress for longer than ``max_busy_s`` (degraded, and
        :func:`read_status` says unhealthy)."""
        health = self.health
        busy = health.busy
        stuck = health.stuck(self.config.max_busy_s)
        with self._lock:
            pending = len(self.queue.pending)
            degraded = sorted(health.degraded.values()) + ([stuck] if stuck else [])
            by_model = collections.Counter(e.model or "(no route yet)" for e in self.queue.pending.values())
            busy_entry = self.queue.pending.get(busy[0]) if busy else None
            recent = list(health.recent)
        state = "unhealthy" if self._fatal else ("degraded" if degraded else "ok")
        return {"state": state, "reason": self._fatal or "; ".join(degraded), "pid": os.getpid(),
                "updated": time.time(), "heartbeat_s": self.config.heartbeat_s, "pending_series": pending,
                "busy_series": busy[0] if busy else None, "busy_since": busy[1] if busy else None,
                "worker_stuck": stuck is not None, "max_busy_s": self.config.max_busy_s,
                "endpoints": dict(health.endpoints),
                "busy_model": busy_entry.model if busy_entry else None,
                "spool_bytes": self.spool.used, "max_spool_bytes": self.config.limits.max_spool_bytes,
                "listening": f"{self.config.ae_title}@{self.config.host}:{self.config.port}",
                "models": list(self.config.served), "routes": self.config.routes.summary(),
                "pending_by_model": dict(by_model), "recent": recent}

    def _write_status(self) -> None:
        try:
            durable_json(self.spool.status_file, self.status())
        except OSError as exc:  # a full disk: the status goes stale, which read_status reports
            if exc.errno == errno.ENOSPC:
                self.health.set_degraded("disk", "the spool's disk is full")
            LOGGER.debug("could not write the node status: %s", describe(exc))
        except Exception as exc:  # noqa: BLE001 - the monitor must outlive a bug in the status
            LOGGER.error("could not write the node status: %s", describe(exc))
