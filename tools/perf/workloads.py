"""Benchmark workloads: the committed fixture and a realistic model from nnU-Net's default plans.

* ``fixture``: ``tests/fixtures/Dataset901_SynthCT`` (3d_tiny, patch 24x32x32, two trained folds) and
  its first held-out case. Cheap: the quick mode and the test use it.
* ``realistic``: nnU-Net's own fingerprint extractor and default ``ExperimentPlanner`` run on a few
  synthetic CT-like volumes (``tools.fixtures.synthct.synthesize_case``) in a temporary nnUNet_raw;
  the resulting ``3d_fullres`` configuration is untouched (default patch size and PlainConvUNet).
  The network gets randomly initialised weights (nnU-Net's own He init, seeded) saved as an nnU-Net
  ``checkpoint_final.pth``: the outputs are meaningless but the cost is that of a trained model. The
  five folds share that one weight set (``fold_1..4`` are hard links of ``fold_0``'s checkpoint): the
  cost per fold is the same as with five trained folds, and the repository builder exports the
  network once instead of five times (see ``tools/perf/repos.py``).
  Benchmark volumes are sized from the plan's patch so the preprocessed volume holds 1 (small),
  2 (medium: 2x1x1) or 4 (large: 2x2x1) tiles at tile_step_size 0.5; their spacing is coarser than
  the target spacing so preprocessing and export resample, as with real scans. A whole-abdomen CT
  would hold tens of tiles: the cost per tile is what the scaling measurement gives.

Usage (the realistic model needs a fresh process: nnU-Net reads ``nnUNet_raw`` etc. at import)::

    python -m tools.perf.workloads realistic-model --out build/perf/models
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = [
    "Case",
    "RealisticRecipe",
    "RECIPE",
    "VOLUME_SCALES",
    "fixture_model_dir",
    "fixture_case",
    "realistic_model_dir",
    "ensure_realistic_model",
    "realistic_case",
    "main",
]

LOGGER = logging.getLogger(__name__)

PERF_BUILD = REPO_ROOT / "build" / "perf"
FIXTURE_DATASET = "Dataset901_SynthCT"
FIXTURE_MODEL_FOLDER = "nnUNetTrainer__nnUNetPlans__3d_tiny"
REALISTIC_CONFIGURATION = "3d_fullres"
TRAINER_NAME = "nnUNetTrainer"
PLANS_IDENTIFIER = "nnUNetPlans"
RECIPE_FILE = "perf_model_recipe.json"
# preprocessed extent = floor(scale * patch) - 2 voxels per axis: 1 tile per axis at scale 1, 2 at 1.5
# (tile_step_size 0.5)
VOLUME_SCALES = {"small": (1.0, 1.0, 1.0), "medium": (1.5, 1.0, 1.0), "large": (1.5, 1.5, 1.0)}
# benchmark case spacing = target spacing * this (z, y, x): preprocessing upsamples, export downsamples
CASE_SPACING_FACTOR = (1.25, 1.2, 1.2)


@dataclass(frozen=True)
class Case:
    """One benchmark input as the endpoint takes it."""

    name: str
    image: np.ndarray  # float32 (C, z, y, x), SimpleITK axis order
    spacing: tuple[float, ...]  # (z, y, x) mm

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, image=self.image, spacing=np.asarray(self.spacing, dtype=np.float64),
                 name=np.asarray(self.name))
        return path

    @classmethod
    def load(cls, path: Path) -> Case:
        with np.load(path) as data:
            return cls(name=str(data["name"]), image=data["image"],
                       spacing=tuple(float(s) for s in data["spacing"]))


@dataclass(frozen=True)
class RealisticRecipe:
    """Everything the realistic model depends on (its sha256 names the cache)."""

    dataset_id: int = 950
    dataset_name: str = "Dataset950_PerfCT"
    training_shapes: tuple[tuple[int, int, int], ...] = (
        (176, 224, 224), (192, 240, 240), (160, 208, 208), (184, 232, 232))
    training_spacing: tuple[float, float, float] = (1.5, 0.8, 0.8)
    folds: tuple[int, ...] = (0, 1, 2, 3, 4)
    seed: int = 950
    shared_weights: bool = True  # every fold's checkpoint is one hard-linked file

    def digest(self) -> str:
        versions = {"nnunetv2": importlib.metadata.version("nnunetv2")}
        text = json.dumps({**asdict(self), **versions}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


RECIPE = RealisticRecipe()


# --- fixture ----------------------------------------------------------------------------------------


def fixture_model_dir(fixtures_root: Path = REPO_ROOT / "tests" / "fixtures") -> Path:
    """The committed 3d_tiny results folder (raises FileNotFoundError naming the generator if absent)."""
    path = fixtures_root / FIXTURE_DATASET / FIXTURE_MODEL_FOLDER
    if not (path / "plans.json").is_file():
        raise FileNotFoundError(f"fixture model {path} is missing; run: make fixtures")
    return path


def read_image(files: Sequence[Path], name: str) -> Case:
    """Read one case's channel files with SimpleITK (nnU-Net's SimpleITKIO axis order z, y, x)."""
    import SimpleITK as sitk

    images = [sitk.ReadImage(str(f)) for f in files]
    image = np.stack([sitk.GetArrayFromImage(i) for i in images]).astype(np.float32)
    spacing = tuple(float(s) for s in reversed(images[0].GetSpacing()))
    return Case(name=name, image=image, spacing=spacing)


def fixture_case(model_dir: Path) -> Case:
    """The first held-out case (the "typical case") of the fixture whose results folder is ``model_dir``."""
    images_ts = model_dir.parent / "imagesTs"
    first = sorted(images_ts.glob("*_0000.nii.gz"))
    if not first:
        raise FileNotFoundError(f"no held-out case in {images_ts}")
    case_id = first[0].name[: -len("_0000.nii.gz")]
    return read_image(sorted(images_ts.glob(f"{case_id}_[0-9][0-9][0-9][0-9].nii.gz")), f"fixture-{case_id}")


# --- realistic model ---------------------------------------------------------------------------------


def realistic_model_dir(root: Path = PERF_BUILD / "models", recipe: RealisticRecipe = RECIPE) -> Path:
    return root / recipe.dataset_name / f"{TRAINER_NAME}__{PLANS_IDENTIFIER}__{REALISTIC_CONFIGURATION}"


def _recipe_matches(model_dir: Path, recipe: RealisticRecipe) -> bool:
    try:
        return json.loads((model_dir / RECIPE_FILE).read_text())["digest"] == recipe.digest()
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return False


def ensure_realistic_model(root: Path = PERF_BUILD / "models", recipe: RealisticRecipe = RECIPE,
                           *, timeout_s: float = 1800.0) -> Path:
    """Make (or reuse) the realistic results folder; planning runs in a subprocess (nnU-Net env vars)."""
    model_dir = realistic_model_dir(root, recipe)
    if _recipe_matches(model_dir, recipe):
        return model_dir
    if recipe != RECIPE:
        raise ValueError("only the default RECIPE can be built through the CLI subprocess.")
    subprocess.run([sys.executable, "-m", "tools.perf.workloads", "realistic-model", "--out", str(root)],
                   cwd=REPO_ROOT, check=True, timeout=timeout_s)
    return model_dir


def _write_nifti(array: np.ndarray, spacing_zyx: Sequence[float], path: Path) -> None:
    import SimpleITK as sitk

    image = sitk.GetImageFromArray(array)
    image.SetSpacing(tuple(float(s) for s in reversed(spacing_zyx)))
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(image, str(path), useCompression=True)


def _write_training_data(raw: Path, recipe: RealisticRecipe) -> None:
    from tools.fixtures.synthct import LABELS, CaseGeometry, synthesize_case

    rng = np.random.default_rng(recipe.seed)
    for index, shape in enumerate(recipe.training_shapes):
        geometry = CaseGeometry(shape=shape, spacing=recipe.training_spacing, slice_axis=0)
        image, label = synthesize_case(rng, geometry)
        _write_nifti(image, geometry.spacing, raw / "imagesTr" / f"perfct_{index:03d}_0000.nii.gz")
        _write_nifti(label, geometry.spacing, raw / "labelsTr" / f"perfct_{index:03d}.nii.gz")
    dataset_json = {
        "name": recipe.dataset_name,
        "description": "Synthetic CT-like volumes for benchmarking (tools/perf/workloads.py); random weights",
        "channel_names": {"0": "CT"},
        "labels": LABELS,
        "numTraining": len(recipe.training_shapes),
        "file_ending": ".nii.gz",
    }
    (raw / "dataset.json").write_text(json.dumps(dataset_json, indent=4))


def _random_checkpoint(plans: dict[str, Any], dataset_json: dict[str, Any], fold: int, seed: int) -> dict:
    """An nnU-Net checkpoint with He-initialised weights, as ``nnUNetTrainer`` would save at epoch 0."""
    import torch
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    plans_manager = PlansManager(plans)
    configuration = plans_manager.get_configuration(REALISTIC_CONFIGURATION)
    torch.manual_seed(seed)
    network = nnUNetTrainer.build_network_architecture(
        plans_manager, configuration,
        determine_num_input_channels(plans_manager, configuration, dataset_json),
        plans_manager.get_label_manager(dataset_json).num_segmentation_heads,
        enable_deep_supervision=False,
    )
    n_spatial = len(configuration.patch_size)
    return {
        "network_weights": network.state_dict(),
        "init_args": {"plans": plans, "configuration": REALISTIC_CONFIGURATION, "fold": fold,
                      "dataset_json": dataset_json, "device": "cpu"},
        "trainer_name": TRAINER_NAME,
        "inference_allowed_mirroring_axes": tuple(range(n_spatial)),
        "current_epoch": 0,
    }


def build_realistic_model(root: Path, recipe: RealisticRecipe = RECIPE) -> Path:
    """Plan with nnU-Net's defaults in a temporary nnUNet_raw and write the results folder."""
    import torch

    model_dir = realistic_model_dir(root, recipe)
    with tempfile.TemporaryDirectory(prefix="nnunet-perf-") as tmp:
        work = Path(tmp)
        for var in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
            (work / var).mkdir()
            os.environ[var] = str(work / var)
        _write_training_data(work / "nnUNet_raw" / recipe.dataset_name, recipe)
        from nnunetv2.experiment_planning.plan_and_preprocess_api import (
            extract_fingerprint_dataset,
            plan_experiment_dataset,
        )

        extract_fingerprint_dataset(recipe.dataset_id, num_processes=1, check_dataset_integrity=True,
                                    clean=True, verbose=False)
        plan_experiment_dataset(recipe.dataset_id)
        preprocessed = work / "nnUNet_preprocessed" / recipe.dataset_name
        if model_dir.exists():
            shutil.rmtree(model_dir)
        model_dir.mkdir(parents=True)
        shutil.copyfile(preprocessed / f"{PLANS_IDENTIFIER}.json", model_dir / "plans.json")
        for name in ("dataset.json", "dataset_fingerprint.json"):
            shutil.copyfile(preprocessed / name, model_dir / name)
    plans = json.loads((model_dir / "plans.json").read_text())
    dataset_json = json.loads((model_dir / "dataset.json").read_text())
    first = model_dir / f"fold_{recipe.folds[0]}" / "checkpoint_final.pth"
    first.parent.mkdir()
    torch.save(_random_checkpoint(plans, dataset_json, recipe.folds[0], recipe.seed), first)
    for fold in recipe.folds[1:]:  # one weight set for every fold: same cost, one export
        (model_dir / f"fold_{fold}").mkdir()
        os.link(first, model_dir / f"fold_{fold}" / "checkpoint_final.pth")
    fullres = plans["configurations"][REALISTIC_CONFIGURATION]
    record = {"digest": recipe.digest(), "recipe": asdict(recipe), "patch_size": fullres["patch_size"],
              "spacing": fullres["spacing"], "network": fullres["architecture"]["network_class_name"]}
    (model_dir / RECIPE_FILE).write_text(json.dumps(record, indent=2))
    LOGGER.info("realistic model in %s: patch %s, spacing %s", model_dir, fullres["patch_size"],
                fullres["spacing"])
    return model_dir


