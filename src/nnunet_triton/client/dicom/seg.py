"""Write a label map as a DICOM Segmentation (highdicom) that references the source series.

One segment per foreground label of dataset.json (segment label = the label's name; the ``ignore`` label
and background have none). Region-based models get one segment per region, overlapping as regions do: a
region covers the label-map values dataset.json lists for it (``"whole": [1, 2]`` covers values 1 and 2,
``"core": 2`` value 2), which is what nnU-Net's ``regions_class_order`` export writes. The segmentation is
BINARY (the most widely supported SEG type; any number of segments, also more than 255 labels); frames
follow the source images (one per single-frame file, or the source's frame order for an enhanced
multi-frame image), so each frame references its source SOP instance.

The SEG copies the patient and study of its source. Sources in the wild miss Type 2 attributes or hold
values that break their VR (a PatientBirthDate of ``1975-03-01``); highdicom then raises, and its message
carries the value. So the source headers are made conformant first, on copies: a missing Type 2 attribute
of the patient and study modules becomes empty, as is allowed, and so does a date, time or sex that is not
valid (the source files are not changed). highdicom's own warnings echo the patient's name: its logger is
held at ERROR.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydicom.uid import generate_uid

from nnunet_triton import __version__
from nnunet_triton.client.dicom.phi import PHI_KEYWORDS, raw_text
from nnunet_triton.client.dicom.volume import DicomVolume
from nnunet_triton.client.imageio import atomic_output
from nnunet_triton.errors import InputValidationError
from nnunet_triton.segment_metadata import (
    PUBLISHED_KEY,
    SegmentCoding,
    SegmentMetadata,
    label_values,
    parse_segment_metadata,
)

__all__ = ["SegmentLabel", "segment_labels", "model_segment_labels", "generic_segment_labels",
           "with_metadata", "write_dicom_seg", "PRIVATE_SCHEME"]

LOGGER = logging.getLogger(__name__)
logging.getLogger("highdicom").setLevel(logging.ERROR)  # its warnings quote patient names
PRIVATE_SCHEME = "99NNUNET"  # private coding scheme for label names that have no standard code
MANUFACTURER = "nnunet_triton"


@dataclass(frozen=True)
class SegmentLabel:
    """Segment ``number`` (1..N), named ``name``, coded ``value``, holds the voxels whose label-map value is
    one of ``members`` (just ``value`` for a plain label; the region's labels for a region)."""

    number: int
    value: int
    name: str
    members: tuple[int, ...] = ()
    coding: SegmentCoding | None = None  # from the endpoint's segment metadata; None: private codes

    def __post_init__(self) -> None:
        if not self.members:
            object.__setattr__(self, "members", (int(self.value),))

    @property
    def label(self) -> str:
        """The segment's (ROI's) label text: the metadata's SegmentLabel, else the dataset.json name."""
        text = self.coding.label if self.coding is not None and self.coding.label else self.name
        return text[:64]


def with_metadata(labels: Sequence[SegmentLabel], metadata: SegmentMetadata | None
                  ) -> tuple[SegmentLabel, ...]:
    """``labels`` with their codings from ``metadata`` (by label-map value; None leaves them uncoded)."""
    if metadata is None:
        return tuple(labels)
    return tuple(replace(s, coding=metadata.coding(s.value)) for s in labels)


def segment_labels(
    labels: Mapping[str, int | Sequence[int]], regions_class_order: Sequence[int] | None = None
) -> tuple[SegmentLabel, ...]:
    """Segments for dataset.json ``labels`` (background and ``ignore`` left out), numbered in label order.

    Region-based models (list values) need ``regions_class_order``: region ``i`` is coded
    ``regions_class_order[i]`` (the value nnU-Net's ``convert_probabilities_to_segmentation`` writes) and
    covers the label-map values of its dataset.json entry.
    """
    return tuple(SegmentLabel(number=k + 1, value=v, name=n, members=m)
                 for k, (v, n, m) in enumerate(label_values(labels, regions_class_order)))


def model_segment_labels(description: Any, dataset_json: Path | None = None) -> tuple[SegmentLabel, ...]:
    """The segments of a served model: from ``dataset_json`` when given, else from the labels the endpoint
    publishes (``EndpointDescription``, regions understood); ``()`` when neither is known. Each carries the
    coding of the segment metadata the endpoint publishes (``build --seg-metadata``), if any."""
    published = description.published if description is not None else {}
    metadata = None
    if published.get(PUBLISHED_KEY):
        metadata = parse_segment_metadata(published[PUBLISHED_KEY],
                                          source=f"segment metadata of endpoint {description.endpoint}")
    else:
        LOGGER.info("the endpoint publishes no segment metadata: DICOM-SEG/RTSTRUCT label codes use the "
                    "private scheme %s, without display colours (build --seg-metadata FILE codes them)",
                    PRIVATE_SCHEME)
    if dataset_json is not None:
        dataset = json.loads(Path(dataset_json).read_text())
        return with_metadata(segment_labels(dataset["labels"], dataset.get("regions_class_order")), metadata)
    if published.get("labels"):
        return with_metadata(segment_labels(description.labels, published.get("regions_class_order")),
                             metadata)
    return ()


def generic_segment_labels(segmentation: np.ndarray) -> tuple[SegmentLabel, ...]:
    """``label_<v>`` segments for the values present, when the model's labels are not known."""
    values = sorted(int(v) for v in np.unique(segmentation) if v != 0)
    return tuple(SegmentLabel(number=k + 1, value=v, name=f"label_{v}") for k, v in enumerate(values))


def _segment_frames(seg: np.ndarray, labels: Sequence[SegmentLabel]) -> np.ndarray:
    """highdicom's BINARY input: segment numbers ``(z, y, x)`` when segments are disjoint and fewer than 256,
    else one boolean plane per segment ``(z, y, x, n)`` (overlapping regions, many labels)."""
    flat = [v for s in labels for v in s.members]
    if len(flat) == len(set(flat)) and len(labels) < 256:
        lookup = np.zeros(max(flat + [int(seg.max(initial=0))]) + 1, dtype=np.uint8)
        for s in labels:
            lookup[list(s.members)] = s.number
        return lookup[seg]
    return np.stack([np.isin(seg, s.members) for s in labels], axis=-1)


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


def coded(code: Any) -> Any:
    """highdicom's CodedConcept of a metadata :class:`~.segment_metadata.Code`."""
    import highdicom as hd

    return hd.sr.CodedConcept(code.value, code.scheme, code.meaning)


def _segment_description(s: SegmentLabel, algorithm: Any) -> Any:
    """The SegmentDescription of ``s``: coded from its metadata, else the private scheme under "Tissue"."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    c = s.coding
    if c is None:
        return hd.seg.SegmentDescription(
            segment_number=s.number, segment_label=s.label,
            segmented_property_category=codes.cid7150.Tissue,
            segmented_property_type=hd.sr.CodedConcept(str(s.value), PRIVATE_SCHEME, s.name[:64]),
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC, algorithm_identification=algorithm)
    description = hd.seg.SegmentDescription(
        segment_number=s.number, segment_label=s.label,
        segmented_property_category=coded(c.category), segmented_property_type=coded(c.type),
        algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC, algorithm_identification=algorithm,
        anatomic_regions=[coded(c.anatomic_region)] if c.anatomic_region is not None else None,
        display_color=hd.color.CIELabColor.from_dicom_value(c.cielab) if c.cielab is not None else None)
    if c.type_modifier is not None:
        item = description.SegmentedPropertyTypeCodeSequence[0]
        item.SegmentedPropertyTypeModifierCodeSequence = [coded(c.type_modifier)]
    if c.anatomic_region_modifier is not None and c.anatomic_region is not None:
        region = description.AnatomicRegionSequence[0]
        region.AnatomicRegionModifierSequence = [coded(c.anatomic_region_modifier)]
    if c.description:
        description.SegmentDescription = c.description
    return description


# Type 2 attributes of the patient and study modules that highdicom's Segmentation reads from its source
SOURCE_TYPE2 = {"PatientName": "PN", "PatientID": "LO", "PatientBirthDate": "DA", "PatientSex": "CS",
                "AccessionNumber": "SH", "StudyID": "SH", "StudyDate": "DA", "StudyTime": "TM",
                "ReferringPhysicianName": "PN"}


_TM = re.compile(r"([01][0-9]|2[0-3])([0-5][0-9]([0-5][0-9]|60)?)?(\.[0-9]{1,6})?")


def _conforms(vr: str, text: str) -> bool:
    """Whether ``text`` (one value, as stored) is valid for ``vr``; checked without pydicom's conversion,
    which would log the value."""
    from pydicom.config import RAISE
    from pydicom.valuerep import validate_value

    if text == "":
        return True
    if vr == "DA":
        try:
            datetime.datetime.strptime(text, "%Y%m%d")
        except ValueError:
            return False
        return len(text) == 8
    if vr == "TM":
        return _TM.fullmatch(text) is not None
    if vr == "CS" and text not in ("M", "F", "O"):
        return False
    try:
        validate_value(vr, text, RAISE)
    except (ValueError, TypeError):
        return False
    return True


def conformant_source(ds: Any) -> Any:
    """A copy of a source header whose patient/study attributes hold valid values: a Type 2 one that is
    missing or breaks its VR becomes empty, another one that breaks its VR is left out of the copy. Values
    are read as stored, so no library logs them while they are checked."""
    from pydicom.datadict import dictionary_VR

    fixed = copy.deepcopy(ds)
    for keyword in dict.fromkeys([*SOURCE_TYPE2, *PHI_KEYWORDS]):
        text = raw_text(fixed, keyword)
        ok = text is not None and all(_conforms(dictionary_VR(keyword), v) for v in text.split("\\"))
        if ok:
            continue
        if keyword in SOURCE_TYPE2:
            setattr(fixed, keyword, "")
        elif keyword in fixed:
            del fixed[keyword]
    return fixed


def write_dicom_seg(
    segmentation: np.ndarray,
    volume: DicomVolume,
    labels: Sequence[SegmentLabel],
    path: str | Path,
    *,
    series_number: int = 901,
    algorithm_name: str = "nnU-Net",
    algorithm_version: str = __version__,
    series_instance_uid: str | None = None,
    sop_instance_uid: str | None = None,
    instance_number: int = 1,
    durable: bool = False,
    series_description: str = "nnU-Net segmentation",
) -> Path:
    """Write ``segmentation`` (``(z, y, x)``, label values, shaped like ``volume.data``) as DICOM-SEG.

    ``series_instance_uid``/``sop_instance_uid``: the SEG's UIDs (new ones by default); the node keeps
    them per series, so a retry sends the same instance. ``durable``: fsync before the file appears.
    """
    import highdicom as hd
    from pydicom.sr.codedict import codes

    seg = np.asarray(segmentation)
    if seg.shape != volume.data.shape:
        raise InputValidationError(
            f"DICOM-SEG: segmentation shape {seg.shape} != source volume shape "
            f"{volume.data.shape} (series {volume.series_instance_uid})."
        )
    unknown = sorted(set(np.unique(seg).tolist()) - {0} - {v for s in labels for v in s.members})
    if unknown:
        raise InputValidationError(f"DICOM-SEG: label values {unknown} have no segment in {list(labels)}.")
    numbers = _segment_frames(seg, labels)
    algorithm = hd.AlgorithmIdentificationSequence(
        name=algorithm_name, family=codes.cid7162.ArtificialIntelligence, version=algorithm_version
    )
    descriptions = [_segment_description(s, algorithm) for s in labels]
    document = hd.seg.Segmentation(
        source_images=[conformant_source(volume.datasets[0]), *volume.datasets[1:]],  # patient/study: 1st
        pixel_array=_frames_in_source_order(numbers, volume),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=descriptions,
        series_instance_uid=series_instance_uid or generate_uid(),
        series_number=series_number,
        sop_instance_uid=sop_instance_uid or generate_uid(),
        instance_number=instance_number,
        manufacturer=MANUFACTURER,
        manufacturer_model_name=algorithm_name,
        software_versions=algorithm_version,
        device_serial_number="0",
        content_label="NNUNET",
        content_description=f"{algorithm_name} segmentation",
        omit_empty_frames=bool(numbers.any()),
        series_description=series_description[:64],
    )
    if durable:
        from nnunet_triton.client.dicom.spool import durable_output

        with durable_output(Path(path)) as temp:
            document.save_as(temp)
    else:
        with atomic_output(path, ".dcm") as temp:
            document.save_as(temp)
    LOGGER.debug("wrote DICOM-SEG %s (%d segments, %d frames)", path, len(labels), document.NumberOfFrames)
    return Path(path)
