"""A PACS over DICOMweb (QIDO-RS, WADO-RS, STOW-RS) through ``dicomweb-client``.

``dicomweb://HOST[:PORT]/ROOT`` is the service at ``http://HOST:PORT/ROOT`` (``dicomwebs://`` for https),
e.g. ``dicomweb://pacs:8042/dicom-web`` for Orthanc's plugin. Plain http carries credentials and patient
data unencrypted, so it is refused for any host but loopback unless the caller allows it explicitly
(``allow_http``). A study is fetched into a folder as plain DICOM files, so the folder reader
(:mod:`.files`, :mod:`.volume`) selects the series and builds the volume exactly as for a DICOM folder;
the series are chosen from their metadata first (QIDO-RS, then WADO-RS metadata: no pixel data), so SR,
SEG, localizer-only series and series of another Modality than the model's are never downloaded, and an
eligible series is streamed one instance at a time. Every UID the server sends is untrusted: a file is
named only after a valid UID (:mod:`.uids`), an instance breaking the rule is refused and the others
proceed. Credentials (HTTP basic or a bearer token) and a TLS CA bundle come from :class:`DicomWebAuth`:
from the environment or files, never from a command line; they are never logged, and error messages
name only the URL, the study or series UID and the server's status.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pydicom

from nnunet_triton.client.dicom.files import NON_VOLUME_MODALITIES
from nnunet_triton.client.dicom.modality import ModalityRule
from nnunet_triton.client.dicom.uids import (
    UID_RULE,
    UnsafeIdentifierError,
    child_path,
    require_uid,
    shown,
    valid_uid,
)
from nnunet_triton.client.imageio import atomic_output
from nnunet_triton.errors import PacsError

__all__ = ["SCHEMES", "DicomWebAuth", "DicomWebLocation", "SeriesChoice", "is_dicomweb", "is_loopback",
           "choose_series", "fetch_study", "store_files", "read_secret", "RedirectRefused"]

LOGGER = logging.getLogger(__name__)
# dicomweb-client logs every request's headers at DEBUG (an Authorization header among them): never let it
logging.getLogger("dicomweb_client").setLevel(logging.INFO)
SCHEMES = {"dicomweb": "http", "dicomwebs": "https"}
USER_ENV = "NNUNET_TRITON_DICOMWEB_USER"
PASSWORD_ENV = "NNUNET_TRITON_DICOMWEB_PASSWORD"  # noqa: S105 - the variable's name, not a secret
TOKEN_ENV = "NNUNET_TRITON_DICOMWEB_TOKEN"  # noqa: S105
CA_ENV = "NNUNET_TRITON_DICOMWEB_CA"
TIMEOUT_S = 60.0
MAX_SECRET_BYTES = 4096
# QIDO-RS series attributes: Modality, SeriesInstanceUID, NumberOfSeriesRelatedInstances
_MODALITY, _SERIES_UID, _N_INSTANCES = "00080060", "0020000E", "00201209"
_ROWS, _IMAGE_TYPE, _SOP_UID = "00280010", "00080008", "00080018"


def is_dicomweb(text: str | Path) -> bool:
    """True for ``dicomweb://...`` and ``dicomwebs://...``."""
    return str(text).split("://", 1)[0].lower() in SCHEMES if "://" in str(text) else False


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); names are not resolved."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_secret(path: str | Path, *, what: str) -> str:
    """The secret in file ``path`` (one line; the trailing newline removed). Errors name the file only."""
    try:
        data = Path(path).read_bytes()[: MAX_SECRET_BYTES + 1]
    except OSError as exc:
        raise PacsError(f"DICOMweb: cannot read the {what} file {str(path)!r} ({exc.strerror}).") from None
    text = data.decode("utf-8", errors="strict").rstrip("\r\n")
    if not text or len(data) > MAX_SECRET_BYTES or "\n" in text:
        raise PacsError(f"DICOMweb: the {what} file {str(path)!r} must hold one non-empty line of at most "
                        f"{MAX_SECRET_BYTES} bytes.")
    return text


