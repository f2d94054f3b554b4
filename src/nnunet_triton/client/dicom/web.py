"""A PACS over DICOMweb (QIDO-RS, WADO-RS, STOW-RS) through ``dicomweb-client``.

``dicomweb://HOST[:PORT]/ROOT`` is the service at ``http://HOST:PORT/ROOT`` (``dicomwebs://`` for https),
e.g. ``dicomweb://pacs:8042/dicom-web`` for Orthanc's plugin. A study is fetched into a folder as plain
DICOM files, so the folder reader (:mod:`.files`, :mod:`.volume`) selects the series and builds the volume
exactly as for a DICOM folder. Credentials (HTTP basic or a bearer token) and a TLS CA bundle come from
:class:`DicomWebAuth`; they are never logged, and error messages name only the URL, the study or series
UID and the server's status.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pydicom

from nnunet_triton.client.imageio import atomic_output
from nnunet_triton.errors import PacsError

__all__ = ["SCHEMES", "DicomWebAuth", "DicomWebLocation", "is_dicomweb", "fetch_study", "store_files"]

LOGGER = logging.getLogger(__name__)
# dicomweb-client logs every request's headers at DEBUG (an Authorization header among them): never let it
logging.getLogger("dicomweb_client").setLevel(logging.INFO)
SCHEMES = {"dicomweb": "http", "dicomwebs": "https"}
USER_ENV = "NNUNET_TRITON_DICOMWEB_USER"
PASSWORD_ENV = "NNUNET_TRITON_DICOMWEB_PASSWORD"  # noqa: S105 - the variable's name, not a secret
TOKEN_ENV = "NNUNET_TRITON_DICOMWEB_TOKEN"  # noqa: S105
CA_ENV = "NNUNET_TRITON_DICOMWEB_CA"
TIMEOUT_S = 60.0


def is_dicomweb(text: str | Path) -> bool:
    """True for ``dicomweb://...`` and ``dicomwebs://...``."""
    return str(text).split("://", 1)[0].lower() in SCHEMES if "://" in str(text) else False


@dataclass(frozen=True)
class DicomWebAuth:
    """How to authenticate: HTTP basic (``user``/``password``) or a bearer ``token``; ``ca_file`` for TLS.

    ``repr`` never shows the secrets. :meth:`from_env` reads ``NNUNET_TRITON_DICOMWEB_USER`` /
    ``_PASSWORD`` / ``_TOKEN`` / ``_CA`` so secrets need not appear on a command line.
    """

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    ca_file: Path | None = None

    def __post_init__(self) -> None:
        if self.token and (self.user or self.password):
            raise PacsError("DICOMweb: give either a user and password or a bearer token, not both.")
        if (self.user is None) != (self.password is None):
            raise PacsError("DICOMweb: HTTP basic authentication needs both a user and a password.")
        if self.ca_file is not None and not Path(self.ca_file).is_file():
            raise PacsError(f"DICOMweb: TLS CA file {str(self.ca_file)!r} does not exist.")

    @classmethod
    def from_env(cls, *, user: str | None = None, password: str | None = None, token: str | None = None,
                 ca_file: str | Path | None = None) -> DicomWebAuth:
        """Explicit values first, then the environment."""
        ca = ca_file or os.environ.get(CA_ENV)
        return cls(user=user or os.environ.get(USER_ENV) or None,
                   password=password or os.environ.get(PASSWORD_ENV) or None,
                   token=token or os.environ.get(TOKEN_ENV) or None,
                   ca_file=Path(ca) if ca else None)


