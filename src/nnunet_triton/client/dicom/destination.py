"""Where the DICOM node sends its SEGs: C-STORE to an AE (:class:`StoreDestination`) or STOW-RS to a
DICOMweb service (:class:`DicomWebDestination`); :func:`parse_destination` reads ``--destination``."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pydicom

from nnunet_triton.client.dicom.web import DicomWebAuth, DicomWebLocation, is_dicomweb, store_files
from nnunet_triton.errors import PacsError

__all__ = ["StoreDestination", "DicomWebDestination", "parse_destination", "STATUS_SUCCESS"]

LOGGER = logging.getLogger(__name__)
STATUS_SUCCESS = 0x0000


@dataclass(frozen=True)
class StoreDestination:
    """C-STORE to ``ae_title`` at ``host:port``, calling as ``calling_ae``."""

    ae_title: str
    host: str
    port: int
    calling_ae: str = "NNUNET"
    timeout_s: float = 30.0

    def send(self, paths: Sequence[Path], what: str) -> None:
        """Store ``paths``; raises :class:`PacsError` (naming ``what``) when refused or not stored."""
        from pynetdicom import AE

        datasets = [pydicom.dcmread(p) for p in paths]
        ae = AE(ae_title=self.calling_ae)
        ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = self.timeout_s
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
            if assoc.is_established:
                assoc.release()
        LOGGER.info("sent %s to %s", what, peer)


@dataclass(frozen=True)
class DicomWebDestination:
    """STOW-RS to a DICOMweb service."""

    location: DicomWebLocation

    def send(self, paths: Sequence[Path], what: str) -> None:
        store_files(self.location, paths, what=what)


def parse_destination(text: str, *, calling_ae: str = "NNUNET", auth: DicomWebAuth | None = None,
                      allow_http: bool = False) -> StoreDestination | DicomWebDestination:
    """``AET@HOST:PORT`` (C-STORE) or ``dicomweb://HOST[:PORT]/ROOT`` (STOW-RS)."""
    if is_dicomweb(text):
        return DicomWebDestination(DicomWebLocation.parse(text, auth, allow_http=allow_http))
    match = re.fullmatch(r"([^@]{1,16})@([^:@]+):(\d{1,5})", text)
    if not match:
        raise PacsError(f"destination must be AET@HOST:PORT or dicomweb://HOST[:PORT]/ROOT, got {text!r}.")
    return StoreDestination(match.group(1), match.group(2), int(match.group(3)), calling_ae=calling_ae)