def realistic_case(model_dir: Path, volume: str, *, seed: int = 0) -> Case:
    """A synthetic CT-like case whose preprocessed extent is ``VOLUME_SCALES[volume]`` x patch - 2 voxels."""
    from tools.fixtures.synthct import CaseGeometry, synthesize_case

    if volume not in VOLUME_SCALES:
        raise ValueError(f"volume must be one of {sorted(VOLUME_SCALES)}, got {volume!r}.")
    plans = json.loads((model_dir / "plans.json").read_text())
    fullres = plans["configurations"][REALISTIC_CONFIGURATION]
    patch, target = fullres["patch_size"], fullres["spacing"]
    spacing = tuple(round(t * f, 4) for t, f in zip(target, CASE_SPACING_FACTOR, strict=True))
    extent = [int(scale * p) - 2 for scale, p in zip(VOLUME_SCALES[volume], patch, strict=True)]
    shape = tuple(round(e / f) for e, f in zip(extent, CASE_SPACING_FACTOR, strict=True))
    rng = np.random.default_rng(seed + 7 * list(VOLUME_SCALES).index(volume))
    image, _ = synthesize_case(rng, CaseGeometry(shape=shape, spacing=spacing, slice_axis=0))
    return Case(name=f"realistic-{volume}", image=image[None].astype(np.float32), spacing=spacing)


# --- command line -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``realistic-model --out DIR``: plan and write the realistic results folder (random weights)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("realistic-model", help="plan + random-weight checkpoints (fresh process)")
    make.add_argument("--out", type=Path, default=PERF_BUILD / "models")
    make.add_argument("--force", action="store_true", help="rebuild even if the recipe matches")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.force and _recipe_matches(realistic_model_dir(args.out), RECIPE):
        print(f"up to date: {realistic_model_dir(args.out)}")
        return 0
    print(f"built: {build_realistic_model(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
