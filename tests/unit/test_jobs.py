"""The cases of an input (``client.jobs``): channel siblings of a file, one job per DICOM series."""

from __future__ import annotations

import numpy as np
import pytest

from nnunet_triton.client.jobs import collect_jobs
from nnunet_triton.errors import InputValidationError
from tests.unit import dicom_support


def test_collect_jobs_finds_channel_siblings_when_input_is_one_file(tmp_path):
    import SimpleITK as sitk

    for channel in range(2):
        sitk.WriteImage(
            sitk.GetImageFromArray(np.full((2, 3, 4), channel, np.int16)),
            str(tmp_path / f"case_{channel:04d}.nii.gz"),
        )
    (job,) = collect_jobs(tmp_path / "case_0000.nii.gz")
    image, volume = job.load()
    assert (job.name, job.is_dicom, volume) == ("case", False, None)
    np.testing.assert_array_equal(image.data[:, 0, 0, 0], [0.0, 1.0])


def test_collect_jobs_makes_one_job_per_dicom_series(tmp_path):
    first = dicom_support.write_ct_series(tmp_path / "a", n_slices=2)
    second = dicom_support.write_ct_series(tmp_path / "b", n_slices=3, seed=1)
    jobs = collect_jobs(tmp_path)
    assert sorted(j.name for j in jobs) == sorted([first.series_uid, second.series_uid])
    assert all(j.is_dicom for j in jobs)


def test_collect_jobs_raises_when_folder_has_neither_images_nor_dicom(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputValidationError, match="no images .* and no DICOM image series"):
        collect_jobs(tmp_path)
