"""The sha256 of a file."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["sha256_file"]

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of the file at ``path``, read in 1 MiB chunks (any size, bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()
