"""Which nnU-Net release made a model folder's validation predictions (``validate --detect-release``).

nnU-Net records no release in a results folder, but each ``fold_<k>/validation/<case>`` segmentation was
written by the inference code of the release that trained the fold (its trainer's
``perform_actual_validation``: that fold's network, step 0.5, Gaussian, mirroring). :func:`detect_release`
re-predicts those cases with that fold alone under each release's numerics (``numerics.releases``, run by
``validate.local.LocalPredictor``) and counts the voxels that differ: the releases answering every case
exactly are the candidates. What the plans imply narrows it (:func:`plans_constraints`): plans with an
``architecture`` block were written by nnU-Net 2.3 or newer, ResEnc ones by 2.4 or newer (flat plans, from
2.2.x or older, are read by every release and bound nothing). Without validation predictions (or without
the images they were made from) only that range is reported, and that the release cannot be decided.

The re-prediction runs on this machine's CPU; validation predictions made on a GPU (the usual case when
training) carry that GPU's arithmetic, so no release may reproduce them exactly: then the differences are
reported and the closest release is named, with the caveat.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics.model_folder import detect_folds
from nnunet_triton.numerics.releases import RELEASES, numerics_names

__all__ = ["ReleaseDetection", "detect_release", "plans_constraints"]

_OLD_PLANS = ("2.0", "2.1", "2.2", "2.2.1")  # read the flat plans only (no 'architecture' block)
_SITK_ENDINGS = (".nii.gz", ".nii", ".nrrd", ".mha")


def plans_constraints(model_dir: str | Path) -> tuple[tuple[str, ...], list[str]]:
    """The ``--numerics`` names the folder's plans allow, and why (one sentence per rule).

    Plans with an ``architecture`` block were written by nnU-Net 2.3 or newer, which only newer releases
    read; ResEnc plans with one (``nnUNetPlannerResEnc*``) by 2.4 or newer. Flat plans were written by 2.2.x
    or older but every later release reads them too, so they bound nothing: the release that trained and
    validated the folder may be any.
    """
    plans = json.loads((Path(model_dir) / "plans.json").read_text())
    configurations = plans.get("configurations", {})
    names = list(numerics_names())
    if any("architecture" not in c for c in configurations.values() if "inherits_from" not in c):
        return tuple(names), ["the plans have no 'architecture' block: planned by nnU-Net 2.2.x or older, "
                              "and every later release reads such plans, so any release may have trained it"]
    names = [n for n in names if n not in _OLD_PLANS]
    reasons = ["the plans have an 'architecture' block: written by nnU-Net 2.3 or newer"]
    if "resenc" in str(plans.get("plans_name", "")).lower():
        names = [n for n in names if n != "2.3"]
        reasons.append(f"plans {plans.get('plans_name')!r} come from a ResEnc planner: nnU-Net 2.4 or newer")
    return tuple(names), reasons


@dataclass
class ReleaseDetection:
    """What :func:`detect_release` found.

    Attributes:
        possible: the numerics the plans allow (:func:`plans_constraints`), newest first.
        reasons: why.
        differences: numerics -> case (``fold_<k>/<case>``) -> voxels differing from the validation output.
        cases: the validation cases compared.
    """

    possible: tuple[str, ...]
    reasons: list[str]
    differences: dict[str, dict[str, int]] = field(default_factory=dict)
    cases: int = 0

    @property
    def reproducing(self) -> tuple[str, ...]:
        """The numerics (among :attr:`possible`) that reproduce every compared case exactly."""
        if not self.cases:
            return ()
        return tuple(n for n in self.possible if not any(self.differences.get(n, {}).values()))

    def to_dict(self) -> dict[str, Any]:
        return {"possible": list(self.possible), "reasons": self.reasons, "cases": self.cases,
                "reproducing": list(self.reproducing),
                "releases": {n: RELEASES[n].releases for n in self.possible},
                "differences": self.differences}

    def summary(self) -> str:
        """Lines for the terminal: the plans' range, then per numerics the differing voxels."""
        lines = [f"plans: {'; '.join(self.reasons)} -> --numerics {', '.join(self.possible)}"]
        if not self.cases:
            lines.append("no validation predictions to re-predict (fold_<k>/validation/ and the images of "
                         "its cases): the release cannot be decided beyond the plans' range")
            return "\n".join(lines)
        for name in self.possible:
            per_case = self.differences.get(name, {})
            total = sum(per_case.values())
            lines.append(f"--numerics {name:<6} ({RELEASES[name].releases}): "
                         + ("reproduces every case exactly" if not total else
                            f"{total} voxels differ in {sum(1 for v in per_case.values() if v)} of "
                            f"{len(per_case)} cases"))
        found = self.reproducing
        lines.append(f"reproduced exactly by --numerics {', '.join(found)}" if found else
                     "no release's CPU numerics reproduce the validation predictions exactly (made on a GPU, "
                     "or with other settings?)")
        return "\n".join(lines)


