"""Read a trained nnU-Net results folder (plans.json, dataset.json, checkpoints) into ``InferenceConfig``."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nnunet_triton.errors import PlansError, UnsupportedModelError
from nnunet_triton.numerics.plans import (
    ChannelNormalization,
    InferenceConfig,
    IntensityProperties,
    LabelSettings,
    NetworkSettings,
    ResamplingSettings,
)

LOGGER = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_NORMALIZATION_SCHEMES",
    "CHECKPOINT_NAME",
    "resolve_configuration",
    "load_inference_config",
    "read_model_folder",
    "detect_folds",
    "parse_fold",
    "load_checkpoint",
    "architecture_of_flat_plans",
]


SUPPORTED_NORMALIZATION_SCHEMES = (
    "CTNormalization",
    "ZScoreNormalization",
    "RescaleTo01Normalization",
    "RGBTo01Normalization",
    "NoNormalization",
)


SUPPORTED_PREPROCESSORS = ("DefaultPreprocessor",)


SUPPORTED_LABEL_MANAGERS = ("LabelManager",)


CHECKPOINT_NAME = "checkpoint_final.pth"


def resolve_configuration(plans: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Resolve ``inherits_from`` chains like ``PlansManager._internal_resolve_configuration_inheritance``.

    The child's keys replace the parent's (a shallow ``dict.update``, as nnU-Net does).
    """
    configurations = plans.get("configurations", {})
    chain: list[str] = []
    current = name
    while True:
        if current not in configurations:
            raise PlansError(
                f"plans.json has no configuration {current!r} (needed for {name!r}); "
                f"available: {sorted(configurations)}."
            )
        if current in chain:
            raise PlansError(f"plans.json configuration inheritance is circular: {chain + [current]}.")
        chain.append(current)
        parent = configurations[current].get("inherits_from")
        if parent is None:
            break
        current = parent
    resolved: dict[str, Any] = {}
    for config_name in reversed(chain):
        resolved.update(copy.deepcopy(configurations[config_name]))
    return resolved


def _normalization(plans: Mapping[str, Any], config: Mapping[str, Any], n_channels: int
                   ) -> tuple[ChannelNormalization, ...]:
    schemes = config.get("normalization_schemes") or []
    masks = config.get("use_mask_for_norm") or []
    if len(schemes) != n_channels or len(masks) != n_channels:
        raise PlansError(
            f"plans.json normalization_schemes ({len(schemes)}) and use_mask_for_norm ({len(masks)}) "
            f"must have one entry per input channel ({n_channels})."
        )
    props = plans.get("foreground_intensity_properties_per_channel") or plans.get(
        "foreground_intensity_properties_by_modality", {}
    )
    out = []
    for c, (scheme, use_mask) in enumerate(zip(schemes, masks, strict=True)):
        if scheme not in SUPPORTED_NORMALIZATION_SCHEMES:
            # nnU-Net raises "Unable to locate class '<scheme>' for normalization" at preprocessing time.
            raise UnsupportedModelError(
                f"plans.json normalization_schemes[{c}] = {scheme!r} is not a normalization class nnU-Net "
                f"ships; supported: {list(SUPPORTED_NORMALIZATION_SCHEMES)}."
            )
        intensity = IntensityProperties.from_plans(props[str(c)]) if str(c) in props else None
        if scheme == "CTNormalization" and intensity is None:
            raise PlansError(
                f"plans.json has no foreground_intensity_properties_per_channel['{c}'], "
                "which CTNormalization needs."
            )
        out.append(ChannelNormalization(scheme=scheme, use_mask_for_norm=bool(use_mask), intensity=intensity))
    return tuple(out)


_FLAT_NETWORKS = {  # UNet_class_name of the flat plans -> the class nnU-Net 2.3+ reconstructs
    "PlainConvUNet": ("dynamic_network_architectures.architectures.unet.PlainConvUNet", "n_conv_per_stage"),
    "ResidualEncoderUNet": ("dynamic_network_architectures.architectures.unet.ResidualEncoderUNet",
                            "n_blocks_per_stage"),
}
_FLAT_KEYS = ("UNet_class_name", "UNet_base_num_features", "n_conv_per_stage_encoder",
              "n_conv_per_stage_decoder", "num_pool_per_axis", "pool_op_kernel_sizes", "conv_kernel_sizes",
              "unet_max_num_features")