@dataclass(frozen=True)
class DicomWebLocation:
    """A DICOMweb service: ``url`` is its http(s) root (what ``dicomweb-client`` takes)."""

    url: str
    auth: DicomWebAuth = DicomWebAuth()

    @classmethod
    def parse(cls, text: str, auth: DicomWebAuth | None = None) -> DicomWebLocation:
        """``dicomweb://HOST[:PORT]/ROOT`` or ``dicomwebs://...``.

        Raises:
            PacsError: another scheme, no host, or credentials inside the URL (they would be logged).
        """
        parts = urlsplit(text)
        scheme = SCHEMES.get(parts.scheme.lower())
        if scheme is None or not parts.hostname:
            raise PacsError(f"DICOMweb location must look like dicomweb://HOST[:PORT]/ROOT, got {text!r}.")
        if parts.username or parts.password:
            raise PacsError("DICOMweb location must not hold credentials; use --dicomweb-user/"
                            "--dicomweb-token or the NNUNET_TRITON_DICOMWEB_* environment variables.")
        port = f":{parts.port}" if parts.port else ""
        url = f"{scheme}://{parts.hostname}{port}{parts.path.rstrip('/')}"
        return cls(url=url, auth=auth or DicomWebAuth())

    def client(self) -> Any:
        """A ``DICOMwebClient`` with the session, headers and CA bundle of :attr:`auth`."""
        from dicomweb_client.api import DICOMwebClient
        from dicomweb_client.session_utils import create_session, create_session_from_user_pass

        auth = self.auth
        session = (create_session_from_user_pass(auth.user, auth.password) if auth.user is not None
                   else create_session())
        if auth.ca_file is not None:
            session.verify = str(auth.ca_file)
        headers = {"Authorization": f"Bearer {auth.token}"} if auth.token else None
        client = DICOMwebClient(self.url, session=session, headers=headers, timeout=TIMEOUT_S)
        client.set_http_retry_params(max_attempts=3, wait_exponential_multiplier=500)  # 503s: ~1.5 s in all
        return client


def _reason(exc: BaseException) -> str:
    """What went wrong, without request headers or bodies: the HTTP status or the exception's kind."""
    response = getattr(exc, "response", None)
    if response is not None and getattr(response, "status_code", None) is not None:
        return f"HTTP {response.status_code} {getattr(response, 'reason', '') or ''}".strip()
    return f"{type(exc).__name__}: {str(exc).split(' headers', 1)[0][:200]}"


def _uid(item: dict[str, Any], tag: str) -> str | None:
    value = item.get(tag, {}).get("Value")
    return str(value[0]) if value else None


def fetch_study(location: DicomWebLocation, study_uid: str, folder: Path, *,
                series_uid: str | None = None) -> list[str]:
    """Find the study's series (QIDO-RS) and download them (WADO-RS) into ``folder``, one file per instance.

    Returns the series UIDs fetched. Raises :class:`PacsError` naming the study (and series) when the PACS
    cannot be reached, answers with an error, or has no such study or series.
    """
    client = location.client()
    try:
        found = client.search_for_series(study_instance_uid=study_uid)
    except Exception as exc:  # requests' errors and dicomweb-client's HTTPError alike
        raise PacsError(f"DICOMweb {location.url}: searching study {study_uid} failed "
                        f"({_reason(exc)}).") from None
    series = [uid for uid in (_uid(item, "0020000E") for item in found) if uid]
    if series_uid is not None:
        if series_uid not in series:
            raise PacsError(f"DICOMweb {location.url}: study {study_uid} has no series {series_uid} "
                            f"(it has {len(series)} series).")
        series = [series_uid]
    if not series:
        raise PacsError(f"DICOMweb {location.url}: study {study_uid} was not found or has no series.")
    folder.mkdir(parents=True, exist_ok=True)
    for uid in series:
        try:
            datasets = client.retrieve_series(study_uid, uid)
        except Exception as exc:
            raise PacsError(f"DICOMweb {location.url}: retrieving series {uid} of study {study_uid} failed "
                            f"({_reason(exc)}).") from None
        for ds in datasets:
            with atomic_output(folder / uid / f"{ds.SOPInstanceUID}.dcm") as temp:
                ds.save_as(temp, enforce_file_format=True)
        LOGGER.info("fetched series %s of study %s: %d instance(s)", uid, study_uid, len(datasets))
    return series


def store_files(location: DicomWebLocation, paths: Iterable[Path], *, what: str) -> None:
    """STOW-RS the DICOM files ``paths``; ``what`` names them in errors (e.g. the source series UID).

    Raises:
        PacsError: unreachable, rejected (HTTP error), or the server's response lists failed instances.
    """
    datasets: Sequence[pydicom.Dataset] = [pydicom.dcmread(p) for p in paths]
    try:
        response = location.client().store_instances(datasets)
    except Exception as exc:
        raise PacsError(f"DICOMweb {location.url}: STOW-RS of {what} was rejected "
                        f"({_reason(exc)}).") from None
    failed = getattr(response, "FailedSOPSequence", None) if response is not None else None
    if failed:
        reasons = sorted({str(getattr(item, "FailureReason", "?")) for item in failed})
        raise PacsError(f"DICOMweb {location.url}: STOW-RS of {what}: {len(failed)} instance(s) failed "
                        f"(failure reasons {reasons}).")
    LOGGER.info("stored %s on %s (%d instance(s))", what, location.url, len(datasets))
