"""nnU-Net itself loads, preprocesses and segments the committed fixture models.

The fixtures under ``tests/fixtures/`` are made by ``python -m tools.fixtures`` (see the README there).
These tests pin the properties later tests rely on: folder layout, slim checkpoints, plans, which cases
are cropped / resampled with separate z / smaller than the patch, and that nnU-Net's own
``nnUNetPredictor`` (CPU, step 0.5, Gaussian, all folds) segments every held-out case with Dice > 0.7.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor
from nnunetv2.preprocessing.resampling.default_resampling import determine_do_sep_z_and_axis
from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

from nnunet_triton.validate.oracle import nnunet_predictor
from tests.fixture_paths import SYNTH_ANISO, SYNTH_CT, FixtureModel

CONFIGURATION = "3d_tiny"
CHECKPOINT_KEYS = {
    "network_weights",
    "init_args",
    "trainer_name",
    "inference_allowed_mirroring_axes",
    "current_epoch",
}
FOREGROUND_LABELS = {"organ": 1, "lesion": 2}
MIN_DICE = 0.7


@dataclass(frozen=True)
class Expected:
    """What each fixture must look like (the generator's contract with the rest of the suite)."""

    model: FixtureModel
    folds: tuple[int, ...]
    transpose_forward: list[int]
    patch_size: list[int]
    # case id -> (separate z at preprocessing, its axis), from determine_do_sep_z_and_axis
    separate_z: dict[str, tuple[bool, int | None]]


EXPECTED = {
    "synthct": Expected(
        SYNTH_CT,
        (0, 1),
        [0, 1, 2],
        [24, 32, 32],
        {"synthct_100": (False, None), "synthct_101": (False, None), "synthct_102": (True, 0)},
    ),
    "aniso": Expected(
        SYNTH_ANISO,
        (0,),
        [2, 0, 1],
        [8, 48, 48],
        {"synthaniso_100": (True, 0), "synthaniso_101": (True, 0)},
    ),
}
HELD_OUT = [(key, case) for key, exp in EXPECTED.items() for case in exp.separate_z]


def _load_json(path) -> dict:
    return json.loads(path.read_text())


def _plans_and_configuration(model: FixtureModel):
    plans_manager = PlansManager(str(model.model_dir / "plans.json"))
    return plans_manager, plans_manager.get_configuration(CONFIGURATION)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """OpenMP threads spin-wait on 2 shared cores; one thread predicted ~9x faster under load."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@functools.cache
def _predictor(key: str) -> nnUNetPredictor:
    # Mirror TTA would cost 8 forward passes per tile on 2 shared CPU cores; the README lists Dice with
    # and without it (both far above the threshold). The checkpoint's axes are still asserted below.
    return nnunet_predictor(EXPECTED[key].model.model_dir, mirroring=False)


def _preprocess(key: str, case_id: str):
    model = EXPECTED[key].model
    plans_manager, configuration_manager = _plans_and_configuration(model)
    case = model.held_out_case(case_id)
    return DefaultPreprocessor(verbose=False).run_case(
        [str(case.image)],
        None,
        plans_manager,
        configuration_manager,
        _load_json(model.model_dir / "dataset.json"),
    )


def _dice(prediction: np.ndarray, reference: np.ndarray, label: int) -> float:
    p, r = prediction == label, reference == label
    return 2.0 * float((p & r).sum()) / max(int(p.sum()) + int(r.sum()), 1)


@pytest.mark.parametrize("key", EXPECTED)
def test_fixture_model_folder_holds_only_inference_files(key: str) -> None:
    model_dir = EXPECTED[key].model.model_dir
    files = {p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file()}
    expected = {"dataset.json", "plans.json", "dataset_fingerprint.json"}
    expected |= {f"fold_{f}/checkpoint_final.pth" for f in EXPECTED[key].folds}
    assert files == expected


@pytest.mark.parametrize("key", EXPECTED)
def test_fixture_checkpoints_are_slim_and_name_nnunet_trainer(key: str) -> None:
    for fold in EXPECTED[key].folds:
        checkpoint = torch.load(
            EXPECTED[key].model.model_dir / f"fold_{fold}" / "checkpoint_final.pth",
            map_location="cpu",
            weights_only=False,
        )
        assert set(checkpoint) == CHECKPOINT_KEYS
        assert (
            checkpoint["trainer_name"],
            checkpoint["init_args"]["configuration"],
            checkpoint["init_args"]["fold"],
            checkpoint["inference_allowed_mirroring_axes"],
        ) == ("nnUNetTrainer", CONFIGURATION, fold, (0, 1, 2))


@pytest.mark.parametrize("key", EXPECTED)
def test_fixture_plans_define_3d_tiny_inheriting_3d_fullres(key: str) -> None:
    plans_manager, configuration_manager = _plans_and_configuration(EXPECTED[key].model)
    raw_configuration = plans_manager.plans["configurations"][CONFIGURATION]
    assert (
        raw_configuration["inherits_from"],
        plans_manager.transpose_forward,
        configuration_manager.patch_size,
        configuration_manager.spacing,
        configuration_manager.normalization_schemes,
    ) == (
        "3d_fullres",
        EXPECTED[key].transpose_forward,
        EXPECTED[key].patch_size,
        plans_manager.get_configuration("3d_fullres").spacing,
        ["CTNormalization"],
    )


@pytest.mark.parametrize("key", EXPECTED)
def test_predictor_finds_expected_folds_and_mirroring_axes(key: str) -> None:
    model_dir = str(EXPECTED[key].model.model_dir)
    folds = nnUNetPredictor.auto_detect_available_folds(model_dir, "checkpoint_final.pth")
    predictor = _predictor(key)
    assert (
        sorted(folds),
        len(predictor.list_of_parameters),
        predictor.allowed_mirroring_axes,
        predictor.trainer_name,
    ) == (list(EXPECTED[key].folds), len(EXPECTED[key].folds), (0, 1, 2), "nnUNetTrainer")


@pytest.mark.parametrize(("key", "case_id"), HELD_OUT)
def test_separate_z_triggers_for_expected_held_out_cases(key: str, case_id: str) -> None:
    plans_manager, configuration_manager = _plans_and_configuration(EXPECTED[key].model)
    _, properties = SimpleITKIO().read_images([str(EXPECTED[key].model.held_out_case(case_id).image)])
    spacing_transposed = [properties["spacing"][i] for i in plans_manager.transpose_forward]
    do_separate_z, axis = determine_do_sep_z_and_axis(None, spacing_transposed, configuration_manager.spacing)
    assert (do_separate_z, None if axis is None else int(axis)) == EXPECTED[key].separate_z[case_id]


def test_crop_to_nonzero_crops_synthct_margin_case() -> None:
    _, _, properties = _preprocess("synthct", "synthct_101")
    shape = properties["shape_before_cropping"]
    assert properties["bbox_used_for_cropping"] != [[0, s] for s in shape]
    assert np.prod(properties["shape_after_cropping_and_before_resampling"]) < np.prod(shape)


def test_synthaniso_small_case_is_smaller_than_patch_on_every_axis_after_preprocessing() -> None:
    data, _, _ = _preprocess("aniso", "synthaniso_101")
    assert all(s < p for s, p in zip(data.shape[1:], EXPECTED["aniso"].patch_size, strict=True))


@pytest.mark.parametrize(("key", "case_id"), HELD_OUT)
def test_predictor_segments_held_out_case_with_dice_above_threshold(key: str, case_id: str) -> None:
    case = EXPECTED[key].model.held_out_case(case_id)
    io = SimpleITKIO()
    image, properties = io.read_images([str(case.image)])
    reference, _ = io.read_seg(str(case.label))
    prediction = _predictor(key).predict_single_npy_array(image, properties, None, None, False)
    dice = {
        name: round(_dice(prediction, reference[0], label), 3) for name, label in FOREGROUND_LABELS.items()
    }
    assert prediction.shape == reference.shape[1:]
    assert all(d > MIN_DICE for d in dice.values()), f"{case_id}: Dice {dice} (must exceed {MIN_DICE})"