def architecture_of_flat_plans(config: Mapping[str, Any], configuration: str) -> dict[str, Any]:
    """A resolved configuration in the plans format of nnU-Net 2.3 and later (an ``architecture`` block).

    Plans written by nnU-Net 2.0 to 2.2.x describe the network with flat keys (``UNet_class_name``,
    ``UNet_base_num_features``, ``n_conv_per_stage_encoder``, ...), which those releases'
    ``get_network_from_plans`` turned into a ``PlainConvUNet`` or ``ResidualEncoderUNet`` with instance norm,
    LeakyReLU and conv bias. nnU-Net 2.3 and later rebuild the same network from them
    (``ConfigurationManager.__init__``, "Detected old nnU-Net plans format"); this is that rebuild, so old
    model folders build and serve, except that the residual network is named where the old releases
    imported it (``architectures.unet``; 2.8.1's rebuild names ``architectures.residual_unet``, which the
    installed dynamic_network_architectures 0.4 lacks). A configuration with an ``architecture`` block is
    returned as it is.

    Raises:
        UnsupportedModelError: flat plans naming another network class, or missing one of the flat keys.
    """
    config = dict(config)
    if "architecture" in config:
        return config
    name = config.get("UNet_class_name")
    if name not in _FLAT_NETWORKS:
        raise UnsupportedModelError(
            f"plans.json configuration {configuration!r} has neither an 'architecture' block nor a "
            f"UNet_class_name nnU-Net can rebuild ({list(_FLAT_NETWORKS)}), got {name!r}.")
    missing = [key for key in _FLAT_KEYS if key not in config]
    if missing or "patch_size" not in config:
        raise UnsupportedModelError(
            f"plans.json configuration {configuration!r} is in the pre-2.3 flat format but lacks "
            f"{missing or ['patch_size']}.")
    class_name, blocks = _FLAT_NETWORKS[name]
    dim = len(config["patch_size"])
    stages = len(config["n_conv_per_stage_encoder"])
    base, most = int(config["UNet_base_num_features"]), int(config["unet_max_num_features"])
    config["architecture"] = {
        "network_class_name": class_name,
        "arch_kwargs": {
            "n_stages": stages,
            "features_per_stage": [min(base * 2**i, most) for i in range(stages)],
            "conv_op": f"torch.nn.modules.conv.Conv{dim}d",
            "kernel_sizes": copy.deepcopy(config["conv_kernel_sizes"]),
            "strides": copy.deepcopy(config["pool_op_kernel_sizes"]),
            blocks: copy.deepcopy(config["n_conv_per_stage_encoder"]),
            "n_conv_per_stage_decoder": copy.deepcopy(config["n_conv_per_stage_decoder"]),
            "conv_bias": True,
            "norm_op": f"torch.nn.modules.instancenorm.InstanceNorm{dim}d",
            "norm_op_kwargs": {"eps": 1e-05, "affine": True},
            "dropout_op": None,
            "dropout_op_kwargs": None,
            "nonlin": "torch.nn.LeakyReLU",
            "nonlin_kwargs": {"inplace": True},
        },
        "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"],
    }
    for key in _FLAT_KEYS:
        del config[key]
    return config


def _check_supported(plans: Mapping[str, Any], config: Mapping[str, Any], configuration: str) -> None:
    preprocessor = config.get("preprocessor_name", "DefaultPreprocessor")
    if preprocessor not in SUPPORTED_PREPROCESSORS:
        raise UnsupportedModelError(
            f"plans.json configuration {configuration!r} preprocessor_name = {preprocessor!r} "
            "is not supported; "
            f"supported: {list(SUPPORTED_PREPROCESSORS)}."
        )
    label_manager = plans.get("label_manager", "LabelManager")
    if label_manager not in SUPPORTED_LABEL_MANAGERS:
        raise UnsupportedModelError(
            f"plans.json label_manager = {label_manager!r} is not supported; "
            f"supported: {list(SUPPORTED_LABEL_MANAGERS)}."
        )