@dataclass(frozen=True)
class DicomWebAuth:
    """How to authenticate: HTTP basic (``user``/``password``) or a bearer ``token``; ``ca_file`` for TLS.

    ``repr`` never shows the secrets. :meth:`from_env` reads the user from an argument or
    ``NNUNET_TRITON_DICOMWEB_USER``, the password and token from a file or ``_PASSWORD`` / ``_TOKEN``,
    and the CA bundle from an argument or ``_CA``: a secret is never taken from a command line, where every
    user of the machine sees it (``ps``) and the shell history keeps it.
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

    @property
    def has_secret(self) -> bool:
        return bool(self.password or self.token)

    @classmethod
    def from_env(cls, *, user: str | None = None, password_file: str | Path | None = None,
                 token_file: str | Path | None = None, ca_file: str | Path | None = None) -> DicomWebAuth:
        """Files and explicit values first, then the environment."""
        ca = ca_file or os.environ.get(CA_ENV)
        password = (read_secret(password_file, what="password") if password_file
                    else os.environ.get(PASSWORD_ENV) or None)
        token = read_secret(token_file, what="token") if token_file else os.environ.get(TOKEN_ENV) or None
        return cls(user=user or os.environ.get(USER_ENV) or None, password=password, token=token,
                   ca_file=Path(ca) if ca else None)


@dataclass(frozen=True)
class DicomWebLocation:
    """A DICOMweb service: ``url`` is its http(s) root (what ``dicomweb-client`` takes)."""

    url: str
    auth: DicomWebAuth = DicomWebAuth()

    @classmethod
    def parse(cls, text: str, auth: DicomWebAuth | None = None, *, allow_http: bool = False
              ) -> DicomWebLocation:
        """``dicomweb://HOST[:PORT]/ROOT`` or ``dicomwebs://...``.

        Raises:
            PacsError: another scheme, no host, credentials inside the URL (they would be logged), or plain
                http (``dicomweb://``) to a host that is not loopback without ``allow_http``.
        """
        parts = urlsplit(text)
        scheme = SCHEMES.get(parts.scheme.lower())
        if scheme is None or not parts.hostname:
            raise PacsError(f"DICOMweb location must look like dicomweb://HOST[:PORT]/ROOT, got {text!r}.")
        if parts.username or parts.password:
            raise PacsError("DICOMweb location must not hold credentials; use --dicomweb-user with "
                            "--dicomweb-password-file/--dicomweb-token-file or the NNUNET_TRITON_DICOMWEB_* "
                            "environment variables.")
        if scheme == "http" and not allow_http and not is_loopback(parts.hostname):
            raise PacsError(
                f"DICOMweb {parts.hostname}: plain http (dicomweb://) to a host other than loopback would "
                "send patient data and credentials unencrypted; use dicomwebs:// (https), or allow it "
                "explicitly (--dicomweb-allow-http) on a network that is protected otherwise.")
        port = f":{parts.port}" if parts.port else ""
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        url = f"{scheme}://{host}{port}{parts.path.rstrip('/')}"
        return cls(url=url, auth=auth or DicomWebAuth())

    def client(self) -> Any:
        """A ``DICOMwebClient`` with the session, headers and CA bundle of :attr:`auth`."""
        from dicomweb_client.api import DICOMwebClient
        from dicomweb_client.session_utils import create_session, create_session_from_user_pass

        auth = self.auth
        session = (create_session_from_user_pass(auth.user, auth.password) if auth.user is not None
                   else create_session())
        session.trust_env = False  # no credentials from ~/.netrc, no proxy from the environment
        session.hooks["response"].append(_same_origin_redirects_only)
        if auth.ca_file is not None:
            session.verify = str(auth.ca_file)
        headers = {"Authorization": f"Bearer {auth.token}"} if auth.token else None
        client = DICOMwebClient(self.url, session=session, headers=headers, timeout=TIMEOUT_S)
        client.set_http_retry_params(max_attempts=3, wait_exponential_multiplier=500)  # 503s: ~1.5 s in all
        return client


class RedirectRefused(PacsError):
    """A DICOMweb server redirected to another origin or to plain http; the client does not follow."""


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or default


def _same_origin_redirects_only(response: Any, *args: Any, **kwargs: Any) -> Any:
    """requests response hook (it runs before a redirect is followed): refuse a redirect whose target has
    another scheme, host or port than the request (the plain-http rule and the credentials stay with the
    origin that was configured)."""
    if not response.is_redirect:
        return response
    from urllib.parse import urljoin

    target = urljoin(response.url, response.headers.get("location", ""))
    if _origin(target) != _origin(response.url):
        scheme, host, port = _origin(target)
        raise RedirectRefused(f"DICOMweb {response.url.split('?')[0]}: HTTP {response.status_code} redirect "
                              f"to another origin ({scheme}://{host}:{port}) is not followed; configure the "
                              "server's own URL.")
    return response


def _reason(exc: BaseException) -> str:
    """What went wrong, without request headers or bodies: the HTTP status or the exception's kind."""
    if isinstance(exc, RedirectRefused):
        return str(exc)
    response = getattr(exc, "response", None)
    if response is not None and getattr(response, "status_code", None) is not None:
        return f"HTTP {response.status_code} {getattr(response, 'reason', '') or ''}".strip()
    return f"{type(exc).__name__}: {str(exc).split(' headers', 1)[0][:200]}"


def _value(item: dict[str, Any], tag: str) -> Any:
    value = item.get(tag, {}).get("Value") if isinstance(item, dict) else None
    return value[0] if isinstance(value, list) and value else None


@dataclass(frozen=True)
class SeriesChoice:
    """One series of a study as its metadata describes it; ``reason`` says why it is not fetched."""

    uid: str
    modality: str
    instances: int | None
    reason: str = ""


def _series_choice(item: dict[str, Any], rule: ModalityRule | None, max_instances: int) -> SeriesChoice:
    raw_uid = _value(item, _SERIES_UID)
    uid = valid_uid(raw_uid)
    modality = str(_value(item, _MODALITY) or "")
    count = _value(item, _N_INSTANCES)
    instances = int(count) if isinstance(count, int | float | str) and str(count).isdigit() else None
    if uid is None:
        return SeriesChoice(shown(raw_uid), modality, instances, f"SeriesInstanceUID is not {UID_RULE}")
    if modality in NON_VOLUME_MODALITIES:
        return SeriesChoice(uid, modality, instances, f"modality {modality} is not an image volume")
    refusal = rule.refusal(modality) if rule is not None else ""
    if refusal:
        return SeriesChoice(uid, modality, instances, refusal)
    if instances is not None and instances > max_instances:
        return SeriesChoice(uid, modality, instances, f"{instances} instances, more than {max_instances}")
    return SeriesChoice(uid, modality, instances)


def _has_volume_images(client: Any, study_uid: str, choice: SeriesChoice) -> SeriesChoice:
    """Refine a choice with the series' instance metadata (no pixel data): image instances that are not
    localizers must be there."""
    metadata = client.retrieve_series_metadata(study_uid, choice.uid)
    images = [m for m in metadata if _value(m, _ROWS) is not None
              and "LOCALIZER" not in [str(v).upper() for v in (m.get(_IMAGE_TYPE, {}).get("Value") or [])]]
    if not images:
        return SeriesChoice(choice.uid, choice.modality, len(metadata),
                            "no image instances besides localizers")
    return SeriesChoice(choice.uid, choice.modality, len(metadata))


def choose_series(location: DicomWebLocation, study_uid: str, *, series_uid: str | None = None,
                  rule: ModalityRule | None = None, max_instances: int = 20_000) -> list[SeriesChoice]:
    """The series of a study with the reason each one is (not) fetched, from QIDO-RS and series metadata."""
    study_uid = require_uid(study_uid, what="--study (StudyInstanceUID)")
    if series_uid is not None:
        series_uid = require_uid(series_uid, what="--series (SeriesInstanceUID)")
    client = location.client()
    try:
        found = client.search_for_series(study_instance_uid=study_uid,
                                         fields=[_MODALITY, _SERIES_UID, _N_INSTANCES])
    except Exception as exc:  # requests' errors and dicomweb-client's HTTPError alike
        raise PacsError(f"DICOMweb {location.url}: searching study {study_uid} failed "
                        f"({_reason(exc)}).") from None
    choices = [_series_choice(item, rule, max_instances) for item in found or []]
    if series_uid is not None:
        choices = [c for c in choices if c.uid == series_uid]
        if not choices:
            raise PacsError(f"DICOMweb {location.url}: study {study_uid} has no series {series_uid} "
                            f"(it has {len(found or [])} series).")
    if not found:
        raise PacsError(f"DICOMweb {location.url}: study {study_uid} was not found or has no series.")
    refined = []
    for choice in choices:
        try:
            refined.append(choice if choice.reason else _has_volume_images(client, study_uid, choice))
        except Exception as exc:
            raise PacsError(f"DICOMweb {location.url}: reading the metadata of series {choice.uid} of study "
                            f"{study_uid} failed ({_reason(exc)}).") from None
    return refined


def fetch_study(location: DicomWebLocation, study_uid: str, folder: Path, *, series_uid: str | None = None,
                rule: ModalityRule | None = None, max_instances: int = 20_000) -> list[str]:
    """Choose the study's eligible series (:func:`choose_series`) and download them (WADO-RS, streamed: one
    instance in memory at a time) into ``folder/<SeriesInstanceUID>/<SOPInstanceUID>.dcm``.

    Returns the series UIDs fetched. An instance whose SOPInstanceUID breaks the UID rule or that belongs to
    another series is refused (logged with the rule, not written); the others are written.

    Raises:
        PacsError: naming the study (and series) when the PACS cannot be reached, answers with an error,
            has no such study or series, or none of its series is eligible (with each series' reason).
    """
    choices = choose_series(location, study_uid, series_uid=series_uid, rule=rule,
                            max_instances=max_instances)
    for choice in choices:
        if choice.reason:
            LOGGER.warning("study %s: series %s (%s) not fetched: %s", study_uid, choice.uid,
                           choice.modality or "no Modality", choice.reason)
    eligible = [c.uid for c in choices if not c.reason]
    if not eligible:
        reasons = "; ".join(f"{c.uid}: {c.reason}" for c in choices)
        raise PacsError(f"study {study_uid}: no eligible image series ({len(choices)} series: {reasons}).")
    folder.mkdir(parents=True, exist_ok=True)
    client = location.client()
    for uid in eligible:
        try:
            written, refused = _fetch_series(client, study_uid, uid, folder, max_instances)
        except (PacsError, UnsafeIdentifierError):
            raise
        except Exception as exc:
            raise PacsError(f"DICOMweb {location.url}: retrieving series {uid} of study {study_uid} failed "
                            f"({_reason(exc)}).") from None
        LOGGER.info("fetched series %s of study %s: %d instance(s), %d refused", uid, study_uid, written,
                    refused)
    return eligible


def _fetch_series(client: Any, study_uid: str, uid: str, folder: Path, max_instances: int) -> tuple[int, int]:
    written = refused = 0
    for ds in client.iter_series(study_uid, uid):
        if written + refused >= max_instances:
            raise PacsError(f"study {study_uid}: series {uid} sent more than {max_instances} instances.")
        sop = valid_uid(ds.get("SOPInstanceUID"))
        series = valid_uid(ds.get("SeriesInstanceUID"))
        if sop is None or series != uid:
            refused += 1
            rule = (f"SOPInstanceUID is not {UID_RULE} (got {shown(ds.get('SOPInstanceUID'))})" if sop is None
                    else f"its SeriesInstanceUID {shown(ds.get('SeriesInstanceUID'))} is not {uid}")
            LOGGER.warning("study %s, series %s: refused an instance from DICOMweb: %s", study_uid, uid, rule)
            continue
        with atomic_output(child_path(folder, uid, f"{sop}.dcm")) as temp:
            ds.save_as(temp, enforce_file_format=True)
        written += 1
    return written, refused


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
