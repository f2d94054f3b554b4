"""DICOM-SEG output: readable by pydicom and highdicom, one segment per label, references the source."""

from __future__ import annotations

import highdicom as hd
import numpy as np
import pydicom
import pytest
from pydicom.uid import SegmentationStorage

from nnunet_triton.client.dicom import seg as dicom_seg
from nnunet_triton.client.dicom import volume as dicom
from nnunet_triton.client.dicom.seg import SegmentLabel
from nnunet_triton.errors import InputValidationError

try:
    from . import dicom_support as support
except ImportError:
    import dicom_support as support

LABELS = {"background": 0, "organ": 1, "lesion": 2}


@pytest.fixture
def series(tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=6)
    volume = dicom.read_dicom_folder(built.folder)
    return built, volume


def _label_map(shape) -> np.ndarray:
    seg = np.zeros(shape, np.uint8)
    seg[1:4, 30:60, 40:80] = 1
    seg[2, 70:90, 70:90] = 2
    return seg


def test_segment_labels_come_from_dataset_json_without_background_and_ignore():
    labels = dicom_seg.segment_labels({"background": 0, "liver": 1, "tumor": 2, "ignore": 3})
    assert labels == (SegmentLabel(1, 1, "liver"), SegmentLabel(2, 2, "tumor"))


def test_segment_labels_use_regions_class_order_when_regions():
    labels = dicom_seg.segment_labels(
        {"background": 0, "whole": [1, 2], "core": [2]}, regions_class_order=[1, 2]
    )
    assert labels == (SegmentLabel(1, 1, "whole", (1, 2)), SegmentLabel(2, 2, "core", (2,)))
    with pytest.raises(InputValidationError, match="need regions_class_order with 2 entries"):
        dicom_seg.segment_labels({"background": 0, "whole": [1, 2], "core": [2]})


def test_write_dicom_seg_is_readable_and_references_source_instances(series, tmp_path):
    built, volume = series
    seg = _label_map(volume.data.shape)
    path = dicom_seg.write_dicom_seg(
        seg, volume, dicom_seg.segment_labels(LABELS), tmp_path / "out" / "seg.dcm"
    )

    ds = pydicom.dcmread(path)
    source = pydicom.dcmread(built.files[0])
    assert ds.SOPClassUID == SegmentationStorage and ds.SegmentationType == "BINARY"
    assert [(s.SegmentNumber, s.SegmentLabel) for s in ds.SegmentSequence] == [(1, "organ"), (2, "lesion")]
    assert (ds.StudyInstanceUID, ds.PatientID) == (source.StudyInstanceUID, source.PatientID)
    referenced = ds.ReferencedSeriesSequence[0]
    assert referenced.SeriesInstanceUID == built.series_uid
    assert sorted(r.ReferencedSOPInstanceUID for r in referenced.ReferencedInstanceSequence) == sorted(
        built.sop_uids
    )

    reread = hd.seg.segread(path)
    pixels = reread.get_pixels_by_source_instance(
        list(built.sop_uids), combine_segments=True, assert_missing_frames_are_empty=True
    )
    np.testing.assert_array_equal(pixels, seg)
    assert sorted(p.name for p in path.parent.iterdir()) == ["seg.dcm"]


def test_write_dicom_seg_follows_source_frame_order_when_source_is_enhanced_multiframe(tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=6, valid_ds=True)  # the SEG copies its DS
    source_path = support.write_enhanced(built, tmp_path / "mf" / "MF.dcm")
    volume = dicom.read_dicom_folder(source_path.parent)
    seg = _label_map(volume.data.shape)
    path = dicom_seg.write_dicom_seg(seg, volume, dicom_seg.segment_labels(LABELS), tmp_path / "seg.dcm")

    source = pydicom.dcmread(source_path)
    pixels = hd.seg.segread(path).get_pixels_by_source_frame(
        source.SOPInstanceUID, list(range(1, 7)), combine_segments=True, assert_missing_frames_are_empty=True
    )
    np.testing.assert_array_equal(pixels[[f.frame for f in volume.frames]], seg)


def test_write_dicom_seg_writes_all_frames_when_segmentation_is_empty(series, tmp_path):
    _, volume = series
    path = dicom_seg.write_dicom_seg(
        np.zeros(volume.data.shape, np.uint8),
        volume,
        dicom_seg.segment_labels(LABELS),
        tmp_path / "empty.dcm",
    )
    assert pydicom.dcmread(path).NumberOfFrames == 2 * volume.data.shape[0]


def test_write_dicom_seg_raises_when_shape_or_labels_do_not_match(series, tmp_path):
    _, volume = series
    labels = dicom_seg.segment_labels(LABELS)
    with pytest.raises(
        InputValidationError, match=r"segmentation shape \(5, 128, 128\) != source volume shape"
    ):
        dicom_seg.write_dicom_seg(np.zeros((5, 128, 128), np.uint8), volume, labels, tmp_path / "a.dcm")
    with pytest.raises(InputValidationError, match=r"label values \[7\] have no segment"):
        dicom_seg.write_dicom_seg(np.full(volume.data.shape, 7, np.uint8), volume, labels, tmp_path / "b.dcm")
    assert list(tmp_path.glob("*.dcm")) == []


def _segment_pixels(path, built) -> np.ndarray:
    """(z, y, x, segments) booleans of the written SEG, in source order."""
    return hd.seg.segread(path).get_pixels_by_source_instance(
        list(built.sop_uids), combine_segments=False, assert_missing_frames_are_empty=True
    ).astype(bool)


