"""DICOM series -> one volume in nnU-Net's SimpleITK axis convention, with pydicom.

:func:`scan_folder` (from :mod:`nnunet_triton.client.dicom.files`) groups a folder's image files by
SeriesInstanceUID. :func:`read_series` turns one series into a float32 ``(z, y, x)`` volume like
SimpleITK's GDCM series reader does: single-frame slices or the frames of enhanced (multi-frame) images via
their functional groups; for CT only axial slices kept; slices sorted by ImagePositionPatient projected on
the slice normal; RescaleSlope/Intercept applied; spacing from PixelSpacing and the slice positions; direction
from ImageOrientationPatient (columns: row direction, column direction, normal). Mixed orientations, gaps,
irregular or non-perpendicular slice steps and limits (files, frames, bytes) raise
:class:`DicomError` naming the file and the problem.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
from pydicom.dataset import Dataset

from nnunet_triton.client.dicom.files import (
    DEFAULT_OPTIONS,
    DicomError,
    DicomOptions,
    DicomScan,
    SeriesFiles,
    case_name,
    is_dicom_file,
    scan_folder,
)
from nnunet_triton.client.imageio import ImageCase, ImageGeometry

__all__ = [
    "DEFAULT_OPTIONS",
    "DicomError",
    "DicomOptions",
    "SeriesFiles",
    "DicomScan",
    "SourceFrame",
    "DicomVolume",
    "scan_folder",
    "read_series",
    "read_dicom_folder",
    "case_name",
    "is_dicom_file",
]

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceFrame:
    """Where slice ``k`` of a volume comes from: a file and, for multi-frame files, a 0-based frame index."""

    path: Path
    frame: int | None
    sop_instance_uid: str


@dataclass(frozen=True)
class DicomVolume:
    """One series as a volume: ``data`` float32 ``(z, y, x)``, ``spacing`` ``(z, y, x)`` (nnU-Net order)."""

    series_instance_uid: str
    modality: str
    data: np.ndarray
    spacing: tuple[float, float, float]
    geometry: ImageGeometry
    frames: tuple[SourceFrame, ...]
    datasets: tuple[Dataset, ...]  # source headers, one per file, in order of first use along z

    def image_case(self) -> ImageCase:
        return ImageCase(data=self.data[None], spacing=self.spacing, geometry=self.geometry)


@dataclass(frozen=True)
class _Slice:
    path: Path
    frame: int | None
    position: np.ndarray
    orientation: np.ndarray
    pixel_spacing: tuple[float, float]
    slope: float
    intercept: float


def _group_item(ds: Dataset, frame: int, sequence: str) -> Dataset | None:
    for groups in ("PerFrameFunctionalGroupsSequence", "SharedFunctionalGroupsSequence"):
        items = ds.get(groups)
        if items:
            item = items[frame if groups.startswith("Per") else 0]
            if sequence in item and item[sequence].value:
                return item[sequence].value[0]
    return None


def _require(path: Path, ds: Dataset | None, keyword: str, frame: int | None = None) -> Any:
    if ds is None or keyword not in ds or ds[keyword].value in (None, ""):
        where = f"{path}" + (f" frame {frame + 1}" if frame is not None else "")
        raise DicomError(f"{where}: missing {keyword}.")
    return ds[keyword].value


def _slices(path: Path, ds: Dataset) -> list[_Slice]:
    if "PerFrameFunctionalGroupsSequence" not in ds:
        return [
            _Slice(
                path,
                None,
                np.asarray(_require(path, ds, "ImagePositionPatient"), float),
                np.asarray(_require(path, ds, "ImageOrientationPatient"), float),
                tuple(float(v) for v in _require(path, ds, "PixelSpacing")),
                float(ds.get("RescaleSlope", 1.0) or 1.0),
                float(ds.get("RescaleIntercept", 0.0) or 0.0),
            )
        ]
    result = []
    for k in range(int(ds.get("NumberOfFrames", 1))):
        transform = _group_item(ds, k, "PixelValueTransformationSequence") or ds
        result.append(
            _Slice(
                path,
                k,
                np.asarray(
                    _require(path, _group_item(ds, k, "PlanePositionSequence"), "ImagePositionPatient", k),
                    float,
                ),
                np.asarray(
                    _require(
                        path, _group_item(ds, k, "PlaneOrientationSequence"), "ImageOrientationPatient", k
                    ),
                    float,
                ),
                tuple(
                    float(v)
                    for v in _require(path, _group_item(ds, k, "PixelMeasuresSequence"), "PixelSpacing", k)
                ),
                float(transform.get("RescaleSlope", 1.0) or 1.0),
                float(transform.get("RescaleIntercept", 0.0) or 0.0),
            )
        )
    return result


def _normal(orientation: np.ndarray) -> np.ndarray:
    return np.cross(orientation[:3], orientation[3:])


def _where(s: _Slice) -> str:
    return f"{s.path}" + (f" frame {s.frame + 1}" if s.frame is not None else "")


def _select(series: SeriesFiles, options: DicomOptions) -> list[_Slice]:
    slices = [s for path, ds in series.headers for s in _slices(path, ds)]
    if str(series.first.get("Modality", "")) == "CT":  # keep axial: the normal's largest component is z
        axial = [s for s in slices if np.argmax(np.abs(_normal(s.orientation))) == 2]
        if len(axial) < len(slices):
            LOGGER.info("series %s: dropped %d non-axial CT slices", series.uid, len(slices) - len(axial))
        if not axial:
            raise DicomError(
                f"{series.description} ({series.uid}): no axial slices (first file "
                f"{series.headers[0][0]}, ImageOrientationPatient {slices[0].orientation.tolist()})."
            )
        slices = axial
    counts: dict[tuple[float, ...], int] = {}
    for s in slices:  # the most common orientation is the reference, so the odd file gets named
        key = tuple(np.round(s.orientation, 4))
        counts[key] = counts.get(key, 0) + 1
    common = max(counts, key=counts.__getitem__)
    ref = next(s for s in slices if tuple(np.round(s.orientation, 4)) == common)
    for s in slices:
        if not np.allclose(s.orientation, ref.orientation, atol=options.orientation_atol, rtol=0):
            raise DicomError(
                f"mixed orientations in series {series.uid}: {_where(s)} has ImageOrientationPatient "
                f"{s.orientation.tolist()}, {_where(ref)} has {ref.orientation.tolist()}."
            )
        if not np.allclose(s.pixel_spacing, ref.pixel_spacing, rtol=1e-4, atol=1e-6):
            raise DicomError(
                f"mixed PixelSpacing in series {series.uid}: {_where(s)} has {s.pixel_spacing}, "
                f"{_where(ref)} has {ref.pixel_spacing}."
            )
    return slices


def _sort_and_step(slices: list[_Slice], uid: str, options: DicomOptions) -> tuple[list[_Slice], float]:
    normal = _normal(slices[0].orientation)
    slices = sorted(slices, key=lambda s: float(s.position @ normal))
    distances = np.array([float(s.position @ normal) for s in slices])
    if len(slices) == 1:
        return slices, 1.0
    steps = np.diff(distances)
    step = float(np.median(steps))
    tolerance = max(options.spacing_atol_mm, options.spacing_rtol * abs(step))
    for k, delta in enumerate(steps):
        a, b = slices[k], slices[k + 1]
        if delta <= tolerance:
            raise DicomError(
                f"series {uid}: {_where(a)} and {_where(b)} lie at the same position "
                f"({distances[k]:.3f} mm along the normal): several phases or acquisitions in one "
                "series?"
            )
        if abs(delta - step) > tolerance:
            kind = "gap (missing slices?)" if delta > 1.5 * step else "irregular slice spacing"
            raise DicomError(
                f"series {uid}: {kind} between {_where(a)} and {_where(b)}: step {delta:.4f} mm, "
                f"the series' step is {step:.4f} mm (tolerance {tolerance:.4f} mm)."
            )
    origin = slices[0].position
    for s, d in zip(slices, distances, strict=True):
        offset = s.position - origin - (d - distances[0]) * normal
        if np.linalg.norm(offset) > tolerance:
            raise DicomError(
                f"series {uid}: {_where(s)} is offset {np.linalg.norm(offset):.4f} mm from the line "
                "through the first slice along the normal (gantry tilt or sheared stack); not supported."
            )
    return slices, step


def _check_limits(series: SeriesFiles, n_frames: int, options: DicomOptions) -> tuple[int, int]:
    rows, cols = int(series.first.Rows), int(series.first.Columns)
    if n_frames > options.max_frames:
        raise DicomError(
            f"series {series.uid} ({series.headers[0][0].parent}): {n_frames} slices/frames, more "
            f"than max_frames={options.max_frames}."
        )
    if rows * cols * n_frames * 4 > options.max_bytes:
        raise DicomError(
            f"series {series.uid}: volume {n_frames}x{rows}x{cols} float32 needs "
            f"{rows * cols * n_frames * 4} bytes, more than max_bytes={options.max_bytes}."
        )
    return rows, cols


def _pixels(path: Path, shape: tuple[int, int]) -> np.ndarray:
    try:
        ds = pydicom.dcmread(path)
        array = ds.pixel_array
    except Exception as exc:
        raise DicomError(f"{path}: cannot read pixel data ({type(exc).__name__}: {exc}).") from None
    if int(ds.get("SamplesPerPixel", 1)) != 1:
        raise DicomError(
            f"{path}: SamplesPerPixel {ds.SamplesPerPixel}; only grayscale volumes are supported."
        )
    array = array.reshape(-1, *array.shape[-2:])
    if array.shape[1:] != shape:
        raise DicomError(
            f"{path}: pixel data is {array.shape[1:]} but the series is {shape} (Rows, Columns)."
        )
    return array


def read_series(series: SeriesFiles, options: DicomOptions = DEFAULT_OPTIONS) -> DicomVolume:
    """Read one series (from :func:`scan_folder`) into a :class:`DicomVolume`."""
    slices, step = _sort_and_step(_select(series, options), series.uid, options)
    rows, cols = _check_limits(series, len(slices), options)
    data = np.empty((len(slices), rows, cols), dtype=np.float32)
    by_file: dict[Path, list[int]] = {}
    for k, s in enumerate(slices):
        by_file.setdefault(s.path, []).append(k)
    for path, indices in by_file.items():
        pixels = _pixels(path, (rows, cols))
        for k in indices:
            s = slices[k]
            frame = pixels[s.frame if s.frame is not None else 0].astype(np.float64)
            data[k] = frame * s.slope + s.intercept
    row, col = slices[0].orientation[:3], slices[0].orientation[3:]
    normal = _normal(slices[0].orientation)
    direction = tuple(float(v) for v in np.stack([row, col, normal], axis=1).reshape(-1))
    dy, dx = slices[0].pixel_spacing  # DICOM PixelSpacing = (between rows, between columns)
    headers = dict(series.headers)
    geometry = ImageGeometry(
        spacing=(dx, dy, abs(step)), origin=tuple(float(v) for v in slices[0].position), direction=direction
    )
    return DicomVolume(
        series_instance_uid=series.uid,
        modality=str(series.first.get("Modality", "")),
        data=data,
        spacing=(abs(step), dy, dx),
        geometry=geometry,
        frames=tuple(SourceFrame(s.path, s.frame, str(headers[s.path].SOPInstanceUID)) for s in slices),
        datasets=tuple(headers[p] for p in by_file),
    )


def read_dicom_folder(folder: str | Path, options: DicomOptions = DEFAULT_OPTIONS) -> DicomVolume:
    """Read the only series of ``folder``; raises when it holds none or several."""
    scan = scan_folder(folder, options)
    if len(scan.series) != 1:
        found = [s.description for s in scan.series]
        raise DicomError(f"{folder}: expected exactly one image series, found {len(found)}: {found}.")
    return read_series(scan.series[0], options)
