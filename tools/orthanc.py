"""A real Orthanc PACS (Debian's ``orthanc`` + ``orthanc-dicomweb``) on free loopback ports.

Used by the PACS tests (``tests/triton/pacs_support.py``) and ``make pacs-demo``. Orthanc runs as a plain
process from a JSON config in a folder of its own (no service manager): HTTP (REST, the explorer and
DICOMweb under ``/dicom-web/``) with basic authentication, DICOM with AE title ``ORTHANC`` (called AE
titles are checked), and one modality ``nnunet`` (AE ``NNUNET`` on loopback) that studies are routed to and
that alone may store by C-STORE (``DicomAlwaysAllowStore`` false, ``DicomCheckModalityHost`` true).
:func:`ensure_orthanc` installs the packages with apt when they are missing and this runs as root.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLUGIN = Path("/usr/share/orthanc/plugins/libOrthancDicomWeb.so")
USER, PASSWORD = "nnunet", "pacs-secret"
AE_TITLE = "ORTHANC"
NODE_AE = "NNUNET"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_orthanc() -> str | None:
    """The Orthanc binary, installed with apt when missing (as root); None when it cannot be had."""
    found = shutil.which("Orthanc")
    if (found is None or not PLUGIN.is_file()) and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "orthanc",
                        "orthanc-dicomweb"], check=False, capture_output=True, timeout=600,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        found = shutil.which("Orthanc")
    return found if found is not None and PLUGIN.is_file() else None


@dataclass
class Orthanc:
    """A running Orthanc: REST/DICOMweb root, DICOM port, and the node port of its ``nnunet`` modality."""

    http_port: int
    dicom_port: int
    node_port: int
    process: subprocess.Popen
    log: Path

    @property
    def rest(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def dicomweb(self) -> str:
        return f"dicomweb://127.0.0.1:{self.http_port}/dicom-web"

    @property
    def store_destination(self) -> str:
        return f"{AE_TITLE}@127.0.0.1:{self.dicom_port}"

    def _open(self, method: str, path: str, body: bytes | None = None) -> bytes:
        """The REST answer's bytes (Basic auth, no proxy: Orthanc listens on loopback)."""
        request = urllib.request.Request(self.rest + path, data=body, method=method)
        request.add_header("Authorization", "Basic " + b64encode(f"{USER}:{PASSWORD}".encode()).decode())
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=120) as response:
            return response.read()

    def request(self, method: str, path: str, body: bytes | None = None) -> Any:
        text = self._open(method, path, body)
        return json.loads(text) if text.strip() else None

    def upload(self, paths: Iterator[Path] | list[Path]) -> list[str]:
        """POST each file to /instances; returns the Orthanc series ids."""
        series = set()
        for path in paths:
            answer = self.request("POST", "/instances", Path(path).read_bytes())
            series.add(answer["ParentSeries"])
        return sorted(series)

    def series_of_study(self, study_uid: str) -> list[dict[str, Any]]:
        """Orthanc's series records (MainDicomTags) of the study ``study_uid`` (none if unknown)."""
        found = self.request("POST", "/tools/find", json.dumps(
            {"Level": "Series", "Query": {"StudyInstanceUID": study_uid}, "Expand": True}).encode())
        return found or []

    def seg_series(self, study_uid: str) -> list[dict[str, Any]]:
        """The study's DICOM-SEG series records."""
        return [s for s in self.series_of_study(study_uid) if s["MainDicomTags"].get("Modality") == "SEG"]

    def wait_for_seg(self, study_uid: str, timeout_s: float = 180.0) -> list[bytes]:
        """The DICOM-SEG file(s) of the study, waiting until one arrives."""
        return self.wait_for_modality(study_uid, "SEG", timeout_s)

    def wait_for_modality(self, study_uid: str, modality: str, timeout_s: float = 180.0) -> list[bytes]:
        """The files of the study's series of ``modality`` (SEG, RTSTRUCT), waiting until one arrives."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [s for s in self.series_of_study(study_uid)
                     if s["MainDicomTags"].get("Modality") == modality]
            if found:
                return [self._open("GET", f"/instances/{i}/file") for s in found for i in s["Instances"]]
            time.sleep(0.5)
        raise AssertionError(f"no {modality} arrived in study {study_uid} within {timeout_s} s; log:\n"
                             + self.log.read_text()[-3000:])


def start_orthanc(folder: Path, binary: str, *, node_port: int | None = None) -> Orthanc:
    """Start Orthanc with its files in ``folder``; its ``nnunet`` modality points at ``node_port``."""
    http_port, dicom_port = free_port(), free_port()
    node_port = node_port or free_port()
    for name in ("storage", "index"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    config = {
        "Name": "nnunet-triton-tests", "StorageDirectory": str(folder / "storage"),
        "IndexDirectory": str(folder / "index"), "HttpPort": http_port, "DicomPort": dicom_port,
        "DicomAet": AE_TITLE, "DicomCheckCalledAet": True, "RemoteAccessAllowed": False,
        "AuthenticationEnabled": True, "RegisteredUsers": {USER: PASSWORD},
        "Plugins": [str(PLUGIN)], "DicomWeb": {"Enable": True, "Root": "/dicom-web/"},
        "DicomModalities": {"nnunet": [NODE_AE, "127.0.0.1", node_port]},
        # only the node, calling as NNUNET from its host, may store (the SEG it sends back)
        "DicomAlwaysAllowStore": False, "DicomCheckModalityHost": True, "DicomAlwaysAllowEcho": True,
        "StableAge": 1, "HttpThreadsCount": 8,
    }
    (folder / "orthanc.json").write_text(json.dumps(config, indent=2))
    log = folder / "orthanc.log"
    process = subprocess.Popen([binary, str(folder / "orthanc.json")], stdout=log.open("w"),
                               stderr=subprocess.STDOUT, cwd=folder)
    orthanc = Orthanc(http_port, dicom_port, node_port, process, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"Orthanc exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            plugins = orthanc.request("GET", "/plugins")
            if "dicom-web" in plugins:
                return orthanc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"Orthanc did not answer within 60 s:\n{log.read_text()[-3000:]}")


def stop_orthanc(orthanc: Orthanc) -> None:
    orthanc.process.terminate()
    try:
        orthanc.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        orthanc.process.kill()
        orthanc.process.wait(timeout=30)
