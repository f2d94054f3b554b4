"""Write a label map as a DICOM Segmentation (highdicom) that references the source series.

One segment per foreground label of dataset.json (segment label = the label's name; for region-based models
one segment per region, value from ``regions_class_order``). The segmentation is BINARY (the most widely
supported SEG type); frames follow the source images (one per single-frame file, or the source's frame order
for an enhanced multi-frame image), so each frame references its source SOP instance.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydicom.uid import generate_uid

from nnunet_triton import __version__
from nnunet_triton.client.dicom.volume import DicomVolume
from nnunet_triton.client.imageio import atomic_output
from nnunet_triton.errors import InputValidationError

__all__ = ["SegmentLabel", "segment_labels", "write_dicom_seg", "PRIVATE_SCHEME"]

LOGGER = logging.getLogger(__name__)
PRIVATE_SCHEME = "99NNUNET"  # private coding scheme for label names that have no standard code
MANUFACTURER = "nnunet_triton"


@dataclass(frozen=True)
class SegmentLabel:
    """Segment ``number`` (1..N) holds the voxels whose label map value is ``value``."""

    number: int
    value: int
    name: str


def segment_labels(
    labels: Mapping[str, int | Sequence[int]], regions_class_order: Sequence[int] | None = None
) -> tuple[SegmentLabel, ...]:
    """Segments for dataset.json ``labels`` (background and ``ignore`` left out), numbered in label order.

    Region-based models (list values) need ``regions_class_order``: region ``i`` is written as value
    ``regions_class_order[i]`` (nnU-Net's ``convert_probabilities_to_segmentation``).
    """
    foreground = [(n, v) for n, v in labels.items() if n != "ignore" and v not in (0, [0], (0,))]
    is_regions = any(isinstance(v, list | tuple) and len(v) > 1 for _, v in foreground)
    if is_regions:
        if regions_class_order is None or len(regions_class_order) != len(foreground):
            raise InputValidationError(
                f"region-based labels {dict(foreground)} need regions_class_order with {len(foreground)} "
                f"entries, got {regions_class_order!r}."
            )
        values = [int(v) for v in regions_class_order]
    else:
        values = [int(v[0] if isinstance(v, list | tuple) else v) for _, v in foreground]
    ordered = sorted(zip(values, (n for n, _ in foreground), strict=True))
    return tuple(SegmentLabel(number=k + 1, value=v, name=n) for k, (v, n) in enumerate(ordered))


def _frames_in_source_order(segmentation: np.ndarray, volume: DicomVolume) -> np.ndarray:
    """Reorder z slices into the order of the source frames highdicom pairs them with."""
    if len(volume.datasets) == len(volume.frames) and all(f.frame is None for f in volume.frames):
        return segmentation  # single-frame sources, already in z order (== volume.datasets order)
    if len(volume.datasets) == 1 and all(f.frame is not None for f in volume.frames):
        n_source = int(volume.datasets[0].get("NumberOfFrames", 1))
        if n_source != len(volume.frames):
            raise InputValidationError(
                f"DICOM-SEG: the source {volume.frames[0].path} has {n_source} frames but the volume uses "
                f"{len(volume.frames)}; a SEG of a subset of an enhanced image's frames is not supported."
            )
        ordered = np.empty_like(segmentation)
        for k, frame in enumerate(volume.frames):
            ordered[frame.frame] = segmentation[k]
        return ordered
    raise InputValidationError(
        "DICOM-SEG: series that mix multi-frame and single-frame files are not supported."
    )


def write_dicom_seg(
    segmentation: np.ndarray,
    volume: DicomVolume,
    labels: Sequence[SegmentLabel],
    path: str | Path,
    *,
    series_number: int = 901,
    algorithm_name: str = "nnU-Net",
    algorithm_version: str = __version__,
) -> Path:
    """Write ``segmentation`` (``(z, y, x)``, label values, shaped like ``volume.data``) as DICOM-SEG."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    seg = np.asarray(segmentation)
    if seg.shape != volume.data.shape:
        raise InputValidationError(
            f"DICOM-SEG: segmentation shape {seg.shape} != source volume shape "
            f"{volume.data.shape} (series {volume.series_instance_uid})."
        )
    unknown = sorted(set(np.unique(seg).tolist()) - {0} - {s.value for s in labels})
    if unknown:
        raise InputValidationError(f"DICOM-SEG: label values {unknown} have no segment in {list(labels)}.")
    lookup = np.zeros(max([s.value for s in labels] + [int(seg.max(initial=0))]) + 1, dtype=np.uint16)
    for s in labels:
        lookup[s.value] = s.number
    numbers = lookup[seg].astype(np.uint8 if len(labels) < 256 else np.uint16)
    algorithm = hd.AlgorithmIdentificationSequence(
        name=algorithm_name, family=codes.cid7162.ArtificialIntelligence, version=algorithm_version
    )
    descriptions = [
        hd.seg.SegmentDescription(
            segment_number=s.number,
            segment_label=s.name[:64],
            segmented_property_category=codes.cid7150.Tissue,
            segmented_property_type=hd.sr.CodedConcept(str(s.value), PRIVATE_SCHEME, s.name[:64]),
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
        )
        for s in labels
    ]
    document = hd.seg.Segmentation(
        source_images=list(volume.datasets),
        pixel_array=_frames_in_source_order(numbers, volume),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=descriptions,
        series_instance_uid=generate_uid(),
        series_number=series_number,
        sop_instance_uid=generate_uid(),
        instance_number=1,
        manufacturer=MANUFACTURER,
        manufacturer_model_name=algorithm_name,
        software_versions=algorithm_version,
        device_serial_number="0",
        content_label="NNUNET",
        content_description=f"{algorithm_name} segmentation",
        omit_empty_frames=bool(numbers.any()),
    )
    with atomic_output(path, ".dcm") as temp:
        document.save_as(temp)
    LOGGER.debug("wrote DICOM-SEG %s (%d segments, %d frames)", path, len(labels), document.NumberOfFrames)
    return Path(path)
