"""nnunet_triton.validate without a server: comparisons, reference sets, the run loop and the report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from nnunet_triton.errors import InputValidationError
from nnunet_triton.options import RequestOptions
from nnunet_triton.validate.compare import compare_case, segmentation_labels
from nnunet_triton.validate.references import RecordedReference, ReferenceError, ReferenceWriter
from nnunet_triton.validate.report import html_page, markdown, write_report
from nnunet_triton.validate.run import Thresholds, ValidationResult, run_validation

LABELS = [(1, "organ"), (2, "lesion")]


def _maps() -> tuple[np.ndarray, np.ndarray]:
    reference = np.zeros((4, 6, 6), np.uint8)
    reference[1:3, 1:5, 1:5] = 1  # 32 voxels of organ
    endpoint = reference.copy()
    endpoint[2, 1:5, 1] = 2  # 4 voxels turn lesion, all in slice 2
    return reference, endpoint


def test_compare_case_gives_dice_agreement_volumes_and_the_worst_slice():
    reference, endpoint = _maps()
    c = compare_case("a", reference, endpoint, LABELS, spacing=(2.0, 1.0, 0.5))
    organ, lesion = c.labels
    assert (organ.name, organ.reference_voxels, organ.endpoint_voxels) == ("organ", 32, 28)
    assert organ.dice == pytest.approx(2 * 28 / 60)
    assert organ.volume_difference_ml == pytest.approx(-4 * 1.0 / 1000)  # 1 mm^3 voxels
    assert (lesion.dice, lesion.reference_voxels, lesion.endpoint_voxels) == (0.0, 0, 4)
    assert (c.differing_voxels, c.worst_slice) == (4, 2)
    assert c.agreement == pytest.approx(1 - 4 / reference.size)
    assert c.min_dice == 0.0 and not c.identical


def test_a_label_absent_from_both_maps_agrees_with_dice_one():
    reference, _ = _maps()
    c = compare_case("a", reference, reference.copy(), LABELS, spacing=(1, 1, 1))
    assert [(label.name, label.dice) for label in c.labels] == [("organ", 1.0), ("lesion", 1.0)]
    assert c.identical and c.worst_slice is None


def test_compare_case_reports_the_largest_probability_difference():
    reference, _ = _maps()
    p = np.zeros((3, *reference.shape), np.float32)
    q = p.copy()
    q[1, 0, 0, 0] = 0.25
    c = compare_case("a", reference, reference, LABELS, (1, 1, 1), reference_probabilities=p,
                     endpoint_probabilities=q)
    assert c.max_probability_difference == 0.25 and not c.identical


def test_compare_case_refuses_maps_of_different_shape_naming_the_case():
    expected = r"case 'a': the endpoint's segmentation has shape \(2, 2\)"
    with pytest.raises(InputValidationError, match=expected):
        compare_case("a", np.zeros((2, 3)), np.zeros((2, 2)), LABELS, (1, 1))


def test_region_labels_take_their_values_from_regions_class_order():
    names = [("background", 0), ("whole", (1, 2)), ("core", 2)]
    assert segmentation_labels(names, [1, 2]) == [(1, "whole"), (2, "core")]
    assert segmentation_labels([("background", 0), ("organ", 1)], None) == [(1, "organ")]


def test_thresholds_pass_on_dice_or_on_exact_identity():
    reference, endpoint = _maps()
    close = compare_case("a", reference, endpoint, [(1, "organ")], (1, 1, 1))
    assert not Thresholds(min_dice=0.999).passes(close)
    same = compare_case("a", reference, reference, LABELS, (1, 1, 1))
    assert Thresholds(exact=True).passes(same) and Thresholds(min_dice=1.0).passes(same)
    with pytest.raises(InputValidationError, match=r"--min-dice must be in \[0, 1\], got 1.5"):
        Thresholds(min_dice=1.5)


def _recorded(tmp_path: Path, image: np.ndarray) -> Path:
    reference, _ = _maps()
    writer = ReferenceWriter(tmp_path / "set", {"dataset_name": "D"}, {"mirroring": True}, {"numpy": "1"})
    writer.add("a", image, (1.0, 1.0, 1.0), reference)
    assert not (tmp_path / "set").exists()  # nothing under its name until complete
    return writer.close()


def test_recorded_reference_round_trips_and_refuses_changed_input_tampering_and_other_options(tmp_path):
    image = np.arange(24, dtype=np.int16).reshape(1, 2, 3, 4)
    folder = _recorded(tmp_path, image)
    recorded = RecordedReference.open(folder)
    segmentation, probabilities = recorded.answer("a", image, (1.0, 1.0, 1.0))
    np.testing.assert_array_equal(segmentation, _maps()[0])
    assert probabilities is None
    with pytest.raises(ReferenceError, match=r"case 'a': the input differs from the recorded one"):
        recorded.answer("a", image + 1, (1.0, 1.0, 1.0))
    with pytest.raises(ReferenceError, match=r"case 'b' is not in the reference set"):
        recorded.answer("b", image, (1.0, 1.0, 1.0))
    with pytest.raises(ReferenceError, match=r"options differ from the recording \(mirroring: recorded True, "
                                             r"now False\)"):
        recorded.check_compatible({"dataset_name": "D"}, {"mirroring": False})
    with pytest.raises(ReferenceError, match=r"of another model \(dataset_name: recorded 'D', served 'E'"):
        recorded.check_compatible({"dataset_name": "E"}, {"mirroring": True})
    np.savez_compressed(folder / "a.npz", segmentation=_maps()[1])  # tampered after recording
    with pytest.raises(ReferenceError, match=r"a.npz was changed or removed after recording"):
        recorded.answer("a", image, (1.0, 1.0, 1.0))


def test_a_new_version_of_the_same_labels_is_compared_only_when_allowed_and_other_labels_never(tmp_path):
    image = np.arange(24, dtype=np.int16).reshape(1, 2, 3, 4)
    recorded = RecordedReference.open(_recorded(tmp_path, image))
    retrained = {"dataset_name": "D", "configuration": "3d_lowres"}
    with pytest.raises(ReferenceError, match=r"configuration: recorded None, served '3d_lowres'\) \(a new "
                                             r"version of the same labels: --allow-model-change\)"):
        recorded.check_compatible(retrained, {"mirroring": True})
    assert recorded.check_compatible(retrained, {"mirroring": True}, allow_model_change=True) == [
        "configuration: recorded None, served '3d_lowres'"]
    with pytest.raises(ReferenceError,
                       match=r"another model \(labels: recorded None, served \{'a': 1\}\)\.$"):
        recorded.check_compatible({**retrained, "labels": {"a": 1}}, {"mirroring": True},
                                  allow_model_change=True)


def test_reference_sets_are_never_overwritten_and_an_incomplete_one_is_refused(tmp_path):
    image = np.zeros((1, 2, 2, 2), np.float32)
    folder = _recorded(tmp_path, image)
    with pytest.raises(ReferenceError, match="the folder exists"):
        ReferenceWriter(folder, {}, {}, {})
    writer = ReferenceWriter(tmp_path / "other", {}, {}, {})
    writer.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]
    (folder / "reference.json").unlink()
    with pytest.raises(ReferenceError, match="no reference.json"):
        RecordedReference.open(folder)


@dataclass
class _Case:
    data: np.ndarray
    spacing: tuple[float, ...]


@dataclass
class _Job:
    name: str
    image: np.ndarray | None
    interrupt: bool = False

    def load(self):
        if self.interrupt:
            raise KeyboardInterrupt
        if self.image is None:
            raise OSError(f"{self.name}: unreadable file")
        return _Case(self.image, (1.0, 1.0, 1.0)), None


class _Fixed:
    def __init__(self, answer):
        self.answer_map = answer

    def answer(self, case, image, spacing):
        return self.answer_map, None


def _result(total: int) -> ValidationResult:
    return ValidationResult(title="t", options=RequestOptions(), thresholds=Thresholds(),
                            reference_kind="test", deployment={}, total=total)


def test_run_reports_a_failing_case_keeps_going_and_stops_cleanly_on_ctrl_c(tmp_path):
    reference, endpoint = _maps()
    image = np.ones((1, *reference.shape), np.float32)
    jobs = [_Job("same", image), _Job("broken", None), _Job("differs", image * 2), _Job("late", image, True),
            _Job("never", image)]

    def segment(img, spacing):
        return (endpoint if img.max() > 1 else reference), None

    result = run_validation(jobs, segment, _Fixed(reference), LABELS, _result(len(jobs)), num_channels=1)
    assert [(c.case, c.passed) for c in result.cases] == [("same", True), ("broken", False),
                                                          ("differs", False)]
    assert result.cases[1].error == "broken: unreadable file" and result.interrupted and not result.passed
    written = write_report(result, tmp_path / "report")
    assert sorted(written) == ["validation.html", "validation.json", "validation.md"]
    assert "INTERRUPTED after 3 of 5 cases (partial report)" in markdown(result)
    assert json.loads(written["validation.json"].read_text())["interrupted"] is True
    page = html_page(result)
    assert page.count("class='case-picture'") == 1 and page.count("class='dice-plot'") == 1  # 'differs' only
    assert "data:image/png;base64," in page


def test_run_refuses_a_case_whose_channels_do_not_match_the_model():
    reference, _ = _maps()
    jobs = [_Job("two", np.ones((2, *reference.shape), np.float32))]
    result = run_validation(jobs, lambda i, s: (reference, None), _Fixed(reference), LABELS, _result(1),
                            num_channels=1)
    assert result.cases[0].error == "case 'two' has 2 channel(s), the model takes 1."
