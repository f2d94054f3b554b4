"""Keep patient data out of log lines and error files.

Our own messages name series by UID and never hold patient data. Exception texts of other libraries may:
pydicom's ``Unable to convert '1975-03-01' to 'DA' object``, highdicom's warning that echoes a patient name.
:func:`redact` removes the values of the patient/study attributes of the datasets involved and masks every
quoted value that is not a UID, a number or a keyword; :func:`describe` is what the node writes for an
exception; :class:`RedactingFilter` applies the same masking to the records of pydicom, highdicom,
pynetdicom and Python's warnings, for the handlers of a process that handles patient data.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterable
from typing import Any

from nnunet_triton.errors import NnunetTritonError

__all__ = ["PHI_KEYWORDS", "raw_text", "phi_values", "redact", "describe", "RedactingFilter",
           "THIRD_PARTY_LOGGERS"]

# Patient and study attributes that identify a person or a visit (PS3.15 E.1-1 basic profile, the parts
# a SEG copies from its source and the ones commonly filled by modalities)
PHI_KEYWORDS = (
    "PatientName", "PatientID", "PatientBirthDate", "PatientBirthTime", "PatientSex", "PatientAge",
    "PatientSize", "PatientWeight", "PatientAddress", "PatientTelephoneNumbers", "PatientMotherBirthName",
    "OtherPatientIDs", "OtherPatientNames", "IssuerOfPatientID", "EthnicGroup", "PatientComments",
    "AccessionNumber", "StudyID", "StudyDate", "StudyTime", "SeriesDate", "SeriesTime",
    "AcquisitionDate", "AcquisitionTime", "ContentDate", "ContentTime", "ReferringPhysicianName",
    "PerformingPhysicianName", "OperatorsName", "InstitutionName", "InstitutionAddress", "StationName",
    "StudyDescription", "SeriesDescription", "RequestingPhysician", "MedicalRecordLocator",
)
THIRD_PARTY_LOGGERS = ("pydicom", "highdicom", "pynetdicom", "py.warnings", "dicomweb_client")
_QUOTED = re.compile(r"""(?P<q>['"])(?P<value>[^'"\n]{0,200})(?P=q)""")
_HARMLESS = re.compile(r"[0-9.]{1,64}|\(?[0-9a-fA-F]{4}, ?[0-9a-fA-F]{4}\)?")  # UIDs, numbers, tags
_WITHHELD = "<withheld>"
MAX_TEXT = 400


def _harmless(value: str) -> bool:
    """A quoted value that cannot be patient data: a UID or number, a tag, a VR, a DICOM keyword."""
    from pydicom.datadict import keyword_dict
    from pydicom.valuerep import VR

    return (value == _WITHHELD or _HARMLESS.fullmatch(value) is not None or value in keyword_dict
            or value in VR.__members__)


def raw_text(ds: Any, keyword: str) -> str | None:
    """The value of ``keyword`` in ``ds`` as stored (None when absent), read without pydicom converting it
    (the conversion of an invalid value logs the value) and decoded with the dataset's
    SpecificCharacterSet."""
    from pydicom.datadict import tag_for_keyword

    tag = tag_for_keyword(keyword)
    if tag is None or tag not in ds:
        return None
    value = ds.get_item(tag).value
    if isinstance(value, bytes):
        return _decode(ds, value).rstrip("\x00 ")
    if value is None:
        return ""
    several = isinstance(value, list | tuple) or type(value).__name__ == "MultiValue"
    return "\\".join(str(v) for v in value) if several else str(value)


def _encodings(ds: Any) -> list[str]:
    """Python codecs of the dataset's SpecificCharacterSet (pydicom's mapping; ASCII when absent)."""
    from pydicom.charset import convert_encodings

    try:
        declared = ds.get("SpecificCharacterSet", "ISO_IR 6") if hasattr(ds, "get") else "ISO_IR 6"
        return list(convert_encodings(declared or "ISO_IR 6"))
    except Exception:  # noqa: BLE001 - an unknown character set: decode as Latin-1 below
        return ["latin_1"]


def _decode(ds: Any, value: bytes) -> str:
    """``value`` as pydicom decodes it with the dataset's character sets (ISO 2022 escape sequences,
    multi-byte sets), delimiters of names and values resetting the state; Latin-1 when that fails."""
    from pydicom.charset import decode_bytes

    try:
        with warnings.catch_warnings():  # a value that does not decode: replaced characters, no warning
            warnings.simplefilter("ignore")
            return decode_bytes(value, _encodings(ds), {0x5C, 0x5E, 0x3D})
    except Exception:  # noqa: BLE001 - redaction must not fail on a broken value
        return value.decode("latin-1")


def _raw_bytes(ds: Any, keyword: str) -> bytes | None:
    from pydicom.datadict import tag_for_keyword

    tag = tag_for_keyword(keyword)
    if tag is None or tag not in ds:
        return None
    value = ds.get_item(tag).value
    return value if isinstance(value, bytes) else None


def _parts(text: str) -> set[str]:
    """A value's items and name components worth masking: two characters or more, or one that is not
    ASCII (a one-ideograph family name)."""
    parts: set[str] = set()
    for item in (text or "").split("\\"):
        item = item.strip()
        for part in [item, *re.split(r"[\^=]", item)]:
            part = part.strip()
            if len(part) >= 2 or (part and not part.isascii()):
                parts.add(part)
    return parts


def phi_values(datasets: Iterable[Any]) -> set[str]:
    """The text of every PHI attribute (each value, each name component) in ``datasets``."""
    values: set[str] = set()
    for ds in datasets:
        for keyword in PHI_KEYWORDS:
            try:
                text = raw_text(ds, keyword)
            except Exception:  # noqa: BLE001 - a value that cannot even be read is not shown either
                continue
            values.update(_parts(text or ""))
            raw = _raw_bytes(ds, keyword)
            if raw is not None:  # as a library that ignored the character set would show it, too
                values.update(_parts(raw.decode("latin-1").rstrip("\x00 ")))
    return values


def redact(text: str, datasets: Iterable[object] = (), values: Iterable[str] = ()) -> str:
    """``text`` without the PHI values of ``datasets`` (and ``values``) and with other quoted values that
    could be patient data replaced by ``<withheld>``; cut to a bounded length."""
    for value in sorted({*phi_values(datasets), *values}, key=len, reverse=True):
        text = text.replace(value, _WITHHELD)

    def mask(match: re.Match[str]) -> str:
        return match[0] if _harmless(match["value"]) else f"{match['q']}{_WITHHELD}{match['q']}"

    text = _QUOTED.sub(mask, text)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "..."


def describe(exc: BaseException, datasets: Iterable[object] = ()) -> str:
    """``Type: message`` for a log line or ``error.txt``: our own errors as they are (they name UIDs and
    rules, not patients) but redacted all the same, other libraries' texts redacted."""
    kind = type(exc).__name__
    text = str(exc)
    if not isinstance(exc, NnunetTritonError) and not text:
        text = "(no message)"
    return f"{kind}: {redact(text, datasets)}"


class RedactingFilter(logging.Filter):
    """Masks quoted values in the records of the libraries that handle datasets (see the module doc)."""

    def __init__(self, loggers: Iterable[str] = THIRD_PARTY_LOGGERS) -> None:
        super().__init__()
        self.loggers = tuple(loggers)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] in self.loggers:
            record.msg = redact(record.getMessage())
            record.args = None
        return True
