"""Generate ``tests/fixtures/Dataset904_SynthCascade``: an nnU-Net cascade (low-res stage -> full-res stage).

One synthetic single-channel CT-like dataset (``make_fixture_model.synthesize_case``: background / organ /
lesion, plain labels), planned by nnU-Net's ``ExperimentPlanner`` and trained by nnU-Net's
``nnUNetTrainer`` on CPU, with two configurations added to ``nnUNetPlans.json`` the way nnU-Net's planner
writes ``3d_lowres`` / ``3d_cascade_fullres`` (``ExperimentPlanner.plan_experiment``):

    * ``3d_lowres_tiny``: inherits from ``3d_fullres``, spacing 2x the 3d_fullres spacing (coarser, so both
      stages resample), its own ``data_identifier``, ``"next_stage": "3d_cascade_tiny"``.
    * ``3d_cascade_tiny``: inherits from ``3d_fullres`` (and its ``data_identifier``, as nnU-Net's
      ``3d_cascade_fullres`` does), ``"previous_stage": "3d_lowres_tiny"``; its network takes the image plus
      one one-hot channel per foreground label of the previous stage's segmentation.

Both stages are trained on fold ``all`` (all cases for training and validation). The low-res trainer's
``perform_actual_validation`` writes ``predicted_next_stage/3d_cascade_tiny`` (the low-res logits resampled
to the cascade's preprocessed shape) for every case, which the cascade trainer reads as its extra input.
Held-out Dice is measured the way ``nnUNetv2_predict`` runs a cascade: ``nnUNetPredictor.predict_from_files``
for the low-res stage writes segmentations, then ``predict_from_files`` of the cascade stage with
``folder_with_segs_from_prev_stage`` pointing at them (``-prev_stage_predictions``). Both predictions are
kept under ``predictions/`` (step 0.5, Gaussian, mirroring, fold ``all``).

Usage (from the repository root)::

    python -m tools.make_cascade_fixture --out tests/fixtures
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.make_fixture_model import (
    CHECKPOINT_KEYS_KEPT,
    LABELS,
    GeometryRanges,
    HeldOutCase,
    _write_nifti,
    dice_per_label,
    export_slim_model_folder,
    run_generator,
    sample_geometry,
    synthesize_case,
    tiny_topology,
    train_nnunet,
)

LOG = logging.getLogger("make_cascade_fixture")

DATASET_ID = 904
DATASET_NAME = "Dataset904_SynthCascade"
SEED = 904
NUM_TRAINING = 10
FOLD = "all"
PLANS_IDENTIFIER = "nnUNetPlans"
TRAINER = "nnUNetTrainer"
LOWRES = "3d_lowres_tiny"
CASCADE = "3d_cascade_tiny"
LOWRES_SPACING_FACTOR = 2.0

GEOMETRY = GeometryRanges(
    slice_axis=0,
    slice_count=(32, 40),
    slice_spacing=(1.7, 2.3),
    inplane_count=(48, 60),
    inplane_spacing=(0.95, 1.25),
    margin_probability=0.5,
)
HELD_OUT = (
    HeldOutCase(margins=((3, 2), (4, 0), (0, 5)),
                purpose="typical case with zero margins: crop_to_nonzero crops"),
    HeldOutCase(slice_count=22, slice_spacing=3.6, inplane_spacing=1.0,
                purpose="spacing ratio 3.6 > 3: separate-z resampling of image and previous-stage "
                        "segmentation"),
)


@dataclass(frozen=True)
class StageSpec:
    """One stage of the cascade: its configuration and training budget."""

    configuration: str
    patch_size: tuple[int, int, int]
    batch_size: int
    features: tuple[int, ...]
    max_numpool: int
    num_epochs: int
    num_iterations_per_epoch: int

    @property
    def folder_name(self) -> str:
        return f"{TRAINER}__{PLANS_IDENTIFIER}__{self.configuration}"


STAGES = (
    StageSpec(LOWRES, (16, 24, 24), 2, (8, 16, 32, 32), 3, 25, 25),
    StageSpec(CASCADE, (24, 32, 32), 2, (8, 16, 32, 32), 3, 25, 25),
)


# --------------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------------


def case_id(index: int) -> str:
    return f"synthcascade_{index:03d}"


def write_raw_dataset(raw_root: Path, out_dataset_dir: Path) -> list[dict[str, Any]]:
    rng = np.random.default_rng(SEED)
    raw = raw_root / DATASET_NAME
    for index in range(NUM_TRAINING):
        geometry = sample_geometry(rng, GEOMETRY)
        image, label = synthesize_case(rng, geometry)
        _write_nifti(image, geometry.spacing, raw / "imagesTr" / f"{case_id(index)}_0000.nii.gz")
        _write_nifti(label, geometry.spacing, raw / "labelsTr" / f"{case_id(index)}.nii.gz")
    held_out = []
    for offset, case in enumerate(HELD_OUT):
        geometry = sample_geometry(rng, GEOMETRY, case)
        image, label = synthesize_case(rng, geometry)
        name = case_id(100 + offset)
        _write_nifti(image, geometry.spacing, out_dataset_dir / "imagesTs" / f"{name}_0000.nii.gz")
        _write_nifti(label, geometry.spacing, out_dataset_dir / "labelsTs" / f"{name}.nii.gz")
        held_out.append({"case": name, "purpose": case.purpose, **asdict(geometry)})
    dataset_json = {
        "name": DATASET_NAME,
        "description": "Synthetic CT-like volumes (air, body, organ, lesion) for a two-stage cascade, "
                       "tools/make_cascade_fixture.py",
        "reference": f"synthetic, seed {SEED}",
        "licence": "CC0-1.0",
        "channel_names": {"0": "CT"},
        "labels": LABELS,
        "numTraining": NUM_TRAINING,
        "file_ending": ".nii.gz",
    }
    (raw / "dataset.json").write_text(json.dumps(dataset_json, indent=4))
    return held_out


# --------------------------------------------------------------------------------------------------
# nnU-Net steps
# --------------------------------------------------------------------------------------------------


def plans_file() -> Path:
    from nnunetv2.paths import nnUNet_preprocessed

    return Path(str(nnUNet_preprocessed)) / DATASET_NAME / f"{PLANS_IDENTIFIER}.json"


def plan() -> None:
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (
        extract_fingerprint_dataset,
        plan_experiment_dataset,
    )

    extract_fingerprint_dataset(DATASET_ID, num_processes=1, check_dataset_integrity=True, clean=True,
                                verbose=False, show_progress_bar=False)
    _, identifier = plan_experiment_dataset(DATASET_ID)
    if identifier != PLANS_IDENTIFIER:
        raise RuntimeError(f"ExperimentPlanner wrote {identifier!r}, expected {PLANS_IDENTIFIER!r}")


def tiny_architecture(stage: StageSpec, spacing: list[float], base: dict[str, Any]) -> dict[str, Any]:
    """PlainConvUNet topology from nnU-Net's ``get_pool_and_conv_props`` for ``spacing`` and the patch."""
    strides, kernel_sizes = tiny_topology(spacing, stage.patch_size, stage.max_numpool)
    n_stages = len(strides)
    architecture = json.loads(json.dumps(base["architecture"]))
    architecture["arch_kwargs"].update(
        n_stages=n_stages,
        features_per_stage=list(stage.features[:n_stages]),
        kernel_sizes=kernel_sizes,
        strides=strides,
        n_conv_per_stage=[2] * n_stages,
        n_conv_per_stage_decoder=[1] * (n_stages - 1),
    )
    return architecture


