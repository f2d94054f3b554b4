"""Compare the endpoint's answer with nnU-Net's for one case: per-label Dice, agreement, volumes.

Pure NumPy on label maps of the same shape (``(z, y, x)``, the reader's axis order). A label absent
from both maps counts as Dice 1.0 (both agree there is none; nnU-Net's evaluation reports NaN, which
no threshold could compare). Volumes are in millilitres (voxel count x product of the spacing in mm /
1000).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError

__all__ = ["LabelComparison", "CaseComparison", "segmentation_labels", "compare_case"]


@dataclass(frozen=True)
class LabelComparison:
    """One label (or region) of one case."""

    value: int
    name: str
    dice: float
    reference_voxels: int
    endpoint_voxels: int
    volume_difference_ml: float  # endpoint - reference


@dataclass(frozen=True)
class CaseComparison:
    """One case: every label, the voxel agreement and where they differ most."""

    case: str
    shape: tuple[int, ...]
    agreement: float  # fraction of voxels with the same label
    differing_voxels: int
    labels: tuple[LabelComparison, ...]
    worst_slice: int | None  # index along the first axis with the most differing voxels (None: identical)
    max_probability_difference: float | None = None

    @property
    def min_dice(self) -> float:
        return min((label.dice for label in self.labels), default=1.0)

    @property
    def identical(self) -> bool:
        return self.differing_voxels == 0 and not self.max_probability_difference

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "min_dice": self.min_dice}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CaseComparison:
        labels = tuple(LabelComparison(**label) for label in data["labels"])
        fields = {k: v for k, v in data.items() if k not in ("labels", "min_dice")}
        return cls(**{**fields, "shape": tuple(fields["shape"]), "labels": labels})


def segmentation_labels(label_names: Sequence[tuple[str, Any]],
                        regions_class_order: Sequence[int] | None) -> list[tuple[int, str]]:
    """``(value in the label map, name)`` of every foreground label, or of every region (value from
    ``regions_class_order``, as nnU-Net writes region-based maps), from dataset.json's labels."""
    foreground = [(name, value) for name, value in label_names if name != "background"]
    if regions_class_order:
        return [(int(order), name) for (name, _), order in zip(foreground, regions_class_order, strict=False)]
    return [(int(value), name) for name, value in foreground]


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    total = int(a.sum()) + int(b.sum())
    return 1.0 if total == 0 else 2.0 * int(np.logical_and(a, b).sum()) / total


def compare_case(case: str, reference: np.ndarray, endpoint: np.ndarray, labels: Sequence[tuple[int, str]],
                 spacing: Sequence[float], *, reference_probabilities: np.ndarray | None = None,
                 endpoint_probabilities: np.ndarray | None = None) -> CaseComparison:
    """Compare two label maps (and optionally their probabilities) of ``case``.

    Raises:
        InputValidationError: the maps (or the probabilities) differ in shape.
    """
    reference, endpoint = np.asarray(reference), np.asarray(endpoint)
    if reference.shape != endpoint.shape:
        raise InputValidationError(f"case {case!r}: the endpoint's segmentation has shape {endpoint.shape}, "
                                   f"nnU-Net's {reference.shape}.")
    voxel_ml = math.prod(float(s) for s in spacing) / 1000.0
    found = {int(v) for v in np.unique(reference)} | {int(v) for v in np.unique(endpoint)}
    named = dict(labels)
    values = sorted((set(named) | found) - {0})
    compared = []
    for value in values:
        ref, ep = reference == value, endpoint == value
        n_ref, n_ep = int(ref.sum()), int(ep.sum())
        compared.append(LabelComparison(value=value, name=named.get(value, f"label_{value}"),
                                        dice=_dice(ref, ep), reference_voxels=n_ref, endpoint_voxels=n_ep,
                                        volume_difference_ml=round((n_ep - n_ref) * voxel_ml, 6)))
    differ = reference != endpoint
    n_differ = int(differ.sum())
    worst = None
    if n_differ and differ.ndim >= 2:
        worst = int(np.argmax(differ.reshape(differ.shape[0], -1).sum(axis=1)))
    max_prob = None
    if reference_probabilities is not None and endpoint_probabilities is not None:
        if reference_probabilities.shape != endpoint_probabilities.shape:
            raise InputValidationError(
                f"case {case!r}: the endpoint's probabilities have shape {endpoint_probabilities.shape}, "
                f"nnU-Net's {reference_probabilities.shape}.")
        max_prob = float(np.abs(reference_probabilities.astype(np.float64)
                                - endpoint_probabilities.astype(np.float64)).max())
    return CaseComparison(case=case, shape=tuple(int(s) for s in reference.shape),
                          agreement=1.0 - n_differ / max(1, reference.size), differing_voxels=n_differ,
                          labels=tuple(compared), worst_slice=worst, max_probability_difference=max_prob)
