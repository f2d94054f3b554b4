"""Run a validation: every case through the endpoint and through the reference, compared and judged.

The reference is nnU-Net itself (:class:`NnunetReference`: ``nnUNetPredictor`` on this machine's CPU
with the same folds, step size and mirroring) or a recorded reference set
(:class:`~nnunet_triton.validate.references.RecordedReference`). A case that cannot be read or
answered is reported with its error and the others still run; Ctrl-C stops after the current case and
the result says it was interrupted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from nnunet_triton.client.jobs import CASE_ERRORS
from nnunet_triton.errors import ClientError, InputValidationError
from nnunet_triton.options import RequestOptions
from nnunet_triton.validate.compare import CaseComparison, compare_case
from nnunet_triton.validate.oracle import nnunet_predictor

__all__ = ["Thresholds", "CaseResult", "ValidationResult", "NnunetReference",
           "Reference", "run_validation", "deployment_mismatch"]

LOGGER = logging.getLogger(__name__)
DEPLOYMENT_KEYS = ("dataset_name", "plans_name", "configuration", "trainer_name", "patch_size", "spacing")


@dataclass(frozen=True)
class Thresholds:
    """A case passes with every label's Dice >= ``min_dice``; ``exact``: every voxel equal (and, with
    probabilities, ``max_probability_difference`` at most ``probability_tolerance``)."""

    min_dice: float = 0.999
    exact: bool = False
    probability_tolerance: float = 1e-6

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_dice <= 1.0:
            raise InputValidationError(f"--min-dice must be in [0, 1], got {self.min_dice}.")

    def passes(self, comparison: CaseComparison) -> bool:
        if self.exact and comparison.differing_voxels:
            return False
        if self.exact and (comparison.max_probability_difference or 0.0) > self.probability_tolerance:
            return False
        return comparison.min_dice >= self.min_dice


class Reference(Protocol):
    """What the endpoint is compared with."""

    def answer(self, case: str, image: np.ndarray, spacing: Sequence[float]
               ) -> tuple[np.ndarray, np.ndarray | None]: ...


@dataclass
class NnunetReference:
    """nnU-Net's ``nnUNetPredictor.predict_single_npy_array`` on CPU for ``model_folder``, then nnU-Net's own
    ``apply_postprocessing`` with the steps the endpoint publishes as deployed (``postprocessing``: the
    description's list of ``remove_all_but_largest_component_from_segmentation`` calls; none or empty: the
    raw prediction), unless the request options switch postprocessing off."""

    model_folder: Path
    options: RequestOptions
    postprocessing: Sequence[Mapping[str, Any]] | None = None
    _predictor: Any = None

    def answer(self, case: str, image: np.ndarray, spacing: Sequence[float]
               ) -> tuple[np.ndarray, np.ndarray | None]:
        if self._predictor is None:
            self._predictor = nnunet_predictor(self.model_folder, folds=self.options.folds or None,
                                               mirroring=self.options.mirroring,
                                               tile_step_size=self.options.tile_step_size)
        data = np.ascontiguousarray(image, dtype=np.float32)  # nnU-Net's readers give float32
        result = self._predictor.predict_single_npy_array(data, {"spacing": [float(s) for s in spacing]},
                                                          None, None, self.options.probabilities)
        if self.options.probabilities:
            segmentation, probabilities = result
            return self._postprocessed(np.asarray(segmentation)), np.asarray(probabilities, dtype=np.float32)
        return self._postprocessed(np.asarray(result)), None

    def _postprocessed(self, segmentation: np.ndarray) -> np.ndarray:
        """nnU-Net's ``apply_postprocessing`` (``nnUNetv2_apply_postprocessing``) with the deployed steps."""
        if not self.postprocessing or not self.options.postprocessing:
            return segmentation
        from nnunetv2.postprocessing.remove_connected_components import (
            apply_postprocessing,
            remove_all_but_largest_component_from_segmentation,
        )

        kwargs = [{"labels_or_regions": [tuple(m) if isinstance(m, list) else m
                                         for m in step["labels_or_regions"]],
                   "background_label": step.get("background_label", 0)} for step in self.postprocessing]
        functions = [remove_all_but_largest_component_from_segmentation] * len(kwargs)
        return np.asarray(apply_postprocessing(segmentation, functions, kwargs))


