"""RTSTRUCT output: one ROI per label (or region) with name, colour and code from the segment metadata,
planar contours per source slice in patient coordinates that give the label map back when filled by the
even-odd rule (as viewers fill RTSTRUCT), references to the source's frame of reference and instances,
an empty ROI for an empty label, and dciodvfy clean."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
import pytest
import SimpleITK as sitk

from nnunet_triton import segment_metadata as sm
from nnunet_triton.client.dicom import rtstruct
from nnunet_triton.client.dicom import seg as dicom_seg
from nnunet_triton.client.dicom import volume as dicom
from tests.dciodvfy_support import check_object
from tests.fixture_paths import FIXTURES_DIR, SYNTH_CT

try:
    from . import dicom_support as support
except ImportError:
    import dicom_support as support

METADATA = FIXTURES_DIR / "seg_metadata"
LABELS = {"background": 0, "organ": 1, "lesion": 2}


def _coded(names, regions_class_order=None, metadata="organ_lesion.json"):
    return dicom_seg.with_metadata(dicom_seg.segment_labels(names, regions_class_order),
                                   sm.read_segment_metadata(METADATA / metadata))


def _rois(path: Path, volume) -> dict[str, np.ndarray]:
    """ROI name -> its contours rasterised on the source grid (even-odd), read back from the file."""
    ds = pydicom.dcmread(path)
    names = {r.ROINumber: r.ROIName for r in ds.StructureSetROISequence}
    out = {}
    for roi in ds.ROIContourSequence:
        contours = []
        for c in roi.get("ContourSequence", []):
            points = np.asarray([float(v) for v in c.ContourData]).reshape(-1, 3)
            uid = c.ContourImageSequence[0].ReferencedSOPInstanceUID
            k = [f.sop_instance_uid for f in volume.frames].index(uid)
            contours.append((k, points))
        out[names[roi.ReferencedROINumber]] = rtstruct.rasterize_roi(contours, volume)
    return out


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    total = a.sum() + b.sum()
    return 1.0 if total == 0 else 2.0 * (a & b).sum() / total


def _ring_with_islands(shape) -> np.ndarray:
    """Per slice: an organ with a hole holding an island (ring, hole, island), two separate organ islands,
    and a lesion with a hole of its own; one diagonal-touching pair of pixels (marching squares' saddle)."""
    seg = np.zeros(shape, np.uint8)
    seg[1:4, 20:80, 20:80] = 1
    seg[1:4, 35:65, 35:65] = 0  # hole
    seg[1:4, 45:55, 45:55] = 1  # island inside the hole
    seg[2, 90:100, 10:20] = 1  # second island
    seg[2, 100:110, 100:120] = 2  # lesion ...
    seg[2, 104:106, 108:112] = 0  # ... with a hole
    seg[3, 5, 5] = seg[3, 6, 6] = 1  # diagonal neighbours
    return seg


def test_rtstruct_contours_give_back_the_label_map_with_holes_and_islands(tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=5, valid_ds=True)
    volume = dicom.read_dicom_folder(built.folder)
    seg = _ring_with_islands(volume.data.shape)
    path = rtstruct.write_rtstruct(seg, volume, _coded(LABELS), tmp_path / "out" / "rt.dcm")

    rois = _rois(path, volume)
    assert list(rois) == ["Organ", "Lesion"]
    np.testing.assert_array_equal(rois["Organ"], seg == 1)  # exact: Dice 1.0
    np.testing.assert_array_equal(rois["Lesion"], seg == 2)
    ds = pydicom.dcmread(path)
    on_slice_2 = volume.frames[2].sop_instance_uid
    organ_slice_2 = [c for c in ds.ROIContourSequence[0].ContourSequence
                     if c.ContourImageSequence[0].ReferencedSOPInstanceUID == on_slice_2]
    assert len(organ_slice_2) == 4  # outer ring, hole, island in the hole, second island
    check_object(path)


def test_rtstruct_of_a_fixture_label_map_has_dice_at_least_0_99_per_structure(tmp_path, record_property):
    case = SYNTH_CT.held_out_case("synthct_101")
    image = sitk.ReadImage(str(case.image))
    label = sitk.GetArrayFromImage(sitk.ReadImage(str(case.label))).astype(np.uint8)
    built = support.write_volume_as_ct(tmp_path / "ct", sitk.GetArrayFromImage(image),
                                       image.GetSpacing()[::-1])
    volume = dicom.read_dicom_folder(built.folder)
    path = rtstruct.write_rtstruct(label, volume, _coded(LABELS), tmp_path / "out" / "rt.dcm")

    rois = _rois(path, volume)
    dice = {name: _dice(rois[name], label == value) for name, value in (("Organ", 1), ("Lesion", 2))}
    record_property("dice", dice)
    print(f"contour round trip Dice on synthct_101: {dice}")
    assert all(d >= 0.99 for d in dice.values()), dice
    assert (label == 1).sum() > 0 and (label == 2).sum() > 0


def test_rtstruct_names_colours_codes_and_references_from_the_metadata(tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=3, valid_ds=True)
    volume = dicom.read_dicom_folder(built.folder)
    seg = np.zeros(volume.data.shape, np.uint8)
    seg[1, 10:30, 10:30] = 1  # the lesion is empty
    path = rtstruct.write_rtstruct(seg, volume, _coded(LABELS), tmp_path / "rt.dcm")

    ds = pydicom.dcmread(path)
    source = pydicom.dcmread(built.files[0])
    assert (ds.Modality, ds.SOPClassUID) == ("RTSTRUCT", rtstruct.RTSTRUCT_SOP_CLASS)
    assert (ds.StudyInstanceUID, ds.PatientID) == (source.StudyInstanceUID, source.PatientID)
    reference = ds.ReferencedFrameOfReferenceSequence[0]
    assert reference.FrameOfReferenceUID == source.FrameOfReferenceUID
    series = reference.RTReferencedStudySequence[0].RTReferencedSeriesSequence[0]
    assert series.SeriesInstanceUID == built.series_uid
    assert [i.ReferencedSOPInstanceUID for i in series.ContourImageSequence] == list(built.sop_uids)
    organ, lesion = ds.ROIContourSequence
    assert [int(v) for v in organ.ROIDisplayColor] == [221, 130, 101]
    assert "ContourSequence" in organ and "ContourSequence" not in lesion  # empty label: empty ROI
    observations = ds.RTROIObservationsSequence
    assert [o.RTROIIdentificationCodeSequence[0].CodeValue for o in observations] == ["91772007", "52988006"]
    assert [o.RTROIInterpretedType for o in observations] == ["ORGAN", ""]
    contour = organ.ContourSequence[0]
    # a square of pixels: marching squares cuts its corners (through the edge midpoints): 8 corners, no more
    assert contour.ContourGeometricType == "CLOSED_PLANAR" and int(contour.NumberOfContourPoints) == 8
    assert contour.ContourImageSequence[0].ReferencedSOPInstanceUID == built.sop_uids[1]
    check_object(path)


def test_rtstruct_of_a_region_based_model_has_one_roi_per_overlapping_region(tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=3, valid_ds=True)
    volume = dicom.read_dicom_folder(built.folder)
    seg = np.zeros(volume.data.shape, np.uint8)
    seg[:, 20:60, 20:60], seg[1, 30:40, 30:40] = 1, 2
    labels = _coded({"background": 0, "organ": [1, 2], "lesion": 2}, [1, 2], "organ_lesion_regions.json")
    path = rtstruct.write_rtstruct(seg, volume, labels, tmp_path / "rt.dcm")

    rois = _rois(path, volume)
    np.testing.assert_array_equal(rois["Organ region"], seg > 0)
    np.testing.assert_array_equal(rois["Lesion"], seg == 2)
    check_object(path)


def test_rtstruct_without_metadata_names_rois_from_dataset_json_without_colour_or_code(tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=2, valid_ds=True)
    volume = dicom.read_dicom_folder(built.folder)
    seg = np.zeros(volume.data.shape, np.uint8)
    path = rtstruct.write_rtstruct(seg, volume, dicom_seg.segment_labels(LABELS), tmp_path / "rt.dcm")
    ds = pydicom.dcmread(path)
    assert [r.ROIName for r in ds.StructureSetROISequence] == ["organ", "lesion"]
    assert all("ROIDisplayColor" not in r and "ContourSequence" not in r for r in ds.ROIContourSequence)
    check_object(path)


def test_rtstruct_refuses_a_mismatched_label_map(tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=2)
    volume = dicom.read_dicom_folder(built.folder)
    with pytest.raises(Exception, match=r"RTSTRUCT: label values \[7\] have no ROI"):
        rtstruct.write_rtstruct(np.full(volume.data.shape, 7, np.uint8), volume,
                                dicom_seg.segment_labels(LABELS), tmp_path / "rt.dcm")
    assert not (tmp_path / "rt.dcm").exists()


@pytest.mark.parametrize("source", ["enhanced", "single-slice"])
def test_rtstruct_of_an_enhanced_or_single_slice_source_references_its_frames_and_gives_the_map_back(
        source, tmp_path):
    built = support.write_ct_series(tmp_path / "ct", n_slices=1 if source == "single-slice" else 4,
                                    valid_ds=True)
    folder = built.folder
    if source == "enhanced":
        folder = support.write_enhanced(built, tmp_path / "mf" / "MF.dcm").parent
    volume = dicom.read_dicom_folder(folder)
    seg = np.zeros(volume.data.shape, np.uint8)
    seg[:, 30:60, 30:70], seg[-1, 40:50, 40:50] = 1, 2
    path = rtstruct.write_rtstruct(seg, volume, _coded(LABELS), tmp_path / "rt.dcm")

    ds = pydicom.dcmread(path)
    images = ds.ReferencedFrameOfReferenceSequence[0].RTReferencedStudySequence[0] \
        .RTReferencedSeriesSequence[0].ContourImageSequence
    if source == "enhanced":  # one multi-frame instance: each contour names its frame (1-based)
        assert sorted(int(i.ReferencedFrameNumber) for i in images) == [1, 2, 3, 4]
        frames = {int(c.ContourImageSequence[0].ReferencedFrameNumber)
                  for c in ds.ROIContourSequence[0].ContourSequence}
        assert frames == {f.frame + 1 for f in volume.frames}
    else:
        assert len(images) == 1
    contours = {name: [] for name in ("Organ", "Lesion")}
    names = {r.ROINumber: r.ROIName for r in ds.StructureSetROISequence}
    for roi in ds.ROIContourSequence:
        for c in roi.ContourSequence:
            points = np.asarray([float(v) for v in c.ContourData]).reshape(-1, 3)
            item = c.ContourImageSequence[0]
            k = next(k for k, f in enumerate(volume.frames)
                     if f.sop_instance_uid == item.ReferencedSOPInstanceUID
                     and (f.frame is None or f.frame + 1 == int(item.ReferencedFrameNumber)))
            contours[names[roi.ReferencedROINumber]].append((k, points))
    np.testing.assert_array_equal(rtstruct.rasterize_roi(contours["Organ"], volume), seg == 1)
    np.testing.assert_array_equal(rtstruct.rasterize_roi(contours["Lesion"], volume), seg == 2)
    check_object(path)
