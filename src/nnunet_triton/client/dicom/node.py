"""A DICOM node (``nnunet-triton listen``): receive series by C-STORE, segment them, send the DICOM-SEG on.

A PACS routes studies to the node's AE title. Every received instance is written atomically to the spool
folder before the C-STORE is answered (``incoming/<SeriesInstanceUID>/<SOPInstanceUID>.dcm``), so nothing
that was acknowledged is lost when the process or the endpoint fails. A series counts as complete when no
instance arrived for ``idle_timeout_s``; it is then read like a DICOM folder (the same series selection and
geometry checks), segmented through the ``nnunet`` endpoint, written as DICOM-SEG (``outgoing/``) and sent to
the destination (C-STORE to an AE, or STOW-RS). A failure the next attempt may not repeat (endpoint or
destination unreachable, association refused, STOW-RS rejected) is retried with exponential backoff; after
``retries`` attempts, or at once for a series that cannot be segmented (no image volume, missing slices,
mixed geometry), the series moves to ``failed/<SeriesInstanceUID>/`` with ``error.txt``. On start the spool
is resumed: series still in ``incoming/`` are processed, SEGs still in ``outgoing/`` are sent again.

Logs name series by UID only: no patient names, IDs or dates.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydicom

from nnunet_triton.client.dicom.seg import SegmentLabel, generic_segment_labels, write_dicom_seg
from nnunet_triton.client.dicom.volume import DicomOptions, read_series, scan_folder
from nnunet_triton.client.dicom.web import DicomWebAuth, DicomWebLocation, is_dicomweb, store_files
from nnunet_triton.client.endpoint import is_unavailable
from nnunet_triton.client.imageio import atomic_output, remove_stale_partials
from nnunet_triton.errors import ClientError, InputValidationError, NnunetTritonError, PacsError

__all__ = ["StoreDestination", "DicomWebDestination", "parse_destination", "NodeConfig", "DicomNode"]

LOGGER = logging.getLogger(__name__)
_UID = re.compile(r"^[0-9]+(\.[0-9]+)*$")
_STATE = ".state.json"  # attempts and last error of a series in incoming/ (dot files are not DICOM input)
MAX_DELAY_S = 300.0
# C-STORE status codes (PS3.4 Annex B.2.3)
STATUS_SUCCESS, STATUS_OUT_OF_RESOURCES, STATUS_CANNOT_UNDERSTAND = 0x0000, 0xA700, 0xC000


def _sop_uid(ds: pydicom.Dataset, keyword: str) -> str | None:
    value = str(ds.get(keyword, ""))
    return value if len(value) <= 64 and _UID.match(value) else None


@dataclass(frozen=True)
class StoreDestination:
    """C-STORE to ``ae_title`` at ``host:port``, calling as ``calling_ae``."""

    ae_title: str
    host: str
    port: int
    calling_ae: str = "NNUNET"

    def send(self, paths: Sequence[Path], what: str) -> None:
        """Store ``paths``; raises :class:`PacsError` (naming ``what``) when refused or not stored."""
        from pynetdicom import AE

        datasets = [pydicom.dcmread(p) for p in paths]
        ae = AE(ae_title=self.calling_ae)
        for ds in datasets:
            ae.add_requested_context(ds.SOPClassUID, ds.file_meta.TransferSyntaxUID)
        peer = f"{self.ae_title}@{self.host}:{self.port}"
        assoc = ae.associate(self.host, self.port, ae_title=self.ae_title)
        if not assoc.is_established:
            raise PacsError(f"C-STORE of {what} to {peer}: the association was refused, aborted or not "
                            "answered (check the AE title, host, port and the peer's allowed callers).")
        try:
            for ds in datasets:
                status = assoc.send_c_store(ds)
                code = int(getattr(status, "Status", -1)) if status else -1
                if code != STATUS_SUCCESS and not 0xB000 <= code <= 0xBFFF:  # warnings still store
                    raise PacsError(f"C-STORE of {what} to {peer} failed with status "
                                    f"{'none' if code < 0 else hex(code)}.")
        finally:
            assoc.release()
        LOGGER.info("sent %s to %s", what, peer)


@dataclass(frozen=True)
class DicomWebDestination:
    """STOW-RS to a DICOMweb service."""

    location: DicomWebLocation

    def send(self, paths: Sequence[Path], what: str) -> None:
        store_files(self.location, paths, what=what)


def parse_destination(text: str, *, calling_ae: str = "NNUNET", auth: DicomWebAuth | None = None
                      ) -> StoreDestination | DicomWebDestination:
    """``AET@HOST:PORT`` (C-STORE) or ``dicomweb://HOST[:PORT]/ROOT`` (STOW-RS)."""
    if is_dicomweb(text):
        return DicomWebDestination(DicomWebLocation.parse(text, auth))
    match = re.fullmatch(r"([^@]{1,16})@([^:@]+):(\d{1,5})", text)
    if not match:
        raise PacsError(f"destination must be AET@HOST:PORT or dicomweb://HOST[:PORT]/ROOT, got {text!r}.")
    return StoreDestination(match.group(1), match.group(2), int(match.group(3)), calling_ae=calling_ae)


