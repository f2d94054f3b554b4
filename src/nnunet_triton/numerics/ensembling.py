"""Ensembles of configurations (``nnUNetv2_ensemble``) on NumPy or CuPy arrays.

Port of ``average_probabilities`` and ``merge_files`` (``nnunetv2/ensembling/ensemble.py``, v2.8.1) and
``LabelManager.convert_probabilities_to_segmentation``: the members' float32 probabilities (each the
output of nnU-Net's export with ``return_probabilities``, in the original geometry) are summed in member
order into a float32 buffer and divided by the member count; the segmentation is the argmax over classes
(first index wins ties) or, for regions, ``p > 0.5`` written in ``regions_class_order``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nnunet_triton.errors import InputValidationError, PlansError
from nnunet_triton.numerics._xp import get_array_module
from nnunet_triton.numerics.plans import InferenceConfig, LabelSettings

__all__ = [
    "average_probabilities",
    "segmentation_from_probabilities",
    "check_ensemble_members",
]


def average_probabilities(members: Sequence[Any]) -> Any:
    """float32 mean of the members' probabilities, accumulated in the given order (as nnU-Net)."""
    if not members:
        raise InputValidationError("an ensemble needs at least one member's probabilities, got none.")
    xp = get_array_module(members[0])
    shape = tuple(members[0].shape)
    for index, member in enumerate(members):
        if tuple(member.shape) != shape:
            raise InputValidationError(
                f"ensemble member {index}: probabilities of shape {tuple(member.shape)} do not match "
                f"member 0's {shape}."
            )
    total = members[0].astype(xp.float32, copy=True)
    for member in members[1:]:
        total += member
    total /= len(members)
    return total


def segmentation_from_probabilities(probabilities: Any, labels: LabelSettings) -> Any:
    """``LabelManager.convert_probabilities_to_segmentation``: argmax, or thresholded regions."""
    xp = get_array_module(probabilities)
    if probabilities.shape[0] != labels.num_segmentation_heads:
        raise InputValidationError(
            f"probabilities must have {labels.num_segmentation_heads} channels, got {probabilities.shape[0]}."
        )
    if not labels.has_regions:
        return xp.argmax(probabilities, axis=0)
    segmentation = xp.zeros(probabilities.shape[1:], dtype=xp.uint16)
    for index, value in enumerate(labels.regions_class_order or ()):
        segmentation[probabilities[index] > 0.5] = value
    return segmentation


def check_ensemble_members(configs: Sequence[InferenceConfig], names: Sequence[str]) -> None:
    """Members must predict the same labels from the same input channels (``nnUNetv2_ensemble`` assumes it).

    Raises:
        PlansError: fewer than two members, or labels / channels that differ from the first member's.
    """
    if len(configs) < 2:
        raise PlansError(
            f"an ensemble of configurations needs at least two model folders, got {list(names)}."
        )
    first = configs[0]
    for config, name in zip(configs[1:], names[1:], strict=True):
        if config.labels != first.labels:
            raise PlansError(
                f"ensemble member {name!r} has labels {config.labels} but {names[0]!r} has {first.labels}; "
                "all members must predict the same labels or regions."
            )
        if config.channel_names != first.channel_names:
            raise PlansError(
                f"ensemble member {name!r} reads channels {list(config.channel_names)} but {names[0]!r} "
                f"reads {list(first.channel_names)}."
            )
