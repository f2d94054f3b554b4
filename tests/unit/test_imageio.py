"""imageio reads like nnU-Net's SimpleITKIO, keeps the geometry on write, and writes atomically."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import SimpleITK as sitk
from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

from nnunet_triton.client import imageio
from nnunet_triton.errors import InputValidationError

SPACING = (0.8, 0.55, 3.2)  # SimpleITK (x, y, z): anisotropic
ORIGIN = (10.5, -20.25, 33.0)


def _oblique_direction() -> tuple[float, ...]:
    """A proper rotation about the axis (1, 2, 3) by 25 degrees (row-major 3x3)."""
    axis = np.array([1.0, 2.0, 3.0]) / np.linalg.norm([1.0, 2.0, 3.0])
    angle = np.deg2rad(25.0)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    rotation = np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k
    return tuple(float(v) for v in rotation.reshape(-1))


def _write(path, array, spacing=SPACING, origin=ORIGIN, direction=None):
    image = sitk.GetImageFromArray(array)
    image.SetSpacing(spacing[: image.GetDimension()])
    image.SetOrigin(origin[: image.GetDimension()])
    if direction is not None:
        image.SetDirection(direction)
    sitk.WriteImage(image, str(path), True)
    return path


@pytest.fixture
def oblique_case(tmp_path):
    rng = np.random.default_rng(0)
    files = [
        _write(
            tmp_path / f"case_{c:04d}.nii.gz",
            rng.integers(-1000, 1000, (7, 9, 11)).astype(np.int16),
            direction=_oblique_direction(),
        )
        for c in range(2)
    ]
    return files


def test_read_images_equals_nnunet_simpleitkio_when_oblique_anisotropic_two_channels(oblique_case):
    case = imageio.read_images(oblique_case)
    data, props = SimpleITKIO().read_images([str(f) for f in oblique_case])

    assert case.data.dtype == np.float32 and case.data.shape == (2, 7, 9, 11)
    np.testing.assert_array_equal(case.data, data)
    assert case.properties() == {**props, "spacing": list(props["spacing"])}
    assert case.spacing == tuple(props["spacing"])


@pytest.mark.parametrize("ending", [".nii.gz", ".nrrd", ".mha"])
def test_write_segmentation_keeps_input_geometry_when_oblique_anisotropic(oblique_case, tmp_path, ending):
    case = imageio.read_images(oblique_case[:1])
    seg = (np.arange(7 * 9 * 11).reshape(7, 9, 11) % 3).astype(np.uint8)
    ours = imageio.write_segmentation(seg, tmp_path / "out" / f"case{ending}", case.geometry)
    theirs = tmp_path / f"nnunet{ending}"
    SimpleITKIO().write_seg(seg, str(theirs), case.properties())

    written, reference = sitk.ReadImage(str(ours)), sitk.ReadImage(str(theirs))
    np.testing.assert_array_equal(sitk.GetArrayFromImage(written), seg)
    assert written.GetPixelID() == reference.GetPixelID() == sitk.sitkUInt8
    # Same geometry as nnU-Net's writer and as the input (NIfTI stores the sform as float32: 1e-6).
    for get in ("GetSpacing", "GetOrigin", "GetDirection"):
        assert getattr(written, get)() == getattr(reference, get)()
        np.testing.assert_allclose(
            getattr(written, get)(), getattr(case.geometry, get[3:].lower()), atol=1e-6
        )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"case{ending}"]


def test_read_and_write_follow_nnunet_2d_convention_when_image_is_2d(tmp_path):
    path = _write(tmp_path / "slice_0000.nii.gz", np.arange(12, dtype=np.int16).reshape(3, 4))
    case = imageio.read_images([path])
    data, props = SimpleITKIO().read_images([str(path)])

    np.testing.assert_array_equal(case.data, data)
    assert case.data.shape == (1, 1, 3, 4)
    assert case.spacing == tuple(props["spacing"])
    assert case.spacing == pytest.approx((0.8 * 999, 0.55, 0.8), rel=1e-6)  # NIfTI stores float32 pixdim
    out = imageio.write_segmentation(np.ones((1, 3, 4), np.uint8), tmp_path / "seg.nii.gz", case.geometry)
    assert sitk.ReadImage(str(out)).GetSize() == (4, 3)


def test_read_images_raises_naming_files_when_channels_differ_in_shape(tmp_path):
    a = _write(tmp_path / "c_0000.nii.gz", np.zeros((2, 3, 4), np.int16))
    b = _write(tmp_path / "c_0001.nii.gz", np.zeros((2, 3, 5), np.int16))
    with pytest.raises(
        InputValidationError, match=r"channels \['c_0000.nii.gz', 'c_0001.nii.gz'\] differ in shape"
    ):
        imageio.read_images([a, b])


def test_read_images_raises_naming_the_file_when_it_is_not_an_image(tmp_path):
    bad = tmp_path / "bad_0000.nii.gz"
    bad.write_bytes(b"not a nifti")
    with pytest.raises(InputValidationError, match="bad_0000.nii.gz: SimpleITK cannot read this image"):
        imageio.read_images([bad])


def test_find_cases_groups_channels_in_nnunet_naming(tmp_path):
    for name in (
        "b_0001.nii.gz",
        "b_0000.nii.gz",
        "a_0000.nii.gz",
        "single.nrrd",
        "notes.txt",
        ".hidden.nii.gz",
    ):
        (tmp_path / name).write_bytes(b"")
    assert imageio.find_cases(tmp_path) == {
        "a": [tmp_path / "a_0000.nii.gz"],
        "b": [tmp_path / "b_0000.nii.gz", tmp_path / "b_0001.nii.gz"],
        "single": [tmp_path / "single.nrrd"],
    }
    assert imageio.find_cases(tmp_path, ".nrrd") == {"single": [tmp_path / "single.nrrd"]}


def test_find_cases_raises_when_a_channel_is_missing(tmp_path):
    for name in ("x_0000.nii.gz", "x_0002.nii.gz"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(InputValidationError, match=r"case 'x' .* numbered _0000.._0001"):
        imageio.find_cases(tmp_path)


def test_write_probabilities_writes_npz_and_pkl_like_nnunet(tmp_path):
    probabilities = np.random.default_rng(1).random((3, 2, 4, 5)).astype(np.float32)
    properties = {"spacing": [1.0, 2.0, 3.0]}
    imageio.write_probabilities(probabilities, tmp_path / "case", properties)

    with np.load(tmp_path / "case.npz") as npz:
        assert list(npz.keys()) == ["probabilities"]
        np.testing.assert_array_equal(npz["probabilities"], probabilities)
    assert pickle.loads((tmp_path / "case.pkl").read_bytes()) == properties
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.npz", "case.pkl"]


def test_atomic_output_leaves_no_file_when_writing_fails(tmp_path, monkeypatch):
    def broken_write(image, path, *args):
        with open(path, "wb") as handle:
            handle.write(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(imageio.sitk, "WriteImage", broken_write)
    geometry = imageio.ImageGeometry((1.0, 1.0, 1.0), (0.0, 0.0, 0.0), tuple(np.eye(3).reshape(-1)))
    with pytest.raises(RuntimeError, match="disk full"):
        imageio.write_segmentation(np.zeros((2, 2, 2), np.uint8), tmp_path / "case.nii.gz", geometry)
    assert list(tmp_path.iterdir()) == []


def test_remove_stale_partials_removes_only_temporaries_of_dead_processes(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    stale = tmp_path / f".a.nii.gz.partial-{dead}-0a1b2c3d.nii.gz"
    mine = tmp_path / f".b.nii.gz.partial-{os.getpid()}-0a1b2c3d.nii.gz"
    final = tmp_path / "c.nii.gz"
    for path in (stale, mine, final):
        path.write_bytes(b"x")
    assert imageio.remove_stale_partials(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, final.name])