@dataclass(frozen=True)
class NodeConfig:
    """What the node listens on, where it spools and sends, and how it retries.

    ``segment(volume)`` returns the label map for a :class:`~.volume.DicomVolume`; ``labels`` names the
    DICOM-SEG segments (None: ``label_<v>`` for the values present).
    """

    ae_title: str
    port: int
    spool: Path
    destination: StoreDestination | DicomWebDestination
    segment: Callable[[Any], Any]
    labels: Sequence[SegmentLabel] | None = None
    host: str = "127.0.0.1"
    idle_timeout_s: float = 10.0
    retries: int = 3
    retry_delay_s: float = 5.0
    dicom_options: DicomOptions = field(default_factory=DicomOptions)

    def __post_init__(self) -> None:
        if not 1 <= len(self.ae_title) <= 16:
            raise PacsError(f"AE title must have 1 to 16 characters, got {self.ae_title!r}.")
        if self.idle_timeout_s <= 0 or self.retries < 0 or self.retry_delay_s < 0:
            raise PacsError("idle timeout must be > 0, retries and retry delay >= 0, got "
                            f"{self.idle_timeout_s}, {self.retries}, {self.retry_delay_s}.")


@dataclass
class _Pending:
    last_seen: float
    attempts: int = 0
    next_attempt: float = 0.0


