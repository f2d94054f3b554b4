"""The many-class fixture (``Dataset905_SynthManyClass``, spec ``manyclass``): 104 labels at ~1.5 mm.

Cheap (seconds): reads the committed model folder, runs nnUNetPredictor on CPU on the small held-out case
and builds a repository from it; nothing is trained here (``make fixtures FIXTURE=manyclass`` does that).
"""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from nnunet_triton import io_names
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.builder.repository import build_repository
from nnunet_triton.numerics.model_folder import read_model_folder
from tests.fixture_paths import MANY_CLASS, require_fixture
from tools.fixtures.manyclass import HU_BODY, HU_BODY_GAP, label_intensities, organ_sites
from tools.fixtures.specs import MANY_CLASS as SPEC

SMALL_CASE = "synthmanyclass_101"  # 16 x 28 x 32 voxels: a quick prediction


def test_many_class_fixture_has_104_foreground_labels_planned_at_about_1_5_mm_isotropic():
    config = read_model_folder(require_fixture(MANY_CLASS.model_dir))
    assert config.labels.foreground_labels == tuple(range(1, 105))
    assert len(config.labels.foreground_labels) >= 100 and SPEC.num_labels == 104
    assert config.network.num_output_channels == 105  # the head: background + 104 labels
    assert config.folds == (0, 1)
    assert config.transpose_forward == (0, 1, 2)
    assert all(1.4 <= s <= 1.6 for s in config.spacing), config.spacing  # nnU-Net's planner chose it
    assert config.patch_size == SPEC.patch_size
    weights = sum(p.stat().st_size for p in MANY_CLASS.model_dir.glob("fold_*/checkpoint_final.pth"))
    assert weights < 1_500_000  # committed weights stay small


def test_many_class_generator_gives_every_label_its_own_site_and_intensity_away_from_the_body():
    sites, levels = organ_sites(SPEC), label_intensities(SPEC)
    assert sites.shape == (SPEC.num_labels, 3) and len({tuple(site) for site in sites}) == SPEC.num_labels
    assert levels.shape == (SPEC.num_labels,) and len(set(levels.tolist())) == SPEC.num_labels
    assert np.abs(levels - HU_BODY).min() >= HU_BODY_GAP


@pytest.mark.parametrize("folds", [(0,), (0, 1)], ids=["one fold", "two folds"])
def test_nnunet_predictor_runs_the_105_channel_head_of_the_many_class_fixture(folds):
    import torch
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    case = MANY_CLASS.held_out_case(SMALL_CASE)
    predictor = nnUNetPredictor(tile_step_size=0.5, use_gaussian=True, use_mirroring=False,
                                perform_everything_on_device=False, device=torch.device("cpu"),
                                verbose=False, verbose_preprocessing=False, allow_tqdm=False)
    model_dir = require_fixture(MANY_CLASS.model_dir)
    predictor.initialize_from_trained_model_folder(str(model_dir), use_folds=folds)
    image, properties = SimpleITKIO().read_images([str(case.image)])
    reference, _ = SimpleITKIO().read_seg(str(case.label))
    labels, probabilities = predictor.predict_single_npy_array(image, properties, None, None, True)

    assert labels.shape == reference[0].shape
    assert probabilities.shape == (105, *labels.shape)
    assert len(np.unique(reference[0])) > 50  # the case holds many labels
    assert set(np.unique(labels).tolist()) - {0, 1, 2, 3}  # labels beyond the small fixtures' range
    # The briefly trained network is weak (see the fixture's README): the foreground channels still
    # differ from voxel to voxel, so the head is a real 105-channel head, not a padded 4-channel one.
    foreground = reference[0] > 0
    best_foreground = probabilities[1:].argmax(axis=0)[foreground] + 1
    assert len(np.unique(best_foreground)) >= 3


def _segmentation_outputs(repo):
    found = {}
    for path in repo.rglob("config.pbtxt"):
        message = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        for tensor in message.output:
            if tensor.name == io_names.SEGMENTATION:
                found[message.name] = model_config_pb2.DataType.Name(tensor.data_type)
    return found


def test_build_accepts_the_many_class_fixture_and_declares_segmentation_uint8(tmp_path):
    result = build_repository(require_fixture(MANY_CLASS.model_dir), tmp_path / "repo",
                              options=BuildOptions(tile_batch_size=1), folds=[0, 1])
    outputs = _segmentation_outputs(result.out)
    assert {io_names.ENDPOINT_MODEL, io_names.STITCH_MODEL} <= set(outputs), outputs
    assert set(outputs.values()) == {"TYPE_UINT8"}  # 104 labels < 255: nnU-Net's uint8 rule
