"""numerics.ensembling against nnU-Net 2.8.1's nnUNetv2_ensemble (nnunetv2/ensembling/ensemble.py).

``average_probabilities`` is compared with nnU-Net's on .npz files written the way nnUNetv2_predict
writes them; the segmentation with ``LabelManager.convert_probabilities_to_segmentation``. Both are
bit-identical (same float32 additions in the same order).
"""

from __future__ import annotations

import numpy as np
import pytest
from nnunetv2.ensembling.ensemble import average_probabilities as nnunet_average
from nnunetv2.utilities.label_handling.label_handling import LabelManager

from nnunet_triton.errors import InputValidationError, PlansError
from nnunet_triton.numerics.ensembling import (
    average_probabilities,
    check_ensemble_members,
    segmentation_from_probabilities,
)
from nnunet_triton.numerics.plans import LabelSettings

LABELS = {"background": 0, "organ": 1, "lesion": 2}
REGIONS = {"background": 0, "organ": [1, 2], "lesion": 2}


def _probabilities(rng: np.random.Generator, members: int, channels: int, regions: bool) -> list[np.ndarray]:
    out = []
    for _ in range(members):
        x = rng.normal(size=(channels, 9, 11, 7)).astype(np.float32)
        if regions:
            out.append((1 / (1 + np.exp(-x))).astype(np.float32))
        else:
            e = np.exp(x - x.max(0))
            out.append((e / e.sum(0)).astype(np.float32))
    return out


@pytest.mark.parametrize("members", [2, 3, 5])
def test_average_probabilities_equals_nnunet_average_of_npz_files(members, tmp_path):
    probs = _probabilities(np.random.default_rng(members), members, 3, regions=False)
    files = []
    for i, p in enumerate(probs):
        files.append(str(tmp_path / f"m{i}.npz"))
        np.savez_compressed(files[-1], probabilities=p)
    expected = nnunet_average(files)
    result = average_probabilities(probs)
    assert result.dtype == expected.dtype == np.float32
    assert np.array_equal(result, expected)
    assert np.array_equal(probs[0], np.load(files[0])["probabilities"])  # inputs untouched


@pytest.mark.parametrize(("labels", "regions_class_order"), [(LABELS, None), (REGIONS, [1, 2])],
                         ids=["labels", "regions"])
def test_segmentation_from_probabilities_equals_label_manager(labels, regions_class_order):
    manager = LabelManager(labels, regions_class_order)
    settings = LabelSettings.from_dataset({"labels": labels, "regions_class_order": regions_class_order})
    probs = average_probabilities(_probabilities(np.random.default_rng(0), 2, manager.num_segmentation_heads,
                                                 regions=manager.has_regions))
    probs[:, 0, 0, 0] = 0.5  # ties / exactly-threshold values
    expected = manager.convert_probabilities_to_segmentation(probs)
    result = segmentation_from_probabilities(probs, settings)
    assert np.array_equal(result, expected) and result.dtype == expected.dtype


def test_average_probabilities_rejects_members_of_different_shapes():
    a, b = _probabilities(np.random.default_rng(1), 2, 3, regions=False)
    with pytest.raises(InputValidationError, match="member 1"):
        average_probabilities([a, b[:, :-1]])


def test_check_ensemble_members_refuses_different_labels_or_channels():
    from types import SimpleNamespace

    labels = LabelSettings.from_dataset({"labels": LABELS})
    a = SimpleNamespace(labels=labels, channel_names=("CT",))
    check_ensemble_members([a, SimpleNamespace(labels=labels, channel_names=("CT",))], ["a", "b"])
    other = LabelSettings.from_dataset({"labels": {"background": 0, "organ": 1}})
    with pytest.raises(PlansError, match="labels"):
        check_ensemble_members([a, SimpleNamespace(labels=other, channel_names=("CT",))], ["a", "b"])
    with pytest.raises(PlansError, match="channels"):
        check_ensemble_members([a, SimpleNamespace(labels=labels, channel_names=("T1",))], ["a", "b"])
    with pytest.raises(PlansError, match="at least two"):
        check_ensemble_members([a], ["a"])
