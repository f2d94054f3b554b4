"""The receiving side of the DICOM node: pynetdicom's event handlers (association request, data, C-STORE,
connection closed), as a mixin of :class:`~.node.DicomNode` (through
:class:`~.receiving_routes.RoutedReceiving`). It writes every instance it keeps to the spool and records
it in the series queue (:class:`~.series_queue.SeriesQueue`), from which the series worker takes the
complete series; see :mod:`.node` for the whole story."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pydicom

from nnunet_triton.client.dicom.access import DEFLATED, REJECT_UNAVAILABLE, Refusal
from nnunet_triton.client.dicom.node_health import NodeHealth
from nnunet_triton.client.dicom.phi import describe
from nnunet_triton.client.dicom.series_queue import PendingSeries, SeriesQueue
from nnunet_triton.client.dicom.spool import InstanceTooLarge, Spool, inflate_deflated
from nnunet_triton.client.dicom.uids import UID_RULE, valid_uid

__all__ = ["Receiving", "receive_into", "STATUS_SUCCESS",
           "STATUS_OUT_OF_RESOURCES", "STATUS_CANNOT_UNDERSTAND",
           "STATUS_SOP_CLASS_NOT_SUPPORTED", "RX_SLACK"]

LOGGER = logging.getLogger("nnunet_triton.client.dicom.node")  # one logger for the node's story
# C-STORE status codes (PS3.4 Annex B.2.3, PS3.7 C.4)
STATUS_SUCCESS, STATUS_OUT_OF_RESOURCES, STATUS_CANNOT_UNDERSTAND = 0x0000, 0xA700, 0xC000
STATUS_SOP_CLASS_NOT_SUPPORTED = 0x0122
RX_SLACK = 1 << 20  # command set and PDU headers on top of an instance's bytes


_RECEIVE_DIR: list[Path] = []  # the spools' tmp/ folders of the nodes running in this process, newest last


_FAILED_RECEIVES: set[str] = set()  # receive files a write failed for (a full disk): answered 0xA700


class _ReceiveFile:
    """pynetdicom's temporary file, whose writes never raise: a write that fails (a full disk) marks the
    file incomplete (:data:`_FAILED_RECEIVES`) instead of aborting the association, so the C-STORE is
    answered "out of resources" and the sender keeps the instance."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.name = handle.name
        self.file = self

    def write(self, data: bytes) -> int:
        if self.name in _FAILED_RECEIVES:
            return len(data)
        try:
            return int(self._handle.write(data))
        except OSError:
            _FAILED_RECEIVES.add(self.name)
            return len(data)

    def flush(self) -> None:
        try:
            self._handle.flush()
        except OSError:
            _FAILED_RECEIVES.add(self.name)

    def close(self) -> None:
        try:
            self._handle.close()
        except OSError:
            _FAILED_RECEIVES.add(self.name)


def _spool_temporary_file(*args: Any, **kwargs: Any) -> Any:
    """pynetdicom's NamedTemporaryFile for a dataset being received, in the spool's ``tmp/`` (counted by
    the quota, removed at the next start after a crash) instead of the machine's TMPDIR."""
    from tempfile import NamedTemporaryFile

    folders = [f for f in reversed(_RECEIVE_DIR) if f.is_dir()]
    if folders:
        kwargs.setdefault("dir", folders[0])
        kwargs.setdefault("prefix", "pynetdicom-")
    return _ReceiveFile(NamedTemporaryFile(*args, **kwargs))


def receive_into(folder: Path | None, *, previous: Path | None = None) -> None:
    """Make pynetdicom write the datasets it receives into ``folder`` (a spool's ``tmp/``); ``previous``
    is forgotten (a node that stops). Process-wide, like pynetdicom's ``STORE_RECV_CHUNKED_DATASET``."""
    from pynetdicom import dimse_messages

    if previous is not None and previous in _RECEIVE_DIR:
        _RECEIVE_DIR.remove(previous)
    if folder is not None:
        _RECEIVE_DIR.append(folder)
    dimse_messages.NamedTemporaryFile = _spool_temporary_file  # type: ignore[assignment]


