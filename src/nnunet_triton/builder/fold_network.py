"""One fold's eager network, rebuilt exactly as ``nnUNetPredictor.initialize_from_trained_model_folder`` does.

``PlansManager(plans)``, the configuration and trainer named in the fold's checkpoint,
``recursive_find_trainer_class_by_name(trainer_name)``, ``build_network_architecture(...,
enable_deep_supervision=False)``, ``load_state_dict(checkpoint["network_weights"])``, ``eval()``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.errors import PlansError, UnsupportedModelError
from nnunet_triton.numerics.model_folder import (
    CHECKPOINT_NAME,
    architecture_of_flat_plans,
    load_checkpoint,
    resolve_configuration,
)

__all__ = [
    "FoldNetwork",
    "load_fold_network",
    "smallest_input",
]


@dataclass(frozen=True)
class FoldNetwork:
    """The eager network of one fold plus the nnU-Net facts the exporter needs."""

    network: Any  # torch.nn.Module, eval mode, on CPU
    trainer_name: str
    configuration: str
    num_input_channels: int
    num_output_channels: int
    patch_size: tuple[int, ...]
    smallest_input: tuple[int, ...] = ()  # spatial: 2x the total downsampling per axis, <= patch

    @property
    def check_spatial(self) -> tuple[int, ...]:
        return self.smallest_input or self.patch_size


def smallest_input(patch_size: Sequence[int], strides: Sequence[Sequence[int]] | None) -> tuple[int, ...]:
    """The smallest spatial input every stage of an nnU-Net encoder accepts with a 2-voxel bottleneck.

    ``strides`` are the per-stage strides (plans ``network_arch_init_kwargs.strides`` or
    ``pool_op_kernel_sizes``); the total downsampling of an axis is their product.
    """
    if not strides:
        return tuple(int(p) for p in patch_size)
    factors = [1] * len(patch_size)
    for stage in strides:
        for axis, stride in enumerate(stage if isinstance(stage, (list, tuple)) else [stage] * len(factors)):
            factors[axis] *= int(stride)
    return tuple(min(int(p), 2 * f) for p, f in zip(patch_size, factors, strict=True))


def _find_trainer_class(trainer_name: str) -> Any:
    from nnunetv2.utilities.find_objects import recursive_find_trainer_class_by_name

    try:
        return recursive_find_trainer_class_by_name(trainer_name)
    except (RuntimeError, AssertionError) as exc:
        raise UnsupportedModelError(
            f"trainer {trainer_name!r} (named in the checkpoint) cannot be used: {exc} -- install the "
            "package that defines it or set nnUNet_extTrainer to its folder."
        ) from None


def _build_network(trainer_class: Any, plans_manager: Any, configuration_manager: Any, n_in: int,
                   n_out: int) -> Any:
    """``build_network_architecture`` with both signatures, as ``initialize_from_trained_model_folder``."""
    sig = inspect.signature(trainer_class.build_network_architecture)
    if "plans_manager" in sig.parameters:
        return trainer_class.build_network_architecture(
            plans_manager, configuration_manager, n_in, n_out, enable_deep_supervision=False
        )
    return trainer_class.build_network_architecture(
        configuration_manager.network_arch_class_name,
        configuration_manager.network_arch_init_kwargs,
        configuration_manager.network_arch_init_kwargs_req_import,
        n_in, n_out, enable_deep_supervision=False,
    )


def load_fold_network(
    model_dir: str | Path,
    fold: int | str,
    *,
    checkpoint_name: str = CHECKPOINT_NAME,
    allow_pickle: bool = True,
) -> FoldNetwork:
    """Rebuild fold ``fold``'s network exactly as nnU-Net's predictor does and load its weights.

    Raises:
        PlansError: missing files or a checkpoint without nnU-Net's keys.
        UnsupportedModelError: the checkpoint's trainer class cannot be found.
    """
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    model_dir = Path(model_dir)
    for name in ("dataset.json", "plans.json"):
        if not (model_dir / name).is_file():
            raise PlansError(f"model folder {str(model_dir)!r} has no {name}.")
    dataset_json = json.loads((model_dir / "dataset.json").read_text())
    plans = json.loads((model_dir / "plans.json").read_text())
    checkpoint = load_checkpoint(model_dir / f"fold_{fold}" / checkpoint_name, allow_pickle=allow_pickle)
    try:
        trainer_name = checkpoint["trainer_name"]
        configuration = checkpoint["init_args"]["configuration"]
        weights = checkpoint["network_weights"]
    except KeyError as exc:
        raise PlansError(
            f"checkpoint fold_{fold}/{checkpoint_name} lacks {exc.args[0]!r}; not an nnU-Net v2 checkpoint?"
        ) from None
    plans_manager = PlansManager(_with_architecture(plans, configuration))
    configuration_manager = plans_manager.get_configuration(configuration)
    n_in = determine_num_input_channels(plans_manager, configuration_manager, dataset_json)
    n_out = plans_manager.get_label_manager(dataset_json).num_segmentation_heads
    trainer_class = _find_trainer_class(trainer_name)
    network = _build_network(trainer_class, plans_manager, configuration_manager, n_in, n_out)
    network.load_state_dict(weights)
    network.eval()
    return FoldNetwork(
        network=network,
        trainer_name=trainer_name,
        configuration=configuration,
        num_input_channels=n_in,
        num_output_channels=n_out,
        patch_size=tuple(int(p) for p in configuration_manager.patch_size),
        smallest_input=smallest_input(configuration_manager.patch_size, _strides(configuration_manager)),
    )


def _with_architecture(plans: dict[str, Any], configuration: str) -> dict[str, Any]:
    """``plans`` whose ``configuration`` is resolved and, in the flat pre-2.3 format, given the architecture
    block those releases built (``numerics.model_folder.architecture_of_flat_plans``): nnU-Net 2.8.1's own
    reconstruction names ``architectures.residual_unet.ResidualEncoderUNet``, a module the installed
    dynamic_network_architectures does not have, where the old releases built ``architectures.unet``'s."""
    if configuration not in plans.get("configurations", {}):
        return plans
    resolved = architecture_of_flat_plans(resolve_configuration(plans, configuration), configuration)
    resolved.pop("inherits_from", None)
    return {**plans, "configurations": {**plans["configurations"], configuration: resolved}}


def _strides(configuration_manager: Any) -> Any:
    try:
        return configuration_manager.pool_op_kernel_sizes
    except (AttributeError, KeyError, TypeError):
        return None
