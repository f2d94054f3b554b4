"""``nnunet-triton`` (``python -m nnunet_triton``) against the embedded server with the SynthCT fixture.

- a folder with one corrupt case: the good cases are written (nnU-Net's segmentations, the input's
  geometry), the bad one is reported, the exit code is 1;
- ``--continue-prediction`` skips finished cases; a killed run (SIGKILL) leaves no half-written output
  under a final name and the next ``--continue-prediction`` run cleans up and finishes; SIGTERM leaves no
  temporaries;
- a DICOM folder gives a DICOM-SEG that references the source instances, and a NIfTI with the DICOM geometry;
- ``info`` prints the deployed model's description.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from pipeline_support import REPO_ROOT, SYNTHCT, cases, model_dir, reference, shared_server

from tests.unit import dicom_support

CLI_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }


def _command(server, *args: str) -> list[str]:
    return [sys.executable, "-m", "nnunet_triton.cli", *args[:1], "--url", server.http_url, *args[1:]]


def _cli(server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(server, *args),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env=_env(),
        check=False,
    )


def _copy_cases(target: Path) -> list[str]:
    """Copy the held-out images (``<case>_0000.nii.gz``); returns the case names."""
    target.mkdir(parents=True, exist_ok=True)
    source = model_dir(SYNTHCT).parent / "imagesTs"
    for case in cases(SYNTHCT):
        shutil.copy(source / f"{case.name}_0000.nii.gz", target / f"{case.name}_0000.nii.gz")
    return [case.name for case in cases(SYNTHCT)]


def _assert_output_matches_nnunet(output: Path, name: str, mirroring: bool) -> None:
    written = sitk.ReadImage(str(output))
    source = sitk.ReadImage(str(model_dir(SYNTHCT).parent / "imagesTs" / f"{name}_0000.nii.gz"))
    expected = reference(SYNTHCT, name, mirroring).segmentation
    np.testing.assert_array_equal(sitk.GetArrayFromImage(written), expected)
    assert (written.GetSpacing(), written.GetOrigin(), written.GetDirection()) == (
        source.GetSpacing(),
        source.GetOrigin(),
        source.GetDirection(),
    )


def test_predict_writes_good_cases_and_reports_corrupt_one_with_nonzero_exit(server, tmp_path):
    names = _copy_cases(tmp_path / "in")
    (tmp_path / "in" / "broken_0000.nii.gz").write_bytes(b"\x1f\x8b truncated")
    result = _cli(server, "predict", "-i", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--disable-tta")

    assert result.returncode == 2, result.stderr
    assert f"{len(names)} case(s) written" in result.stderr and "1 failed" in result.stderr
    assert "failed broken:" in result.stderr and "SimpleITK cannot read this image" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{n}.nii.gz" for n in names)
    for name in names:
        _assert_output_matches_nnunet(tmp_path / "out" / f"{name}.nii.gz", name, mirroring=False)

    again = _cli(
        server,
        "predict",
        "-i",
        str(tmp_path / "in"),
        "-o",
        str(tmp_path / "out"),
        "--continue-prediction",
        "--disable-tta",
    )
    assert (
        again.returncode == 2
        and f"0 case(s) written to {tmp_path / 'out'}, {len(names)} skipped" in again.stderr
    )


def test_predict_saves_probabilities_like_nnunet_when_asked(server, tmp_path):
    case = cases(SYNTHCT)[0]
    source = model_dir(SYNTHCT).parent / "imagesTs" / f"{case.name}_0000.nii.gz"
    result = _cli(
        server,
        "predict",
        "-i",
        str(source),
        "-o",
        str(tmp_path),
        "--save_probabilities",
        "--disable_tta",
        "-f",
        "0",
        "1",
    )

    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{case.name}{e}" for e in (".nii.gz", ".npz", ".pkl")
    )
    with np.load(tmp_path / f"{case.name}.npz") as npz:
        # 1e-6: the endpoint's float32 exp vs torch's (see test_pipeline_parity)
        np.testing.assert_allclose(
            npz["probabilities"], reference(SYNTHCT, case.name, False).probabilities, atol=1e-6
        )
    _assert_output_matches_nnunet(tmp_path / f"{case.name}.nii.gz", case.name, mirroring=False)


def _write_small_cases(target: Path, count: int, url: str) -> dict[str, np.ndarray]:
    """``count`` one-tile crops of the first case as NIfTI inputs; returns the endpoint's segmentation of each
    (no mirroring), computed up front so that the interrupted run can be checked file by file."""
    from nnunet_triton.client.client import NnunetClient

    target.mkdir(parents=True, exist_ok=True)
    case = cases(SYNTHCT)[0]
    expected = {}
    with NnunetClient(url, timeout_s=300) as client:
        for k in range(count):
            crop = np.ascontiguousarray(case.image[0, 2 * k : 2 * k + 12, 10:34, 10:34])
            image = sitk.GetImageFromArray(crop)
            image.SetSpacing(tuple(reversed(case.spacing)))
            sitk.WriteImage(image, str(target / f"small{k}_0000.nii.gz"))
            expected[f"small{k}"] = client.segment(crop[None], case.spacing, mirroring=False).segmentation
    return expected


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_interrupted_run_leaves_no_partial_outputs_and_continue_prediction_finishes(server, tmp_path, signum):
    expected = _write_small_cases(tmp_path / "in", 8, server.http_url)
    out = tmp_path / "out"
    process = subprocess.Popen(
        _command(server, "predict", "-i", str(tmp_path / "in"), "-o", str(out), "--disable-tta"),
        env=_env(),
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + CLI_TIMEOUT_S
    # a final name, not atomic_output's hidden temporary (which also ends in .nii.gz)
    while (not [p for p in out.glob("*.nii.gz") if not p.name.startswith(".")]
           and time.monotonic() < deadline and process.poll() is None):
        time.sleep(0.02)
    process.send_signal(signum)
    process.wait(timeout=60)

    finished = sorted(out.glob("*.nii.gz"))
    assert 0 < len(finished) < len(expected), "the run was not interrupted in the middle"
    for path in finished:  # every output under its final name is complete
        name = path.name[: -len(".nii.gz")]
        np.testing.assert_array_equal(sitk.GetArrayFromImage(sitk.ReadImage(str(path))), expected[name])
    leftovers = [p.name for p in out.iterdir() if p not in finished]
    if signum == signal.SIGTERM:
        assert process.returncode == 128 + signal.SIGTERM and leftovers == []
    assert all(".partial-" in n and n.startswith(".") for n in leftovers)

    resumed = _cli(
        server,
        "predict",
        "-i",
        str(tmp_path / "in"),
        "-o",
        str(out),
        "--disable-tta",
        "--continue-prediction",
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(expected) - len(finished)} case(s) written" in resumed.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.nii.gz" for n in expected)
    for name, segmentation in expected.items():
        np.testing.assert_array_equal(
            sitk.GetArrayFromImage(sitk.ReadImage(str(out / f"{name}.nii.gz"))), segmentation
        )


def test_predict_on_dicom_folder_writes_dicom_seg_and_nifti_with_dicom_geometry(server, tmp_path):
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.client.dicom import volume as dicom

    case = cases(SYNTHCT)[0]
    series = dicom_support.write_volume_as_ct(
        tmp_path / "dicom" / "ct", np.round(case.image[0]), case.spacing
    )
    dicom_support.write_localizer(tmp_path / "dicom" / "ct", series.series_uid)
    dicom_support.write_non_images(tmp_path / "dicom")
    volume = dicom.read_dicom_folder(tmp_path / "dicom")
    with NnunetClient(server.http_url, timeout_s=300) as client:
        expected = client.segment(volume.data[None], volume.spacing, mirroring=False).segmentation

    dataset_json = model_dir(SYNTHCT) / "dataset.json"
    seg_run = _cli(
        server,
        "predict",
        "-i",
        str(tmp_path / "dicom"),
        "-o",
        str(tmp_path / "seg"),
        "--output-format",
        "dicom-seg",
        "--dataset-json",
        str(dataset_json),
        "--disable-tta",
    )
    assert seg_run.returncode == 0, seg_run.stderr
    path = tmp_path / "seg" / f"{series.series_uid}.dcm"
    document = pydicom.dcmread(path)
    labels = json.loads(dataset_json.read_text())["labels"]
    assert [s.SegmentLabel for s in document.SegmentSequence] == [n for n, v in labels.items() if v != 0]
    assert document.ReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid
    pixels = hd.seg.segread(path).get_pixels_by_source_instance(
        list(series.sop_uids), combine_segments=True, assert_missing_frames_are_empty=True
    )
    np.testing.assert_array_equal(pixels, expected)

    nifti_run = _cli(
        server, "predict", "-i", str(tmp_path / "dicom"), "-o", str(tmp_path / "nii"), "--disable-tta"
    )
    assert nifti_run.returncode == 0, nifti_run.stderr
    image = sitk.ReadImage(str(tmp_path / "nii" / f"{series.series_uid}.nii.gz"))
    np.testing.assert_array_equal(sitk.GetArrayFromImage(image), expected)
    # NIfTI stores the affine as float32: geometry to 1e-5.
    np.testing.assert_allclose(image.GetSpacing(), volume.geometry.spacing, rtol=1e-6)
    np.testing.assert_allclose(image.GetOrigin(), series.origin, atol=1e-5)
    np.testing.assert_allclose(image.GetDirection(), series.direction, atol=1e-5)


def test_dicom_seg_output_is_refused_for_nifti_input(server, tmp_path):
    _copy_cases(tmp_path / "in")
    result = _cli(
        server,
        "predict",
        "-i",
        str(tmp_path / "in"),
        "-o",
        str(tmp_path / "out"),
        "--output-format",
        "dicom-seg",
    )
    assert result.returncode == 2 and "dicom-seg needs DICOM input" in result.stderr


def test_info_prints_the_deployed_model(server):
    result = _cli(server, "info")
    assert result.returncode == 0, result.stderr
    assert "nnunet on http://" in result.stdout
    assert "preprocess_model -> orchestrator_model -> stitch_model" in result.stdout
    assert "fold models     fold_0, fold_1" in result.stdout
    assert "FP32 [C=1, z, y, x]" in result.stdout and "PROBABILITIES FP32 [K=3" in result.stdout


def test_predict_exits_3_with_clear_message_when_server_is_unreachable(tmp_path):
    _copy_cases(tmp_path / "in")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nnunet_triton.cli",
            "predict",
            "-i",
            str(tmp_path / "in"),
            "-o",
            str(tmp_path / "o"),
            "--url",
            "127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )
    assert result.returncode == 3 and "cannot describe model 'nnunet' on http://127.0.0.1:9" in result.stderr


def test_concurrent_predict_writes_the_same_files_as_a_sequential_run_and_reports_a_bad_case(
        server, tmp_path):
    names = _copy_cases(tmp_path / "in")
    (tmp_path / "in" / "broken_0000.nii.gz").write_bytes(b"\x1f\x8b truncated")
    runs = {}
    for concurrency in ("1", "3"):
        out = tmp_path / f"out{concurrency}"
        result = _cli(server, "predict", "-i", str(tmp_path / "in"), "-o", str(out), "--disable-tta",
                      "--concurrency", concurrency)
        assert result.returncode == 2, result.stderr
        assert f"{len(names)} case(s) written" in result.stderr and "1 failed" in result.stderr
        assert "failed broken:" in result.stderr
        runs[concurrency] = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(runs["3"]) == sorted(f"{n}.nii.gz" for n in names)
    assert runs["3"] == runs["1"]  # byte-identical files, whatever order the answers came in
    for name in names:
        _assert_output_matches_nnunet(tmp_path / "out3" / f"{name}.nii.gz", name, mirroring=False)


def test_concurrency_default_comes_from_the_orchestrator_instances_and_bad_values_are_refused(
        server, tmp_path):
    from nnunet_triton.cli.predict import default_concurrency
    from nnunet_triton.client.endpoint import describe_endpoint

    description = describe_endpoint(server.http_url)
    assert description.orchestrator_instances == 1 and default_concurrency(description) == 2
    bad = _cli(server, "predict", "-i", str(tmp_path), "-o", str(tmp_path / "o"), "--concurrency", "0")
    assert bad.returncode == 2 and "--concurrency: must be a positive integer, got '0'" in bad.stderr