def cascade_configurations(fullres: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``3d_lowres_tiny`` and ``3d_cascade_tiny``, keyed and linked like the planner's lowres/cascade pair."""
    lowres, cascade = STAGES
    lowres_spacing = [float(s) * LOWRES_SPACING_FACTOR for s in fullres["spacing"]]
    median_shape = [float(n) / LOWRES_SPACING_FACTOR for n in fullres["median_image_size_in_voxels"]]
    return {
        LOWRES: {
            "inherits_from": "3d_fullres",
            "data_identifier": f"{PLANS_IDENTIFIER}_{LOWRES}",
            "batch_size": lowres.batch_size,
            "patch_size": list(lowres.patch_size),
            "median_image_size_in_voxels": median_shape,
            "spacing": lowres_spacing,
            "architecture": tiny_architecture(lowres, lowres_spacing, fullres),
            "next_stage": CASCADE,
        },
        CASCADE: {
            "inherits_from": "3d_fullres",
            "previous_stage": LOWRES,
            "batch_size": cascade.batch_size,
            "patch_size": list(cascade.patch_size),
            "architecture": tiny_architecture(cascade, fullres["spacing"], fullres),
        },
    }


def add_configurations_and_preprocess() -> dict[str, Any]:
    from nnunetv2.experiment_planning.plan_and_preprocess_api import preprocess_dataset

    plans = json.loads(plans_file().read_text())
    plans["configurations"].update(cascade_configurations(plans["configurations"]["3d_fullres"]))
    plans_file().write_text(json.dumps(plans, indent=4))
    preprocess_dataset(DATASET_ID, PLANS_IDENTIFIER, configurations=(LOWRES, CASCADE), num_processes=(1, 1),
                       verbose=False, show_progress_bar=False)
    return plans


def train(stage: StageSpec, index: int, *, validate: bool) -> float:
    """nnU-Net's trainer on fold ``all``; ``validate``: ``perform_actual_validation`` (next-stage export)."""
    return train_nnunet(plans_file(), stage.configuration, FOLD, trainer_name=TRAINER,
                        seed=SEED * 100 + index, num_epochs=stage.num_epochs,
                        num_iterations_per_epoch=stage.num_iterations_per_epoch, validate=validate)


def check_next_stage_predictions() -> list[str]:
    """The low-res stage must have exported ``predicted_next_stage`` for every training case."""
    from nnunetv2.paths import nnUNet_results

    folder = (Path(str(nnUNet_results)) / DATASET_NAME / STAGES[0].folder_name / "predicted_next_stage"
              / CASCADE)
    found = sorted(p.name.split(".")[0] for p in folder.glob("*.b2nd"))
    expected = [case_id(i) for i in range(NUM_TRAINING)]
    if found != expected:
        raise RuntimeError(f"{folder}: predicted_next_stage has {found}, expected {expected}")
    return found


def export_model_folder(stage: StageSpec, out_model_dir: Path) -> None:
    from nnunetv2.paths import nnUNet_results

    src = Path(str(nnUNet_results)) / DATASET_NAME / stage.folder_name
    export_slim_model_folder(src, out_model_dir, (FOLD,), trainer_name=TRAINER,
                             configuration=stage.configuration)


def predict_cascade(dataset_dir: Path) -> dict[str, dict[str, dict[str, float]]]:
    """``nnUNetv2_predict`` for both stages: low-res, then the cascade with ``-prev_stage_predictions``."""
    import torch
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE  # nnU-Net's default, the endpoint's

    out = dataset_dir / "predictions"
    dice: dict[str, dict[str, dict[str, float]]] = {}
    previous: str | None = None
    for stage in STAGES:
        predictor = nnUNetPredictor(tile_step_size=DEFAULT_TILE_STEP_SIZE, use_gaussian=True,
                                    use_mirroring=True,
                                    perform_everything_on_device=False, device=torch.device("cpu"),
                                    verbose=False, verbose_preprocessing=False, allow_tqdm=False)
        predictor.initialize_from_trained_model_folder(str(dataset_dir / stage.folder_name),
                                                       use_folds=(FOLD,))
        target = out / stage.configuration
        predictor.predict_from_files(str(dataset_dir / "imagesTs"), str(target), save_probabilities=False,
                                     overwrite=True, num_processes_preprocessing=1,
                                     num_processes_segmentation_export=1,
                                     folder_with_segs_from_prev_stage=previous)
        for name in ("dataset.json", "plans.json", "predict_from_raw_data_args.json"):
            (target / name).unlink(missing_ok=True)
        previous = str(target)
        io = SimpleITKIO()
        dice[stage.configuration] = {}
        for reference_file in sorted((dataset_dir / "labelsTs").glob("*.nii.gz")):
            reference, _ = io.read_seg(str(reference_file))
            prediction, _ = io.read_seg(str(target / reference_file.name))
            scores = dice_per_label(prediction[0], reference[0])
            dice[stage.configuration][reference_file.name[: -len(".nii.gz")]] = {
                k: round(v, 4) for k, v in scores.items()
            }
    return dice


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------


def build(out_root: Path, work_dir: Path) -> dict[str, Any]:
    import nnunetv2  # noqa: F401
    import torch

    start = time.perf_counter()
    dataset_dir = out_root / DATASET_NAME
    if dataset_dir.exists():
        shutil.rmtree(dataset_dir)
    held_out = write_raw_dataset(work_dir / "nnUNet_raw", dataset_dir)
    plan()
    plans = add_configurations_and_preprocess()
    prepared_s = time.perf_counter() - start
    seconds = {"data_planning_preprocessing": round(prepared_s, 1)}
    seconds[f"train_{LOWRES}_and_validation"] = round(train(STAGES[0], 0, validate=True), 1)
    next_stage_cases = check_next_stage_predictions()
    seconds[f"train_{CASCADE}"] = round(train(STAGES[1], 1, validate=False), 1)
    for stage in STAGES:
        export_model_folder(stage, dataset_dir / stage.folder_name)
    eval_start = time.perf_counter()
    dice = predict_cascade(dataset_dir)
    seconds["evaluation"] = round(time.perf_counter() - eval_start, 1)
    seconds["total"] = round(time.perf_counter() - start, 1)
    configurations = plans["configurations"]
    record: dict[str, Any] = {
        "dataset": DATASET_NAME,
        "command": "python -m tools.make_cascade_fixture --out tests/fixtures",
        "seed": SEED,
        "training_seeds": {stage.configuration: SEED * 100 + i for i, stage in enumerate(STAGES)},
        "fold": FOLD,
        "torch_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "stages": {stage.folder_name: asdict(stage) for stage in STAGES},
        "plans": {
            "transpose_forward": plans["transpose_forward"],
            "3d_fullres_spacing": configurations["3d_fullres"]["spacing"],
            "normalization_schemes": configurations["3d_fullres"]["normalization_schemes"],
            LOWRES: {k: v for k, v in configurations[LOWRES].items() if k != "architecture"},
            CASCADE: {k: v for k, v in configurations[CASCADE].items() if k != "architecture"},
            "strides": {name: configurations[name]["architecture"]["arch_kwargs"]["strides"]
                        for name in (LOWRES, CASCADE)},
        },
        "predicted_next_stage_cases": next_stage_cases,
        "held_out_cases": held_out,
        "dice_nnunetv2_predict": dice,
        "seconds": seconds,
    }
    record["size_bytes"] = sum(p.stat().st_size for p in dataset_dir.rglob("*") if p.is_file())
    (dataset_dir / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    write_readme(dataset_dir, record)
    return record


def write_readme(dataset_dir: Path, record: dict[str, Any]) -> None:
    seconds = record["seconds"]
    lines = [
        f"# {DATASET_NAME}", "", (__doc__ or "").split("Usage")[0].strip(), "",
        f"Command: `{record['command']}` (seed {SEED}, torch {record['versions']['torch']}, "
        f"{record['torch_threads']} torch thread, {seconds['total']} s on 2 shared CPU cores, "
        f"{record['size_bytes'] / 1e6:.2f} MB). Checkpoints keep only {', '.join(CHECKPOINT_KEYS_KEPT)}.",
        "",
        f"Plans: 3d_fullres spacing {[round(s, 4) for s in record['plans']['3d_fullres_spacing']]}, "
        f"`{LOWRES}` spacing {[round(s, 4) for s in record['plans'][LOWRES]['spacing']]}; strides "
        f"{record['plans']['strides']}.",
        "",
        "| model folder | patch | epochs x iterations | seconds |",
        "|---|---|---|---|",
    ]
    for name, stage in record["stages"].items():
        key = next(k for k in seconds if k.startswith(f"train_{stage['configuration']}"))
        lines.append(f"| `{name}/fold_{FOLD}` | {stage['patch_size']} | {stage['num_epochs']} x "
                     f"{stage['num_iterations_per_epoch']} | {seconds[key]} |")
    lines += ["", "Dice on the held-out cases (`nnUNetPredictor.predict_from_files`, fold all, step 0.5, "
              "Gaussian, mirroring; the cascade row used the low-res row's segmentations as "
              "`folder_with_segs_from_prev_stage`):",
              "", "| stage | case | organ | lesion |", "|---|---|---|---|"]
    for configuration, per_case in record["dice_nnunetv2_predict"].items():
        for case, scores in per_case.items():
            lines.append(f"| `{configuration}` | {case} | {scores['organ']:.4f} | {scores['lesion']:.4f} |")
    lines += ["", "Held-out cases: " + "; ".join(
        f"`{c['case']}` {c['shape']} at {[round(s, 3) for s in c['spacing']]} mm, margins {c['margins']} "
        f"({c['purpose']})" for c in record["held_out_cases"]), ""]
    (dataset_dir / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    record = run_generator(DATASET_NAME, build, argv, (__doc__ or "").split("\n\n")[0])
    LOG.info("done in %s s: %s", record["seconds"]["total"], record["dice_nnunetv2_predict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