def _validation_cases(model_dir: Path, images: Path,
                      ending: str) -> list[tuple[int | str, str, Path, list[Path]]]:
    from nnunet_triton.client.imageio import find_cases

    available = find_cases(images, ending)
    found = []
    for fold in detect_folds(model_dir):
        folder = model_dir / f"fold_{fold}" / "validation"
        if not folder.is_dir():
            continue
        for prediction in sorted(folder.glob(f"*{ending}")):
            case = prediction.name[: -len(ending)]
            if case in available:
                found.append((fold, case, prediction, available[case]))
    return found


def detect_release(model_dir: str | Path, images: str | Path | None, *,
                   load_network: Callable[[Path, int | str], Any],
                   progress: Callable[[str], None] | None = None,
                   numerics: Sequence[str] | None = None) -> ReleaseDetection:
    """Re-predict the folder's validation cases under every release numerics the plans allow.

    Args:
        model_dir: the nnU-Net results folder (``fold_<k>/validation/<case><file ending>`` written by
            nnU-Net's validation).
        images: the folder holding those cases' images in nnU-Net naming (``imagesTr``); None: report the
            plans' range only.
        load_network: a fold's eager network (``validate.local.LocalPredictor``).
        progress: called with one line per re-predicted case.
        numerics: restrict the comparison to these names (default: all the plans allow).
    """
    import SimpleITK as sitk

    from nnunet_triton.client.imageio import read_images
    from nnunet_triton.validate.local import LocalPredictor

    model_dir = Path(model_dir)
    for name in ("plans.json", "dataset.json"):
        if not (model_dir / name).is_file():
            raise InputValidationError(f"--model-dir {model_dir}: no {name} (not an nnU-Net results folder).")
    possible, reasons = plans_constraints(model_dir)
    if numerics is not None:
        possible = tuple(n for n in possible if n in numerics)
    detection = ReleaseDetection(possible=possible, reasons=reasons)
    if images is None:
        return detection
    ending = json.loads((model_dir / "dataset.json").read_text()).get("file_ending", ".nii.gz")
    if ending not in _SITK_ENDINGS:
        raise InputValidationError(f"--detect-release reads validation outputs with SimpleITK "
                                   f"({', '.join(_SITK_ENDINGS)}); dataset.json's file_ending is {ending!r}.")
    cases = _validation_cases(model_dir, Path(images), ending)
    predictors: dict[int | str, Any] = {}
    for fold, case, prediction, files in cases:
        if fold not in predictors:
            predictors[fold] = LocalPredictor(model_dir, load_network, folds=(fold,))
        predictor = predictors[fold]
        expected = sitk.GetArrayFromImage(sitk.ReadImage(str(prediction)))
        image = read_images(files)
        key = f"fold_{fold}/{case}"
        for name in possible:
            labels = predictor.predict(image.data, image.spacing, numerics=name)
            if labels.shape != expected.shape:
                raise InputValidationError(f"{prediction}: shape {expected.shape} but the image {files[0]} "
                                           f"gives {labels.shape}; not the image it was predicted from.")
            detection.differences.setdefault(name, {})[key] = int(np.count_nonzero(labels != expected))
        detection.cases += 1
        if progress is not None:
            progress(f"{key}: " + ", ".join(f"{n}={detection.differences[n][key]}" for n in possible))
    return detection
