"""The GPU check's goals fail when their figure misses the limit, and "not measured" is never a pass."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tools import gpu_goals

METRICS = """# HELP nnunet_host_fallbacks_total Tensors between models that arrived in host memory.
# TYPE nnunet_host_fallbacks_total counter
nnunet_host_fallbacks_total{{model="orchestrator_model",tensor="PREPROCESSED"}} {a}
nnunet_host_fallbacks_total{{model="stitch_model",tensor="LOGITS"}} {b}
nv_inference_count{{model="fold_0",version="1"}} 12
"""


@pytest.mark.parametrize(("name", "value", "met"), [
    ("latency_vs_predictor", 0.5, True), ("latency_vs_predictor", 0.51, False),
    ("latency_vs_batched_floor", 1.2, True), ("latency_vs_batched_floor", 1.25, False),
    ("throughput_c4_vs_predictor", 3.0, True), ("throughput_c4_vs_predictor", 2.9, False),
    ("largest_fold_batch_vs_tile_batch", 1.0, False), ("largest_fold_batch_vs_tile_batch", 2.0, True),
    ("tiles_per_axis", 1, False), ("tiles_per_axis", 2, True),
    ("waves_at_concurrency_4", 2, False), ("waves_at_concurrency_4", 3, True),
    ("host_fallbacks", 0.0, True), ("host_fallbacks", 1.0, False),
])
def test_each_goal_is_met_exactly_up_to_its_limit(name, value, met):
    assert gpu_goals.check(name, value).met is met


@pytest.mark.parametrize("value", [None, math.nan])
def test_a_figure_that_was_not_measured_is_neither_met_nor_missed(value):
    goal = gpu_goals.check("host_fallbacks", value)
    assert goal.met is None and goal.row(applies=True)["verdict"] == "not measured"


def test_a_goal_off_the_gpu_says_it_is_enforced_there_only():
    assert gpu_goals.check("latency_vs_predictor", 2.0).row(applies=False)["verdict"] == \
        "missed (enforced on a GPU only)"


def test_an_absent_counter_family_is_not_measured_and_zero_counts_are_zero():
    without = 'nv_inference_count{model="fold_0",version="1"} 12\n'
    assert gpu_goals.prometheus_samples(without, gpu_goals.HOST_FALLBACKS) is None
    assert gpu_goals.host_fallbacks(without, without) == (None, {})
    zero = METRICS.format(a=0, b=0)
    assert gpu_goals.host_fallbacks(zero, zero) == (0.0, {})


def test_host_fallbacks_count_only_what_grew_between_the_scrapes():
    total, by = gpu_goals.host_fallbacks(METRICS.format(a=2, b=0), METRICS.format(a=5, b=1))
    assert total == 4.0 and by == {"orchestrator_model/PREPROCESSED": 3.0, "stitch_model/LOGITS": 1.0}


def test_a_declared_family_without_samples_yet_is_measured_as_zero():
    declared = "# TYPE nnunet_host_fallbacks_total counter\n"
    assert gpu_goals.host_fallbacks(declared, declared) == (0.0, {})


def _stats(inferences, executions, batches):
    stats = [{"batch_size": size, "compute_infer": {"count": n, "ns": 1}} for size, n in batches.items()]
    return gpu_goals.batch_counts({"inference_count": inferences, "execution_count": executions,
                                   "batch_stats": stats})


def test_batch_delta_sums_the_fold_models_and_keeps_only_the_batches_run_in_between():
    before = {"fold_0": _stats(8, 2, {4: 2}), "fold_1": _stats(8, 2, {4: 2})}
    after = {"fold_0": _stats(24, 4, {4: 2, 8: 2}), "fold_1": _stats(20, 4, {4: 3, 8: 1})}
    delta = gpu_goals.batch_delta(before, after)
    assert (delta.inferences, delta.executions) == (28, 4)
    assert delta.batches == {4: 1, 8: 3} and delta.largest == 8 and delta.mean == 7.0


def test_no_execution_in_between_has_no_mean_and_no_largest_batch():
    same = {"fold_0": _stats(8, 2, {4: 2})}
    delta = gpu_goals.batch_delta(same, same)
    assert delta.largest == 0 and math.isnan(delta.mean)
    assert gpu_goals.check("largest_fold_batch_vs_tile_batch", delta.largest / 4).met is False


def _softmax(logits):
    e = np.exp(logits - logits.max(axis=0))
    return e / e.sum(axis=0)


def test_near_ties_marks_voxels_whose_top_two_logits_are_within_a_few_fp16_steps():
    gap = gpu_goals.NEAR_TIE_LOGIT_GAP
    # three labels, four voxels: exact tie, just inside the gap, just outside, clear winner
    logits = np.array([[5.0, 5.0, 5.0, 9.0], [5.0, 5.0 - gap / 2, 5.0 - 2 * gap, 1.0],
                       [-3.0, -3.0, 5.0 - 3 * gap, 0.0]])
    assert gpu_goals.near_ties(_softmax(logits), regions=False).tolist() == [True, True, False, False]


def test_near_ties_of_a_region_model_are_voxels_whose_region_logit_is_near_its_threshold():
    gap = gpu_goals.NEAR_TIE_LOGIT_GAP
    logits = np.array([[0.0, gap / 2, 2 * gap, -4.0], [3.0, 3.0, 3.0, -3.0]])
    assert gpu_goals.near_ties(1 / (1 + np.exp(-logits)), regions=True).tolist() == [True, True, False, False]


def test_dice_goal_ignores_a_flipped_near_tie_voxel_and_reports_it_apart():
    reference = np.zeros((4, 4, 4), np.uint8)
    reference[1:3, 1:3, 1:3] = 1  # an 8-voxel lesion
    logits = np.where(reference[None] == 1, [[[[0.0]]], [[[6.0]]]], [[[[6.0]]], [[[0.0]]]]).astype(np.float64)
    logits[:, 1, 1, 1] = [3.0, 3.0 + gpu_goals.NEAR_TIE_LOGIT_GAP / 4]  # nnU-Net's label 1 by a hair
    endpoint = reference.copy()
    endpoint[1, 1, 1] = 0  # the endpoint's fp16 sums tip it the other way
    split = gpu_goals.compare_confident("c", reference, endpoint, _softmax(logits), [(1, "lesion")],
                                        (1.0, 1.0, 1.0), regions=False)
    assert (split.confident.min_dice, split.near_tie_voxels, split.differing_near_tie_voxels) == (1.0, 1, 1)
    endpoint[2, 2, 2] = 0  # a confident voxel flipped: a real difference, counted
    split = gpu_goals.compare_confident("c", reference, endpoint, _softmax(logits), [(1, "lesion")],
                                        (1.0, 1.0, 1.0), regions=False)
    assert split.confident.min_dice == pytest.approx(2 * 6 / (7 + 6))
