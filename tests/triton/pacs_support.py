"""The real Orthanc of the PACS tests (``tools/orthanc.py``); skipped with the reason where it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.orthanc import NODE_AE, PASSWORD, USER, Orthanc, ensure_orthanc, free_port, stop_orthanc
from tools.orthanc import start_orthanc as _start

__all__ = ["NODE_AE", "PASSWORD", "USER", "Orthanc", "free_port", "start_orthanc", "stop_orthanc"]


def start_orthanc(folder: Path) -> Orthanc:
    binary = ensure_orthanc()
    if binary is None:
        pytest.skip("Orthanc (Debian packages orthanc, orthanc-dicomweb) is not installed and cannot be "
                    "installed here (needs root and apt-get)")
    return _start(folder, binary)
