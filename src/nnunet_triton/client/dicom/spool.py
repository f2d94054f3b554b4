"""The DICOM node's spool on disk: durable writes, its folders, per-series state, quota and retention.

Layout (every name below the folders is a validated UID, :mod:`.uids`)::

    incoming/<series>/<sop>.dcm      received instances, durable before the C-STORE is answered
    incoming/<series>/.state.json    the series' round: its route (called AE title, model, why), attempts,
                                     first failure, the SEG's UIDs and the instances it covers
    outgoing/<series>.dcm            the SEG of the current round, written once, sent until it is stored
    outgoing/<series>.rtstruct       the RTSTRUCT of the current round (output rtstruct or both), likewise
    done/<series>.json               what was sent for a series (SEG series UID, instance number, SOP UIDs
                                     covered, its route); UIDs and names only, kept for
                                     ``record_retention_s``
    done/<series>/<sop>.dcm          the instances of a sent series, kept for ``done_retention_s`` so that a
                                     late instance leads to the whole series being segmented again
    failed/<series>[.<n>]/           instances, ``error.txt``, the unsent SEG; kept for ``failed_retention_s``
    tmp/                             instances being received (never acknowledged yet)
    status.json                      the node's health (see :mod:`.node`)

:func:`durable_output` is the one way files are written: :func:`nnunet_triton.util.durable.durable_output`
(a temporary file in the same folder, ``fsync``-ed, renamed onto the target, and the folder ``fsync``-ed,
so a file that exists after a power cut is complete and its name is on disk), after the missing folders
were made with each new name ``fsync``-ed in its parent. :func:`inflate_deflated` turns a Deflated
Explicit VR Little Endian file into Explicit VR Little Endian in chunks, refusing it once it grows past a
limit (a deflate bomb of 1 MB can inflate to 1 GB).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.client.dicom.uids import child_path, shown, valid_uid
from nnunet_triton.errors import InputValidationError
from nnunet_triton.util import durable
from nnunet_triton.util.durable import fsync_dir

__all__ = ["SpoolLimits", "Spool", "durable_output", "durable_json", "fsync_dir", "inflate_deflated",
           "InstanceTooLarge", "STATE", "EXPLICIT_LE"]

LOGGER = logging.getLogger(__name__)
STATE = ".state.json"
EXPLICIT_LE = "1.2.840.10008.1.2.1"
CHUNK = 1 << 20


class InstanceTooLarge(InputValidationError):
    """A received instance is larger (as sent, or inflated) than the node's ``max_instance_bytes``."""


@dataclass(frozen=True)
class SpoolLimits:
    """Bounds on what the node keeps: bytes in the spool, per instance, instances per series; how long
    sent series (their instances; their UID records) and failed series stay (seconds)."""

    max_spool_bytes: int = 50 * 2**30
    max_instance_bytes: int = 1 * 2**30
    max_instances_per_series: int = 5_000
    done_retention_s: float = 24 * 3600.0
    record_retention_s: float = 30 * 24 * 3600.0
    failed_retention_s: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        if min(self.max_spool_bytes, self.max_instance_bytes, self.max_instances_per_series) < 1:
            raise InputValidationError(f"spool limits must be >= 1, got {self}.")
        if min(self.done_retention_s, self.record_retention_s, self.failed_retention_s) < 0:
            raise InputValidationError(f"retention times must be >= 0 seconds, got {self}.")


def _make_dirs(folder: Path) -> None:
    """``mkdir -p`` that makes each new folder's name durable in its parent."""
    missing = []
    current = folder
    while not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir()
        fsync_dir(path.parent)


