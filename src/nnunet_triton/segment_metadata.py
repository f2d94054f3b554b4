"""Coded segment metadata (dcmqi's JSON metadata format): what each label of a model is, for DICOM-SEG and
RTSTRUCT.

``nnunet-triton build --seg-metadata FILE`` reads a file in the format of dcmqi's ``itkimage2segimage``
(``seg-schema.json``)::

    {"segmentAttributes": [[
        {"labelID": 1, "SegmentLabel": "liver",
         "SegmentedPropertyCategoryCodeSequence": {"CodeValue": "91723000", "CodingSchemeDesignator": "SCT",
                                                   "CodeMeaning": "Anatomical Structure"},
         "SegmentedPropertyTypeCodeSequence": {"CodeValue": "10200004", "CodingSchemeDesignator": "SCT",
                                               "CodeMeaning": "Liver"},
         "recommendedDisplayRGBValue": [221, 130, 101]}]]}

``labelID`` is the value the model's label map holds for the label (for a region-based model: the region's
entry of ``regions_class_order``, the value nnU-Net writes for it). Per segment: ``SegmentLabel`` (default:
the dataset.json name), ``SegmentDescription``, the category and type (required), optional
``SegmentedPropertyTypeModifierCodeSequence``, ``AnatomicRegionSequence``,
``AnatomicRegionModifierSequence``, and the colour as ``recommendedDisplayRGBValue`` (sRGB, converted here
to CIELab as DICOM stores it: highdicom's ICC conversion to the PCS-Lab, scaled to 16 bit) or
``RecommendedDisplayCIELabValue`` (already scaled). dcmqi's ``SegmentAlgorithmType`` and
``SegmentAlgorithmName`` are accepted and ignored (the writer says AUTOMATIC and names nnU-Net), as are
dcmqi's series-level keys (``ContentCreatorName``, ``SeriesDescription``, ...).

Checked at build time against the model's labels (:func:`check_against_labels`): every label must have one
entry and every entry a label; a malformed code names the label and the field. The normalised form
(:meth:`SegmentMetadata.to_published`) is what the endpoint publishes in its description, so every version of
an endpoint carries its own and the clients read it from the server. A core module (the builder and the
clients import it): only the standard library at module level, highdicom inside the colour conversion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.errors import InputValidationError, PlansError

__all__ = ["Code", "SegmentCoding", "SegmentMetadata", "read_segment_metadata", "parse_segment_metadata",
           "rgb_to_dicom_cielab", "label_values", "PUBLISHED_KEY"]

PUBLISHED_KEY = "segment_metadata"  # the key of the endpoint description that holds the normalised form
MAX_FILE_BYTES = 4 << 20
_CODE_FIELDS = ("CodeValue", "CodingSchemeDesignator", "CodeMeaning")
_CODED = {
    "SegmentedPropertyCategoryCodeSequence": "category",
    "SegmentedPropertyTypeCodeSequence": "type",
    "SegmentedPropertyTypeModifierCodeSequence": "type_modifier",
    "AnatomicRegionSequence": "anatomic_region",
    "AnatomicRegionModifierSequence": "anatomic_region_modifier",
}
_REQUIRED_CODES = ("SegmentedPropertyCategoryCodeSequence", "SegmentedPropertyTypeCodeSequence")
_SEGMENT_KEYS = ("labelID", "SegmentLabel", "SegmentDescription", "SegmentAlgorithmType",
                 "SegmentAlgorithmName", "recommendedDisplayRGBValue", "RecommendedDisplayCIELabValue",
                 "segmentationFileName", *_CODED)
_TOP_KEYS = ("@schema", "ContentCreatorName", "ClinicalTrialSeriesID", "ClinicalTrialTimePointID",
             "ClinicalTrialCoordinatingCenterName", "ContentLabel", "ContentDescription", "SeriesDescription",
             "SeriesNumber", "InstanceNumber", "BodyPartExamined", "segmentAttributesFileMapping",
             "segmentAttributes")
# DICOM value representations of the code attributes (PS3.5 6.2): SH 16 characters, UC for long code
# values is not used here; LO 64 characters; no backslash (a value delimiter) nor control characters
_SH = re.compile(r"[^\\\x00-\x1f]{1,16}")
_LO = re.compile(r"[^\\\x00-\x1f]{1,64}")
_SCT = re.compile(r"[1-9][0-9]{5,17}")  # a SNOMED CT identifier: 6 to 18 digits, no leading zero


@dataclass(frozen=True)
class Code:
    """One coded concept (CodeValue, CodingSchemeDesignator, CodeMeaning)."""

    value: str
    scheme: str
    meaning: str

    def to_dict(self) -> dict[str, str]:
        return {"CodeValue": self.value, "CodingSchemeDesignator": self.scheme, "CodeMeaning": self.meaning}


@dataclass(frozen=True)
class SegmentCoding:
    """What one label is: its label text, coded category and type (and modifier, anatomic region), colour.

    ``cielab``: RecommendedDisplayCIELabValue as stored (three 16-bit integers); ``rgb``: the sRGB colour
    (given, or converted back from ``cielab``) for RTSTRUCT's ROIDisplayColor.
    """

    label_id: int
    label: str | None
    category: Code
    type: Code
    type_modifier: Code | None = None
    anatomic_region: Code | None = None
    anatomic_region_modifier: Code | None = None
    description: str | None = None
    rgb: tuple[int, int, int] | None = None
    cielab: tuple[int, int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"labelID": self.label_id}
        if self.label is not None:
            out["SegmentLabel"] = self.label
        if self.description is not None:
            out["SegmentDescription"] = self.description
        for key, attr in _CODED.items():
            code = getattr(self, attr)
            if code is not None:
                out[key] = code.to_dict()
        if self.rgb is not None:
            out["recommendedDisplayRGBValue"] = list(self.rgb)
        if self.cielab is not None:
            out["RecommendedDisplayCIELabValue"] = list(self.cielab)
        return out


@dataclass(frozen=True)
class SegmentMetadata:
    """Every label's :class:`SegmentCoding` (by labelID) and the series description, from one file."""

    segments: Mapping[int, SegmentCoding]
    series_description: str | None = None
    source: str = "segment metadata"

    def coding(self, label_id: int) -> SegmentCoding | None:
        return self.segments.get(int(label_id))

    def to_published(self) -> dict[str, Any]:
        """The normalised form the endpoint publishes (dcmqi's field names, colours in both forms)."""
        segments = [self.segments[k].to_dict() for k in sorted(self.segments)]
        out: dict[str, Any] = {"segmentAttributes": [segments]}
        if self.series_description is not None:
            out["SeriesDescription"] = self.series_description
        return out

    def check_against_labels(self, labels: Mapping[int, str]) -> None:
        """Every label of the model (label-map value -> name, :func:`label_values`) has an entry and every
        entry a label.

        Raises:
            PlansError: naming the labels without an entry, or the labelIDs that no label has.
        """
        by_value = {int(v): n for v, n in labels.items()}
        missing = [f"{name!r} (labelID {value})" for value, name in sorted(by_value.items())
                   if value not in self.segments]
        if missing:
            raise PlansError(f"{self.source}: no entry in segmentAttributes for label(s) "
                             f"{', '.join(missing)} "
                             "of the model; every label (for a region-based model: every region, by its "
                             "regions_class_order value) needs its coded category and type.")
        extra = sorted(set(self.segments) - set(by_value))
        if extra:
            raise PlansError(f"{self.source}: segmentAttributes has labelID(s) {extra}, which the model does "
                             f"not predict (its labels: {by_value}).")


