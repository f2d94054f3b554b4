"""An ensemble of configurations behind the one ``nnunet`` endpoint equals ``nnUNetv2_ensemble``.

Members: the 3D and the 2D model of ``Dataset903_SynthMulti`` (two channels, regions; the classic
"2d + 3d_fullres" ensemble that ``nnUNetv2_find_best_configuration`` proposes). nnU-Net's way, as the
reference: ``nnUNetPredictor.predict_single_npy_array(..., save_or_return_probabilities=True)`` per
member, the probabilities saved as ``.npz`` and merged with ``nnunetv2.ensembling.ensemble``'s
``average_probabilities``, then ``LabelManager.convert_probabilities_to_segmentation``. The endpoint's
SEGMENTATION must be identical; its PROBABILITIES (the average) within 1e-6 (float32 ``exp``, see
test_pipeline_parity.py). Plus the build-time refusal of members that predict different labels.
"""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_support import BUILD_ROOT, FIXTURES, cases, predictor
from recovery_support import Load, assert_recovers_under_load

from nnunet_triton.client.client import NnunetClient
from nnunet_triton.errors import PlansError
from tests.fixture_paths import require_fixture

MULTI = "Dataset903_SynthMulti"
MEMBERS = (f"{MULTI}/nnUNetTrainer__nnUNetPlans__3d_tiny", f"{MULTI}/nnUNetTrainer__nnUNetPlans__2d_tiny")
TIMEOUT_S = 1800.0
PROBABILITY_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def ensemble_server(triton_server):
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.builder.repository import build_ensemble_repository

    for member in MEMBERS:
        require_fixture(FIXTURES / member / "plans.json")
    options = BuildOptions(tile_batch_size=4, per_sample_forward=True)
    result = build_ensemble_repository([FIXTURES / m for m in MEMBERS], BUILD_ROOT / "ensemble-2d-3d",
                                       options=options)
    with triton_server(result.out) as handle:
        yield handle


def _nnunet_ensemble(image: np.ndarray, spacing, mirroring: bool, tmp_path) -> tuple[np.ndarray, np.ndarray]:
    from nnunetv2.ensembling.ensemble import average_probabilities

    files = []
    for index, member in enumerate(MEMBERS):
        p = predictor(member, None, mirroring)
        _, probabilities = p.predict_single_npy_array(image, {"spacing": list(spacing)}, None, None, True)
        files.append(str(tmp_path / f"member{index}.npz"))
        np.savez_compressed(files[-1], probabilities=probabilities)
    average = average_probabilities(files)
    label_manager = predictor(MEMBERS[0], None, mirroring).label_manager
    return np.asarray(label_manager.convert_probabilities_to_segmentation(average)), average


@pytest.mark.parametrize(("index", "mirroring"), [(0, False), (1, False), (0, True)],
                         ids=["case0-no_mirroring", "case1-no_mirroring", "case0-mirroring"])
def test_configuration_ensemble_equals_nnunetv2_ensemble(ensemble_server, index, mirroring, tmp_path):
    case = cases(MEMBERS[0])[index]
    expected, average = _nnunet_ensemble(case.image, case.spacing, mirroring, tmp_path)
    with NnunetClient(ensemble_server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        result = client.segment(case.image, case.spacing, mirroring=mirroring, probabilities=True)
    np.testing.assert_array_equal(result.segmentation, expected)
    assert result.probabilities.shape == average.shape
    assert float(np.abs(result.probabilities - average).max()) <= PROBABILITY_TOLERANCE
    member_segmentations = [predictor(m, None, mirroring).predict_single_npy_array(
        case.image, {"spacing": list(case.spacing)}) for m in MEMBERS]
    if index == 0 and not mirroring:  # the ensemble is not just one member's answer
        assert any(not np.array_equal(expected, s) for s in member_segmentations)


def test_killed_combine_model_is_reloaded_and_ensemble_answers_stay_correct_under_load(ensemble_server,
                                                                                       tmp_path):
    case = cases(MEMBERS[0])[0]
    image = np.ascontiguousarray(case.image[:, :16, :32, :32])  # a crop: short requests, same code path
    expected, _ = _nnunet_ensemble(image, case.spacing, False, tmp_path)
    load = Load(ensemble_server, image, case.spacing, expected, options={"mirroring": False})
    assert_recovers_under_load(ensemble_server, "combine_model", load)


def test_validate_refuses_to_compare_an_ensemble_of_configurations_with_one_member(ensemble_server, tmp_path,
                                                                                   capsys):
    from nnunet_triton import cli

    member = FIXTURES / MEMBERS[0]
    code = cli.main(["validate", "--url", ensemble_server.http_url, "--model-dir", str(member),
                     "-i", str(member.parent / "imagesTs"), "--report", str(tmp_path / "r")])
    assert code == 2
    assert "the endpoint is an ensemble of configurations or a cascade" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_ensemble_build_refuses_members_with_different_labels(tmp_path):
    from nnunet_triton.builder.repository import build_ensemble_repository

    other = FIXTURES / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny"
    with pytest.raises(PlansError, match="labels"):
        build_ensemble_repository([FIXTURES / MEMBERS[0], other], tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
