"""Coded segment metadata (dcmqi's JSON format): parsed and checked against the model's labels, carried by
the SEG as coded category/type, label text and CIELab display colour."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pydicom
import pytest

from nnunet_triton import segment_metadata as sm
from nnunet_triton.client.dicom import seg as dicom_seg
from nnunet_triton.client.dicom import volume as dicom
from nnunet_triton.errors import PlansError

try:
    from . import dicom_support as support
except ImportError:
    import dicom_support as support

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "seg_metadata"
LABELS = {"background": 0, "organ": 1, "lesion": 2}


def _fixture(name: str = "organ_lesion.json") -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_fixture_metadata_parses_into_coded_segments_with_colours_in_both_forms():
    metadata = sm.read_segment_metadata(FIXTURES / "organ_lesion.json")
    organ, lesion = metadata.coding(1), metadata.coding(2)
    assert (organ.label, organ.category, organ.type) == (
        "Organ", sm.Code("91723000", "SCT", "Anatomical Structure"), sm.Code("91772007", "SCT", "Organ"))
    assert lesion.anatomic_region == sm.Code("91772007", "SCT", "Organ")
    assert organ.rgb == (221, 130, 101) and organ.cielab == sm.rgb_to_dicom_cielab((221, 130, 101))
    # the published form parses back to the same metadata (what the clients read from the server)
    again = sm.parse_segment_metadata(metadata.to_published())
    assert again.segments == metadata.segments


def test_rgb_is_stored_as_dicom_scaled_cielab():
    # PS3.3 C.10.7.1.1: L* 0..100 -> 0..65535, a*/b* -128..127 -> 0..65535 (0 -> 0x8080)
    white = sm.rgb_to_dicom_cielab((255, 255, 255))
    assert white[0] == 65535 and all(abs(v - 0x8080) <= 8 for v in white[1:])
    black = sm.rgb_to_dicom_cielab((0, 0, 0))
    assert black[0] == 0 and all(abs(v - 0x8080) <= 8 for v in black[1:])
    red = sm.rgb_to_dicom_cielab((255, 0, 0))
    assert red[1] > 0x8080 + 10000 and red[2] > 0x8080  # red: large positive a*, positive b*
    for rgb in ((221, 130, 101), (0, 151, 206), (255, 255, 0)):  # round trip through the stored value
        item = {**_fixture()["segmentAttributes"][0][0]}
        item.pop("recommendedDisplayRGBValue")
        item["RecommendedDisplayCIELabValue"] = list(sm.rgb_to_dicom_cielab(rgb))
        coding = sm.parse_segment_metadata({"segmentAttributes": [[item]]}).coding(1)
        assert all(abs(a - b) <= 1 for a, b in zip(coding.rgb, rgb, strict=True)), (coding.rgb, rgb)


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d["segmentAttributes"][0][1].pop("SegmentedPropertyTypeCodeSequence"),
     r"labelID 2: missing SegmentedPropertyTypeCodeSequence"),
    (lambda d: d["segmentAttributes"][0][0]["SegmentedPropertyCategoryCodeSequence"].pop("CodeMeaning"),
     r"labelID 1\.SegmentedPropertyCategoryCodeSequence: .*missing \['CodeMeaning'\]"),
    (lambda d: d["segmentAttributes"][0][0]["SegmentedPropertyTypeCodeSequence"].update(CodeValue="T-62000"),
     r"labelID 1\.SegmentedPropertyTypeCodeSequence\.CodeValue: a SNOMED CT \(SCT\) code is 6 to 18 digits"),
    (lambda d: d["segmentAttributes"][0][0]["SegmentedPropertyTypeCodeSequence"].update(CodeValue=""),
     r"labelID 1\.SegmentedPropertyTypeCodeSequence\.CodeValue: a string of 1 to 16 characters"),
    (lambda d: d["segmentAttributes"][0][1]["AnatomicRegionSequence"].update(CodeMeaning="x" * 65),
     r"labelID 2\.AnatomicRegionSequence\.CodeMeaning: a string of 1 to 64 characters"),
    (lambda d: d["segmentAttributes"][0][1].update(recommendedDisplayRGBValue=[255, 0, 300]),
     r"labelID 2\.recommendedDisplayRGBValue: three integers from 0 to 255"),
    (lambda d: d["segmentAttributes"][0][1].update(Colour=[1, 2, 3]),
     r"labelID 2: unknown field\(s\) \['Colour'\]"),
    (lambda d: d["segmentAttributes"][0][1].update(labelID=1), r"labelID 1: given twice"),
    (lambda d: d["segmentAttributes"][0][1].update(labelID="2"), r"segmentAttributes\[0\]\[1\]\.labelID"),
])
def test_malformed_metadata_is_refused_naming_the_label_and_field(change, match):
    data = copy.deepcopy(_fixture())
    change(data)
    with pytest.raises(PlansError, match=match):
        sm.parse_segment_metadata(data, source="segment metadata test.json")


def test_metadata_must_cover_every_label_and_name_no_other():
    metadata = sm.read_segment_metadata(FIXTURES / "organ_lesion.json")
    metadata.check_against_labels({1: "organ", 2: "lesion"})
    with pytest.raises(PlansError, match=r"for label\(s\) 'tumour' \(labelID 3\)"):
        metadata.check_against_labels({1: "organ", 2: "lesion", 3: "tumour"})
    with pytest.raises(PlansError, match=r"labelID\(s\) \[2\], which the model does not predict"):
        metadata.check_against_labels({1: "organ"})


def test_region_metadata_maps_each_region_by_its_regions_class_order_value():
    dataset = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "Dataset903_SynthMulti" /
                          "nnUNetTrainer__nnUNetPlans__2d_tiny" / "dataset.json").read_text())
    labels = dicom_seg.segment_labels(dataset["labels"], dataset["regions_class_order"])
    metadata = sm.read_segment_metadata(FIXTURES / "organ_lesion_regions.json")
    metadata.check_against_labels({s.value: s.name for s in labels})
    coded = dicom_seg.with_metadata(labels, metadata)
    assert [(s.name, s.members, s.label) for s in coded] == [("organ", (1, 2), "Organ region"),
                                                            ("lesion", (2,), "Lesion")]


def _description(published):
    from nnunet_triton.client.endpoint import EndpointDescription

    return EndpointDescription(url="x", model_name="nnunet", server_version="2.51.0", num_channels=1,
                               num_heads=3, segmentation_dtype="UINT8", composing_models=(), fold_models=(),
                               published=published)


def test_seg_carries_the_published_codes_label_text_and_cielab_colour(tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=4)
    volume = dicom.read_dicom_folder(built.folder)
    metadata = sm.read_segment_metadata(FIXTURES / "organ_lesion.json")
    labels = dicom_seg.model_segment_labels(_description({"labels": LABELS,
                                                          sm.PUBLISHED_KEY: metadata.to_published()}))
    seg = np.zeros(volume.data.shape, np.uint8)
    seg[1:3, 20:60, 20:60], seg[2, 30:40, 30:40] = 1, 2
    path = dicom_seg.write_dicom_seg(seg, volume, labels, tmp_path / "seg.dcm")

    segments = pydicom.dcmread(path).SegmentSequence
    assert [s.SegmentLabel for s in segments] == ["Organ", "Lesion"]
    organ, lesion = segments
    assert (organ.SegmentedPropertyCategoryCodeSequence[0].CodeValue,
            organ.SegmentedPropertyTypeCodeSequence[0].CodeValue,
            organ.SegmentedPropertyTypeCodeSequence[0].CodingSchemeDesignator
            ) == ("91723000", "91772007", "SCT")
    assert list(organ.RecommendedDisplayCIELabValue) == list(metadata.coding(1).cielab)
    assert organ.SegmentDescription == "synthetic organ (80 HU)"
    assert lesion.AnatomicRegionSequence[0].CodeMeaning == "Organ"
    assert lesion.SegmentedPropertyCategoryCodeSequence[0].CodeMeaning == "Morphologically Abnormal Structure"


def test_seg_without_metadata_keeps_private_codes_and_says_so(tmp_path, caplog):
    caplog.set_level("INFO", logger="nnunet_triton.client.dicom.seg")
    labels = dicom_seg.model_segment_labels(_description({"labels": LABELS}))
    assert all(s.coding is None for s in labels)
    assert "publishes no segment metadata" in caplog.text and dicom_seg.PRIVATE_SCHEME in caplog.text
    built = support.write_ct_series(tmp_path / "ct", n_slices=3)
    volume = dicom.read_dicom_folder(built.folder)
    path = dicom_seg.write_dicom_seg(np.ones(volume.data.shape, np.uint8), volume, labels, tmp_path / "s.dcm")
    first = pydicom.dcmread(path).SegmentSequence[0]
    assert first.SegmentedPropertyTypeCodeSequence[0].CodingSchemeDesignator == dicom_seg.PRIVATE_SCHEME
    assert "RecommendedDisplayCIELabValue" not in first


def test_info_lists_the_published_segment_metadata_one_line_per_segment():
    from nnunet_triton.client.endpoint import format_description

    metadata = sm.read_segment_metadata(FIXTURES / "organ_lesion.json")
    text = format_description(_description({"labels": LABELS, sm.PUBLISHED_KEY: metadata.to_published()}))
    assert "segment_metadata 2 coded segment(s)" in " ".join(text.split())
    assert "1: Organ (SCT 91772007)" in text and "2: Lesion (SCT 52988006)" in text