def label_values(labels: Mapping[str, int | Sequence[int]], regions_class_order: Sequence[int] | None = None
                 ) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
    """``(value, name, members)`` of every foreground label of dataset.json ``labels`` (background and
    ``ignore`` left out), by value: ``value`` is what the label map holds for it, ``members`` the values it
    covers. Region-based models (list values) need ``regions_class_order``: region ``i`` is written as
    ``regions_class_order[i]`` (nnU-Net's ``convert_probabilities_to_segmentation``) and covers the values
    of its dataset.json entry.

    Raises:
        InputValidationError: regions without a ``regions_class_order`` of one value per region.
    """
    foreground = [(n, v) for n, v in labels.items() if n != "ignore" and v not in (0, [0], (0,))]
    members = [tuple(int(x) for x in v) if isinstance(v, list | tuple) else (int(v),) for _, v in foreground]
    if any(len(m) > 1 for m in members):
        if regions_class_order is None or len(regions_class_order) != len(foreground):
            raise InputValidationError(
                f"region-based labels {dict(foreground)} need regions_class_order with {len(foreground)} "
                f"entries, got {regions_class_order!r}.")
        values = [int(v) for v in regions_class_order]
    else:
        values = [m[0] for m in members]
    return tuple(sorted(zip(values, (n for n, _ in foreground), members, strict=True)))


