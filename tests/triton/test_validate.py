"""``nnunet-triton validate`` against the served SynthCT fixture: nnU-Net itself and reference sets.

The endpoint is the shared SynthCT server; the cases are the fixture's held-out images
(``imagesTs``, nnU-Net naming). Mirroring is off to keep the runs short (same code path).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import ANISO, SYNTHCT, model_dir, shared_server

from nnunet_triton import cli
from nnunet_triton.client.jobs import collect_jobs

FAST = ["--disable-tta"]
LABELS = [(1, "organ"), (2, "lesion")]


@pytest.fixture(scope="module")
def server(triton_server, request):
    return shared_server(SYNTHCT, triton_server, request)


def _validate(server, tmp_path: Path, *args: str, report: str = "report") -> tuple[int, dict]:
    code = cli.main(["validate", "--url", server.http_url, "-i", str(model_dir(SYNTHCT).parent / "imagesTs"),
                     "--report", str(tmp_path / report), *args])
    path = tmp_path / report / "validation.json"
    return code, json.loads(path.read_text()) if path.is_file() else {}


def test_validate_passes_exactly_when_the_endpoint_is_nnunet_and_records_a_reference_set(server, tmp_path):
    code, report = _validate(server, tmp_path, "--model-dir", str(model_dir(SYNTHCT)), "--exact", *FAST,
                             "--record", str(tmp_path / "set"))
    assert code == 0 and report["passed"] and report["total"] == 3
    for case in report["cases"]:
        comparison = case["comparison"]
        assert case["passed"] and comparison["differing_voxels"] == 0 and comparison["agreement"] == 1.0
        assert [label["dice"] for label in comparison["labels"]] == [1.0, 1.0]
    manifest = json.loads((tmp_path / "set" / "reference.json").read_text())
    assert sorted(manifest["cases"]) == [c["case"] for c in report["cases"]]
    assert manifest["options"] == {"folds": ["0", "1"], "mirroring": False, "tile_step_size": 0.5,
                                   "probabilities": False, "postprocessing": True}
    assert manifest["deployment"]["dataset_name"] == "Dataset901_SynthCT" and manifest["versions"]["nnunetv2"]
    html = (tmp_path / "report" / "validation.html").read_text()
    assert "PASS" in html and html.count("<tr class='pass'>") == 6  # 3 cases x 2 labels

    # later: the same deployment against the recorded set, without nnU-Net
    code, again = _validate(server, tmp_path, "--against", str(tmp_path / "set"), "--exact", *FAST,
                            report="again")
    assert code == 0 and again["passed"]
    assert again["reference"].startswith(f"reference set {tmp_path / 'set'}")

    # other options than recorded: refused, naming the option
    assert _validate(server, tmp_path, "--against", str(tmp_path / "set"), report="mirroring")[0] == 2

    # a tampered reference set: that case fails, naming the file
    first = sorted(manifest["cases"])[0]
    with np.load(tmp_path / "set" / manifest["cases"][first]["file"]) as data:
        segmentation = data["segmentation"].copy()
    segmentation[segmentation == 0] = 1
    np.savez_compressed(tmp_path / "set" / manifest["cases"][first]["file"], segmentation=segmentation)
    code, tampered = _validate(server, tmp_path, "--against", str(tmp_path / "set"), *FAST, report="tampered")
    assert code == 1 and not tampered["passed"]
    failed = {c["case"]: c["error"] for c in tampered["cases"] if not c["passed"]}
    assert list(failed) == [first] and "changed or removed after recording" in failed[first]


def test_validate_refuses_a_model_folder_the_server_does_not_serve(server, tmp_path, capsys):
    code, report = _validate(server, tmp_path, "--model-dir", str(model_dir(ANISO)), *FAST)
    assert (code, report) == (2, {})
    err = capsys.readouterr().err
    assert "serves another model than --model" in err and "dataset_name: served 'Dataset901_SynthCT'" in err


def test_validate_refuses_an_input_folder_without_cases(server, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = cli.main(["validate", "--url", server.http_url, "-i", str(tmp_path / "empty"), "--model-dir",
                     str(model_dir(SYNTHCT))])
    assert code == 2 and "empty: no images" in capsys.readouterr().err


def test_validate_fails_with_nnunets_numbers_when_the_deployment_differs(server, tmp_path):
    """The endpoint asked for fold 0 only, nnU-Net for both folds: the report's Dice is the Dice of those
    two label maps, computed here independently."""
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.options import RequestOptions
    from nnunet_triton.validate.compare import compare_case
    from nnunet_triton.validate.run import (
        NnunetReference,
        Thresholds,
        ValidationResult,
        run_validation,
    )

    jobs = collect_jobs(model_dir(SYNTHCT).parent / "imagesTs")
    options = RequestOptions(folds=("0", "1"), mirroring=False)
    result = ValidationResult(title="t", options=options, thresholds=Thresholds(min_dice=0.9999),
                              reference_kind="nnU-Net", deployment={}, total=len(jobs))
    answers = {}
    with NnunetClient(server.http_url) as client:
        def segment(image, spacing):
            answer = client.segment(image, spacing, mirroring=False, folds=["0"])  # "another deployment"
            return answer.segmentation, None

        run_validation(jobs, segment, NnunetReference(model_dir(SYNTHCT), options), LABELS, result,
                       num_channels=1, on_case=lambda c: answers.setdefault(c.case, c))
    differing = [c for c in result.cases if c.comparison.differing_voxels]
    assert differing, "fold 0 alone and folds 0+1 gave identical maps on every case: pick other options"
    assert not result.passed
    case = differing[0]
    job = next(j for j in jobs if j.name == case.case)
    image = job.load()[0]
    expected = NnunetReference(model_dir(SYNTHCT), options).answer(case.case, image.data, image.spacing)[0]
    with NnunetClient(server.http_url) as client:
        got = client.segment(image.data, image.spacing, mirroring=False, folds=["0"]).segmentation
    assert case.comparison == compare_case(case.case, expected, got, LABELS, image.spacing)
    for label in case.comparison.labels:
        a, b = expected == label.value, got == label.value
        total = int(a.sum() + b.sum())
        assert label.dice == pytest.approx(2 * int((a & b).sum()) / total if total else 1.0)


def test_make_validate_tool_builds_serves_validates_and_stops(tmp_path):
    """What ``make validate MODEL=... INPUT=... FOLDS=0`` runs (tools/validate.py), end to end."""
    from tools import validate as tool

    cases = model_dir(SYNTHCT).parent / "imagesTs"
    code = tool.main(["--model-dir", str(model_dir(SYNTHCT)), "--input", str(cases), "--folds", "0",
                      "--out", str(tmp_path / "out"), "--", "--exact", "--disable-tta"])
    assert code == 0
    report = json.loads((tmp_path / "out" / "report" / "validation.json").read_text())
    assert report["passed"] and report["options"]["folds"] == ["0"] and report["total"] == 3
    assert not (tmp_path / "out" / "server.json").exists()  # the server was stopped
