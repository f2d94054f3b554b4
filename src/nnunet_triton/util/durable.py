"""Atomic, durable file writes: a reader sees the old file or the new one, never a mix, and a file that
exists after a crash or power cut has its whole content.

Every write goes the same way: a hidden temporary file in the target's folder (same file system, so the
rename is atomic), fsync of the file, ``os.replace`` onto the target, fsync of the folder (so the rename
itself survives a power cut). On any exception the temporary file is removed and the target is left as it
was. ``mode`` (e.g. ``0o600`` for a file holding a token or a private config) creates the temporary file with
exactly those permission bits, whatever the umask, before a byte is written: the file is never readable by
anyone else, not even for an instant. Temporaries are named ``.<name>.partial-<pid>-<random><suffix>``, so
:func:`remove_stale_temporaries` can tell those of a dead writer from those being written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nnunet_triton.util.process import pid_alive

__all__ = [
    "TEMP_MARKER",
    "durable_output",
    "fsync_dir",
    "remove_stale_temporaries",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]

TEMP_MARKER = ".partial-"
_TEMP = re.compile(r"^\..+\.partial-(?P<pid>\d+)-[0-9a-f]+")


def fsync_dir(folder: str | Path) -> None:
    """fsync a folder, so that files created, renamed or removed in it stay so after a power cut."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def durable_output(path: str | Path, *, suffix: str = "", mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` (ending ``suffix``, for writers that choose the format by
    extension); when the block ends without an exception the file is fsync-ed, renamed onto ``path`` and the
    folder fsync-ed. On any exception (KeyboardInterrupt included) the temporary file is removed and ``path``
    is left as it was. The folder is created if missing. ``mode``: the temporary file is created empty with
    exactly these permission bits (the writer then opens it again; writing keeps them)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}{suffix}")
    try:
        if mode is not None:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            try:
                os.fchmod(fd, mode)  # the umask may have taken bits away; never adds any here
            finally:
                os.close(fd)
        yield temp
        _fsync_file(temp)
        os.replace(temp, target)
        fsync_dir(target.parent)
    finally:
        temp.unlink(missing_ok=True)


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically and durably, created with ``mode`` when given (see the
    module docstring)."""
    with durable_output(path, mode=mode) as temp:
        temp.write_bytes(data)


def write_text_atomic(path: str | Path, text: str, *, encoding: str = "utf-8",
                      mode: int | None = None) -> None:
    """Replace ``path`` with ``text`` atomically and durably (see the module docstring)."""
    write_bytes_atomic(path, text.encode(encoding), mode=mode)


def write_json_atomic(path: str | Path, value: Any, *, mode: int | None = None, **dump_options: Any) -> None:
    """Replace ``path`` with ``value`` as JSON (``json.dumps(value, **dump_options)`` plus a newline),
    atomically and durably. A value that cannot be serialised raises before anything is written."""
    write_text_atomic(path, json.dumps(value, **dump_options) + "\n", mode=mode)


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete the temporaries of :func:`durable_output` in ``folder`` whose writing process is gone (a
    killed writer cannot clean up); returns what was removed. Those of live writers are kept."""
    removed = []
    for path in Path(folder).glob(f".*{TEMP_MARKER}*"):
        match = _TEMP.match(path.name)
        if match is None or pid_alive(int(match["pid"])):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed
