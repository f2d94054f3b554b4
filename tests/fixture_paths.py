"""Where the nnU-Net-trained fixture models live (made by the one generator, ``python -m tools.fixtures``).

Import as ``from tests.fixture_paths import SYNTH_CT, SYNTH_ANISO, MANY_CLASS`` (needs the repository root on
``sys.path``, which ``python -m pytest`` provides). See ``tests/fixtures/README.md`` for provenance.

The fixtures are committed: a missing one is a broken checkout, so :func:`require_fixture` fails the test
that needs it (naming the file and its generator) instead of skipping it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "ALL_FIXTURE_MODELS",
    "FIXTURES_DIR",
    "MANY_CLASS",
    "MODEL_FOLDER_NAME",
    "SYNTH_ANISO",
    "SYNTH_CT",
    "FixtureModel",
    "HeldOutCase",
    "require_fixture",
]

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
REPO_ROOT = FIXTURES_DIR.parents[1]
MODEL_FOLDER_NAME = "nnUNetTrainer__nnUNetPlans__3d_tiny"
_IMAGE_SUFFIX = "_0000.nii.gz"


@dataclass(frozen=True)
class HeldOutCase:
    """One held-out image (single CT channel) and its reference segmentation."""

    case_id: str
    image: Path
    label: Path


@dataclass(frozen=True)
class FixtureModel:
    """A committed nnU-Net results folder plus its held-out cases."""

    dataset_name: str

    @property
    def dataset_dir(self) -> Path:
        return FIXTURES_DIR / self.dataset_name

    @property
    def model_dir(self) -> Path:
        """The folder to pass to ``nnUNetPredictor.initialize_from_trained_model_folder``."""
        return self.dataset_dir / MODEL_FOLDER_NAME

    def held_out_cases(self) -> tuple[HeldOutCase, ...]:
        """Held-out cases sorted by id; raises if an image has no label."""
        cases = []
        for image in sorted((self.dataset_dir / "imagesTs").glob(f"*{_IMAGE_SUFFIX}")):
            case_id = image.name[: -len(_IMAGE_SUFFIX)]
            label = self.dataset_dir / "labelsTs" / f"{case_id}.nii.gz"
            if not label.is_file():
                raise FileNotFoundError(
                    f"held-out case {case_id!r} of {self.dataset_name}: missing label {label}"
                )
            cases.append(HeldOutCase(case_id, image, label))
        return tuple(cases)

    def held_out_case(self, case_id: str) -> HeldOutCase:
        for case in self.held_out_cases():
            if case.case_id == case_id:
                return case
        raise KeyError(f"{self.dataset_name} has no held-out case {case_id!r}")


SYNTH_CT = FixtureModel("Dataset901_SynthCT")
SYNTH_ANISO = FixtureModel("Dataset902_SynthAniso")
ALL_FIXTURE_MODELS = (SYNTH_CT, SYNTH_ANISO)
# 104 foreground labels at ~1.5 mm, folds 0 and 1 (not in ALL_FIXTURE_MODELS: its own tests)
MANY_CLASS = FixtureModel("Dataset905_SynthManyClass")


def generator_command(path: Path) -> str:
    """The command that regenerates the fixture holding ``path`` (from its dataset folder's name)."""
    dataset = next((part for part in path.parts if part.startswith("Dataset")), None)
    from tools.fixtures.specs import FIXTURES

    which = next((key for key, spec in FIXTURES.items() if spec.dataset_name == dataset), "all")
    return f"python -m tools.fixtures --out tests/fixtures --which {which}"


def require_fixture(path: Path, *, made_by: str | None = None) -> Path:
    """``path`` (a committed fixture file or folder); fails the calling test when it is missing.

    Args:
        path: the fixture file or folder the test reads.
        made_by: how to regenerate it, named in the failure; default: the generator's command for the
            fixture that holds ``path`` (:func:`generator_command`).
    """
    if not path.exists():
        shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
        pytest.fail(f"fixture {shown} is missing: the fixtures are committed (restore it with git, or "
                    f"regenerate it with `{made_by or generator_command(path)}`); a missing fixture fails, "
                    "it is not skipped", pytrace=False)
    return path
