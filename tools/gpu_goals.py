"""The GPU check's goals as pure functions: each figure is compared with its limit and a missed goal fails
the stage on a GPU; nothing here starts a server.

Goals (``GOALS``): per-label Dice >= 0.999 against nnUNetPredictor on cuda (mirroring on and off; stage b),
counted over the voxels that are not near-ties (:func:`near_ties`: the reference's top two logits within
``NEAR_TIE_FP16_STEPS`` fp16 steps; nnU-Net's own fp16 sums leave exact ties and near-ties in every case,
where either label is right, and one flipped voxel of a 382-voxel lesion is already Dice 0.9987); the
near-tie voxels and how many of them differ are reported apart;
on the realistic volume of at least 2x2x2 tiles: endpoint latency <= 0.5x nnUNetPredictor, <= 1.2x the
batched network floor, throughput at concurrency 4 >= 3x nnUNetPredictor back to back over at least 3
waves; the fold models executed batches larger than one orchestrator call's tile batch during the
concurrent phase (Triton's statistics API: ``batch_stats``, ``inference_count``/``execution_count``); zero
``nnunet_host_fallbacks_total`` (a counter family that is absent is "not measured", never zero).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GOALS", "DICE_GOAL", "HOST_FALLBACKS", "NEAR_TIE_FP16_STEPS", "NEAR_TIE_LOGIT_GAP", "Goal",
           "check", "batch_counts", "BatchDelta", "batch_delta", "prometheus_samples", "host_fallbacks",
           "near_ties", "ConfidentComparison", "compare_confident"]

DICE_GOAL = 0.999
# a near-tie: the reference's top two logits closer than this many fp16 steps. The step is taken at logits
# of magnitude 8..16 (2**-7; nnU-Net's competing logits at a boundary are smaller): 4 steps = 0.03125
NEAR_TIE_FP16_STEPS = 4
NEAR_TIE_LOGIT_GAP = NEAR_TIE_FP16_STEPS * 2.0**-7
HOST_FALLBACKS = "nnunet_host_fallbacks_total"
# name: (operator, limit)
GOALS: Mapping[str, tuple[str, float]] = {
    "tiles_per_axis": (">=", 2),
    "waves_at_concurrency_4": (">=", 3),
    "latency_vs_predictor": ("<=", 0.5),
    "latency_vs_batched_floor": ("<=", 1.2),
    "throughput_c4_vs_predictor": (">=", 3.0),
    "largest_fold_batch_vs_tile_batch": (">", 1.0),
    "host_fallbacks": ("==", 0),
}


@dataclass(frozen=True)
class Goal:
    """One goal's verdict: ``met`` None when the figure was not measured."""

    name: str
    value: float | None
    op: str
    limit: float
    met: bool | None
    note: str = ""

    def row(self, applies: bool) -> dict[str, Any]:
        verdict = "not measured" if self.met is None else ("met" if self.met else "missed")
        return {"goal": self.name, "value": "not measured" if self.value is None else self.value,
                "limit": f"{self.op} {self.limit:g}", "verdict": verdict if applies else
                f"{verdict} (enforced on a GPU only)", "note": self.note}


def check(name: str, value: float | None, note: str = "") -> Goal:
    """Compare ``value`` with ``GOALS[name]``; ``None`` or NaN is not measured."""
    op, limit = GOALS[name]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return Goal(name, None, op, limit, None, note)
    met = {">=": value >= limit, "<=": value <= limit, ">": value > limit, "==": value == limit}[op]
    return Goal(name, value, op, limit, bool(met), note)


def batch_counts(model_stats: Mapping[str, Any]) -> dict[str, Any]:
    """One model's ``/v2/models/<m>/stats`` entry -> inference/execution counts, ``{batch size: count}``."""
    batches = {int(b["batch_size"]): int(b.get("compute_infer", {}).get("count", 0))
               for b in model_stats.get("batch_stats", [])}
    return {"inference_count": int(model_stats.get("inference_count", 0)),
            "execution_count": int(model_stats.get("execution_count", 0)), "batches": batches}


@dataclass(frozen=True)
class BatchDelta:
    """What the fold models executed between two statistics snapshots (all fold models together)."""

    inferences: int
    executions: int
    batches: dict[int, int]

    @property
    def largest(self) -> int:
        return max((size for size, count in self.batches.items() if count > 0), default=0)

    @property
    def mean(self) -> float:
        return self.inferences / self.executions if self.executions else float("nan")


