"""One rule for identifiers that come from DICOM data: validated UIDs only, paths that stay in their folder.

Every file or folder name this project builds from a DICOM value (the node's spool, a DICOMweb fetch, the
case names of the folder reader, the outputs of ``predict``) is a UID that passed :func:`valid_uid`, and
every such path is checked by :func:`child_path` to resolve inside the folder it is meant for. A UID is
the DICOM UI value representation (PS3.5 9.1): numeric components separated by ``.``, at most 64
characters. PS3.5 also forbids a leading zero in a component; files from some scanners have them, and a
component of digits is as safe in a path, so they are accepted. Anything else (``..``, ``/``, ``\\``,
letters, an empty component) is refused with :class:`UnsafeIdentifierError`, which names the attribute,
the rule and an escaped, shortened form of the value (a UID is no patient data, but a value that is not
a UID may be anything, so it is shortened and never interpreted).
"""

from __future__ import annotations

import re
from pathlib import Path

from nnunet_triton.errors import InputValidationError

__all__ = ["UID_RULE", "MAX_UID_LENGTH", "UnsafeIdentifierError", "valid_uid", "require_uid", "child_path",
           "shown"]

MAX_UID_LENGTH = 64
UID_RULE = "a DICOM UID (digits in dot-separated components, at most 64 characters)"
_UID = re.compile(r"[0-9]+(?:\.[0-9]+)*")


class UnsafeIdentifierError(InputValidationError):
    """An identifier from DICOM data breaks the UID rule or would name a path outside its folder."""


def shown(value: object, limit: int = 24) -> str:
    """``value`` for an error message: ASCII-escaped and cut to ``limit`` characters (with its length)."""
    text = str(value)
    cut = ascii(text[:limit])
    return cut if len(text) <= limit else f"{cut}... ({len(text)} characters)"


def valid_uid(value: object) -> str | None:
    """The UID ``value`` stands for (DICOM padding stripped), or None when it breaks the rule."""
    if value is None:
        return None
    text = str(value).rstrip("\x00 ")
    if not 0 < len(text) <= MAX_UID_LENGTH or _UID.fullmatch(text) is None:
        return None
    return text


def require_uid(value: object, *, what: str) -> str:
    """``value`` as a UID; raises :class:`UnsafeIdentifierError` naming ``what`` (e.g. ``SOPInstanceUID
    of an instance from DICOMweb``), the rule and the value."""
    uid = valid_uid(value)
    if uid is None:
        raise UnsafeIdentifierError(f"{what} must be {UID_RULE}, got {shown(value)}.")
    return uid


def child_path(folder: str | Path, *names: str) -> Path:
    """``folder / names...``, refused with :class:`UnsafeIdentifierError` unless it resolves inside
    ``folder`` (no ``..``, no absolute part, no symbolic link leading out)."""
    base = Path(folder)
    path = base.joinpath(*names)
    root = base.resolve()
    resolved = path.resolve()
    if resolved == root or root not in resolved.parents:
        raise UnsafeIdentifierError(
            f"the name {shown('/'.join(names), 64)} would leave the folder {base}; names built from DICOM "
            "data must stay inside their folder.")
    return path
