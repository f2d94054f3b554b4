"""Build DICOM series on disk from pydicom's real test file ``CT_small.dcm`` (a 128x128 CT slice).

Every slice is the real file with new UIDs, its pixels shifted by ``7 * k``, a per-slice rescale
(slope alternating 1/2, intercept ``-1024 + k``) and ImagePositionPatient ``origin + k * step * normal``;
the files get shuffled names so that name order is not z order. The expected volume/geometry is computed
from that construction (not from the reader under test).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pydicom
from pydicom.data import get_testdata_file
from pydicom.uid import generate_uid
from pydicom.valuerep import DSfloat

TILT_DEG = 15.0  # an oblique axial stack: rotated about x, still axial (normal mostly along z)
_C, _S = np.cos(np.deg2rad(TILT_DEG)), np.sin(np.deg2rad(TILT_DEG))
OBLIQUE_AXIAL = (1.0, 0.0, 0.0, 0.0, float(_C), float(_S))
CORONAL = (1.0, 0.0, 0.0, 0.0, 0.0, -1.0)


@dataclass(frozen=True)
class BuiltSeries:
    """What was written and what a correct reader must return."""

    folder: Path
    series_uid: str
    files: tuple[Path, ...]  # in z order (ascending along the normal)
    volume: np.ndarray  # float32 (z, y, x)
    spacing_zyx: tuple[float, float, float]
    origin: tuple[float, float, float]
    direction: tuple[float, ...]  # SimpleITK row-major, columns = row dir, column dir, normal
    sop_uids: tuple[str, ...]


def template() -> pydicom.Dataset:
    return pydicom.dcmread(get_testdata_file("CT_small.dcm"))


def _normal(orientation: Sequence[float]) -> np.ndarray:
    return np.cross(np.asarray(orientation[:3]), np.asarray(orientation[3:]))


def _ds(value: float) -> DSfloat:
    """A DS value of at most 16 characters (PS3.5), as a scanner writes it (``valid_ds``). By default the
    series keep full ``float`` text, which the geometry tests compare exactly; a SEG of an enhanced image
    copies its functional groups verbatim, so the series behind one that dciodvfy checks uses valid DS."""
    return DSfloat(float(value), auto_format=True)


def _save(ds: pydicom.Dataset, path: Path) -> None:
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def write_ct_series(
    folder: Path,
    *,
    n_slices: int = 6,
    step: float = 2.5,
    orientation: Sequence[float] = OBLIQUE_AXIAL,
    origin: Sequence[float] = (-80.0, -90.0, -40.0),
    seed: int = 0,
    skip: Sequence[int] = (),
    positions: Sequence[float] | None = None,
    orientations: dict[int, Sequence[float]] | None = None,
    modality: str = "CT",
    valid_ds: bool = False,
) -> BuiltSeries:
    """Write a CT series; ``skip`` leaves slices out (gaps), ``positions`` overrides the offsets along the
    normal, ``orientations`` overrides ImageOrientationPatient per slice index."""
    base = template()
    pixels = base.pixel_array.astype(np.int16)
    series_uid = generate_uid()
    normal = _normal(orientation)
    offsets = list(positions) if positions is not None else [k * step for k in range(n_slices)]
    names = [f"IM{i:04d}.dcm" for i in random.Random(seed).sample(range(1000), len(offsets))]
    files, volume, uids = [], [], []
    for k, offset in enumerate(offsets):
        if k in skip:
            continue
        ds = copy.deepcopy(base)
        ds.SeriesInstanceUID = series_uid
        ds.SOPInstanceUID = generate_uid()
        ds.Modality = modality
        ds.InstanceNumber = k + 1
        text = _ds if valid_ds else float
        ds.ImageOrientationPatient = [text(v) for v in (orientations or {}).get(k, orientation)]
        ds.ImagePositionPatient = [text(v) for v in np.asarray(origin) + offset * normal]
        slope, intercept = (1.0, 2.0)[k % 2], -1024.0 + k
        ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
        stored = (pixels + 7 * k).astype(np.int16)
        ds.PixelData = stored.tobytes()
        _save(ds, folder / names[k])
        files.append(folder / names[k])
        volume.append(stored.astype(np.float64) * slope + intercept)
        uids.append(str(ds.SOPInstanceUID))
    spacing = float(base.PixelSpacing[0]), float(base.PixelSpacing[1])
    direction = np.stack([np.asarray(orientation[:3]), np.asarray(orientation[3:]), normal], axis=1)
    return BuiltSeries(
        folder=folder,
        series_uid=series_uid,
        files=tuple(files),
        volume=np.stack(volume).astype(np.float32),
        spacing_zyx=(step, *spacing),
        origin=tuple(float(v) for v in origin),
        direction=tuple(float(v) for v in direction.reshape(-1)),
        sop_uids=tuple(uids),
    )


def write_localizer(folder: Path, series_uid: str, name: str = "SCOUT.dcm") -> Path:
    """A coronal LOCALIZER image in the same series (scanners do that)."""
    ds = template()
    ds.SeriesInstanceUID = series_uid
    ds.SOPInstanceUID = generate_uid()
    ds.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
    ds.ImageOrientationPatient = list(CORONAL)
    _save(ds, folder / name)
    return folder / name


def write_non_images(folder: Path) -> list[Path]:
    """A structured report (real pydicom file) and a text file: neither is part of a volume."""
    report = pydicom.dcmread(get_testdata_file("reportsi.dcm"))
    _save(report, folder / "REPORT.dcm")
    (folder / "README.txt").write_text("not dicom\n")
    return [folder / "REPORT.dcm", folder / "README.txt"]


def write_enhanced(series: BuiltSeries, path: Path) -> Path:
    """Convert the single-frame series to one Legacy Converted Enhanced CT image with highdicom."""
    from highdicom.legacy import LegacyConvertedEnhancedCTImage

    datasets = [pydicom.dcmread(f) for f in series.files]
    image = LegacyConvertedEnhancedCTImage(
        legacy_datasets=datasets,
        series_instance_uid=generate_uid(),
        series_number=99,
        sop_instance_uid=generate_uid(),
        instance_number=1,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save_as(path)
    return path


def write_volume_as_ct(
    folder: Path,
    volume: np.ndarray,
    spacing_zyx: Sequence[float],
    *,
    origin: Sequence[float] = (-30.0, -40.0, -20.0),
    orientation: Sequence[float] = OBLIQUE_AXIAL,
    seed: int = 0,
    study_uid: str | None = None,
) -> BuiltSeries:
    """Write an int16 ``(z, y, x)`` volume as a CT series (template CT_small.dcm; slope 1, intercept 0);
    ``study_uid`` puts it in its own study (default: the template's)."""
    base = template()
    if study_uid is not None:
        base.StudyInstanceUID = study_uid
    series_uid = generate_uid()
    normal = _normal(orientation)
    names = [f"IM{i:04d}.dcm" for i in random.Random(seed).sample(range(10_000), volume.shape[0])]
    files, uids = [], []
    for k, plane in enumerate(np.asarray(volume, dtype=np.int16)):
        ds = copy.deepcopy(base)
        ds.SeriesInstanceUID, ds.SOPInstanceUID, ds.InstanceNumber = series_uid, generate_uid(), k + 1
        ds.Rows, ds.Columns = plane.shape
        ds.PixelSpacing = [float(spacing_zyx[1]), float(spacing_zyx[2])]
        ds.SliceThickness = float(spacing_zyx[0])
        ds.ImageOrientationPatient = [float(v) for v in orientation]
        ds.ImagePositionPatient = [float(v) for v in np.asarray(origin) + k * spacing_zyx[0] * normal]
        ds.RescaleSlope, ds.RescaleIntercept = 1.0, 0.0
        for keyword in ("SmallestImagePixelValue", "LargestImagePixelValue"):
            if keyword in ds:
                delattr(ds, keyword)
        ds.PixelData = np.ascontiguousarray(plane).tobytes()
        _save(ds, folder / names[k])
        files.append(folder / names[k])
        uids.append(str(ds.SOPInstanceUID))
    direction = np.stack([np.asarray(orientation[:3]), np.asarray(orientation[3:]), normal], axis=1)
    return BuiltSeries(
        folder=folder,
        series_uid=series_uid,
        files=tuple(files),
        volume=np.asarray(volume, dtype=np.int16).astype(np.float32),
        spacing_zyx=tuple(float(s) for s in spacing_zyx),
        origin=tuple(float(v) for v in origin),
        direction=tuple(float(v) for v in direction.reshape(-1)),
        sop_uids=tuple(uids),
    )
