"""The committed ``Dataset903_SynthMulti`` fixture is what the model-variety tests assume.

Made by ``python -m tools.fixtures --which multi`` with nnU-Net's own planners and trainers (see the README in
the dataset folder). Pinned here: the four model folders with slim checkpoints naming their trainer,
the planned network classes, two channels with CT + ZScore-with-mask normalization, region labels with
an ignore label, and the postprocessing.pkl nnU-Net determined (readable by our safe loader).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nnunet_triton.numerics.model_folder import read_model_folder
from nnunet_triton.numerics.postprocessing import find_postprocessing_pkl, load_postprocessing_pkl
from tests.fixture_paths import require_fixture

DATASET = Path(__file__).resolve().parents[1] / "fixtures" / "Dataset903_SynthMulti"
CHECKPOINT_KEYS = {"network_weights", "init_args", "trainer_name", "inference_allowed_mirroring_axes",
                   "current_epoch"}
# model folder -> (trainer, configuration, network class, patch dims)
MODELS = {
    "nnUNetTrainer__nnUNetPlans__3d_tiny": ("nnUNetTrainer", "3d_tiny", "PlainConvUNet", 3),
    "nnUNetTrainer__nnUNetPlans__2d_tiny": ("nnUNetTrainer", "2d_tiny", "PlainConvUNet", 2),
    "nnUNetTrainer__nnUNetResEncUNetMPlans__3d_tiny": ("nnUNetTrainer", "3d_tiny", "ResidualEncoderUNet", 3),
    "nnUNetTrainerBN__nnUNetPlans__3d_tiny": ("nnUNetTrainerBN", "3d_tiny", "PlainConvUNet", 3),
}


@pytest.fixture(autouse=True)
def _committed_fixture() -> None:
    require_fixture(DATASET)


@pytest.mark.parametrize("folder", MODELS)
def test_variety_model_folder_reads_as_its_planned_kind(folder: str) -> None:
    trainer, configuration, network, ndim = MODELS[folder]
    checkpoint = torch.load(DATASET / folder / "fold_0" / "checkpoint_final.pth", map_location="cpu",
                            weights_only=False)
    assert set(checkpoint) == CHECKPOINT_KEYS
    assert (checkpoint["trainer_name"], checkpoint["init_args"]["configuration"]) == (trainer, configuration)
    config = read_model_folder(DATASET / folder)
    assert config.network.network_class_name.rsplit(".", 1)[-1] == network
    assert len(config.patch_size) == ndim
    assert [(n.scheme, n.use_mask_for_norm) for n in config.normalization] == [
        ("CTNormalization", False), ("ZScoreNormalization", True)]
    assert config.labels.has_regions and config.labels.regions_class_order == (1, 2)
    assert config.labels.ignore_label == 3 and config.labels.num_segmentation_heads == 2


def test_variety_fixture_has_two_channel_held_out_cases_and_nnunets_postprocessing_choice() -> None:
    dataset = json.loads((DATASET / "nnUNetTrainer__nnUNetPlans__3d_tiny" / "dataset.json").read_text())
    assert dataset["channel_names"] == {"0": "CT", "1": "T2"}
    for case in ("synthmulti_100", "synthmulti_101"):
        assert all((DATASET / "imagesTs" / f"{case}_000{c}.nii.gz").is_file() for c in (0, 1))
        assert (DATASET / "labelsTs" / f"{case}.nii.gz").is_file()
    pkl = find_postprocessing_pkl(DATASET / "nnUNetTrainer__nnUNetPlans__3d_tiny", (0,))
    assert pkl is not None
    recorded = json.loads((DATASET / "provenance.json").read_text())["models"][
        "nnUNetTrainer__nnUNetPlans__3d_tiny"]["postprocessing"]["functions"]
    assert len(load_postprocessing_pkl(pkl).steps) == len(recorded)