def batch_delta(before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]]
                ) -> BatchDelta:
    """Differences of :func:`batch_counts` snapshots ``{model: counts}`` summed over the models."""
    inferences = executions = 0
    batches: dict[int, int] = {}
    for model, now in after.items():
        then = before.get(model, {"inference_count": 0, "execution_count": 0, "batches": {}})
        inferences += now["inference_count"] - then["inference_count"]
        executions += now["execution_count"] - then["execution_count"]
        for size, count in now["batches"].items():
            grown = count - then["batches"].get(size, 0)
            if grown:
                batches[size] = batches.get(size, 0) + grown
    return BatchDelta(inferences, executions, dict(sorted(batches.items())))


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def prometheus_samples(text: str, family: str) -> list[tuple[dict[str, str], float]] | None:
    """Samples of ``family`` in Prometheus text format, or None when the family does not appear."""
    samples: list[tuple[dict[str, str], float]] = []
    declared = False
    for line in text.splitlines():
        if line.startswith("#"):
            declared |= line.split()[2:3] == [family] and line.split()[1:2] in (["TYPE"], ["HELP"])
            continue
        match = _SAMPLE.match(line)
        if match and match.group(1) == family:
            samples.append((dict(_LABEL.findall(match.group(2) or "")), float(match.group(3))))
    return samples if samples or declared else None


def host_fallbacks(before: str, after: str) -> tuple[float | None, dict[str, float]]:
    """Host fallbacks counted between two scrapes: (total, None if not measured; by model/tensor)."""
    then, now = prometheus_samples(before, HOST_FALLBACKS), prometheus_samples(after, HOST_FALLBACKS)
    if now is None:
        return None, {}
    base = {_key(labels): value for labels, value in (then or [])}
    by = {_key(labels): value - base.get(_key(labels), 0.0) for labels, value in now}
    return float(sum(by.values())), {k: v for k, v in by.items() if v}


def _key(labels: Mapping[str, str]) -> str:
    return f"{labels.get('model', '?')}/{labels.get('tensor', '?')}"



def near_ties(probabilities: np.ndarray, *, regions: bool, gap: float = NEAR_TIE_LOGIT_GAP) -> np.ndarray:
    """Voxels where the reference could as well have given another label: a boolean map of the spatial shape.

    Args:
        probabilities: nnU-Net's probabilities, shape (C, *spatial): softmax over labels, or one sigmoid per
            region when ``regions``.
        regions: region-based model (a voxel is a near-tie when any region's logit is within ``gap`` of 0,
            its threshold) rather than softmax (the top two logits within ``gap``: for a softmax,
            ``log p1 - log p2`` is exactly ``l1 - l2``).
        gap: the logit distance below which a voxel is a near-tie.
    """
    p = np.asarray(probabilities, np.float64)
    if p.ndim < 2:
        raise ValueError(f"probabilities: expected shape (C, *spatial), got {p.shape}.")
    with np.errstate(divide="ignore"):
        if regions:
            logits = np.log(p) - np.log1p(-p)
            return np.any(np.abs(logits) < gap, axis=0)
        if p.shape[0] < 2:
            return np.zeros(p.shape[1:], bool)
        top_two = np.partition(p, p.shape[0] - 2, axis=0)[-2:]
        return (np.log(top_two[1]) - np.log(top_two[0])) < gap


@dataclass(frozen=True)
class ConfidentComparison:
    """Dice over the voxels that are not near-ties (``confident``), and the near-ties apart."""

    confident: Any  # nnunet_triton.validate.compare.CaseComparison over the confident voxels
    near_tie_voxels: int
    differing_near_tie_voxels: int


def compare_confident(case: str, reference: np.ndarray, endpoint: np.ndarray, probabilities: np.ndarray,
                      labels: Sequence[tuple[int, str]], spacing: Sequence[float], *,
                      regions: bool) -> ConfidentComparison:
    """``validate.compare.compare_case`` over the voxels where :func:`near_ties` of the reference's
    ``probabilities`` is False.

    Raises:
        ValueError: the probabilities' spatial shape is not the label maps'.
    """
    from nnunet_triton.validate.compare import compare_case

    reference, endpoint = np.asarray(reference), np.asarray(endpoint)
    ties = near_ties(probabilities, regions=regions)
    if ties.shape != reference.shape:
        raise ValueError(f"case {case!r}: probabilities of spatial shape {ties.shape}, label map "
                         f"{reference.shape}.")
    confident = compare_case(case, reference[~ties], endpoint[~ties], labels, spacing)
    return ConfidentComparison(confident, int(ties.sum()), int((reference[ties] != endpoint[ties]).sum()))
