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
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pydicom

from nnunet_triton.client.dicom.access import VERIFICATION, AccessPolicy
from nnunet_triton.client.dicom.admission import Admission, AdmittingServer
from nnunet_triton.client.dicom.destination import DicomWebDestination, StoreDestination, parse_destination
from nnunet_triton.client.dicom.modality import ModalityRule
from nnunet_triton.client.dicom.node_admin import read_status, requeue
from nnunet_triton.client.dicom.outputs import DicomOutput, write_dicom_outputs
from nnunet_triton.client.dicom.phi import describe
from nnunet_triton.client.dicom.receiving import STATUS_SUCCESS, Receiving, receive_into
from nnunet_triton.client.dicom.routing import NoRoute, Route, Routes
from nnunet_triton.client.dicom.seg import SegmentLabel, generic_segment_labels
from nnunet_triton.client.dicom.spool import Spool, SpoolLimits, durable_json, durable_output
from nnunet_triton.client.dicom.uids import shown, valid_uid
from nnunet_triton.client.dicom.volume import DicomOptions, read_series, scan_folder
from nnunet_triton.client.endpoint import is_unavailable
from nnunet_triton.errors import ClientError, InputValidationError, NnunetTritonError, PacsError
from nnunet_triton.util.durable import TEMP_MARKER
from nnunet_triton.util.retry import RetryPolicy

# the destinations and the spool commands are importable from here too (one module for the node)
__all__ = ["StoreDestination", "DicomWebDestination", "parse_destination", "NodeConfig", "NodeModel",
           "DicomNode", "Routes", "read_status", "requeue"]

LOGGER = logging.getLogger(__name__)
SEG_HEADER_BYTES = 64 * 1024  # a SEG's attributes and per-frame groups, on top of its pixels
PROCESSED_KEPT = 1000  # outcomes kept in memory (DicomNode.processed)
RECENT_SHOWN = 20  # outcomes shown in status.json, with their model
ROUTE_KEYS = ("called_ae", "model", "route")  # a series' route in its state and its record
ABORT_GRACE_S = 2.0  # stop: how long the aborted associations' handlers may take to end


@dataclass(frozen=True)
class NodeModel:
    """A model (endpoint) the node segments with: ``segment(volume)`` returns the label map of a
    :class:`~.volume.DicomVolume`; ``labels`` name the DICOM-SEG segments (None: ``label_<v>`` for the values
    present); ``modalities`` says which series fit it; ``ready()`` raises when the endpoint is not ready (the
    monitor calls it every ``endpoint_check_s``; None: not checked); ``output``: the DICOM objects its
    results become (SEG, RTSTRUCT or both, sent together)."""

    segment: Callable[[Any], Any]
    labels: Sequence[SegmentLabel] | None = None
    modalities: ModalityRule = field(default_factory=lambda: ModalityRule(None))
    ready: Callable[[], Any] | None = None
    output: DicomOutput = DicomOutput.SEG


