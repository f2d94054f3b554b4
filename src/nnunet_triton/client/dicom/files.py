"""Find the DICOM image series in a folder (pydicom, headers only).

:func:`scan_folder` walks a folder recursively, groups files by SeriesInstanceUID and keeps those that carry
3D image geometry; non-DICOM files, non-image objects (SR, SEG, RT, presentation states) and localizers
(ImageType ``LOCALIZER``) are listed as skipped with the reason.
:mod:`nnunet_triton.client.dicom.volume` turns a series
into a volume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pydicom
import pydicom.misc
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError

from nnunet_triton.client.dicom.uids import UID_RULE, require_uid, valid_uid
from nnunet_triton.errors import InputValidationError

__all__ = [
    "DicomError",
    "DicomOptions",
    "DEFAULT_OPTIONS",
    "SeriesFiles",
    "DicomScan",
    "scan_folder",
    "case_name",
    "is_dicom_file",
]

LOGGER = logging.getLogger(__name__)
NON_VOLUME_MODALITIES = frozenset(
    {"SEG", "SR", "PR", "KO", "DOC", "RTSTRUCT", "RTPLAN", "RTDOSE", "RTRECORD", "REG"}
)


class DicomError(InputValidationError):
    """A DICOM file or series cannot become a volume; the message names the file and the rule."""


@dataclass(frozen=True)
class DicomOptions:
    """Limits and tolerances.

    ``max_bytes`` bounds the float32 volume; the spacing tolerance is
    ``max(spacing_atol_mm, spacing_rtol * step)``; orientation cosines agree within ``orientation_atol``.
    """

    max_files: int = 20_000
    max_frames: int = 5_000
    max_bytes: int = 4 * 2**30
    spacing_rtol: float = 0.01
    spacing_atol_mm: float = 0.01
    orientation_atol: float = 1e-4


@dataclass(frozen=True)
class SeriesFiles:
    """The image files of one series with their headers (read without pixel data)."""

    uid: str
    headers: tuple[tuple[Path, Dataset], ...]

    @property
    def first(self) -> Dataset:
        return self.headers[0][1]

    @property
    def description(self) -> str:
        ds = self.first
        number, text = ds.get("SeriesNumber", "?"), ds.get("SeriesDescription", "")
        return f"{ds.get('Modality', '?')} series {number} {text}".rstrip()


@dataclass(frozen=True)
class DicomScan:
    series: tuple[SeriesFiles, ...]
    skipped: tuple[tuple[Path, str], ...]  # (file, why it is not part of any volume)


DEFAULT_OPTIONS = DicomOptions()


def scan_folder(folder: str | Path, options: DicomOptions = DEFAULT_OPTIONS) -> DicomScan:
    """Group the DICOM files under ``folder`` (recursively) by SeriesInstanceUID."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and not p.name.startswith("."))
    if len(files) > options.max_files:
        raise DicomError(
            f"{folder}: holds {len(files)} files, more than max_files={options.max_files}; "
            "point the input at one study or series folder."
        )
    series: dict[str, list[tuple[Path, Dataset]]] = {}
    skipped: list[tuple[Path, str]] = []
    for path in files:
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True)
        except InvalidDicomError:
            skipped.append((path, "not a DICOM file"))
            continue
        except Exception as exc:  # truncated or malformed header
            skipped.append((path, f"unreadable DICOM header ({type(exc).__name__}: {exc})"))
            continue
        reason = _not_a_volume_image(ds)
        if reason:
            skipped.append((path, reason))
        else:
            series.setdefault(str(valid_uid(ds.SeriesInstanceUID)), []).append((path, ds))
    for path, reason in skipped:
        LOGGER.info("skipping %s: %s", path, reason)
    return DicomScan(tuple(SeriesFiles(uid, tuple(h)) for uid, h in series.items()), tuple(skipped))


def _not_a_volume_image(ds: Dataset) -> str:
    modality = str(ds.get("Modality", ""))
    if modality in NON_VOLUME_MODALITIES:
        return f"modality {modality} is not an image volume"
    if "SeriesInstanceUID" not in ds or "Rows" not in ds:
        return "no SeriesInstanceUID/Rows: not an image"
    for keyword in ("SeriesInstanceUID", "SOPInstanceUID"):  # they name outputs and reference the source
        if valid_uid(ds.get(keyword)) is None:
            return f"{keyword} is not {UID_RULE}"
    if "LOCALIZER" in [str(v).upper() for v in ds.get("ImageType", [])]:
        return "localizer (ImageType LOCALIZER)"
    if "ImagePositionPatient" not in ds and "PerFrameFunctionalGroupsSequence" not in ds:
        return "no ImagePositionPatient or per-frame functional groups: no 3D geometry"
    return ""


def case_name(series: SeriesFiles) -> str:
    """Output name of a series: its SeriesInstanceUID (unique and stable across runs), checked against the
    UID rule (:mod:`.uids`) once more, since it becomes a file name."""
    return require_uid(series.uid, what=f"SeriesInstanceUID of {series.headers[0][0]}")


def is_dicom_file(path: str | Path) -> bool:
    """True when ``path`` starts with the DICOM preamble (``DICM`` at byte 128)."""
    return pydicom.misc.is_dicom(str(path))