def test_region_based_seg_has_one_overlapping_segment_per_region_named_from_dataset_json(series, tmp_path):
    # the model: {"whole": [1, 2], "core": 2}, regions_class_order [1, 2]; value 2 = core (and whole)
    built, volume = series
    seg = _label_map(volume.data.shape)
    labels = dicom_seg.segment_labels({"background": 0, "whole": [1, 2], "core": 2},
                                      regions_class_order=[1, 2])
    path = dicom_seg.write_dicom_seg(seg, volume, labels, tmp_path / "regions.dcm")

    ds = pydicom.dcmread(path)
    assert [(s.SegmentNumber, s.SegmentLabel) for s in ds.SegmentSequence] == [(1, "whole"), (2, "core")]
    pixels = _segment_pixels(path, built)
    np.testing.assert_array_equal(pixels[..., 0], seg > 0)  # whole: labels 1 and 2
    np.testing.assert_array_equal(pixels[..., 1], seg == 2)  # core: label 2, inside whole
    assert (pixels[..., 0] & pixels[..., 1]).any()  # the segments overlap


def test_seg_leaves_out_the_ignore_label(series, tmp_path):
    built, volume = series
    labels = dicom_seg.segment_labels({"background": 0, "organ": 1, "lesion": 2, "ignore": 3})
    path = dicom_seg.write_dicom_seg(_label_map(volume.data.shape), volume, labels, tmp_path / "ignore.dcm")
    assert [s.SegmentLabel for s in pydicom.dcmread(path).SegmentSequence] == ["organ", "lesion"]


def test_seg_of_a_model_with_more_than_255_labels_keeps_every_label(series, tmp_path):
    built, volume = series
    names = {"background": 0, **{f"structure_{k}": k for k in range(1, 301)}}
    seg = np.zeros(volume.data.shape, np.uint16)
    seg[1, 10:20, 10:20], seg[3, 50:60, 50:60], seg[4, 90:100, 90:100] = 1, 256, 300
    path = dicom_seg.write_dicom_seg(seg, volume, dicom_seg.segment_labels(names), tmp_path / "many.dcm")

    ds = pydicom.dcmread(path)
    assert len(ds.SegmentSequence) == 300 and ds.SegmentSequence[299].SegmentLabel == "structure_300"
    pixels = _segment_pixels(path, built)
    for value in (1, 256, 300):
        np.testing.assert_array_equal(pixels[..., value - 1], seg == value)


def test_generic_segment_labels_name_each_value_present():
    seg = np.array([[0, 3], [7, 3]], np.uint8)
    assert dicom_seg.generic_segment_labels(seg) == (SegmentLabel(1, 3, "label_3"),
                                                     SegmentLabel(2, 7, "label_7"))


def _description(published):
    from nnunet_triton.client.endpoint import EndpointDescription

    return EndpointDescription(url="x", model_name="nnunet", server_version="2.51.0", num_channels=1,
                               num_heads=2, segmentation_dtype="UINT8", composing_models=(), fold_models=(),
                               published=published)


def test_model_segment_labels_understand_the_regions_a_server_publishes():
    # the case: labels published with regions; the SEG must have a segment per region
    published = {"labels": {"background": 0, "whole": [1, 2], "core": 2}, "regions_class_order": [1, 2]}
    labels = dicom_seg.model_segment_labels(_description(published))
    assert [(s.name, s.members) for s in labels] == [("whole", (1, 2)), ("core", (2,))]
    assert dicom_seg.model_segment_labels(_description({})) == ()  # unknown: label_<v> per value instead


def _rewrite(files, **values):
    for path in files:
        ds = pydicom.dcmread(path)
        for keyword, value in values.items():
            if value is None:
                delattr(ds, keyword)
            else:
                ds.add_new(keyword, pydicom.datadict.dictionary_VR(keyword), value)
        ds.save_as(path, enforce_file_format=True)


@pytest.mark.dciodvfy_allows({
    "Missing attribute or value that would be needed to build DICOMDIR":
        "the test's source lacks PatientID, StudyDate, StudyTime and StudyID: the SEG keeps them empty "
        "(Type 2)",
})
@pytest.mark.parametrize("values", [
    {"PatientBirthDate": "1975-03-01", "PatientSex": "female", "StudyTime": "25:61"},  # break their VRs
    dict.fromkeys(["PatientName", "PatientID", "PatientBirthDate", "PatientSex", "StudyDate", "StudyTime",
                   "ReferringPhysicianName", "StudyID", "AccessionNumber"]),  # missing Type 2 attributes
], ids=["nonconformant", "missing"])
def test_write_dicom_seg_copes_with_source_patient_data_that_breaks_its_rules(values, tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=3)
    _rewrite(built.files, **values)
    volume = dicom.read_dicom_folder(built.folder)

    path = dicom_seg.write_dicom_seg(_label_map(volume.data.shape), volume, dicom_seg.segment_labels(LABELS),
                                     tmp_path / "seg.dcm", series_instance_uid="1.2.3.4",
                                     sop_instance_uid="1.2.3.5", instance_number=2)

    ds = pydicom.dcmread(path)
    assert (ds.SeriesInstanceUID, ds.SOPInstanceUID, ds.InstanceNumber) == ("1.2.3.4", "1.2.3.5", 2)
    for keyword in values:
        assert ds.get(keyword) in ("", None), keyword  # Type 2: present and empty
    assert pydicom.dcmread(built.files[0]).get("PatientBirthDate") == values.get("PatientBirthDate")
