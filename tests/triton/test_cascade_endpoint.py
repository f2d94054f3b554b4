"""A cascade (low-res stage -> cascade stage) runs inside ONE ``nnunet`` call and equals nnU-Net's cascade.

Fixture ``Dataset904_SynthCascade`` (``tools/fixtures``, spec ``cascade``): ``3d_lowres_tiny`` and
``3d_cascade_tiny`` (``previous_stage``), both trained by nnU-Net on fold ``all``. nnU-Net's way as the
reference: ``nnUNetPredictor`` of the low-res stage segments the image; its segmentation, as
``nnUNetv2_predict -prev_stage_predictions`` reads it back from the written file (``SimpleITKIO.read_seg``:
float32, shape (1, *spatial)), is the ``segmentation_previous_stage`` of the cascade stage's
``predict_single_npy_array``. The endpoint's SEGMENTATION must be identical, with and without mirroring.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from pipeline_support import BUILD_ROOT, FIXTURES, cases
from recovery_support import Load, assert_recovers_under_load

from nnunet_triton.client.client import NnunetClient
from nnunet_triton.errors import PlansError
from nnunet_triton.validate.oracle import nnunet_predictor
from tests.fixture_paths import require_fixture

DATASET = "Dataset904_SynthCascade"
LOWRES = f"{DATASET}/nnUNetTrainer__nnUNetPlans__3d_lowres_tiny"
CASCADE = f"{DATASET}/nnUNetTrainer__nnUNetPlans__3d_cascade_tiny"
FOLDS = ("all",)
TIMEOUT_S = 1800.0


@pytest.fixture(scope="module")
def cascade_server(triton_server):
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.builder.repository import build_repository

    require_fixture(FIXTURES / CASCADE / "plans.json")
    options = BuildOptions(tile_batch_size=4, per_sample_forward=True)
    result = build_repository(FIXTURES / CASCADE, BUILD_ROOT / "cascade", options=options, folds=FOLDS)
    with triton_server(result.out) as handle:
        yield handle


@cache
def _predictor(folder: str, mirroring: bool):
    return nnunet_predictor(FIXTURES / folder, folds=FOLDS, mirroring=mirroring)


def _nnunet_cascade(image: np.ndarray, spacing, mirroring: bool) -> tuple[np.ndarray, np.ndarray]:
    props = {"spacing": list(spacing)}
    low = np.asarray(_predictor(LOWRES, mirroring).predict_single_npy_array(image, props))
    previous = low[None].astype(np.float32)  # what read_seg returns for the written low-res file
    final = _predictor(CASCADE, mirroring).predict_single_npy_array(image, props, previous)
    return low, np.asarray(final)


@pytest.mark.parametrize(("index", "mirroring"), [(0, False), (1, False), (0, True)],
                         ids=["case0-no_mirroring", "case1-no_mirroring", "case0-mirroring"])
def test_cascade_endpoint_equals_nnunet_cascade_in_one_call(cascade_server, index, mirroring):
    case = cases(CASCADE)[index]
    low, expected = _nnunet_cascade(case.image, case.spacing, mirroring)
    with NnunetClient(cascade_server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        result = client.segment(case.image, case.spacing, mirroring=mirroring)
    np.testing.assert_array_equal(result.segmentation, expected)
    assert not np.array_equal(low, expected)  # the cascade stage changed the low-res answer


def test_cascade_repository_holds_both_stages_and_chains_them(cascade_server):
    from nnunet_triton.registry import version_metadata

    metadata = version_metadata(BUILD_ROOT / "cascade")
    assert metadata["previous_stage"] == {"model_folder": "nnUNetTrainer__nnUNetPlans__3d_lowres_tiny",
                                          "configuration": "3d_lowres_tiny", "folds": ["all"]}
    expected = {"previous_stage_preprocess_model", "previous_stage_orchestrator_model",
                "previous_stage_fold_all", "previous_stage_stitch_model", "preprocess_model", "fold_all",
                "nnunet__v1"}
    assert expected <= set(metadata["models"])
    # only the cascade stage answers probabilities=true; the previous stage's are never computed
    previous_stitch = (BUILD_ROOT / "cascade" / "previous_stage_stitch_model" / "config.pbtxt").read_text()
    assert 'key: "probabilities_output"' in previous_stitch and 'string_value: "never"' in previous_stitch


def test_cascade_endpoint_returns_the_cascade_stages_probabilities(cascade_server):
    """probabilities=true gives the cascade stage's probabilities (nnU-Net's, within 1e-6)."""
    case = cases(CASCADE)[0]
    low, _ = _nnunet_cascade(case.image, case.spacing, False)
    cascade = _predictor(CASCADE, False)
    _, expected = cascade.predict_single_npy_array(case.image, {"spacing": list(case.spacing)},
                                                   low[None].astype(np.float32), None, True)
    with NnunetClient(cascade_server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        result = client.segment(case.image, case.spacing, mirroring=False, probabilities=True)
    assert result.probabilities.shape == expected.shape
    assert float(np.abs(result.probabilities - expected).max()) <= 1e-6


def test_killed_previous_stage_fold_is_reloaded_and_cascade_answers_stay_correct_under_load(cascade_server):
    case = cases(CASCADE)[0]
    image = np.ascontiguousarray(case.image[:, :16, :32, :32])  # a crop: short requests, same code path
    _, expected = _nnunet_cascade(image, case.spacing, False)
    load = Load(cascade_server, image, case.spacing, expected, options={"mirroring": False})
    assert_recovers_under_load(cascade_server, "previous_stage_fold_all", load)


def test_cascade_build_refuses_when_the_previous_stage_folder_is_missing(tmp_path):
    import shutil

    from nnunet_triton.builder.repository import build_repository

    copy = tmp_path / CASCADE.split("/")[1]
    shutil.copytree(FIXTURES / CASCADE, copy)
    with pytest.raises(PlansError, match="3d_lowres_tiny"):
        build_repository(copy, tmp_path / "repo", folds=FOLDS)
    assert not (tmp_path / "repo").exists()