@dataclass(frozen=True)
class NodeConfig:
    """What the node listens on, who may store, where it spools and sends, how it retries and its limits.

    One model: ``segment(volume)`` returns the label map for a :class:`~.volume.DicomVolume`, ``labels``
    names the DICOM-SEG segments (None: ``label_<v>`` for the values present), ``modalities`` the series that
    fit; it is the ``routes``' default model (``Routes()``: everything to ``nnunet``). Several models:
    ``models`` maps every endpoint name the ``routes`` name to its :class:`NodeModel` (``segment`` None).
    Times are seconds.
    """

    ae_title: str
    port: int
    spool: Path
    destination: StoreDestination | DicomWebDestination
    segment: Callable[[Any], Any] | None = None
    labels: Sequence[SegmentLabel] | None = None
    host: str = "127.0.0.1"
    idle_timeout_s: float = 10.0
    max_open_wait_s: float = 120.0
    retries: int | None = None
    retry_delay_s: float = 5.0
    max_retry_delay_s: float = 300.0
    retry_window_s: float = 3600.0
    access: AccessPolicy = field(default_factory=AccessPolicy)
    limits: SpoolLimits = field(default_factory=SpoolLimits)
    modalities: ModalityRule = field(default_factory=lambda: ModalityRule(None))
    dicom_options: DicomOptions = field(default_factory=DicomOptions)
    network_timeout_s: float = 60.0
    max_busy_s: float = 900.0
    endpoint_check_s: float = 30.0
    poll_s: float = 0.2
    heartbeat_s: float = 2.0
    rescan_s: float = 5.0
    sweep_s: float = 60.0
    routes: Routes = field(default_factory=Routes)
    models: Mapping[str, NodeModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= len(self.ae_title) <= 16:
            raise PacsError(f"AE title must have 1 to 16 characters, got {self.ae_title!r}.")
        bad_retries = self.retries is not None and self.retries < 0
        if self.idle_timeout_s <= 0 or bad_retries or self.retry_delay_s < 0:
            raise PacsError("idle timeout must be > 0, retries and retry delay >= 0, got "
                            f"{self.idle_timeout_s}, {self.retries}, {self.retry_delay_s}.")
        if min(self.retry_window_s, self.max_retry_delay_s, self.max_open_wait_s) < 0 or min(
                self.network_timeout_s, self.poll_s, self.heartbeat_s, self.rescan_s, self.sweep_s,
                self.max_busy_s, self.endpoint_check_s) <= 0:
            raise PacsError("retry window, delays and waits must be >= 0 and the node's intervals > 0.")
        self.access.check_listening(self.host)
        self._check_models()

    @property
    def retry_policy(self) -> RetryPolicy:
        """The backoff between a series' attempts: ``retry_delay_s`` doubling up to ``max_retry_delay_s``
        (how many attempts: ``retries`` and ``retry_window_s``, which the node applies)."""
        return RetryPolicy(retries=self.retries or 0, backoff_s=self.retry_delay_s,
                           max_delay_s=self.max_retry_delay_s)

    def _check_models(self) -> None:
        routes = self.routes
        if self.models:
            if self.segment is not None or self.labels is not None or self.modalities != ModalityRule(None):
                raise PacsError("give the node one model (segment, labels, modalities) or several (models), "
                                "not both.")
            missing = [name for name in routes.models if name not in self.models]
            if missing:
                raise PacsError(f"the routes send series to model {missing[0]!r} "
                                f"({routes.where(missing[0])}) but the node has no such model (it has "
                                f"{sorted(self.models)}).")
            object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        elif self.segment is None:
            raise PacsError("the node needs a model: segment (one) or models (one per endpoint name).")
        elif routes.models != (routes.default,):
            others = [name for name in routes.models if name != routes.default]
            raise PacsError(f"one segment callable is the routes' default model ({routes.default}) only; the "
                            f"routes also name {others}: give models, one per endpoint name.")

    @property
    def served(self) -> tuple[str, ...]:
        """The endpoint names the node segments with."""
        return tuple(self.models) if self.models else (str(self.routes.default),)

    def model_for(self, name: object) -> NodeModel | None:
        """The model the node segments with for endpoint ``name``; None when it serves no such model."""
        if self.models:
            return self.models.get(name) if isinstance(name, str) else None
        if self.segment is None or name != self.routes.default:
            return None
        return NodeModel(self.segment, self.labels, self.modalities)


@dataclass
class _Series:
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


class _Fatal(Exception):
    """The node cannot go on (its spool is gone, its worker died)."""


class DicomNode(Receiving):
    """The listening AE, the worker that turns complete series into sent DICOM-SEGs, and their monitor."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        config.spool.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._lock_spool(config.spool)
        self.spool = Spool(config.spool, config.limits)
        self.incoming, self.outgoing = self.spool.incoming, self.spool.outgoing
        self.failed = self.spool.failed
        self._pending: dict[str, _Series] = {}
        self._study_seen: dict[str, float] = {}
        self._carrying: dict[int, set[str]] = {}  # association -> studies it delivered
        self._rx_bytes: dict[int, int] = {}  # association -> bytes received since its last C-STORE
        self._storing: set[tuple[str, str]] = set()  # (series, SOP instance) being stored now
        self._series_locks: dict[str, threading.Lock] = {}  # a series' folder: filled vs. cleared
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: Any = None
        self._server_closed = False
        self._threads: list[threading.Thread] = []
        self._processed: collections.deque[tuple[str, str]] = collections.deque(maxlen=PROCESSED_KEPT)
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_SHOWN)
        self._called_ae: dict[int, str] = {}  # association -> its called AE title (for the routes)
        self._fatal: str | None = None
        self._dead = threading.Event()  # set once a fatal error is handled: status written, server closed
        self._degraded: dict[str, str] = {}  # what is wrong now but may pass: disk full, destination down
        self._busy: tuple[str, float] | None = None
        self._endpoints: dict[str, str] = {}  # model -> "ready" | "not ready: why" (the monitor's last check)
        self._kept: dict[str, tuple[list[str], Any]] = {}  # series -> (instances, label map) not yet written

    @staticmethod
    def _new_series(study: str, now: float, count: int) -> _Series:
        return _Series(study, now, count=count)

    @property
    def processed(self) -> list[tuple[str, str]]:
        """(series UID, ``"sent"`` | ``"failed: ..."``) in order, the last ``PROCESSED_KEPT`` of them."""
        return list(self._processed)

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

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume the spool, start listening, the worker and the monitor.

        Sets pynetdicom's process-wide ``STORE_RECV_CHUNKED_DATASET`` (datasets are received to a file) and
        makes it write those files into the spool's ``tmp/`` (:func:`.receiving.receive_into`).
        """
        from pynetdicom import AE, _config, evt

        self._resume()
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

    # --- receiving: called AE titles and routes ------------------------------------------------------
    def _own_ae_title(self, called: str) -> str:
        """The called AE titles the routes map to a model are the node's own too."""
        return called if called in self.config.routes.called_ae_titles else self.config.ae_title

    def _accepted(self, assoc: Any, called: str) -> None:
        """Keep the called AE title of an accepted association: it routes the series it stores."""
        self._called_ae[id(assoc)] = called

    def _on_closed(self, event: Any) -> None:
        self._called_ae.pop(id(event.assoc), None)
        super()._on_closed(event)

    def _keep(self, staged: Path, study: str, series: str, sop: str, *, assoc_key: int) -> int:
        """Keep the instance (:meth:`.receiving.Receiving._keep`); the first one kept of a series decides
        and records its route before the C-STORE is answered."""
        called = self._called_ae.get(assoc_key)
        with self._lock:
            entry = self._pending.get(series)
            routed = entry is not None and entry.routed
        decision = None if routed else self._decide(staged, called)
        status = super()._keep(staged, study, series, sop, assoc_key=assoc_key)
        if status != STATUS_SUCCESS:
            return status
        try:
            self._note_route(series, sop, called, decision, study=study)
        except OSError as exc:  # the instance is kept; the sender sends it again and the route is recorded
            return self._spool_error(f"recording the route of series {series}", exc)
        return status

    def _decide(self, path: Path, called: str | None) -> Route | NoRoute:
        """The route of a series whose instance ``path`` came to ``called`` (only the attributes the rules
        read are read), or the :class:`NoRoute` saying why there is none."""
        routes = self.config.routes
        header: Any = {}
        if routes.keywords and not (called and called in routes.called_ae_titles):
            header = pydicom.dcmread(path, stop_before_pixels=True, defer_size=1 << 16,
                                     specific_tags=list(routes.keywords))
        try:
            return routes.decide(called, header)
        except NoRoute as exc:
            return exc

    def _note_route(self, series: str, sop: str, called: str | None,
                    decision: Route | NoRoute | None, *, study: str) -> None:
        """Record the route of a series in its state unless it has one (a later instance follows it, and so
        does a series whose earlier SEG was sent: its record keeps the route), with its study (a restart
        keeps the series with the other series of its study)."""
        with self._lock:
            entry = self._pending.get(series)
            if entry is None:  # a known instance of a sent series: nothing waits for a route
                return
            routed, first, model = entry.routed, entry.called_ae, entry.model
            other = routed and called is not None and called != first and called not in entry.other_called
            if other:
                entry.other_called.add(str(called))
        if other:
            LOGGER.warning("series %s: an instance came to called AE title %s; the series follows the route "
                           "of its first instance (called AE title %s): model %s", series, shown(called, 16),
                           shown(first, 16), model or "(none)")
        if routed:
            return
        with self._series_lock(series):
            if not self.spool.series_dir(series).is_dir():  # its instances are in done/ only: no new round
                return
            state = self.spool.state(series)
            new = "called_ae" not in state
            if new:
                if decision is None:
                    decision = self._decide(self.spool.instance(series, sop), called)
                state.update(self._route_keys(series, called, decision), study=study)
                self.spool.write_state(series, state)
        with self._lock:
            _route_entry(entry, state)
        if new and state.get("model"):
            LOGGER.info("series %s: routed to model %s (%s)", series, state["model"], state.get("route"))
        elif new:
            LOGGER.warning("series %s: %s; it will be set aside", series, state.get("route"))

    def _route_keys(self, series: str, called: str | None, decision: Route | NoRoute) -> dict[str, Any]:
        record = self.spool.record(series)
        if isinstance(record.get("model"), str):  # an earlier round was sent: the SEG series keeps its model
            return {"called_ae": record.get("called_ae"), "model": record["model"],
                    "route": f"{record.get('route') or 'recorded'}, as its earlier DICOM-SEG"}
        if isinstance(decision, Route):
            return {"called_ae": called, "model": decision.model, "route": decision.reason}
        return {"called_ae": called, "route": str(decision)}

    # --- resume and spool scans --------------------------------------------------------------------
    def _resume(self) -> None:
        self.spool.clear_tmp()
        for folder in (self.spool.incoming, self.spool.outgoing, self.spool.done):
            for leftover in folder.rglob(f".*{TEMP_MARKER}*"):  # one node per spool: nothing is being written
                leftover.unlink(missing_ok=True)
        self._scan_incoming()
        for seg in sorted(self.spool.outgoing.glob("*.dcm")):
            self._adopt_outgoing(seg)
        if self._pending:
            LOGGER.info("resuming %d spooled series", len(self._pending))

    def _scan_incoming(self) -> None:
        """Pick up series in ``incoming/`` the node does not know yet (a restart, ``requeue``)."""
        now = time.monotonic()
        for uid in self.spool.incoming_series():
            with self._lock:
                if uid in self._pending:
                    continue
            state = self.spool.state(uid)
            study = str(valid_uid(state.get("study")) or uid)
            entry = _Series(study, now, count=self.spool.count(uid), attempts=int(state.get("attempts", 0)),
                            first_failure=state.get("first_failure"))
            _route_entry(entry, state)
            with self._lock:
                self._pending.setdefault(uid, entry)
                self._study_seen.setdefault(study, now)

    def _adopt_outgoing(self, seg: Path) -> None:
        """A SEG in ``outgoing/``: part of a series in incoming/ (handled with it), sent already (removed),
        or on its own: sent when it is a readable DICOM-SEG, set aside when it is not."""
        uid = valid_uid(seg.stem)
        if uid is None or uid in self._pending:
            return
        record = self.spool.record(uid)
        sop = _seg_sop(seg)
        if sop is not None and sop == record.get("sop_uid"):
            self.spool.remove_tree(seg)  # stored by the PACS and recorded; only the cleanup was missing
        elif sop is None:
            self._set_aside_outgoing(uid, seg)
        else:
            self._pending[uid] = _Series(uid, time.monotonic() - self.config.idle_timeout_s)

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
        self._outcome(uid, "failed: unreadable DICOM-SEG in outgoing/", None)
        LOGGER.error("series %s: the DICOM-SEG in outgoing/ is unreadable; moved to %s", uid, target)

    # --- the worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        last_scan = last_sweep = time.monotonic()
        try:
            while not self._stop.wait(self.config.poll_s):
                problem = self.spool.check()
                if problem:
                    raise _Fatal(problem)
                now = time.monotonic()
                if now - last_scan >= self.config.rescan_s:
                    self._scan_incoming()
                    last_scan = now
                if now - last_sweep >= self.config.sweep_s:
                    self._sweep()
                    last_sweep = now
                uid = self._due()
                if uid is not None:
                    self._attempt(uid)
        except BaseException as exc:  # noqa: BLE001 - recorded, then the node stops accepting
            self._die(str(exc) if isinstance(exc, _Fatal) else f"worker failed: {describe(exc)}")

    def _due(self) -> str | None:
        now = time.monotonic()
        wait = self.config.idle_timeout_s
        with self._lock:
            open_studies = set().union(*self._carrying.values()) if self._carrying else set()
            storing = {series for series, _ in self._storing}
            for uid, entry in sorted(self._pending.items(), key=lambda item: item[1].last_seen):
                if uid in storing:  # an instance is being stored: its place is counted, its file not there
                    continue
                idle = now - max(entry.last_seen, self._study_seen.get(entry.study, 0.0))
                held = entry.study in open_studies and idle < self.config.max_open_wait_s
                if idle >= wait and not held and now >= entry.next_attempt:
                    return uid
        return None

    def _sweep(self) -> None:
        try:
            removed = self.spool.sweep()
        except OSError as exc:
            LOGGER.error("retention sweep failed: %s", describe(exc))
            return
        for path in removed:
            LOGGER.info("retention: removed %s/%s", path.parent.name, path.name)
        now = time.monotonic()
        with self._lock:  # studies no series waits for are forgotten, and the locks of finished series
            for uid in [u for u in self._series_locks if u not in self._pending]:
                del self._series_locks[uid]
            waiting = {entry.study for entry in self._pending.values()}
            forget_after = self.config.idle_timeout_s + self.config.max_open_wait_s
            for study, seen in list(self._study_seen.items()):
                if study not in waiting and now - seen > forget_after:
                    del self._study_seen[study]

    def _attempt(self, uid: str) -> None:
        with self._lock:
            entry = self._pending[uid]
            entry.attempts += 1
            attempt = entry.attempts
        self._busy = (uid, time.time())
        try:
            self._process(uid, entry)
        except ClientError as exc:  # a PACS or the endpoint unreachable or busy may answer later
            if isinstance(exc, PacsError) or exc.status is None or is_unavailable(exc):
                self._set_degraded("destination", f"series {uid}: {self._describe(uid, exc)}")
                self._retry_or_fail(uid, attempt, self._describe(uid, exc))
            else:  # the endpoint refused this series (e.g. INVALID_ARG): it would refuse it again
                self._fail(uid, self._describe(uid, exc), unless_grown=True)
        except OSError as exc:  # a full disk, a spool folder in trouble: may pass
            self._set_degraded("disk", f"series {uid}: {self._describe(uid, exc)}")
            self._retry_or_fail(uid, attempt, self._describe(uid, exc))
        except NnunetTritonError as exc:  # the series as it is cannot be segmented: no retry helps
            self._fail(uid, self._describe(uid, exc), unless_grown=True)
        except Exception as exc:  # noqa: BLE001 - a bug must not stop the node; the series is kept aside
            LOGGER.error("series %s: unexpected error %s", uid, self._describe(uid, exc))
            self._fail(uid, self._describe(uid, exc), unless_grown=True)
        finally:
            self._busy = None
            entry.round = None

    def _describe(self, uid: str, exc: BaseException) -> str:
        """``describe(exc)`` with the patient/study values of the series' first instance redacted too."""
        headers = []
        for folder in (self.spool.series_dir(uid), self.spool.done_dir(uid)):
            for path in self.spool.instances(folder)[:1]:
                with contextlib.suppress(Exception):
                    headers.append(pydicom.dcmread(path, stop_before_pixels=True, defer_size=1 << 16))
        return describe(exc, headers)

    def _process(self, uid: str, entry: _Series) -> None:
        folder = self.spool.series_dir(uid)
        seg_path = self.spool.seg_file(uid)
        if not folder.is_dir():  # a SEG on its own in outgoing/ (left by an earlier run)
            self._send(uid, seg_path)
            self._forget(uid)
            self.spool.remove_tree(seg_path)
            return
        state, record = self.spool.state(uid), self.spool.record(uid)
        done_dir = self.spool.done_dir(uid)
        if done_dir.is_dir():  # a late instance: the earlier ones come back, the SEG covers the whole series
            self.spool.merge_into(done_dir, folder)
            with contextlib.suppress(OSError):
                done_dir.rmdir()
        names = [p.name for p in self.spool.instances(folder)]
        entry.round = frozenset(names)
        missing = set(record.get("covers", [])) - set(names)
        if missing:
            raise InputValidationError(
                f"series {uid}: {len(names)} late instance(s) arrived after the {len(missing)} instances of "
                f"its earlier SEG were deleted (done_retention_s={self.config.limits.done_retention_s}); "
                "send the whole series again.")
        seg = state.get("seg") if isinstance(state.get("seg"), dict) else None
        sent = {"series_uid": record.get("seg_series_uid"), "sop_uid": record.get("sop_uid"),
                "instance_number": record.get("instance_number"), "covers": record.get("covers"),
                "volume": record.get("volume")}
        if record.get("sop_uid") and record.get("covers") == names and (
                seg is None or seg.get("sop_uid") == record.get("sop_uid")):
            # sent already (a crash before the cleanup), or the very instances of the SEG sent before
            # arrived again after done_retention_s: nothing new to segment
            LOGGER.info("series %s: its DICOM-SEG of these %d instance(s) was sent already", uid, len(names))
            seg = sent
        else:
            if seg is not None and seg.get("covers") == names and self._written(uid, seg):
                LOGGER.info("series %s: sending the DICOM-SEG written before (no inference)", uid)
            else:
                seg = self._segment(uid, entry, folder, state, record, names, seg)
            if not seg.get("unchanged"):
                self._send(uid, seg_path, seg)
        self._finish(uid, seg, names)

    def _segment(self, uid: str, entry: _Series, folder: Path, state: dict[str, Any], record: dict[str, Any],
                 names: list[str], seg: dict[str, Any] | None) -> dict[str, Any]:
        from pydicom.uid import generate_uid

        scan = scan_folder(folder, self.config.dicom_options)
        eligible = [s for s in scan.series if s.uid == uid]
        if not eligible:
            reasons = sorted({reason for _, reason in scan.skipped}) or ["no instances"]
            raise InputValidationError(f"series {uid}: no image volume to segment ({'; '.join(reasons)}).")
        name, model = self._model_of(uid, entry, state, eligible[0].first)
        refusal = model.modalities.refusal(str(eligible[0].first.get("Modality", "")))
        if refusal:
            raise InputValidationError(f"series {uid}: {refusal} (model {name}); it is not segmented.")
        volume = read_series(eligible[0], self.config.dicom_options)
        used = sorted(f"{ds.get('SOPInstanceUID')}.dcm" for ds in volume.datasets)
        if len(used) < len(names):
            reasons = sorted({reason for _, reason in scan.skipped}) or ["not slices of the volume"]
            LOGGER.info("series %s: %d of its %d instance(s) are not part of the volume and cannot change "
                        "the segmentation (%s)", uid, len(names) - len(used), len(names), "; ".join(reasons))
        if record.get("sop_uid") and record.get("volume") == used:
            LOGGER.info("series %s: its late instance(s) do not change the volume; the DICOM-SEG sent before "
                        "stands (no inference, no new SEG)", uid)
            return {"series_uid": record.get("seg_series_uid"), "sop_uid": record.get("sop_uid"),
                    "instance_number": record.get("instance_number"), "covers": names, "volume": used,
                    "unchanged": True}
        LOGGER.info("series %s: segmenting %d instance(s) with model %s", uid, len(used), name)
        if seg is None or seg.get("covers") != names:  # a new round: new SOP instance, same SEG series
            series_uid = state.get("seg_series_uid") or record.get("seg_series_uid") or generate_uid()
            seg = {"series_uid": series_uid, "sop_uid": generate_uid(),
                   "instance_number": int(record.get("instance_number", 0)) + 1, "covers": names}
        if model.output.rtstruct and not seg.get("rt_sop_uid"):  # the RTSTRUCT's own series, kept likewise
            rt_series = state.get("rt_series_uid") or record.get("rt_series_uid") or generate_uid()
            seg.update(rt_series_uid=rt_series, rt_sop_uid=generate_uid())
        seg["output"] = str(model.output)
        seg["volume"] = used
        state.update(seg=seg, seg_series_uid=seg["series_uid"], study=entry.study,
                     **({"rt_series_uid": seg["rt_series_uid"]} if seg.get("rt_series_uid") else {}))
        self.spool.write_state(uid, state)  # the UIDs exist before the file does
        kept = self._kept.get(uid)
        if kept is not None and kept[0] == names:
            LOGGER.info("series %s: writing the label map kept from the attempt before (no inference)", uid)
            segmentation = kept[1]
        else:
            self._check_seg_space(uid, volume, model)  # a full disk costs no inference
            segmentation = model.segment(volume)
            self._kept[uid] = (names, segmentation)
        labels = model.labels or generic_segment_labels(segmentation)
        paths = write_dicom_outputs(
            segmentation, volume, labels, model.output, seg_path=self.spool.seg_file(uid),
            rtstruct_path=self.spool.rtstruct_file(uid), seg_uids=(seg["series_uid"], seg["sop_uid"]),
            rtstruct_uids=(seg.get("rt_series_uid"), seg.get("rt_sop_uid")),
            instance_number=int(seg["instance_number"]), durable=True)
        self._kept.pop(uid, None)
        self.spool.add(sum(path.stat().st_size for path in paths))
        return seg

    def _outputs(self, uid: str, seg: Mapping[str, Any]) -> list[tuple[Path, str | None]]:
        """(file, its SOP Instance UID) of every object of the round ``seg`` (the SEG, the RTSTRUCT)."""
        output = DicomOutput(seg.get("output") or DicomOutput.SEG)
        return ([(self.spool.seg_file(uid), seg.get("sop_uid"))] if output.seg else []) + (
            [(self.spool.rtstruct_file(uid), seg.get("rt_sop_uid"))] if output.rtstruct else [])

    def _written(self, uid: str, seg: Mapping[str, Any]) -> bool:
        """Whether every object of the round ``seg`` is in outgoing/ as written (sent again, no inference)."""
        return all(_seg_sop(path) == sop for path, sop in self._outputs(uid, seg))

    def _check_seg_space(self, uid: str, volume: Any, model: NodeModel) -> None:
        """Raise ENOSPC before inference when the SEG would not fit: on the spool's disk or in its quota
        (a binary SEG: one bit per voxel and segment, plus its header)."""
        segments = max(1, len(model.labels or ()))
        needed = int(np.prod(np.shape(volume.data))) // 8 * segments + SEG_HEADER_BYTES
        free = shutil.disk_usage(self.spool.outgoing).free
        quota_left = self.config.limits.max_spool_bytes - self.spool.used
        if min(free, quota_left) < needed:
            where = "free on the spool's disk" if free < needed else "left in max_spool_bytes"
            raise OSError(errno.ENOSPC, f"series {uid}: its DICOM-SEG needs about {needed} bytes, "
                                        f"{min(free, quota_left)} {where}; not segmented until there is room")

    def _model_of(self, uid: str, entry: _Series, state: dict[str, Any],
                  header: Any) -> tuple[str, NodeModel]:
        """The model of the series' recorded route; routed now (and recorded with the state) when it has
        none (a spool of an earlier node, a crash before the route was written) or when the node no longer
        serves its model (the routes changed). A series nothing routes cannot be segmented."""
        recorded = state.get("model")
        model = self.config.model_for(recorded)
        if model is None:
            called = state.get("called_ae") if isinstance(state.get("called_ae"), str) else None
            try:
                route = self.config.routes.decide(called, header)
            except NoRoute as exc:
                raise InputValidationError(f"series {uid}: {exc}; it is not segmented.") from None
            if isinstance(recorded, str):
                LOGGER.warning("series %s: its model %s is not served by this node now; routed again to "
                               "model %s (%s)", uid, shown(recorded, 48), route.model, route.reason)
            else:
                LOGGER.info("series %s: routed to model %s (%s)", uid, route.model, route.reason)
            state.update(called_ae=called, model=route.model, route=route.reason)
            recorded, model = route.model, self.config.model_for(route.model)
            if model is None:  # NodeConfig checks that every routed model is served
                raise InputValidationError(f"series {uid}: model {route.model} is not served by this node.")
        with self._lock:
            _route_entry(entry, state)
        return str(recorded), model

    def _send(self, uid: str, seg_path: Path, seg: Mapping[str, Any] | None = None) -> None:
        files = [path for path, _ in self._outputs(uid, seg)] if seg is not None else [seg_path]
        what = "the DICOM-SEG" if files == [seg_path] else (
            f"the {'DICOM-SEG and ' * (seg_path in files)}RTSTRUCT")
        self.config.destination.send(files, what=f"{what} of series {uid}")
        self._set_degraded("destination", None)

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
        with self._series_lock(uid):  # no instance lands in the folder while it is found empty and removed
            with self._lock:
                remaining = self.spool.instances(folder)
                entry = self._pending[uid]
                if remaining:  # instances arrived while segmenting: another round, for the whole series
                    entry.attempts, entry.first_failure, entry.count = 0, None, len(remaining) + len(names)
                else:
                    self._pending.pop(uid, None)
            if not remaining:
                self.spool.remove_tree(folder)
        if remaining:
            self.spool.write_state(uid, {"seg_series_uid": seg["series_uid"], "study": entry.study, **route})
        self._outcome(uid, "sent", route.get("model"))
        LOGGER.info("series %s: DICOM-SEG sent (model %s)", uid, route.get("model") or "unknown")

    def _outcome(self, uid: str, outcome: str, model: object) -> None:
        self._processed.append((uid, outcome))
        self._recent.append({"series": uid, "model": model if isinstance(model, str) else None,
                             "outcome": outcome.split(":")[0], "at": time.time()})

    def _series_lock(self, uid: str) -> threading.Lock:
        with self._lock:
            return self._series_locks.setdefault(uid, threading.Lock())

    def _forget(self, uid: str) -> None:
        with self._lock:
            entry = self._pending.pop(uid, None)
        self._outcome(uid, "sent", entry.model if entry else None)
        LOGGER.info("series %s: DICOM-SEG sent", uid)

    def _retry_or_fail(self, uid: str, attempt: int, message: str) -> None:
        config = self.config
        with self._lock:
            entry = self._pending[uid]
            entry.first_failure = entry.first_failure or time.time()
            first = entry.first_failure
        over_window = time.time() - first >= config.retry_window_s
        if over_window or (config.retries is not None and attempt > config.retries):
            window = f", {time.time() - first:.0f} s after the first failure" if over_window else ""
            self._fail(uid, f"{message} (after {attempt} attempts{window})")
            return
        delay = config.retry_policy.delay(attempt - 1)
        with self._lock:
            entry.next_attempt = time.monotonic() + delay
        folder = self.spool.series_dir(uid)
        if folder.is_dir():
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
        with self._lock:
            entry = self._pending.get(uid)
            model, route = (entry.model, entry.route) if entry is not None else (None, "")
        routed = f"model: {model} ({route})\n" if model else ""
        try:
            with self._series_lock(uid):
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
            with self._lock:
                entry = self._pending.get(uid)
                if entry is not None:
                    entry.next_attempt = time.monotonic() + max(self.config.retry_delay_s, 1.0)
            return
        with self._lock:
            self._pending.pop(uid, None)
        self._kept.pop(uid, None)
        self._outcome(uid, f"failed: {message}", model)
        LOGGER.error("series %s: moved to %s: %s", uid, target, message)

    def _grown(self, uid: str, entry: _Series | None, folder: Path) -> bool:
        """Whether instances arrived in the series' folder during the attempt in progress (then the entry
        is made ready for another round, after the idle timeout; called under the series' lock)."""
        if entry is None or entry.round is None or not folder.is_dir():
            return False
        with self._lock:  # one being stored now is linked into the folder once the series' lock is free
            storing = any(series == uid for series, _ in self._storing)
        if not storing and not {p.name for p in self.spool.instances(folder)} - entry.round:
            return False
        with self._lock:
            entry.attempts, entry.first_failure, entry.next_attempt = 0, None, 0.0
        self._kept.pop(uid, None)
        return True

    # --- health ------------------------------------------------------------------------------------
    def _monitor(self) -> None:
        checked = None
        while not self._stop.wait(self.config.heartbeat_s):
            worker = self._threads[0] if self._threads else None
            if worker is not None and not worker.is_alive() and not self._stop.is_set():
                self._die("the worker thread ended")
            if checked is None or time.monotonic() - checked >= self.config.endpoint_check_s:
                self._check_endpoints()
                checked = time.monotonic()
            self._write_status()

    def _check_endpoints(self) -> None:
        """Ask every served model's endpoint whether it is ready; one that is not makes the node degraded."""
        for name in self.config.served:
            model = self.config.model_for(name)
            if model is None or model.ready is None:
                continue
            try:
                model.ready()
            except Exception as exc:  # noqa: BLE001 - any failure means not ready
                self._endpoints[name] = f"not ready: {describe(exc)}"
                self._set_degraded(f"endpoint {name}", f"endpoint {name} is not ready ({describe(exc)})")
            else:
                self._endpoints[name] = "ready"
                self._set_degraded(f"endpoint {name}", None)

    def _set_degraded(self, key: str, reason: str | None) -> None:
        with self._lock:
            if reason is None:
                self._degraded.pop(key, None)
            else:
                self._degraded[key] = reason

    def _stuck(self) -> str | None:
        """Why the worker counts as stuck (one series in progress for longer than ``max_busy_s``), or None."""
        busy = self._busy
        if busy is None:
            return None
        elapsed = time.time() - busy[1]
        if elapsed <= self.config.max_busy_s:
            return None
        return (f"the worker has been busy with series {busy[0]} for {elapsed:.0f} s, more than "
                f"max_busy_s={self.config.max_busy_s:g} (endpoint or destination hung?)")

    def _refuses_new_series(self) -> str | None:
        return self._stuck()

    def status(self) -> dict[str, Any]:
        """What ``status.json`` holds: state ``ok`` | ``degraded`` | ``unhealthy``, the reasons, counts;
        ``worker_stuck`` when a series has been in progress for longer than ``max_busy_s`` (degraded, and
        :func:`read_status` says unhealthy)."""
        busy = self._busy
        stuck = self._stuck()
        with self._lock:
            pending = len(self._pending)
            degraded = sorted(self._degraded.values()) + ([stuck] if stuck else [])
            by_model = collections.Counter(e.model or "(no route yet)" for e in self._pending.values())
            busy_entry = self._pending.get(busy[0]) if busy else None
            recent = list(self._recent)
        state = "unhealthy" if self._fatal else ("degraded" if degraded else "ok")
        return {"state": state, "reason": self._fatal or "; ".join(degraded), "pid": os.getpid(),
                "updated": time.time(), "heartbeat_s": self.config.heartbeat_s, "pending_series": pending,
                "busy_series": busy[0] if busy else None, "busy_since": busy[1] if busy else None,
                "worker_stuck": stuck is not None, "max_busy_s": self.config.max_busy_s,
                "endpoints": dict(self._endpoints),
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
                self._set_degraded("disk", "the spool's disk is full")
            LOGGER.debug("could not write the node status: %s", describe(exc))
        except Exception as exc:  # noqa: BLE001 - the monitor must outlive a bug in the status
            LOGGER.error("could not write the node status: %s", describe(exc))


def _route_entry(entry: _Series, state: Mapping[str, Any]) -> None:
    """Copy a series' recorded route (its state's ROUTE_KEYS) to its entry (under the node's lock once the
    entry is in ``_pending``)."""
    if "called_ae" not in state and not isinstance(state.get("model"), str):
        return
    called, model = state.get("called_ae"), state.get("model")
    entry.routed = True
    entry.called_ae = called if isinstance(called, str) else None
    entry.model = model if isinstance(model, str) else None
    entry.route = str(state.get("route") or "")


def _seg_sop(path: Path) -> str | None:
    """The SOPInstanceUID of a readable DICOM file at ``path``, else None (missing, empty, damaged)."""
    try:
        if path.stat().st_size == 0:
            return None
        return valid_uid(pydicom.dcmread(path, stop_before_pixels=True).get("SOPInstanceUID"))
    except Exception:  # noqa: BLE001 - any reason it cannot be read means it cannot be sent
        return None


