"""nnunet_triton.numerics.plans against nnU-Net 2.8.1's PlansManager / LabelManager on synthetic plans."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch
from nnunetv2.preprocessing.resampling.default_resampling import resample_data_or_seg_to_shape
from nnunetv2.utilities.label_handling.label_handling import LabelManager, determine_num_input_channels
from nnunetv2.utilities.plans_handling.plans_handler import PlansManager
from test_preprocess import make_configuration, make_dataset, make_plans

from nnunet_triton.errors import PlansError, UnsupportedModelError
from nnunet_triton.numerics.model_folder import (
    load_inference_config,
    read_model_folder,
    resolve_configuration,
)
from nnunet_triton.numerics.plans import InferenceConfig

LABELS = {"background": 0, "liver": 1, "tumor": 2}
REGIONS = {"background": 0, "whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing": 3}
IGNORE = {"background": 0, "liver": 1, "tumor": 2, "ignore": 3}


def _plans(n_channels: int = 1) -> dict:
    schemes = ("CTNormalization", "ZScoreNormalization", "RescaleTo01Normalization")[:n_channels]
    return make_plans(
        {
            "3d_fullres": make_configuration((2.5, 0.8, 0.8), (64, 128, 128), schemes, (False,) * n_channels),
            "2d": make_configuration((0.8, 0.8), (256, 256), schemes, (False,) * n_channels),
            "3d_custom": {"inherits_from": "3d_fullres", "spacing": [3.0, 1.0, 1.0]},
            "3d_custom_child": {"inherits_from": "3d_custom", "patch_size": [32, 64, 64]},
        },
        transpose_forward=(2, 0, 1),
    )


def _dataset(labels=LABELS, n_channels: int = 1, **extra) -> dict:
    return make_dataset(n_channels) | {"labels": copy.deepcopy(labels)} | extra


def _load(plans, dataset, name="3d_fullres", mirror_axes=(0, 1, 2)) -> InferenceConfig:
    return load_inference_config(
        plans, dataset, name, trainer_name="nnUNetTrainer", mirror_axes=mirror_axes, folds=(0, 1)
    )


@pytest.mark.parametrize("name", ["3d_fullres", "3d_custom", "3d_custom_child"])
def test_resolve_configuration_equals_plans_manager_when_inherits_from_chains(name):
    plans = _plans()
    assert resolve_configuration(plans, name) == PlansManager(
        plans
    )._internal_resolve_configuration_inheritance(name)


def test_load_inference_config_uses_child_and_parent_values_when_configuration_inherits():
    config = _load(_plans(), _dataset(), "3d_custom_child")
    assert (config.spacing, config.patch_size, config.configuration) == (
        (3.0, 1.0, 1.0),
        (32, 64, 64),
        "3d_custom_child",
    )


@pytest.mark.parametrize(
    "configurations, message",
    [
        ({"a": {"inherits_from": "missing"}}, "no configuration 'missing'"),
        ({"a": {"inherits_from": "b"}, "b": {"inherits_from": "a"}}, "circular"),
    ],
)
def test_resolve_configuration_raises_plans_error_when_chain_is_broken(configurations, message):
    with pytest.raises(PlansError, match=message):
        resolve_configuration({"configurations": configurations}, "a")


@pytest.mark.parametrize(
    "labels, extra", [(LABELS, {}), (REGIONS, {"regions_class_order": [1, 2, 3]}), (IGNORE, {})]
)
def test_label_settings_equal_label_manager_when_labels_regions_or_ignore(labels, extra):
    config = _load(_plans(), _dataset(labels, **extra))
    lm = LabelManager(labels, extra.get("regions_class_order"))
    lab = config.labels
    assert lab.has_regions == lm.has_regions
    assert list(lab.all_labels) == [int(v) for v in lm.all_labels]
    assert lab.ignore_label == lm.ignore_label
    assert lab.num_segmentation_heads == lm.num_segmentation_heads == config.network.num_output_channels
    assert list(lab.foreground_labels) == [int(v) for v in lm.foreground_labels]
    if lm.has_regions:
        assert lab.foreground_regions == tuple(
            r if isinstance(r, tuple) else (r,) for r in lm.foreground_regions
        )
        assert list(lab.regions_class_order) == lm.regions_class_order
    else:
        assert lab.foreground_regions is None and lab.regions_class_order is None


def test_label_settings_raise_when_regions_lack_regions_class_order():
    with pytest.raises(PlansError, match="regions_class_order"):
        _load(_plans(), _dataset(REGIONS))


def test_label_settings_raise_when_ignore_label_is_not_the_highest():
    with pytest.raises(PlansError, match="ignore.*highest.*3.*got 1"):
        _load(_plans(), _dataset({"background": 0, "ignore": 1, "a": 2}))


def test_label_settings_raise_when_labels_are_not_consecutive():
    with pytest.raises(PlansError, match=r"consecutive.*\[0, 1, 5\]"):
        _load(_plans(), _dataset({"background": 0, "a": 1, "b": 5}))


def _set(path: str, value):
    def edit(plans: dict) -> None:
        target = plans
        *keys, last = path.split("/")
        for key in keys:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value

    return edit


UNSUPPORTED = {
    "normalization_schemes": (_set("configurations/3d_fullres/normalization_schemes", ["MyNorm"]), "MyNorm"),
    "resampling_fn_data": (
        _set("configurations/3d_fullres/resampling_fn_data", "resample_torch_fornnunet"),
        "resampling_fn_data",
    ),
    "resampling_fn_probabilities": (
        _set("configurations/3d_fullres/resampling_fn_probabilities", "no_resampling_hack"),
        "resampling_fn_probabilities",
    ),
    "resampling kwargs": (
        _set(
            "configurations/3d_fullres/resampling_fn_seg_kwargs",
            {"is_seg": True, "separate_z_anisotropy_threshold": 2},
        ),
        "resampling_fn_seg_kwargs.*separate_z_anisotropy_threshold",
    ),
    "preprocessor_name": (
        _set("configurations/3d_fullres/preprocessor_name", "MyPreprocessor"),
        "preprocessor_name.*MyPreprocessor",
    ),
    "label_manager": (_set("label_manager", "MyLabelManager"), "label_manager.*MyLabelManager"),
    "previous_stage (cascade)": (
        _set("configurations/3d_fullres/previous_stage", "3d_lowres"),
        "previous_stage",
    ),
    "old plans format": (_set("configurations/3d_fullres/architecture", KeyError), "architecture"),
}


@pytest.mark.parametrize("setting", sorted(UNSUPPORTED))
def test_load_inference_config_raises_unsupported_naming_the_setting_when_plans_use_it(setting):
    edit, message = UNSUPPORTED[setting]
    plans = _plans()
    edit(plans)
    with pytest.raises(UnsupportedModelError, match=message):
        _load(plans, _dataset())


def test_load_inference_config_raises_plans_error_when_transposes_are_not_inverse():
    plans = _plans()
    plans["transpose_backward"] = [2, 0, 1]
    with pytest.raises(PlansError, match="inverse permutations"):
        _load(plans, _dataset())


def test_load_inference_config_matches_nnunet_managers_when_plans_are_synthetic():
    plans, dataset = _plans(n_channels=3), _dataset(n_channels=3)
    config = _load(plans, dataset)
    pm = PlansManager(plans)
    cm = pm.get_configuration("3d_fullres")
    assert (
        config.num_input_channels
        == config.network.num_input_channels
        == determine_num_input_channels(pm, cm, dataset)
    )
    assert list(config.patch_size) == cm.patch_size and list(config.spacing) == cm.spacing
    assert list(config.transpose_forward) == pm.transpose_forward
    assert list(config.transpose_backward) == pm.transpose_backward
    assert [n.scheme for n in config.normalization] == cm.normalization_schemes
    assert [n.use_mask_for_norm for n in config.normalization] == cm.use_mask_for_norm
    assert config.channel_names == ("CT", "T1", "T2")
    assert (
        config.normalization[0].intensity.percentile_99_5
        == plans["foreground_intensity_properties_per_channel"]["0"]["percentile_99_5"]
    )
    assert (config.network.network_class_name, config.network.arch_kwargs) == (
        cm.network_arch_class_name,
        cm.network_arch_init_kwargs,
    )
    for ours, key in (
        (config.resampling_data, "resampling_fn_data_kwargs"),
        (config.resampling_seg, "resampling_fn_seg_kwargs"),
        (config.resampling_probabilities, "resampling_fn_probabilities_kwargs"),
    ):
        assert {k: getattr(ours, k) for k in cm.configuration[key]} == cm.configuration[key]


def test_resampling_settings_default_like_nnunet_when_plans_kwargs_are_empty():
    """Missing kwargs take resample_data_or_seg_to_shape's own defaults (force_separate_z=False)."""
    plans = _plans()
    plans["configurations"]["3d_fullres"]["resampling_fn_data_kwargs"] = {}
    config = _load(plans, _dataset())
    data = np.random.default_rng(0).standard_normal((1, 4, 9, 10)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = resample_data_or_seg_to_shape(data, (8, 7, 12), [4.0, 1.0, 1.0], [2.0, 1.2, 0.8])
    from nnunet_triton.numerics.resampling import resample_with_settings

    ours = resample_with_settings(data, (8, 7, 12), [4.0, 1.0, 1.0], [2.0, 1.2, 0.8], config.resampling_data)
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize(
    "labels, extra, name, mirror",
    [
        (LABELS, {}, "3d_fullres", (0, 1, 2)),
        (REGIONS, {"regions_class_order": [1, 2, 3]}, "3d_custom_child", None),
        (IGNORE, {}, "2d", (0, 1)),
    ],
)
def test_inference_config_round_trips_when_serialized_to_json(labels, extra, name, mirror):
    config = _load(_plans(n_channels=2), _dataset(labels, n_channels=2, **extra), name, mirror)
    text = config.to_json()
    assert json.loads(text) == json.loads(InferenceConfig.from_json(text).to_json())
    assert InferenceConfig.from_json(text) == config


def _write_model_folder(root, plans, dataset, folds, *, mirror=(0, 1, 2), with_mirror_key=True):
    (root / "plans.json").write_text(json.dumps(plans))
    (root / "dataset.json").write_text(json.dumps(dataset))
    for fold in folds:
        (root / f"fold_{fold}").mkdir()
        checkpoint = {
            "trainer_name": "nnUNetTrainer",
            "init_args": {"configuration": "3d_custom"},
            "network_weights": {},
        }
        if with_mirror_key:
            checkpoint["inference_allowed_mirroring_axes"] = mirror
        torch.save(checkpoint, root / f"fold_{fold}" / "checkpoint_final.pth")


def test_read_model_folder_takes_configuration_and_mirroring_from_first_fold_when_folds_exist(tmp_path):
    _write_model_folder(tmp_path, _plans(), _dataset(), ["3", "0", "all"])
    config = read_model_folder(tmp_path)
    assert (config.folds, config.configuration, config.mirror_axes) == ((0, 3), "3d_custom", (0, 1, 2))
    assert config.network.trainer_name == "nnUNetTrainer"


def test_read_model_folder_means_no_mirroring_when_checkpoint_lacks_the_key(tmp_path):
    _write_model_folder(tmp_path, _plans(), _dataset(), ["0"], with_mirror_key=False)
    assert read_model_folder(tmp_path).mirror_axes is None


def test_read_model_folder_raises_plans_error_when_no_fold_has_a_checkpoint(tmp_path):
    _write_model_folder(tmp_path, _plans(), _dataset(), [])
    with pytest.raises(PlansError, match="no fold_"):
        read_model_folder(tmp_path)