class DicomNode:
    """The listening AE plus the worker that turns complete series into sent DICOM-SEGs."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        spool = config.spool
        self.incoming, self.outgoing, self.failed = spool / "incoming", spool / "outgoing", spool / "failed"
        for folder in (self.incoming, self.outgoing, self.failed):
            folder.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: Any = None
        self._worker: threading.Thread | None = None
        self.processed: list[tuple[str, str]] = []  # (series UID, "sent" | "failed: ...") in order

    # --- receiving ---------------------------------------------------------------------------------
    def _on_store(self, event: Any) -> int:
        try:
            ds = event.dataset
            ds.file_meta = event.file_meta
        except Exception:  # noqa: BLE001 - an undecodable dataset is refused, not fatal to the node
            return STATUS_CANNOT_UNDERSTAND
        series, sop = _sop_uid(ds, "SeriesInstanceUID"), _sop_uid(ds, "SOPInstanceUID")
        if series is None or sop is None:
            LOGGER.warning("refused an instance without valid SeriesInstanceUID/SOPInstanceUID")
            return STATUS_CANNOT_UNDERSTAND
        try:  # atomic: a crash leaves the old file or none, never half a file (and no .dcm temporary)
            with atomic_output(self.incoming / series / f"{sop}.dcm") as temp:
                ds.save_as(temp, enforce_file_format=True)
        except OSError as exc:
            LOGGER.error("could not spool instance %s of series %s: %s", sop, series, exc.strerror)
            return STATUS_OUT_OF_RESOURCES
        with self._lock:
            pending = self._pending.setdefault(series, _Pending(time.monotonic()))
            pending.last_seen = time.monotonic()
        return STATUS_SUCCESS

    def start(self) -> None:
        """Resume the spool, start listening and start the worker thread."""
        from pynetdicom import AE, AllStoragePresentationContexts, VerificationPresentationContexts, evt

        now = time.monotonic()
        for folder in sorted(p for p in self.incoming.iterdir() if p.is_dir()):
            remove_stale_partials(folder)  # instances a dead run was still writing (never acknowledged)
            self._pending[folder.name] = _Pending(now, attempts=self._state(folder).get("attempts", 0))
        if self._pending:
            LOGGER.info("resuming %d spooled series", len(self._pending))
        ae = AE(ae_title=self.config.ae_title)
        ae.supported_contexts = [*AllStoragePresentationContexts, *VerificationPresentationContexts]
        self._server = ae.start_server((self.config.host, self.config.port), block=False,
                                       evt_handlers=[(evt.EVT_C_STORE, self._on_store)])
        self._worker = threading.Thread(target=self._run, name="nnunet-triton-node", daemon=True)
        self._worker.start()
        LOGGER.info("listening as %s on %s:%d, spool %s", self.config.ae_title, self.config.host,
                    self.config.port, self.config.spool)

    def stop(self) -> None:
        """Stop listening; the series being processed finishes first, nothing spooled is removed."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
        if self._worker is not None:
            self._worker.join(timeout=600)

    # --- processing --------------------------------------------------------------------------------
    def _run(self) -> None:
        self._resend_outgoing()
        while not self._stop.wait(0.2):
            due = self._due()
            if due is not None:
                self._attempt(due)

    def _due(self) -> str | None:
        now = time.monotonic()
        with self._lock:
            for uid, p in sorted(self._pending.items(), key=lambda item: item[1].last_seen):
                if now - p.last_seen >= self.config.idle_timeout_s and now >= p.next_attempt:
                    return uid
        return None

    def _state(self, folder: Path) -> dict[str, Any]:
        try:
            return json.loads((folder / _STATE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def _attempt(self, uid: str) -> None:
        folder = self.incoming / uid
        with self._lock:
            pending = self._pending[uid]
            pending.attempts += 1
            attempt = pending.attempts
        try:
            self._process(uid, folder)
        except ClientError as exc:  # a PACS or the endpoint unreachable or busy may answer later
            if isinstance(exc, PacsError) or exc.status is None or is_unavailable(exc):
                self._retry_or_fail(uid, folder, attempt, exc)
            else:  # the endpoint refused this series (e.g. INVALID_ARG): it would refuse it again
                self._fail(uid, folder, f"{type(exc).__name__}: {exc}")
        except OSError as exc:
            self._retry_or_fail(uid, folder, attempt, exc)
        except NnunetTritonError as exc:  # the series itself cannot be segmented: no retry helps
            self._fail(uid, folder, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bug must not stop the node; the series is kept aside
            LOGGER.exception("series %s: unexpected error", uid)
            self._fail(uid, folder, f"{type(exc).__name__}: {exc}")

    def _process(self, uid: str, folder: Path) -> None:
        received = [p for p in folder.iterdir() if p.suffix == ".dcm"]  # what this attempt segments
        scan = scan_folder(folder, self.config.dicom_options)
        eligible = [s for s in scan.series if s.uid == uid]
        if not eligible:
            reasons = sorted({reason for _, reason in scan.skipped}) or ["no instances"]
            raise InputValidationError(f"series {uid}: no image volume to segment ({'; '.join(reasons)}).")
        volume = read_series(eligible[0], self.config.dicom_options)
        segmentation = self.config.segment(volume)
        labels = self.config.labels or generic_segment_labels(segmentation)
        seg_path = write_dicom_seg(segmentation, volume, labels, self.outgoing / f"{uid}.dcm")
        self._send(uid, seg_path)
        for path in received:
            path.unlink(missing_ok=True)
        with self._lock:
            if any(folder.glob("*.dcm")):  # instances arrived while segmenting: another round for them
                self._pending[uid].attempts = 0
                return
            self._pending.pop(uid, None)
        shutil.rmtree(folder, ignore_errors=True)

    def _send(self, uid: str, seg_path: Path) -> None:
        self.config.destination.send([seg_path], what=f"the DICOM-SEG of series {uid}")
        seg_path.unlink()
        self.processed.append((uid, "sent"))
        LOGGER.info("series %s: DICOM-SEG sent", uid)

    def _resend_outgoing(self) -> None:
        """Send the SEGs a previous run wrote but did not send; a series still in incoming/ is segmented
        again instead (its SEG may predate instances received since)."""
        for seg_path in sorted(self.outgoing.glob("*.dcm")):
            uid = seg_path.stem
            if (self.incoming / uid).is_dir():
                continue
            try:
                self._send(uid, seg_path)
            except (ClientError, OSError) as exc:
                LOGGER.error("series %s: sending the spooled DICOM-SEG failed: %s", uid, exc)

    def _retry_or_fail(self, uid: str, folder: Path, attempt: int, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        if attempt > self.config.retries:
            self._fail(uid, folder, f"{message} (after {attempt} attempts)")
            return
        delay = min(MAX_DELAY_S, self.config.retry_delay_s * 2 ** (attempt - 1))
        (folder / _STATE).write_text(json.dumps({"attempts": attempt, "last_error": message}))
        with self._lock:
            self._pending[uid].next_attempt = time.monotonic() + delay
        LOGGER.warning("series %s: attempt %d failed (%s); retrying in %.1f s", uid, attempt, message, delay)

    def _fail(self, uid: str, folder: Path, message: str) -> None:
        target = self.failed / uid
        if target.exists():
            target = self.failed / f"{uid}.{time.strftime('%Y%m%dT%H%M%S')}"
        if folder.exists():
            folder.rename(target)
        else:
            target.mkdir(parents=True)
        seg = self.outgoing / f"{uid}.dcm"
        if seg.exists():
            seg.rename(target / "nnunet_seg.dcm.unsent")
        (target / "error.txt").write_text(message + "\n")
        with self._lock:
            self._pending.pop(uid, None)
        self.processed.append((uid, f"failed: {message}"))
        LOGGER.error("series %s: moved to %s: %s", uid, target, message)