@contextlib.contextmanager
def durable_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is fsync-ed and renamed onto ``path`` and the
    folder fsync-ed (:func:`nnunet_triton.util.durable.durable_output`, after the missing folders were made
    durably). On any exception the temporary file is removed and ``path`` is left as it was."""
    _make_dirs(path.parent)
    with durable.durable_output(path) as temp:
        yield temp


def durable_json(path: Path, data: dict[str, Any]) -> None:
    _make_dirs(path.parent)
    durable.write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when missing or unreadable (a torn write never happens with
    :func:`durable_output`, but a file from elsewhere may be anything)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _dataset_offset(head: bytes) -> int:
    """Where the dataset starts in a Part 10 file: after preamble, ``DICM`` and the group 2 elements
    (their length from FileMetaInformationGroupLength, which pynetdicom and pydicom write first)."""
    if len(head) < 144 or head[128:132] != b"DICM" or head[132:138] != b"\x02\x00\x00\x00UL":
        raise InputValidationError("received instance: no DICOM file meta with a group length.")
    (length,) = struct.unpack("<I", head[140:144])
    return 144 + length


def _inflate(inflater: Any, data: bytes, out: Any, written: int, limit: int) -> int:
    """Feed ``data``, writing at most CHUNK bytes of output at a time; returns the running total."""
    while True:
        chunk = inflater.decompress(data, CHUNK)
        if not chunk:
            return written
        written += len(chunk)
        if written > limit:
            raise InstanceTooLarge(f"received instance inflates to more than max_instance_bytes={limit}.")
        out.write(chunk)
        data = inflater.unconsumed_tail


def inflate_deflated(source: Path, target: Path, *, limit: int, file_meta: Any) -> int:
    """Write ``source`` (Deflated Explicit VR LE) to ``target`` as Explicit VR LE, inflating in chunks;
    returns the dataset's inflated bytes. Raises :class:`InstanceTooLarge` as soon as it exceeds ``limit``
    (the output never grows more than one chunk past it), :class:`InputValidationError` when the stream
    is not valid raw deflate."""
    from pydicom.filewriter import write_file_meta_info

    meta = file_meta.__class__(file_meta)
    meta.TransferSyntaxUID = EXPLICIT_LE
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    written = 0
    with source.open("rb") as src, target.open("wb") as out:
        head = src.read(CHUNK)
        data = head[_dataset_offset(head):]
        out.write(b"\x00" * 128 + b"DICM")
        write_file_meta_info(out, meta, enforce_standard=True)
        try:
            while data and not inflater.eof:
                written = _inflate(inflater, data, out, written, limit)
                data = src.read(CHUNK)
        except zlib.error:
            raise InputValidationError("received instance: the Deflate stream is corrupt.") from None
    return written


def _size(path: Path) -> int:
    try:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else (
            path.stat().st_size)
    except OSError:
        return 0


class Spool:
    """The spool's folders and its byte count (for the quota)."""

    def __init__(self, root: Path, limits: SpoolLimits) -> None:
        self.root = root
        self.limits = limits
        self.incoming, self.outgoing = root / "incoming", root / "outgoing"
        self.done, self.failed, self.tmp = root / "done", root / "failed", root / "tmp"
        self.status_file = root / "status.json"
        for folder in self.folders:
            _make_dirs(folder)
        self._used_lock = threading.Lock()
        self._used = _size(root)

    @property
    def used(self) -> int:
        """Bytes in the spool (received instances and SEGs; recounted by :meth:`sweep`)."""
        return self._used

    def reserve(self, size: int) -> bool:
        """Count ``size`` more bytes unless that exceeds ``max_spool_bytes`` (then False)."""
        with self._used_lock:
            if self._used + size > self.limits.max_spool_bytes:
                return False
            self._used += size
            return True

    def release(self, size: int) -> None:
        with self._used_lock:
            self._used = max(0, self._used - size)

    def add(self, size: int) -> None:
        with self._used_lock:
            self._used += size

    def clear_tmp(self) -> None:
        """Remove instances a dead run was receiving (never acknowledged); only the node, at its start."""
        for leftover in self.tmp.iterdir():
            leftover.unlink(missing_ok=True)

    @property
    def folders(self) -> tuple[Path, ...]:
        return (self.incoming, self.outgoing, self.done, self.failed, self.tmp)

    def check(self) -> str:
        """``""`` when every folder is there; else what is wrong (the node cannot go on without them)."""
        missing = [str(f) for f in self.folders if not f.is_dir()]
        return f"spool folders missing: {missing}" if missing else ""

    # --- names -------------------------------------------------------------------------------------
    def series_dir(self, series: str) -> Path:
        return child_path(self.incoming, series)

    def instance(self, series: str, sop: str) -> Path:
        return child_path(self.incoming, series, f"{sop}.dcm")

    def done_dir(self, series: str) -> Path:
        return child_path(self.done, series)

    def record_file(self, series: str) -> Path:
        return child_path(self.done, f"{series}.json")

    def seg_file(self, series: str) -> Path:
        return child_path(self.outgoing, f"{series}.dcm")

    def rtstruct_file(self, series: str) -> Path:
        """The RTSTRUCT of the current round (a model whose output is ``rtstruct`` or ``both``); not
        ``*.dcm``, so it is never taken for a SEG of its own."""
        return child_path(self.outgoing, f"{series}.rtstruct")

    def staging(self) -> Path:
        return self.tmp / f"rx-{os.getpid()}-{secrets.token_hex(8)}.dcm"

    # --- series ------------------------------------------------------------------------------------
    def incoming_series(self) -> list[str]:
        """The series folders of ``incoming/`` (names that are not UIDs are left alone and reported)."""
        names = []
        for path in sorted(self.incoming.iterdir()):
            if path.is_dir() and valid_uid(path.name) == path.name:
                names.append(path.name)
            elif not path.name.startswith("."):
                LOGGER.warning("spool: ignoring %s in incoming/ (not a series folder named by a UID)",
                               shown(path.name))
        return names

    def instances(self, folder: Path) -> list[Path]:
        if not folder.is_dir():
            return []
        return sorted(p for p in folder.glob("*.dcm") if not p.name.startswith("."))

    def state(self, series: str) -> dict[str, Any]:
        return read_json(self.series_dir(series) / STATE)

    def write_state(self, series: str, state: dict[str, Any]) -> None:
        durable_json(self.series_dir(series) / STATE, state)

    def record(self, series: str) -> dict[str, Any]:
        return read_json(self.record_file(series))

    def known(self, series: str, sop: str) -> bool:
        """True when this instance is spooled already (waiting, or kept with its sent series)."""
        name = f"{sop}.dcm"
        return (self.series_dir(series) / name).exists() or (self.done_dir(series) / name).exists()

    def count(self, series: str) -> int:
        return len(self.instances(self.series_dir(series))) + len(self.instances(self.done_dir(series)))

    # --- moving ------------------------------------------------------------------------------------
    def move(self, source: Path, target: Path) -> None:
        """Rename durably (both folders fsync-ed)."""
        _make_dirs(target.parent)
        os.replace(source, target)
        fsync_dir(target.parent)
        if source.parent != target.parent:
            fsync_dir(source.parent)

    def place(self, source: Path, target: Path) -> bool:
        """Hard-link ``source`` to ``target`` durably unless ``target`` exists (then False, nothing
        changed): the exclusive create that never replaces a file."""
        _make_dirs(target.parent)
        try:
            os.link(source, target)
        except FileExistsError:
            return False
        fsync_dir(target.parent)
        return True

    def merge_into(self, source_dir: Path, target_dir: Path, *, names: set[str] | None = None) -> int:
        """Move the instances of ``source_dir`` (those in ``names``, default all) into ``target_dir``."""
        moved = 0
        for path in self.instances(source_dir):
            if names is None or path.name in names:
                self.move(path, target_dir / path.name)
                moved += 1
        return moved

    def unique_failed(self, series: str) -> Path:
        """``failed/<series>``, or ``failed/<series>_<n>`` with the first free ``n`` (``_`` is in no UID)."""
        target = child_path(self.failed, series)
        n = 2
        while target.exists():
            target = child_path(self.failed, f"{series}_{n}")
            n += 1
        return target

    def remove_tree(self, path: Path) -> None:
        size = _size(path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        self.release(size)
        with contextlib.suppress(OSError):
            fsync_dir(path.parent)

    # --- retention ---------------------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> list[Path]:
        """Delete what is past its retention: failed series, instances of sent series, old records."""
        now = time.time() if now is None else now
        removed = []
        limits = self.limits
        rules = [(self.failed, limits.failed_retention_s, lambda p: p.is_dir()),
                 (self.done, limits.done_retention_s, lambda p: p.is_dir()),
                 (self.done, limits.record_retention_s, lambda p: p.suffix == ".json")]
        for folder, keep_s, kind in rules:
            for path in list(folder.iterdir()):
                try:
                    old = now - path.stat().st_mtime > keep_s
                except OSError:
                    continue
                if kind(path) and old:
                    self.remove_tree(path)
                    removed.append(path)
        recount = _size(self.root)
        with self._used_lock:
            self._used = recount
        return removed