@dataclass(frozen=True)
class CaseResult:
    """One case: its comparison, or the error that stopped it; ``picture`` holds the worst slice."""

    case: str
    passed: bool
    comparison: CaseComparison | None = None
    error: str | None = None
    picture: Mapping[str, np.ndarray] | None = None  # image, reference, endpoint 2D slices

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "passed": self.passed, "error": self.error,
                "comparison": self.comparison.to_dict() if self.comparison else None}


@dataclass
class ValidationResult:
    """Everything a report shows."""

    title: str
    options: RequestOptions
    thresholds: Thresholds
    reference_kind: str  # "nnU-Net (nnUNetPredictor, CPU)" or "reference set <folder>"
    deployment: Mapping[str, Any]
    total: int
    cases: list[CaseResult] = field(default_factory=list)
    interrupted: bool = False

    @property
    def passed(self) -> bool:
        return not self.interrupted and len(self.cases) == self.total and all(c.passed for c in self.cases)

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "passed": self.passed, "interrupted": self.interrupted,
                "total": self.total, "options": self.options.to_dict(),
                "thresholds": {"min_dice": self.thresholds.min_dice, "exact": self.thresholds.exact,
                               "probability_tolerance": self.thresholds.probability_tolerance},
                "reference": self.reference_kind, "deployment": dict(self.deployment),
                "cases": [c.to_dict() for c in self.cases]}


def deployment_mismatch(published: Mapping[str, Any], config: Any) -> list[str]:
    """What differs between the endpoint's description and a model folder's ``InferenceConfig``."""
    local = {"dataset_name": config.dataset_name, "plans_name": config.plans_name,
             "configuration": config.configuration, "trainer_name": config.network.trainer_name,
             "patch_size": list(config.patch_size), "spacing": list(config.spacing)}
    return [f"{key}: served {published.get(key)!r}, model folder {local[key]!r}"
            for key in DEPLOYMENT_KEYS if published.get(key) != local[key]]


def _picture(image: np.ndarray, reference: np.ndarray, endpoint: np.ndarray, index: int | None
             ) -> dict[str, np.ndarray] | None:
    if index is None or reference.ndim != 3:
        return None
    return {"image": np.asarray(image[0, index], dtype=np.float32), "reference": reference[index],
            "endpoint": endpoint[index]}


def run_validation(
    jobs: Iterable[Any],
    segment: Callable[[np.ndarray, Sequence[float]], tuple[np.ndarray, np.ndarray | None]],
    reference: Reference,
    labels: Sequence[tuple[int, str]],
    result: ValidationResult,
    *,
    num_channels: int,
    on_case: Callable[[CaseResult], None] | None = None,
    record: Callable[[str, np.ndarray, Sequence[float], np.ndarray, np.ndarray | None], None] | None = None,
) -> ValidationResult:
    """Validate every job (``cli.Job``: ``name``, ``load()``) into ``result``; Ctrl-C marks it interrupted.

    ``segment(image, spacing)`` asks the endpoint; ``record`` (``ReferenceWriter.add``) stores its answer.
    """
    try:
        for job in jobs:
            case_result = _one_case(job, segment, reference, labels, result.thresholds, num_channels, record)
            result.cases.append(case_result)
            if on_case is not None:
                on_case(case_result)
    except KeyboardInterrupt:
        result.interrupted = True
        LOGGER.warning("interrupted after %d of %d cases", len(result.cases), result.total)
    return result


def _one_case(job: Any, segment: Callable[..., Any], reference: Reference, labels: Sequence[tuple[int, str]],
              thresholds: Thresholds, num_channels: int, record: Callable[..., None] | None) -> CaseResult:
    try:
        case, _ = job.load()
        image, spacing = case.data, case.spacing
        if image.shape[0] != num_channels:
            raise InputValidationError(f"case {job.name!r} has {image.shape[0]} channel(s), the model takes "
                                       f"{num_channels}.")
        got, got_probabilities = segment(image, spacing)
        if record is not None:
            record(job.name, image, spacing, got, got_probabilities)
        expected, expected_probabilities = reference.answer(job.name, image, spacing)
        comparison = compare_case(job.name, expected, got, labels, spacing,
                                  reference_probabilities=expected_probabilities,
                                  endpoint_probabilities=got_probabilities)
    except (ClientError, *CASE_ERRORS) as exc:
        LOGGER.error("case %s: %s", job.name, exc)
        return CaseResult(case=job.name, passed=False, error=str(exc))
    return CaseResult(case=job.name, passed=thresholds.passes(comparison), comparison=comparison,
                      picture=_picture(image, expected, got, comparison.worst_slice))