def _fail(source: str, where: str, message: str) -> PlansError:
    return PlansError(f"{source}: {where}: {message}")


def _code(value: object, source: str, where: str, *, sct_digits: bool = True) -> Code:
    if not isinstance(value, dict):
        raise _fail(source, where, 'an object {"CodeValue": ..., "CodingSchemeDesignator": ..., '
                                   f'"CodeMeaning": ...}}, got {ascii(value)[:80]}')
    unknown = sorted(set(value) - set(_CODE_FIELDS))
    missing = [f for f in _CODE_FIELDS if f not in value]
    if unknown or missing:
        raise _fail(source, where, f"needs exactly {list(_CODE_FIELDS)}"
                                   + (f"; missing {missing}" if missing else "")
                                   + (f"; unknown {unknown}" if unknown else ""))
    code_value, scheme, meaning = (value[f] for f in _CODE_FIELDS)
    for field, text, pattern, rule in (("CodeValue", code_value, _SH, "1 to 16 characters (SH)"),
                                       ("CodingSchemeDesignator", scheme, _SH, "1 to 16 characters (SH)"),
                                       ("CodeMeaning", meaning, _LO, "1 to 64 characters (LO)")):
        if not isinstance(text, str) or pattern.fullmatch(text) is None or text != text.strip():
            raise _fail(source, f"{where}.{field}", f"a string of {rule}, no backslash, control characters "
                                                    f"or surrounding spaces, got {ascii(text)[:80]}")
    if scheme == "SCT" and sct_digits and _SCT.fullmatch(code_value) is None:
        raise _fail(source, f"{where}.CodeValue", f"a SNOMED CT (SCT) code is 6 to 18 digits, got "
                                                  f"{code_value!r} (an SRT code such as T-62000 has an SCT "
                                                  "equivalent: use it, SRT is retired)")
    return Code(code_value, scheme, meaning)


def _triplet(value: object, source: str, where: str, upper: int) -> tuple[int, int, int]:
    if not isinstance(value, list) or len(value) != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= upper for v in value):
        raise _fail(source, where, f"three integers from 0 to {upper}, got {ascii(value)[:80]}")
    return int(value[0]), int(value[1]), int(value[2])


def rgb_to_dicom_cielab(rgb: Sequence[int]) -> tuple[int, int, int]:
    """RecommendedDisplayCIELabValue (PS3.3 C.10.7.1.1: PCS-Lab, L* 0..100 -> 0..0xFFFF, a*/b* -128..127 ->
    0..0xFFFF) of an sRGB colour, by highdicom's ICC conversion."""
    import highdicom as hd

    return tuple(int(v) for v in hd.color.CIELabColor.from_rgb(*(int(c) for c in rgb)).value)  # type: ignore[return-value]


def _dicom_cielab_to_rgb(lab: Sequence[int]) -> tuple[int, int, int]:
    import highdicom as hd

    return tuple(int(v) for v in hd.color.CIELabColor.from_dicom_value(tuple(lab)).to_rgb())  # type: ignore[return-value]