def load_inference_config(
    plans: Mapping[str, Any],
    dataset: Mapping[str, Any],
    configuration: str,
    *,
    trainer_name: str,
    mirror_axes: Sequence[int] | None,
    folds: Sequence[int | str],
    allow_cascade: bool = False,
) -> InferenceConfig:
    """Build an :class:`InferenceConfig` from already-parsed JSON and checkpoint metadata.

    A cascade stage (``previous_stage`` in its configuration) raises :class:`UnsupportedModelError` unless
    ``allow_cascade``; then ``previous_stage`` is kept and the network takes
    ``num_input_channels + len(foreground labels)`` channels, as nnU-Net's ``determine_num_input_channels``.
    """
    config = architecture_of_flat_plans(resolve_configuration(plans, configuration), configuration)
    _check_supported(plans, config, configuration)
    channel_names = dataset.get("channel_names") or dataset.get("modality")
    if not channel_names:
        raise PlansError("dataset.json has no 'channel_names'.")
    n_channels = len(channel_names)
    labels = LabelSettings.from_dataset(dataset)
    patch_size = tuple(int(p) for p in config["patch_size"])
    spacing = tuple(float(s) for s in config["spacing"])
    if len(patch_size) not in (2, 3) or len(spacing) != len(patch_size):
        raise PlansError(
            f"plans.json configuration {configuration!r}: patch_size {patch_size} and spacing {spacing} "
            "must both have 2 or 3 entries."
        )
    transpose_forward = tuple(int(t) for t in plans["transpose_forward"])
    transpose_backward = tuple(int(t) for t in plans["transpose_backward"])
    permutations = sorted(transpose_forward) == [0, 1, 2] and sorted(transpose_backward) == [0, 1, 2]
    if not permutations or [transpose_forward[t] for t in transpose_backward] != [0, 1, 2]:
        raise PlansError(
            f"plans.json transpose_forward {transpose_forward} / transpose_backward {transpose_backward} "
            "must be inverse permutations of (0, 1, 2)."
        )
    previous_stage = config.get("previous_stage")
    if previous_stage is not None and not allow_cascade:
        raise UnsupportedModelError(
            f"configuration {configuration!r} is a cascade stage (previous_stage = {previous_stage!r}); "
            "read it with allow_cascade=True; repository.build serves it together with its previous stage."
        )
    arch = config["architecture"]
    network = NetworkSettings(
        trainer_name=trainer_name,
        network_class_name=arch["network_class_name"],
        arch_kwargs_json=json.dumps(arch["arch_kwargs"], sort_keys=True),
        kw_requires_import=tuple(arch.get("_kw_requires_import", ())),
        num_input_channels=n_channels + (len(labels.foreground_labels) if previous_stage is not None else 0),
        num_output_channels=labels.num_segmentation_heads,
    )
    if mirror_axes is not None and any(a < 0 or a >= len(patch_size) for a in mirror_axes):
        raise PlansError(
            f"checkpoint inference_allowed_mirroring_axes {tuple(mirror_axes)} out of range for a "
            f"{len(patch_size)}D configuration."
        )
    return InferenceConfig(
        dataset_name=str(plans.get("dataset_name", "")),
        plans_name=str(plans.get("plans_name", "")),
        configuration=configuration,
        patch_size=patch_size,
        spacing=spacing,
        transpose_forward=transpose_forward,
        transpose_backward=transpose_backward,
        normalization=_normalization(plans, config, n_channels),
        resampling_data=ResamplingSettings.from_plans(config, "resampling_fn_data"),
        resampling_seg=ResamplingSettings.from_plans(config, "resampling_fn_seg"),
        resampling_probabilities=ResamplingSettings.from_plans(config, "resampling_fn_probabilities"),
        network=network,
        labels=labels,
        mirror_axes=tuple(int(a) for a in mirror_axes) if mirror_axes is not None else None,
        folds=tuple(folds),
        channel_names=tuple(channel_names[k] for k in sorted(channel_names, key=int)),
        image_reader_writer=str(plans.get("image_reader_writer", "SimpleITKIO")),
        file_ending=str(dataset.get("file_ending", ".nii.gz")),
        previous_stage=previous_stage,
    )


