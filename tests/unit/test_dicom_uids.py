"""One rule for identifiers from DICOM data: only valid UIDs become names, and every name stays in its folder.

The adversarial cases are the issue's reproductions: a DICOM folder whose SeriesInstanceUID is ``../../x``
made ``predict`` name its outputs from it (``case_name``), so they were written outside ``-o``.
"""

from __future__ import annotations

import argparse
import os

import pydicom
import pytest

from nnunet_triton.cli import predict as cli
from nnunet_triton.client.dicom import volume as dicom
from nnunet_triton.client.dicom.uids import UnsafeIdentifierError, child_path, require_uid, valid_uid
from nnunet_triton.client.jobs import Job, collect_jobs

try:
    from . import dicom_support as support
except ImportError:  # run from tests/unit without package context
    import dicom_support as support

TRAVERSALS = ["../../x", "/abs/x", "1.2/../../x", "..", ".", "1.2.3/4", "1.2.3\\4", "1..2", ".1.2", "1.2.",
              "1.2.3a", "", "1." + "2" * 63, "1.2\x00.3", "１.２"]


GOOD = ["1.2.840.10008.5.1.4.1.1.2", "1.2.826.0.1.3680043.8.498.1", "0", "2.25.1", "1.2.3\x00", "1.2.3 ",
        "1.2.840.113619.2.5.1762583153.215519.978957063.078"]  # a leading zero, as some scanners write


@pytest.mark.parametrize("value", GOOD)
def test_valid_uid_accepts_dicom_uids_padding_stripped(value):
    assert valid_uid(value) == value.rstrip("\x00 ")


@pytest.mark.parametrize("value", TRAVERSALS)
def test_valid_uid_refuses_traversals_separators_and_non_uids(value):
    assert valid_uid(value) is None
    rule = r"must be a DICOM UID \(digits in dot-separated components, at most 64 characters\), got"
    with pytest.raises(UnsafeIdentifierError, match=r"SOPInstanceUID of x " + rule):
        require_uid(value, what="SOPInstanceUID of x")


def test_child_path_refuses_names_that_leave_the_folder_also_through_a_symbolic_link(tmp_path):
    base = tmp_path / "out"
    base.mkdir()
    (base / "link").symlink_to(tmp_path)
    assert child_path(base, "1.2.3", "4.5.dcm") == base / "1.2.3" / "4.5.dcm"
    for names in (("../x.dcm",), ("/abs/x",), ("a", "..", "..", "x"), ("link", "escaped.dcm"), ("",)):
        with pytest.raises(UnsafeIdentifierError, match="would leave the folder"):
            child_path(base, *names)


def _set_series_uid(files, value):
    for path in files:
        ds = pydicom.dcmread(path)
        ds.SeriesInstanceUID = value
        ds.save_as(path, enforce_file_format=True)


def test_scan_folder_refuses_instances_with_a_traversal_series_uid_and_keeps_the_good_series(tmp_path):
    good = support.write_ct_series(tmp_path / "in" / "good", n_slices=3)
    bad = support.write_ct_series(tmp_path / "in" / "bad", n_slices=3, seed=1)
    _set_series_uid(bad.files, "../../x")

    scan = dicom.scan_folder(tmp_path / "in")
    jobs = collect_jobs(tmp_path / "in")

    assert [s.uid for s in scan.series] == [good.series_uid]
    rule = "SeriesInstanceUID is not a DICOM UID (digits in dot-separated components, at most 64 characters)"
    assert sorted(reason for path, reason in scan.skipped if path in bad.files) == [rule] * 3
    assert [job.name for job in jobs] == [good.series_uid]


def test_scan_folder_refuses_an_instance_with_a_traversal_sop_instance_uid(tmp_path):
    series = support.write_ct_series(tmp_path / "in", n_slices=3)
    ds = pydicom.dcmread(series.files[1])
    ds.SOPInstanceUID = "/abs/x"
    ds.save_as(series.files[1], enforce_file_format=True)

    scan = dicom.scan_folder(tmp_path / "in")

    assert [(p.name, r.split(" is not")[0]) for p, r in scan.skipped] == [(series.files[1].name,
                                                                           "SOPInstanceUID")]
    assert len(scan.series[0].headers) == 2


def test_case_name_and_outputs_refuse_a_series_uid_that_would_leave_the_output_folder(tmp_path):
    series = support.write_ct_series(tmp_path / "in", n_slices=2)
    found = dicom.scan_folder(tmp_path / "in").series[0]
    forged = dicom.SeriesFiles("../../x", found.headers)  # what the reader built before the rule
    args = argparse.Namespace(output_format="nifti", probabilities=True)

    with pytest.raises(UnsafeIdentifierError, match=r"SeriesInstanceUID of .* must be a DICOM UID"):
        dicom.case_name(forged)
    with pytest.raises(UnsafeIdentifierError, match="would leave the folder"):
        cli._outputs(tmp_path / "out", Job("../../x", lambda: None, is_dicom=True), args)
    assert cli._outputs(tmp_path / "out", Job(series.series_uid, lambda: None, is_dicom=True), args) == [
        tmp_path / "out" / f"{series.series_uid}.nii.gz", tmp_path / "out" / f"{series.series_uid}.npz"]
    assert not any(p.name.startswith("x") for p in tmp_path.parent.iterdir())
    assert os.listdir(tmp_path) == ["in"]
