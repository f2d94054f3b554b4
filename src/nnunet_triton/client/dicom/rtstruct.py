"""Write a label map as a DICOM RT Structure Set (RTSTRUCT) that references the source series.

One ROI per foreground label (or region, with the members :mod:`.seg` gives it), named with the segment's
label text, coloured (ROIDisplayColor) and coded (RT ROI Identification Code Sequence, the segmented
property type) from the endpoint's segment metadata when there is one. Contours are planar, one set per
source slice, in patient coordinates (mm), and each references the source SOP instance (and frame, for an
enhanced multi-frame source) it was drawn on; the structure set references the source's frame of reference,
study and series.

Contours are extracted with scikit-image's marching squares (``measure.find_contours`` at level 0.5 on the
zero-padded slice mask): every island and every hole gets its own closed contour through the midpoints
between inside and outside pixel centres; collinear points are dropped (exact, no smoothing). RTSTRUCT has
no notion of holes beyond the contours themselves: a viewer fills a slice's contours of one ROI by the
even-odd rule (XOR), so a hole is a contour inside another, an island in a hole a contour inside that.
:func:`rasterize_roi` does exactly that, and gives back the label map's pixels (every pixel centre lies
at least 0.35 pixel from a contour). An empty label gives an ROI without ContourSequence (Type 3).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydicom.uid import generate_uid

from nnunet_triton import __version__
from nnunet_triton.client.dicom.seg import MANUFACTURER, SOURCE_TYPE2, SegmentLabel, conformant_source
from nnunet_triton.client.dicom.volume import DicomVolume
from nnunet_triton.client.imageio import atomic_output
from nnunet_triton.errors import InputValidationError

__all__ = ["write_rtstruct", "slice_contours", "rasterize_roi", "RTSTRUCT_SOP_CLASS"]

LOGGER = logging.getLogger(__name__)
RTSTRUCT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.481.3"
STUDY_COMPONENT_SOP_CLASS = "1.2.840.10008.3.1.2.3.1"  # what RT Referenced Study Sequence items name
ANATOMICAL_STRUCTURE = ("91723000", "SCT")  # CID 7150: an anatomical category -> RTROIInterpretedType ORGAN


def _drop_collinear(points: np.ndarray) -> np.ndarray:
    """The corners of a closed polygon (first point not repeated): points on a straight run dropped."""
    prev, nxt = np.roll(points, 1, axis=0), np.roll(points, -1, axis=0)
    cross = (points[:, 0] - prev[:, 0]) * (nxt[:, 1] - prev[:, 1]) - (points[:, 1] - prev[:, 1]) * (
        nxt[:, 0] - prev[:, 0])
    keep = np.abs(cross) > 1e-9
    return points[keep] if keep.sum() >= 3 else points


def slice_contours(mask: np.ndarray) -> list[np.ndarray]:
    """Closed contours of a 2D boolean ``mask`` (rows, columns): ``(n, 2)`` arrays of (row, column) pixel
    coordinates, one per island boundary and per hole boundary (fill them by the even-odd rule)."""
    from skimage import measure

    padded = np.pad(np.asarray(mask, dtype=np.uint8), 1)
    contours = []
    for contour in measure.find_contours(padded, 0.5):
        points = contour[:-1] - 1.0 if np.array_equal(contour[0], contour[-1]) else contour - 1.0
        if len(points) >= 3:
            contours.append(_drop_collinear(points))
    return contours


def _index_to_patient(volume: DicomVolume) -> tuple[np.ndarray, np.ndarray]:
    """(matrix, origin): patient (x, y, z) mm = origin + matrix @ (column, row, slice)."""
    geometry = volume.geometry
    direction = np.asarray(geometry.direction, float).reshape(3, 3)
    return direction * np.asarray(geometry.spacing, float)[None, :], np.asarray(geometry.origin, float)


def rasterize_roi(contours: Sequence[tuple[int, np.ndarray]], volume: DicomVolume) -> np.ndarray:
    """The ``(z, y, x)`` mask of one ROI's contours (``(slice index, (n, 3) patient points)`` pairs) on the
    source grid, filled by the even-odd rule (XOR of each contour's inside, as viewers fill RTSTRUCT)."""
    from skimage.draw import polygon

    matrix, origin = _index_to_patient(volume)
    inverse = np.linalg.inv(matrix)
    mask = np.zeros(volume.data.shape, dtype=bool)
    for k, points in contours:
        index = (np.asarray(points, float) - origin) @ inverse.T  # (column, row, slice)
        if not np.allclose(index[:, 2], k, atol=1e-3):
            raise InputValidationError(f"RTSTRUCT: a contour of slice {k} is not in that slice's plane.")
        inside = np.zeros(volume.data.shape[1:], dtype=bool)
        rows, cols = polygon(index[:, 1], index[:, 0], shape=inside.shape)
        inside[rows, cols] = True
        mask[k] ^= inside
    return mask


def _ds(values: np.ndarray) -> list[str]:
    """DS text (at most 16 characters) of patient coordinates, to 1e-4 mm."""
    return [f"{v:.4f}" for v in np.asarray(values, float).reshape(-1)]


def _code_item(code: Any) -> Any:
    from pydicom.dataset import Dataset

    item = Dataset()
    item.CodeValue, item.CodingSchemeDesignator, item.CodeMeaning = code.value, code.scheme, code.meaning
    return item


def _image_reference(volume: DicomVolume, k: int) -> Any:
    from pydicom.dataset import Dataset

    frame = volume.frames[k]
    source = next((d for d in volume.datasets if str(d.SOPInstanceUID) == frame.sop_instance_uid),
                  volume.datasets[0])
    item = Dataset()
    item.ReferencedSOPClassUID = source.SOPClassUID
    item.ReferencedSOPInstanceUID = frame.sop_instance_uid
    if frame.frame is not None:
        item.ReferencedFrameNumber = frame.frame + 1
    return item


def _referenced_frame_of_reference(volume: DicomVolume, frame_of_reference: str) -> Any:
    from pydicom.dataset import Dataset

    first = volume.datasets[0]
    series = Dataset()
    series.SeriesInstanceUID = volume.series_instance_uid
    series.ContourImageSequence = [_image_reference(volume, k) for k in range(len(volume.frames))]
    study = Dataset()
    study.ReferencedSOPClassUID = STUDY_COMPONENT_SOP_CLASS
    study.ReferencedSOPInstanceUID = first.StudyInstanceUID
    study.RTReferencedSeriesSequence = [series]
    item = Dataset()
    item.FrameOfReferenceUID = frame_of_reference
    item.RTReferencedStudySequence = [study]
    return item


def _roi_contours(seg: np.ndarray, label: SegmentLabel, volume: DicomVolume) -> list[Any]:
    from pydicom.dataset import Dataset

    matrix, origin = _index_to_patient(volume)
    mask = np.isin(seg, label.members)
    items = []
    for k in np.flatnonzero(mask.any(axis=(1, 2))):
        for contour in slice_contours(mask[k]):
            index = np.column_stack([contour[:, 1], contour[:, 0], np.full(len(contour), float(k))])
            points = origin + index @ matrix.T
            item = Dataset()
            item.ContourImageSequence = [_image_reference(volume, int(k))]
            item.ContourGeometricType = "CLOSED_PLANAR"
            item.NumberOfContourPoints = len(points)
            item.ContourNumber = len(items) + 1
            item.ContourData = _ds(points)
            items.append(item)
    return items


def _roi(seg: np.ndarray, label: SegmentLabel, volume: DicomVolume, frame_of_reference: str,
         algorithm: str) -> tuple[Any, Any, Any]:
    """(StructureSetROI, ROIContour, RTROIObservations) items of ``label``."""
    from pydicom.dataset import Dataset

    roi = Dataset()
    roi.ROINumber = label.number
    roi.ReferencedFrameOfReferenceUID = frame_of_reference
    roi.ROIName = label.label
    roi.ROIGenerationAlgorithm = "AUTOMATIC"
    roi.ROIGenerationDescription = algorithm[:64]
    contour = Dataset()
    contour.ReferencedROINumber = label.number
    if label.coding is not None and label.coding.rgb is not None:
        contour.ROIDisplayColor = list(label.coding.rgb)
    contours = _roi_contours(seg, label, volume)
    if contours:  # Type 3: an empty label is an ROI without contours, not an empty sequence
        contour.ContourSequence = contours
    observation = Dataset()
    observation.ObservationNumber = label.number
    observation.ReferencedROINumber = label.number
    coding = label.coding
    anatomical = coding is not None and (
        coding.category.value, coding.category.scheme) == ANATOMICAL_STRUCTURE
    observation.RTROIInterpretedType = "ORGAN" if anatomical else ""
    observation.ROIInterpreter = ""
    if coding is not None:
        observation.RTROIIdentificationCodeSequence = [_code_item(coding.type)]
    return roi, contour, observation


def _header(volume: DicomVolume, *, series_instance_uid: str, sop_instance_uid: str, series_number: int,
            instance_number: int, series_description: str, algorithm_name: str, algorithm_version: str
            ) -> Any:
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import PYDICOM_IMPLEMENTATION_UID, ExplicitVRLittleEndian

    source = conformant_source(volume.datasets[0])
    now = datetime.datetime.now()
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = RTSTRUCT_SOP_CLASS
    meta.MediaStorageSOPInstanceUID = sop_instance_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
    ds = Dataset()
    ds.file_meta = meta
    if "SpecificCharacterSet" in source:
        ds.SpecificCharacterSet = source.SpecificCharacterSet
    ds.SOPClassUID, ds.SOPInstanceUID = RTSTRUCT_SOP_CLASS, sop_instance_uid
    ds.InstanceCreationDate, ds.InstanceCreationTime = now.strftime("%Y%m%d"), now.strftime("%H%M%S")
    for keyword in SOURCE_TYPE2:  # patient and study (made conformant on the copy)
        setattr(ds, keyword, source.get(keyword, ""))
    ds.StudyInstanceUID = source.StudyInstanceUID
    ds.Modality = "RTSTRUCT"
    ds.SeriesInstanceUID, ds.SeriesNumber = series_instance_uid, series_number
    ds.SeriesDescription = series_description[:64]
    ds.OperatorsName = ""
    ds.Manufacturer, ds.ManufacturerModelName = MANUFACTURER, algorithm_name[:64]
    ds.SoftwareVersions, ds.DeviceSerialNumber = algorithm_version[:64], "0"
    ds.InstanceNumber = instance_number
    ds.StructureSetLabel = "NNUNET"
    ds.StructureSetName = f"{algorithm_name} structures"[:64]
    ds.StructureSetDate, ds.StructureSetTime = now.strftime("%Y%m%d"), now.strftime("%H%M%S")
    return ds


def write_rtstruct(
    segmentation: np.ndarray,
    volume: DicomVolume,
    labels: Sequence[SegmentLabel],
    path: str | Path,
    *,
    series_number: int = 902,
    algorithm_name: str = "nnU-Net",
    algorithm_version: str = __version__,
    series_instance_uid: str | None = None,
    sop_instance_uid: str | None = None,
    instance_number: int = 1,
    durable: bool = False,
    series_description: str = "nnU-Net structures",
) -> Path:
    """Write ``segmentation`` (``(z, y, x)`` label values shaped like ``volume.data``) as an RTSTRUCT with
    one ROI per entry of ``labels`` (see the module docstring). UIDs and ``durable`` as ``write_dicom_seg``.

    Raises:
        InputValidationError: shape mismatch, values without a label, or a source without a
            FrameOfReferenceUID.
    """
    seg = np.asarray(segmentation)
    if seg.shape != volume.data.shape:
        raise InputValidationError(f"RTSTRUCT: segmentation shape {seg.shape} != source volume shape "
                                   f"{volume.data.shape} (series {volume.series_instance_uid}).")
    unknown = sorted(set(np.unique(seg).tolist()) - {0} - {v for s in labels for v in s.members})
    if unknown:
        raise InputValidationError(f"RTSTRUCT: label values {unknown} have no ROI in {list(labels)}.")
    frame_of_reference = str(volume.datasets[0].get("FrameOfReferenceUID", "") or "")
    if not frame_of_reference:
        raise InputValidationError(f"RTSTRUCT: the source series {volume.series_instance_uid} has no "
                                   "FrameOfReferenceUID; contours in patient coordinates need one.")
    ds = _header(volume, series_instance_uid=series_instance_uid or generate_uid(),
                 sop_instance_uid=sop_instance_uid or generate_uid(), series_number=series_number,
                 instance_number=instance_number, series_description=series_description,
                 algorithm_name=algorithm_name, algorithm_version=algorithm_version)
    ds.FrameOfReferenceUID = frame_of_reference  # Frame of Reference module: the source's
    ds.PositionReferenceIndicator = volume.datasets[0].get("PositionReferenceIndicator", "") or ""
    ds.ReferencedFrameOfReferenceSequence = [_referenced_frame_of_reference(volume, frame_of_reference)]
    rois = [_roi(seg, label, volume, frame_of_reference, f"{algorithm_name} {algorithm_version}")
            for label in labels]
    ds.StructureSetROISequence = [r[0] for r in rois]
    ds.ROIContourSequence = [r[1] for r in rois]
    ds.RTROIObservationsSequence = [r[2] for r in rois]
    if durable:
        from nnunet_triton.client.dicom.spool import durable_output

        with durable_output(Path(path)) as temp:
            ds.save_as(temp, enforce_file_format=True)
    else:
        with atomic_output(path, ".dcm") as temp:
            ds.save_as(temp, enforce_file_format=True)
    LOGGER.debug("wrote RTSTRUCT %s (%d ROIs)", path, len(labels))
    return Path(path)