class Receiving:
    """pynetdicom handlers of :class:`~.node.DicomNode`; every instance is checked, then kept durably in
    ``spool`` and recorded in ``queue`` (under ``queue.lock``); what is wrong but may pass goes to
    ``health``."""

    config: Any
    spool: Spool
    queue: SeriesQueue
    health: NodeHealth
    _rx_bytes: dict[int, int]
    _fatal: str | None
    _server: Any

    # --- associations ------------------------------------------------------------------------------
    def _own_ae_title(self, called: str) -> str:
        """The AE title an association must call to reach this node (a node that answers to several titles,
        one per routed model, accepts ``called`` when it is one of them)."""
        return self.config.ae_title

    def _refuses_new_series(self) -> str | None:
        """Why the node takes no new series now (its worker is stuck), or None."""
        return None

    def _accepted(self, assoc: Any, called: str) -> None:
        """An association was accepted; ``called`` is the AE title it called (kept by a routing node)."""

    def _on_requested(self, event: Any) -> None:
        """EVT_REQUESTED: decide the association before pynetdicom negotiates it."""
        assoc = event.assoc
        request = assoc.requestor.primitive
        host = str(assoc.requestor.address)
        called = str(request.called_ae_title).strip()
        if self._fatal is not None or self._server is None:
            refusal: Refusal | None = Refusal(REJECT_UNAVAILABLE, "the node is not working (see its status)")
        else:
            from_host = sum(1 for a in self._server.active_associations if str(a.requestor.address) == host)
            refusal = self.config.access.refusal(
                own_ae=self._own_ae_title(called), called_ae=called,
                calling_ae=str(request.calling_ae_title), host=host, listening_host=self.config.host,
                from_host=from_host)
        if refusal is None:
            self._accepted(assoc, called)
            return
        LOGGER.warning("refused an association from %s: %s", host, refusal.reason)
        assoc.acse.send_reject(*refusal.rsd)
        assoc.is_rejected = True
        assoc.kill()

    def _on_data(self, event: Any) -> None:
        """EVT_DATA_RECV: abort an association whose instance grows past ``max_instance_bytes``."""
        key = id(event.assoc)
        received = self._rx_bytes.get(key, 0) + len(event.data)
        self._rx_bytes[key] = received
        limit = self.config.limits.max_instance_bytes
        if received > limit + RX_SLACK:
            self._rx_bytes[key] = -(1 << 62)  # abort once
            LOGGER.warning("aborted the association from %s: an instance exceeded max_instance_bytes=%d",
                           event.assoc.requestor.address, limit)
            event.assoc.abort()

    def _on_closed(self, event: Any) -> None:
        """EVT_CONN_CLOSE: forget the association; remove the dataset it was sending when it ended."""
        key = id(event.assoc)
        self._rx_bytes.pop(key, None)
        with self.queue.lock:
            self.queue.carrying.pop(key, None)
        message = getattr(getattr(event.assoc, "dimse", None), "message", None)
        partial = getattr(message, "_data_set_file", None)
        if partial is not None:  # pynetdicom keeps a half-received dataset in a temporary file
            _FAILED_RECEIVES.discard(partial.name)
            with contextlib.suppress(OSError):
                partial.close()
                os.unlink(partial.name)

    # --- receiving ---------------------------------------------------------------------------------
    def _on_store(self, event: Any) -> int:
        self._rx_bytes[id(event.assoc)] = 0
        try:
            return self._receive(event)
        except Exception as exc:  # noqa: BLE001 - one bad instance is refused, the node goes on
            LOGGER.error("refused an instance from %s: %s", event.assoc.requestor.address, describe(exc))
            return STATUS_CANNOT_UNDERSTAND

    def _receive(self, event: Any) -> int:
        if self._fatal is not None:
            return STATUS_OUT_OF_RESOURCES
        source = Path(event.dataset_path)  # STORE_RECV_CHUNKED_DATASET: the dataset as it arrived
        if str(source) in _FAILED_RECEIVES:
            _FAILED_RECEIVES.discard(str(source))
            return self._spool_error("receiving an instance into the spool's tmp/",
                                     OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        limits = self.spool.limits
        if source.stat().st_size > limits.max_instance_bytes + RX_SLACK:
            LOGGER.warning("refused an instance of %d bytes: more than max_instance_bytes=%d",
                           source.stat().st_size, limits.max_instance_bytes)
            return STATUS_OUT_OF_RESOURCES
        staged = self.spool.staging()
        try:
            try:
                self._stage(event, source, staged)
            except InstanceTooLarge as exc:
                LOGGER.warning("refused an instance from %s: %s", event.assoc.requestor.address, exc)
                return STATUS_OUT_OF_RESOURCES
            except OSError as exc:
                return self._spool_error("staging a received instance", exc)
            ids = self._identify(staged, event)
            if isinstance(ids, int):
                return ids
            return self._keep(staged, *ids, assoc_key=id(event.assoc))
        finally:
            staged.unlink(missing_ok=True)

    def _stage(self, event: Any, source: Path, staged: Path) -> None:
        from pydicom.filereader import read_file_meta_info

        if str(event.context.transfer_syntax) == DEFLATED:
            inflate_deflated(source, staged, limit=self.spool.limits.max_instance_bytes,
                             file_meta=read_file_meta_info(source))
        else:
            shutil.copyfile(source, staged)

    def _identify(self, staged: Path, event: Any) -> tuple[str, str, str] | int:
        """(study, series, SOP instance UID) of a staged instance, or the status refusing it."""
        header = pydicom.dcmread(staged, stop_before_pixels=True, defer_size=1 << 16)
        request = event.request
        sop, sop_class = valid_uid(header.get("SOPInstanceUID")), valid_uid(header.get("SOPClassUID"))
        series, study = valid_uid(header.get("SeriesInstanceUID")), valid_uid(header.get("StudyInstanceUID"))
        broken = [name for name, value in (("SOPInstanceUID", sop), ("SOPClassUID", sop_class),
                                           ("SeriesInstanceUID", series), ("StudyInstanceUID", study))
                  if value is None]
        if broken:
            LOGGER.warning("refused an instance from %s: %s not %s", event.assoc.requestor.address,
                           "/".join(broken), UID_RULE)
            return STATUS_CANNOT_UNDERSTAND
        if sop != str(request.AffectedSOPInstanceUID) or sop_class != str(request.AffectedSOPClassUID):
            LOGGER.warning("refused instance %s of series %s: its UIDs differ from the C-STORE request's",
                           sop, series)
            return STATUS_CANNOT_UNDERSTAND
        if sop_class not in self.config.access.storage_classes:
            LOGGER.warning("refused instance %s of series %s: SOP class %s is not accepted", sop, series,
                           sop_class)
            return STATUS_SOP_CLASS_NOT_SUPPORTED
        return str(study), str(series), str(sop)

    def _keep(self, staged: Path, study: str, series: str, sop: str, *, assoc_key: int) -> int:
        """Check duplicates, limits and quota and reserve the instance's place in the series' count, all
        under the node's lock; then hard-link it into ``incoming/`` (exclusive: an instance already there
        is never replaced) durably."""
        limits = self.spool.limits
        size = staged.stat().st_size
        now = time.monotonic()
        with self.queue.lock:
            if (series, sop) in self.queue.storing:  # another association is storing the same instance now
                self._seen(series, study, now, assoc_key)
                LOGGER.warning("refused instance %s of series %s: another association is storing it now",
                               sop, series)
                return STATUS_OUT_OF_RESOURCES
            if self.spool.known(series, sop):  # e.g. a PACS sending the whole series again after a restart
                self._seen(series, study, now, assoc_key)
                LOGGER.info("series %s: instance %s is spooled already; not stored again", series, sop)
                return STATUS_SUCCESS
            pending = self.queue.pending.get(series)
            stuck = self._refuses_new_series() if pending is None else None
            if stuck:  # a series it could not process for a long time: the sender keeps it and retries
                LOGGER.warning("refused instance %s of new series %s: %s", sop, series, stuck)
                return STATUS_OUT_OF_RESOURCES
            count = pending.count if pending is not None else self.spool.count(series)
            if count >= limits.max_instances_per_series:
                LOGGER.warning("refused instance %s of series %s: the series has %d instances, the limit "
                               "max_instances_per_series", sop, series, count)
                return STATUS_OUT_OF_RESOURCES
            if not self.spool.reserve(size):
                quota = f"spool quota max_spool_bytes={limits.max_spool_bytes} reached"
                self.health.degraded["quota"] = quota
                LOGGER.warning("refused instance %s of series %s: the spool quota of %d bytes is reached",
                               sop, series, limits.max_spool_bytes)
                return STATUS_OUT_OF_RESOURCES
            # the place is reserved before the data is accepted: concurrent stores see it counted
            entry = pending if pending is not None else self.queue.pending.setdefault(
                series, PendingSeries(study, now, count=count))
            entry.count += 1
            self.queue.storing.add((series, sop))
        placed = False
        try:
            with open(staged, "rb") as handle:
                os.fsync(handle.fileno())
            with self.queue.series_lock(series):  # the worker does not clear the folder meanwhile
                placed = self.spool.place(staged, self.spool.instance(series, sop))
        except OSError as exc:
            return self._spool_error(f"spooling instance {sop} of series {series}", exc)
        finally:
            self._settle(series, sop, entry, placed=placed, size=size, study=study, assoc_key=assoc_key)
        if not placed:
            LOGGER.info("series %s: instance %s is spooled already; not stored again", series, sop)
        return STATUS_SUCCESS

    def _settle(self, series: str, sop: str, entry: Any, *, placed: bool, size: int, study: str,
                assoc_key: int) -> None:
        """End a reservation: count the instance stored, or give its place and bytes back."""
        now = time.monotonic()
        with self.queue.lock:
            self.queue.storing.discard((series, sop))
            if not placed:
                self.spool.release(size)
                entry.count -= 1
                pending = self.queue.pending
                if entry.count <= 0 and pending.get(series) is entry and not self.spool.count(series):
                    del pending[series]
                return
            self.health.degraded.pop("disk", None)
            self.health.degraded.pop("quota", None)
            self.queue.pending.setdefault(series, entry)  # the worker may have finished the series meanwhile
            self._seen(series, study, now, assoc_key, entry)

    def _seen(self, series: str, study: str, now: float, assoc_key: int, entry: Any = None) -> None:
        """An instance of ``series`` arrived (stored now, or one the spool has already): the series and its
        study are not idle, and the association counts as delivering the study (it holds the study's series
        while it is open). Called under the node's lock. A sender that sends a whole series again (a PACS
        after the node restarted) keeps it open with the instances the spool has too, so it is not cut in
        the middle of the re-send; a series recovered from the spool without a recorded study (it stands
        for its own study then) learns it here."""
        entry = entry if entry is not None else self.queue.pending.get(series)
        if entry is not None:
            entry.last_seen = now
            if entry.study == series:
                entry.study = study
        self.queue.study_seen[study] = now
        self.queue.carrying.setdefault(assoc_key, set()).add(study)

    def _spool_error(self, what: str, exc: OSError) -> int:
        reason = f"{what} failed: {os.strerror(exc.errno) if exc.errno else type(exc).__name__}"
        self.health.set_degraded("disk", reason)
        LOGGER.error("could not keep a received instance: %s", reason)
        return STATUS_OUT_OF_RESOURCES