def _segment(item: object, source: str, index: str) -> SegmentCoding:
    where = f"segmentAttributes{index}"
    if not isinstance(item, dict):
        raise _fail(source, where, f"an object per segment, got {type(item).__name__}")
    label_id = item.get("labelID")
    if isinstance(label_id, bool) or not isinstance(label_id, int) or label_id < 1:
        raise _fail(source, f"{where}.labelID", f"an integer >= 1 (the label map value), got "
                                                f"{ascii(label_id)[:40]}")
    where = f"labelID {label_id}"
    unknown = sorted(set(item) - set(_SEGMENT_KEYS))
    if unknown:
        raise _fail(source, where, f"unknown field(s) {unknown}; known: {list(_SEGMENT_KEYS)}")
    for key in _REQUIRED_CODES:
        if key not in item:
            raise _fail(source, where, f"missing {key} (required)")
    codes = {attr: _code(item[key], source, f"{where}.{key}") if key in item else None
             for key, attr in _CODED.items()}
    texts = {}
    for key in ("SegmentLabel", "SegmentDescription"):
        text = item.get(key)
        if text is not None and (not isinstance(text, str) or _LO.fullmatch(text) is None):
            raise _fail(source, f"{where}.{key}", f"1 to 64 characters (LO), no backslash or control "
                                                  f"characters, got {ascii(text)[:80]}")
        texts[key] = text
    rgb = lab = None
    if "recommendedDisplayRGBValue" in item:
        rgb = _triplet(item["recommendedDisplayRGBValue"], source, f"{where}.recommendedDisplayRGBValue", 255)
    if "RecommendedDisplayCIELabValue" in item:
        lab = _triplet(item["RecommendedDisplayCIELabValue"], source,
                       f"{where}.RecommendedDisplayCIELabValue", 0xFFFF)
    if rgb is not None and lab is None:
        lab = rgb_to_dicom_cielab(rgb)
    elif lab is not None and rgb is None:
        rgb = _dicom_cielab_to_rgb(lab)
    return SegmentCoding(label_id=label_id, label=texts["SegmentLabel"],
                         description=texts["SegmentDescription"], rgb=rgb, cielab=lab, **codes)


def parse_segment_metadata(data: object, *, source: str = "segment metadata") -> SegmentMetadata:
    """A :class:`SegmentMetadata` from dcmqi's JSON (already parsed), or from the published form.

    Raises:
        PlansError: naming ``source``, the labelID and the field of whatever is malformed.
    """
    if not isinstance(data, dict):
        raise _fail(source, "top level", f"a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise _fail(source, "top level", f"unknown key(s) {unknown}; known: {list(_TOP_KEYS)}")
    groups = data.get("segmentAttributes")
    if not isinstance(groups, list) or not groups:
        raise _fail(source, "segmentAttributes", "a non-empty list of lists of segments (dcmqi's format: one "
                                                 "inner list per label file; here one label map)")
    segments: dict[int, SegmentCoding] = {}
    for g, group in enumerate(groups):
        if not isinstance(group, list):
            raise _fail(source, f"segmentAttributes[{g}]", "a list of segments")
        for k, item in enumerate(group):
            coding = _segment(item, source, f"[{g}][{k}]")
            if coding.label_id in segments:
                raise _fail(source, f"labelID {coding.label_id}", "given twice")
            segments[coding.label_id] = coding
    description = data.get("SeriesDescription")
    if description is not None and (not isinstance(description, str) or _LO.fullmatch(description) is None):
        raise _fail(source, "SeriesDescription", f"1 to 64 characters (LO), got {ascii(description)[:80]}")
    return SegmentMetadata(segments=segments, series_description=description, source=source)


def read_segment_metadata(path: str | Path) -> SegmentMetadata:
    """Read and check a dcmqi metadata JSON file (duplicate keys and ``NaN`` refused).

    Raises:
        PlansError: the file cannot be read, is not JSON, or is malformed (naming the label and field).
    """
    path = Path(path)
    source = f"segment metadata {path}"
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise PlansError(f"{source}: cannot be read ({exc.strerror or exc}).") from None
    if len(raw) > MAX_FILE_BYTES:
        raise PlansError(f"{source}: larger than {MAX_FILE_BYTES} bytes.")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=unique, parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PlansError(f"{source}: not valid JSON: {exc}.") from None
    return parse_segment_metadata(data, source=source)
