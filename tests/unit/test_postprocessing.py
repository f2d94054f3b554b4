"""numerics.postprocessing against nnU-Net 2.8.1's postprocessing (remove_connected_components.py).

Pickles are written with nnU-Net's own ``save_pickle`` of nnU-Net's own function objects, exactly as
``determine_postprocessing`` writes them; results are compared with ``np.array_equal`` (dtype included).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from acvl_utils.morphology.morphology_helper import remove_all_but_largest_component
from batchgenerators.utilities.file_and_folder_operations import save_pickle
from nnunetv2.postprocessing.remove_connected_components import (
    apply_postprocessing as nnunet_apply_postprocessing,
)
from nnunetv2.postprocessing.remove_connected_components import (
    remove_all_but_largest_component_from_segmentation,
)

from nnunet_triton.errors import PlansError, UnsupportedModelError
from nnunet_triton.numerics.postprocessing import (
    PostprocessingPlan,
    PostprocessingStep,
    apply_postprocessing,
    find_postprocessing_pkl,
    keep_largest_component,
    load_postprocessing_pkl,
)

try:
    from . import parity_support as ps
except ImportError:
    import parity_support as ps

# Every kind of kwargs determine_postprocessing writes: all foreground labels at once, one label, one
# region (tuple), plus the list-of-regions form nnU-Net accepts.
KWARGS_CASES = {
    "all_foreground_labels": [{"labels_or_regions": [1, 2, 3]}],
    "one_label_then_another": [{"labels_or_regions": 2}, {"labels_or_regions": 1}],
    "region_tuple": [{"labels_or_regions": (1, 2)}],
    "list_of_regions": [{"labels_or_regions": [(1, 2), 3]}],
    "all_then_per_label": [{"labels_or_regions": [1, 2, 3]}, {"labels_or_regions": 3},
                           {"labels_or_regions": 1}],
    "numpy_int_labels": [{"labels_or_regions": [np.int64(1), np.int64(3)]}],
    "background_label": [{"labels_or_regions": 2, "background_label": 1}],
}


def _blobby_segmentation(rng: np.random.Generator, shape: tuple[int, ...], labels: int = 3) -> np.ndarray:
    """Several blobs per label (so components must be removed), some touching only diagonally."""
    seg = np.zeros(shape, dtype=np.uint8)
    for label in range(1, labels + 1):
        for _ in range(4):
            center = [rng.integers(0, n) for n in shape]
            radius = [rng.integers(1, max(2, n // 5)) for n in shape]
            slices = tuple(slice(max(0, c - r), c + r) for c, r in zip(center, radius, strict=True))
            seg[slices] = label
    seg[tuple(rng.integers(0, n, 30) for n in shape)] = rng.integers(1, labels + 1, 30)
    return seg


def _write_pkl(path: Path, kwargs: list[dict]) -> Path:
    save_pickle(([remove_all_but_largest_component_from_segmentation] * len(kwargs), kwargs), str(path))
    return path


@pytest.mark.parametrize("name", sorted(KWARGS_CASES))
@pytest.mark.parametrize("shape", [(17, 23, 19), (1, 40, 37)], ids=["3d", "single_slice"])
def test_apply_postprocessing_equals_nnunet_for_every_kwargs_form(name, shape, tmp_path):
    kwargs = KWARGS_CASES[name]
    plan = load_postprocessing_pkl(_write_pkl(tmp_path / "postprocessing.pkl", kwargs))
    for seed in range(5):
        seg = _blobby_segmentation(np.random.default_rng(seed), shape)
        expected = nnunet_apply_postprocessing(
            seg, [remove_all_but_largest_component_from_segmentation] * len(kwargs), kwargs
        )
        result = apply_postprocessing(seg, plan)
        assert result.dtype == expected.dtype
        assert np.array_equal(result, expected), f"{name} seed {seed}"
        assert not np.array_equal(seg, expected) or name == "background_label"


def test_apply_postprocessing_keeps_every_component_of_the_largest_size_when_sizes_tie():
    seg = np.zeros((1, 9, 9), dtype=np.uint8)
    seg[0, 0:2, 0:2] = 1
    seg[0, 6:8, 6:8] = 1
    seg[0, 4, 4] = 1
    step = PostprocessingStep((1,))
    expected = remove_all_but_largest_component_from_segmentation(seg, 1)
    assert np.array_equal(apply_postprocessing(seg, PostprocessingPlan((step,))), expected)
    assert expected.sum() == 8


def test_keep_largest_component_uses_full_connectivity():
    mask = np.zeros((5, 5, 5), dtype=bool)
    mask[0, 0, 0] = mask[1, 1, 1] = mask[2, 2, 2] = True  # corner-to-corner chain: one component
    mask[0, 0, 4] = mask[0, 1, 4] = True  # a face-connected pair, smaller
    kept = keep_largest_component(mask)
    assert kept.sum() == 3 and not kept[0, 0, 4]
    assert np.array_equal(kept, remove_all_but_largest_component(mask))


def test_apply_postprocessing_leaves_the_input_unchanged_and_handles_an_empty_mask():
    seg = np.zeros((4, 5, 6), dtype=np.uint8)
    seg[0, 0, 0] = 2
    before = seg.copy()
    out = apply_postprocessing(seg, PostprocessingPlan((PostprocessingStep((1,)),)))
    assert np.array_equal(seg, before) and np.array_equal(out, before) and out is not seg


def test_postprocessing_plan_round_trips_through_json(tmp_path):
    plan = load_postprocessing_pkl(_write_pkl(tmp_path / "pp.pkl", KWARGS_CASES["all_then_per_label"]
                                              + KWARGS_CASES["list_of_regions"]))
    assert PostprocessingPlan.from_json(plan.to_json()) == plan
    assert plan.steps[0] == PostprocessingStep((1, 2, 3)) and plan.steps[3] == PostprocessingStep(((1, 2), 3))


def test_load_postprocessing_pkl_refuses_other_functions_without_running_them(tmp_path):
    path = tmp_path / "evil.pkl"
    with open(path, "wb") as f:
        pickle.dump(([print], [{"labels_or_regions": 1}]), f)
    with pytest.raises(UnsupportedModelError, match=r"builtins\.print"):
        load_postprocessing_pkl(path)


def test_load_postprocessing_pkl_rejects_a_pickle_that_is_not_functions_and_kwargs(tmp_path):
    path = tmp_path / "pp.pkl"
    with open(path, "wb") as f:
        pickle.dump({"labels_or_regions": 1}, f)
    with pytest.raises(PlansError, match="must hold"):
        load_postprocessing_pkl(path)
    with pytest.raises(PlansError, match="does not exist"):
        load_postprocessing_pkl(tmp_path / "missing.pkl")


def test_load_postprocessing_pkl_reads_an_empty_choice_as_no_steps(tmp_path):
    assert load_postprocessing_pkl(_write_pkl(tmp_path / "pp.pkl", [])).steps == ()


def test_find_postprocessing_pkl_uses_nnunets_crossval_folder_name(tmp_path):
    folder = tmp_path / "crossval_results_folds_0_1"
    folder.mkdir()
    _write_pkl(folder / "postprocessing.pkl", [])
    assert find_postprocessing_pkl(tmp_path, (0, 1)) == folder / "postprocessing.pkl"
    assert find_postprocessing_pkl(tmp_path, (0,)) is None


@pytest.mark.parametrize("xp_name", ["cupy"])
def test_apply_postprocessing_on_cupy_equals_numpy(xp_name, tmp_path):
    xp = ps.xp_from_param(xp_name)
    plan = load_postprocessing_pkl(_write_pkl(tmp_path / "pp.pkl", KWARGS_CASES["all_then_per_label"]))
    seg = _blobby_segmentation(np.random.default_rng(0), (17, 23, 19))
    on_gpu = xp.asnumpy(apply_postprocessing(xp.asarray(seg), plan))
    assert np.array_equal(on_gpu, apply_postprocessing(seg, plan))