def parse_fold(text: str) -> int | str:
    """A fold as the command lines take it: ``"all"`` or a number (ValueError otherwise)."""
    return "all" if text == "all" else int(text)


def detect_folds(model_dir: str | Path, checkpoint_name: str = CHECKPOINT_NAME) -> tuple[int | str, ...]:
    """Folds with a checkpoint, like ``nnUNetPredictor.auto_detect_available_folds``.

    ``fold_all`` is excluded, as nnU-Net does.
    """
    model_dir = Path(model_dir)
    folds: list[int] = []
    for sub in model_dir.glob("fold_*"):
        suffix = sub.name[len("fold_"):]
        if suffix.isdigit() and (sub / checkpoint_name).is_file():
            folds.append(int(suffix))
    return tuple(sorted(folds))


def load_checkpoint(path: str | Path, *, allow_pickle: bool = True) -> dict[str, Any]:
    """Load an nnU-Net checkpoint on the CPU.

    Tries ``weights_only=True`` first (no arbitrary code runs). nnU-Net's own checkpoints can hold
    objects that the safe loader refuses; then, only if ``allow_pickle`` is true, the file is loaded
    with full unpickling, which executes code from the file: only do that for files you trust.
    """
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise PlansError(f"checkpoint {str(path)!r} does not exist.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not allow_pickle:
            raise PlansError(
                f"checkpoint {str(path)!r} needs full unpickling (weights_only=True failed: {exc}); "
                "pass allow_pickle=True only if you trust the file."
            ) from None
        LOGGER.warning("checkpoint %s needs full unpickling (weights_only=True failed)", path)
        return torch.load(path, map_location="cpu", weights_only=False)


def read_model_folder(
    model_dir: str | Path,
    *,
    folds: Sequence[int | str] | None = None,
    checkpoint_name: str = CHECKPOINT_NAME,
    allow_pickle: bool = True,
    allow_cascade: bool = False,
) -> InferenceConfig:
    """Read a results folder (``dataset.json``, ``plans.json``, ``fold_k/<checkpoint>``).

    Like nnU-Net, the trainer name, the configuration and the mirroring axes come from the first
    fold's checkpoint; a missing ``inference_allowed_mirroring_axes`` means no mirroring. ``fold_all`` is
    only read when ``folds`` names it (``("all",)``), as ``nnUNetPredictor`` needs ``use_folds``.
    ``allow_cascade``: see :func:`load_inference_config`.
    """
    model_dir = Path(model_dir)
    for name in ("dataset.json", "plans.json"):
        if not (model_dir / name).is_file():
            raise PlansError(f"model folder {str(model_dir)!r} has no {name}.")
    dataset = json.loads((model_dir / "dataset.json").read_text())
    plans = json.loads((model_dir / "plans.json").read_text())
    folds = tuple(folds) if folds is not None else detect_folds(model_dir, checkpoint_name)
    if not folds:
        raise PlansError(f"model folder {str(model_dir)!r} has no fold_*/{checkpoint_name}.")
    first = load_checkpoint(model_dir / f"fold_{folds[0]}" / checkpoint_name, allow_pickle=allow_pickle)
    try:
        trainer_name = first["trainer_name"]
        configuration = first["init_args"]["configuration"]
    except KeyError as exc:
        raise PlansError(
            f"checkpoint fold_{folds[0]}/{checkpoint_name} lacks {exc.args[0]!r}; "
            "not an nnU-Net v2 checkpoint?"
        ) from None
    mirror_axes = first.get("inference_allowed_mirroring_axes")
    return load_inference_config(
        plans, dataset, configuration, trainer_name=trainer_name, mirror_axes=mirror_axes, folds=folds,
        allow_cascade=allow_cascade,
    )
