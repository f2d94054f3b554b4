"""The DICOM reader builds the volume and geometry a series was constructed with (real pydicom CT file as
template), agrees with SimpleITK's GDCM series reader, and refuses broken series with errors naming files."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import SimpleITK as sitk

from nnunet_triton.client.dicom import volume as dicom
from nnunet_triton.client.dicom.volume import DicomError, DicomOptions

try:
    from . import dicom_support as support
except ImportError:  # run from tests/unit without package context
    import dicom_support as support


def _read_only_series(folder, options=dicom.DEFAULT_OPTIONS):
    scan = dicom.scan_folder(folder, options)
    assert len(scan.series) == 1
    return dicom.read_series(scan.series[0], options)


@pytest.fixture
def ct_series(tmp_path):
    built = support.write_ct_series(tmp_path / "study")
    support.write_localizer(tmp_path / "study", built.series_uid)
    support.write_non_images(tmp_path / "study")
    return built


def test_read_series_returns_constructed_volume_and_geometry_when_shuffled_with_localizer_and_non_images(
    ct_series,
):
    volume = _read_only_series(ct_series.folder)

    assert volume.series_instance_uid == ct_series.series_uid and volume.modality == "CT"
    assert volume.data.dtype == np.float32
    np.testing.assert_array_equal(volume.data, ct_series.volume)  # z order, slope and intercept per slice
    assert volume.spacing == ct_series.spacing_zyx
    assert volume.geometry == dicom.ImageGeometry(
        spacing=ct_series.spacing_zyx[::-1], origin=ct_series.origin, direction=ct_series.direction
    )
    assert [f.path for f in volume.frames] == list(ct_series.files)
    assert [f.sop_instance_uid for f in volume.frames] == list(ct_series.sop_uids)
    assert [str(d.SOPInstanceUID) for d in volume.datasets] == list(ct_series.sop_uids)


def test_read_series_agrees_with_simpleitk_gdcm_series_reader(ct_series):
    volume = _read_only_series(ct_series.folder)
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames([str(f) for f in ct_series.files])  # GDCM would also take the localizer
    image = reader.Execute()

    np.testing.assert_array_equal(volume.data, sitk.GetArrayFromImage(image).astype(np.float32))
    np.testing.assert_allclose(volume.geometry.spacing, image.GetSpacing(), rtol=1e-12)
    np.testing.assert_allclose(volume.geometry.origin, image.GetOrigin(), rtol=1e-12)
    np.testing.assert_allclose(volume.geometry.direction, image.GetDirection(), atol=1e-12)


def test_scan_folder_lists_localizer_and_non_images_as_skipped(ct_series):
    scan = dicom.scan_folder(ct_series.folder)
    assert [(p.name, reason) for p, reason in scan.skipped] == [
        ("README.txt", "not a DICOM file"),
        ("REPORT.dcm", "modality SR is not an image volume"),
        ("SCOUT.dcm", "localizer (ImageType LOCALIZER)"),
    ]
    assert [s.uid for s in scan.series] == [ct_series.series_uid]


def test_read_series_of_enhanced_multiframe_equals_single_frame_series(ct_series, tmp_path):
    path = support.write_enhanced(ct_series, tmp_path / "enhanced" / "MF.dcm")
    single = _read_only_series(ct_series.folder)
    multi = _read_only_series(path.parent)

    np.testing.assert_array_equal(multi.data, single.data)
    assert (multi.spacing, multi.geometry) == (single.spacing, single.geometry)
    assert {f.path for f in multi.frames} == {path}
    assert sorted(f.frame for f in multi.frames) == list(range(6))


def test_read_series_raises_naming_neighbours_when_a_slice_is_missing(tmp_path):
    built = support.write_ct_series(tmp_path, n_slices=6, skip=(3,))
    before, after = built.files[2].name, built.files[3].name
    with pytest.raises(
        DicomError, match=rf"gap \(missing slices\?\) between .*{before} and .*{after}: step 5.0000 mm"
    ):
        _read_only_series(tmp_path)


def test_read_series_raises_when_slice_spacing_is_irregular(tmp_path):
    support.write_ct_series(tmp_path, positions=(0.0, 2.5, 5.0, 6.2, 8.7))
    with pytest.raises(DicomError, match="irregular slice spacing between"):
        _read_only_series(tmp_path)


def test_read_series_raises_when_two_slices_share_a_position(tmp_path):
    support.write_ct_series(tmp_path, positions=(0.0, 2.5, 2.5, 5.0))
    with pytest.raises(DicomError, match="lie at the same position .* several phases"):
        _read_only_series(tmp_path)


def test_read_series_raises_naming_the_file_when_orientations_are_mixed(tmp_path):
    built = support.write_ct_series(tmp_path, n_slices=4, orientations={2: (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)})
    odd = built.files[2].name
    with pytest.raises(
        DicomError,
        match=rf"mixed orientations in series {built.series_uid}: .*{odd} has "
        r"ImageOrientationPatient \[1.0, 0.0, 0.0, 0.0, 1.0, 0.0\], .* has \[1.0, ",
    ):
        _read_only_series(tmp_path)


def test_read_series_raises_when_ct_series_has_no_axial_slices(tmp_path):
    support.write_ct_series(tmp_path, n_slices=3, orientation=support.CORONAL)
    with pytest.raises(DicomError, match="no axial slices"):
        _read_only_series(tmp_path)


def test_read_series_keeps_coronal_slices_when_modality_is_not_ct(tmp_path):
    built = support.write_ct_series(tmp_path, n_slices=3, orientation=support.CORONAL, modality="MR")
    volume = _read_only_series(tmp_path)
    np.testing.assert_array_equal(volume.data, built.volume)
    assert volume.geometry.direction == built.direction


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        ({"max_files": 3}, "holds 6 files, more than max_files=3"),
        ({"max_frames": 5}, "6 slices/frames, more than max_frames=5"),
        ({"max_bytes": 6 * 128 * 128 * 4 - 1}, "needs 393216 bytes, more than max_bytes=393215"),
    ],
)
def test_read_raises_clear_error_when_a_limit_is_exceeded(tmp_path, limit, message):
    support.write_ct_series(tmp_path, n_slices=6)
    with pytest.raises(DicomError, match=message):
        _read_only_series(tmp_path, dataclasses.replace(DicomOptions(), **limit))


def test_read_series_raises_naming_the_file_when_pixel_data_is_truncated(tmp_path):
    built = support.write_ct_series(tmp_path, n_slices=3)
    victim = built.files[1]
    victim.write_bytes(victim.read_bytes()[:-5000])
    with pytest.raises(DicomError, match=rf"{victim.name}: cannot read pixel data"):
        _read_only_series(tmp_path)


def test_scan_folder_separates_series_and_read_dicom_folder_refuses_several(tmp_path):
    first = support.write_ct_series(tmp_path / "a", n_slices=2)
    second = support.write_ct_series(tmp_path / "b", n_slices=3, seed=1)
    scan = dicom.scan_folder(tmp_path)
    assert sorted(len(s.headers) for s in scan.series) == [2, 3]
    assert {s.uid for s in scan.series} == {first.series_uid, second.series_uid}
    with pytest.raises(DicomError, match="expected exactly one image series, found 2"):
        dicom.read_dicom_folder(tmp_path)
