"""Generate ``tests/fixtures/Dataset903_SynthMulti``: the model kinds beyond a plain 3D CT network.

One synthetic two-channel dataset (channel 0 CT-like -> ``CTNormalization``, channel 1 MR-like ->
``ZScoreNormalization`` with ``use_mask_for_norm`` chosen by nnU-Net's planner because zero margins take
most of each volume), region-based labels (``organ`` = {1, 2}, ``lesion`` = {2}, ``regions_class_order``
[1, 2]) and an ignore label (3: unannotated slabs in some training cases), planned by nnU-Net's own
planners and trained by nnU-Net's own trainers on CPU, in these model folders:

    * ``nnUNetTrainer__nnUNetPlans__3d_tiny``: PlainConvUNet (``ExperimentPlanner``), with the
      ``postprocessing.pkl`` that nnU-Net's ``determine_postprocessing`` chose on the fold's validation
      predictions (``crossval_results_folds_0/``, where ``nnUNetv2_find_best_configuration`` puts it).
    * ``nnUNetTrainer__nnUNetPlans__2d_tiny``: a 2D PlainConvUNet run slice by slice on 3D volumes.
    * ``nnUNetTrainer__nnUNetResEncUNetMPlans__3d_tiny``: ResidualEncoderUNet planned by
      ``nnUNetPlannerResEncM`` (the ResEnc M preset).
    * ``nnUNetTrainerBN__nnUNetPlans__3d_tiny``: a trainer that overrides ``build_network_architecture``
      (BatchNorm instead of InstanceNorm), so the network only builds through that trainer.

Every ``*_tiny`` configuration inherits from nnU-Net's planned configuration (``3d_fullres`` or ``2d``) and
only shrinks patch, batch and features (topology from ``get_pool_and_conv_props``). Training is short:
the fixtures exist for parity of serving with ``nnUNetPredictor``, not for accuracy (Dice is recorded).

Usage (from the repository root)::

    python -m tools.make_variety_fixtures --out tests/fixtures
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.make_fixture_model import (
    CaseGeometry,
    GeometryRanges,
    HeldOutCase,
    _write_nifti,
    export_slim_model_folder,
    run_generator,
    sample_geometry,
    synthesize_case,
    tiny_topology,
    train_nnunet,
)

LOG = logging.getLogger("make_variety_fixtures")

DATASET_ID = 903
DATASET_NAME = "Dataset903_SynthMulti"
SEED = 903
NUM_TRAINING = 10
FOLD = 0
IGNORE_LABEL = 3
LABELS: dict[str, Any] = {"background": 0, "organ": [1, 2], "lesion": 2, "ignore": IGNORE_LABEL}
REGIONS_CLASS_ORDER = [1, 2]
# MR-like intensities of the second channel (air, body, organ, lesion, noise std); margins stay 0.
MR_AIR, MR_BODY, MR_ORGAN, MR_LESION, MR_NOISE_STD = 20.0, 300.0, 520.0, 160.0, 25.0

GEOMETRY = GeometryRanges(
    slice_axis=0,
    slice_count=(30, 38),
    slice_spacing=(1.8, 2.2),
    inplane_count=(52, 60),
    inplane_spacing=(0.9, 1.1),
    margin_probability=1.0,
)
HELD_OUT = (
    HeldOutCase(purpose="typical case (zero margins: crop_to_nonzero and the ZScore mask matter)"),
    HeldOutCase(slice_count=24, slice_spacing=2.6, purpose="coarser slices: both networks resample"),
)


@dataclass(frozen=True)
class ModelSpec:
    """One model folder of the fixture: which planner, configuration and trainer made it."""

    plans_identifier: str
    planner: str  # class name in nnunetv2.experiment_planning
    base_configuration: str  # the planned configuration the tiny one inherits from
    configuration: str
    trainer: str
    patch_size: tuple[int, ...]
    batch_size: int
    features: tuple[int, ...]
    max_numpool: int
    num_epochs: int
    num_iterations_per_epoch: int
    postprocessing: bool = False

    @property
    def folder_name(self) -> str:
        return f"{self.trainer}__{self.plans_identifier}__{self.configuration}"


MODELS = (
    ModelSpec("nnUNetPlans", "ExperimentPlanner", "3d_fullres", "3d_tiny", "nnUNetTrainer",
              (24, 32, 32), 2, (8, 16, 32, 32), 3, 30, 25, postprocessing=True),
    ModelSpec("nnUNetPlans", "ExperimentPlanner", "2d", "2d_tiny", "nnUNetTrainer",
              (48, 48), 8, (8, 16, 32, 32), 3, 30, 25),
    ModelSpec("nnUNetResEncUNetMPlans", "nnUNetPlannerResEncM", "3d_fullres", "3d_tiny", "nnUNetTrainer",
              (24, 32, 32), 2, (8, 16, 32, 32), 3, 12, 20),
    ModelSpec("nnUNetPlans", "ExperimentPlanner", "3d_fullres", "3d_tiny", "nnUNetTrainerBN",
              (24, 32, 32), 2, (8, 16, 32, 32), 3, 12, 20),
)


# --------------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------------


def large_margins(rng: np.random.Generator, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Zero margins of 13-18 % of every axis on both sides: the cropped volume is ~1/3 of the image."""
    return tuple((round(n * rng.uniform(0.13, 0.18)), round(n * rng.uniform(0.13, 0.18))) for n in shape)


def mr_channel(rng: np.random.Generator, ct: np.ndarray, label: np.ndarray) -> np.ndarray:
    """An MR-like second channel over the same anatomy: zero exactly where the CT is zero (margins)."""
    body = ct > -500
    image = np.full(ct.shape, MR_AIR)
    image[body] = MR_BODY
    image[label == 1] = MR_ORGAN
    image[label == 2] = MR_LESION
    image = np.abs(image + rng.normal(0.0, MR_NOISE_STD, size=ct.shape)).astype(np.float32)
    image[ct == 0] = 0.0
    return image


def ignore_slab(rng: np.random.Generator, label: np.ndarray) -> np.ndarray:
    """Mark a slab of slices as unannotated (ignore label), as sparse annotations would."""
    out = label.copy()
    n = label.shape[0]
    start = int(rng.integers(0, n // 2))
    out[start:start + max(2, n // 5)] = IGNORE_LABEL
    return out


def write_case(rng: np.random.Generator, geometry: CaseGeometry, images_dir: Path, labels_dir: Path,
               case_id: str, *, with_ignore: bool) -> None:
    ct, label = synthesize_case(rng, geometry)
    mr = mr_channel(rng, ct, label)
    if with_ignore:
        label = ignore_slab(rng, label)
    _write_nifti(ct, geometry.spacing, images_dir / f"{case_id}_0000.nii.gz")
    _write_nifti(mr, geometry.spacing, images_dir / f"{case_id}_0001.nii.gz")
    _write_nifti(label, geometry.spacing, labels_dir / f"{case_id}.nii.gz")


def write_raw_dataset(raw_root: Path, out_dataset_dir: Path) -> list[dict[str, Any]]:
    rng = np.random.default_rng(SEED)
    raw = raw_root / DATASET_NAME
    for index in range(NUM_TRAINING):
        drawn = sample_geometry(rng, GEOMETRY)
        geometry = CaseGeometry(drawn.shape, drawn.spacing, drawn.slice_axis, large_margins(rng, drawn.shape))
        write_case(rng, geometry, raw / "imagesTr", raw / "labelsTr", f"synthmulti_{index:03d}",
                   with_ignore=index % 2 == 1)
    held_out = []
    for offset, case in enumerate(HELD_OUT):
        drawn = sample_geometry(rng, GEOMETRY, case)
        geometry = CaseGeometry(drawn.shape, drawn.spacing, drawn.slice_axis, large_margins(rng, drawn.shape))
        case_id = f"synthmulti_{100 + offset:03d}"
        write_case(rng, geometry, out_dataset_dir / "imagesTs", out_dataset_dir / "labelsTs", case_id,
                   with_ignore=False)
        held_out.append({"case": case_id, "purpose": case.purpose, **asdict(geometry)})
    dataset_json = {
        "name": DATASET_NAME,
        "description": "Synthetic two-channel CT+MR-like volumes with region labels and an ignore label, "
                       "tools/make_variety_fixtures.py",
        "reference": f"synthetic, seed {SEED}",
        "licence": "CC0-1.0",
        "channel_names": {"0": "CT", "1": "T2"},
        "labels": LABELS,
        "regions_class_order": REGIONS_CLASS_ORDER,
        "numTraining": NUM_TRAINING,
        "file_ending": ".nii.gz",
    }
    (raw / "dataset.json").write_text(json.dumps(dataset_json, indent=4))
    return held_out


# --------------------------------------------------------------------------------------------------
# nnU-Net steps
# --------------------------------------------------------------------------------------------------


def _planner_class(name: str) -> Any:
    from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import ExperimentPlanner
    from nnunetv2.experiment_planning.experiment_planners.residual_unets import (
        residual_encoder_unet_planners as resenc,
    )

    return ExperimentPlanner if name == "ExperimentPlanner" else getattr(resenc, name)


def plan(planner: str) -> str:
    from nnunetv2.experiment_planning.plan_and_preprocess_api import plan_experiment_dataset

    _, plans_identifier = plan_experiment_dataset(DATASET_ID, _planner_class(planner))
    return plans_identifier


def tiny_configuration(model: ModelSpec, base: dict[str, Any]) -> dict[str, Any]:
    """A small configuration inheriting from ``model.base_configuration``; nnU-Net's topology rules."""
    strides, kernel_sizes = tiny_topology(base["spacing"], model.patch_size, model.max_numpool)
    n_stages = len(strides)
    architecture = json.loads(json.dumps(base["architecture"]))
    kwargs = architecture["arch_kwargs"]
    kwargs.update(
        n_stages=n_stages,
        features_per_stage=list(model.features[:n_stages]),
        kernel_sizes=kernel_sizes,
        strides=strides,
        n_conv_per_stage_decoder=[1] * (n_stages - 1),
    )
    if "n_blocks_per_stage" in kwargs:  # ResidualEncoderUNet
        kwargs["n_blocks_per_stage"] = [1] + [2] * (n_stages - 1)
    else:
        kwargs["n_conv_per_stage"] = [2] * n_stages
    return {
        "inherits_from": model.base_configuration,
        "data_identifier": f"{model.plans_identifier}_{model.configuration}",
        "patch_size": list(model.patch_size),
        "batch_size": model.batch_size,
        "architecture": architecture,
    }


def add_configuration_and_preprocess(model: ModelSpec) -> None:
    from nnunetv2.experiment_planning.plan_and_preprocess_api import preprocess_dataset
    from nnunetv2.paths import nnUNet_preprocessed

    plans_file = Path(str(nnUNet_preprocessed)) / DATASET_NAME / f"{model.plans_identifier}.json"
    plans = json.loads(plans_file.read_text())
    if model.configuration not in plans["configurations"]:
        base = plans["configurations"][model.base_configuration]
        plans["configurations"][model.configuration] = tiny_configuration(model, base)
        plans_file.write_text(json.dumps(plans, indent=4))
        preprocess_dataset(DATASET_ID, model.plans_identifier, configurations=(model.configuration,),
                           num_processes=(1,), verbose=False, show_progress_bar=False)


def train(model: ModelSpec, index: int) -> float:
    from nnunetv2.paths import nnUNet_preprocessed

    plans_file = Path(str(nnUNet_preprocessed)) / DATASET_NAME / f"{model.plans_identifier}.json"
    return train_nnunet(plans_file, model.configuration, FOLD, trainer_name=model.trainer,
                        seed=SEED * 100 + index, num_epochs=model.num_epochs,
                        num_iterations_per_epoch=model.num_iterations_per_epoch,
                        validate=model.postprocessing)


def determine_postprocessing_for(model: ModelSpec, results_dir: Path) -> dict[str, Any]:
    """nnU-Net's ``determine_postprocessing`` on the fold's validation predictions."""
    from nnunetv2.paths import nnUNet_preprocessed
    from nnunetv2.postprocessing.remove_connected_components import determine_postprocessing

    validation = results_dir / f"fold_{FOLD}" / "validation"
    gt = Path(str(nnUNet_preprocessed)) / DATASET_NAME / "gt_segmentations"
    fns, kwargs = determine_postprocessing(str(validation), str(gt), str(results_dir / "plans.json"),
                                           str(results_dir / "dataset.json"), num_processes=1,
                                           keep_postprocessed_files=False)
    return {"functions": [f.__name__ for f in fns], "kwargs": json.loads(json.dumps(kwargs, default=list))}


def export_model_folder(model: ModelSpec, out_model_dir: Path) -> None:
    from nnunetv2.paths import nnUNet_results

    src = Path(str(nnUNet_results)) / DATASET_NAME / model.folder_name
    export_slim_model_folder(src, out_model_dir, (FOLD,), trainer_name=model.trainer,
                             configuration=model.configuration)
    if model.postprocessing:
        pp_dir = out_model_dir / f"crossval_results_folds_{FOLD}"
        pp_dir.mkdir(exist_ok=True)
        for name in ("postprocessing.pkl", "postprocessing.json"):
            shutil.copyfile(src / f"fold_{FOLD}" / "validation" / name, pp_dir / name)


def region_dice(prediction: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    scores = {}
    for name, members in (("organ", (1, 2)), ("lesion", (2,))):
        p, r = np.isin(prediction, members), np.isin(reference, members)
        denominator = int(p.sum()) + int(r.sum())
        scores[name] = 1.0 if denominator == 0 else round(2.0 * int((p & r).sum()) / denominator, 4)
    return scores


def evaluate(model: ModelSpec, dataset_dir: Path) -> dict[str, dict[str, float]]:
    import torch
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE  # nnU-Net's default, the endpoint's

    predictor = nnUNetPredictor(tile_step_size=DEFAULT_TILE_STEP_SIZE, use_gaussian=True, use_mirroring=False,
                                perform_everything_on_device=False, device=torch.device("cpu"),
                                verbose=False, verbose_preprocessing=False, allow_tqdm=False)
    predictor.initialize_from_trained_model_folder(str(dataset_dir / model.folder_name), use_folds=(FOLD,))
    io = SimpleITKIO()
    results = {}
    for first in sorted((dataset_dir / "imagesTs").glob("*_0000.nii.gz")):
        case = first.name[: -len("_0000.nii.gz")]
        image, properties = io.read_images([str(first), str(first.parent / f"{case}_0001.nii.gz")])
        reference, _ = io.read_seg(str(dataset_dir / "labelsTs" / f"{case}.nii.gz"))
        prediction = predictor.predict_single_npy_array(image, properties, None, None, False)
        results[case] = region_dice(prediction, reference[0])
    return results


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------


def build(out_root: Path, work_dir: Path) -> dict[str, Any]:
    import nnunetv2  # noqa: F401
    import torch
    from nnunetv2.experiment_planning.plan_and_preprocess_api import extract_fingerprint_dataset
    from nnunetv2.paths import nnUNet_results

    start = time.perf_counter()
    dataset_dir = out_root / DATASET_NAME
    if dataset_dir.exists():
        shutil.rmtree(dataset_dir)
    held_out = write_raw_dataset(work_dir / "nnUNet_raw", dataset_dir)
    extract_fingerprint_dataset(DATASET_ID, num_processes=1, check_dataset_integrity=True, clean=True,
                                verbose=False, show_progress_bar=False)
    planned: set[str] = set()
    record: dict[str, Any] = {"dataset": DATASET_NAME, "command": "python -m tools.make_variety_fixtures "
                              "--out tests/fixtures", "seed": SEED, "torch": torch.__version__,
                              "held_out_cases": held_out, "models": {}}
    for index, model in enumerate(MODELS):
        model_start = time.perf_counter()
        if model.planner not in planned:
            identifier = plan(model.planner)
            if identifier != model.plans_identifier:
                raise RuntimeError(
                    f"{model.planner} wrote {identifier!r}, expected {model.plans_identifier!r}"
                )
            planned.add(model.planner)
        add_configuration_and_preprocess(model)
        train(model, index)
        results_dir = Path(str(nnUNet_results)) / DATASET_NAME / model.folder_name
        entry: dict[str, Any] = {"spec": asdict(model)}
        if model.postprocessing:
            entry["postprocessing"] = determine_postprocessing_for(model, results_dir)
        export_model_folder(model, dataset_dir / model.folder_name)
        plans = json.loads((dataset_dir / model.folder_name / "plans.json").read_text())
        configuration = plans["configurations"][model.configuration]
        base = plans["configurations"][model.base_configuration]
        entry.update(
            network_class=base["architecture"]["network_class_name"],
            normalization_schemes=base["normalization_schemes"],
            use_mask_for_norm=base["use_mask_for_norm"],
            patch_size=configuration["patch_size"],
            spacing=base["spacing"],
            transpose_forward=plans["transpose_forward"],
            dice_no_mirroring=evaluate(model, dataset_dir),
            seconds=round(time.perf_counter() - model_start, 1),
        )
        record["models"][model.folder_name] = entry
        LOG.info("%s done: %s", model.folder_name, entry)
    record["seconds_total"] = round(time.perf_counter() - start, 1)
    record["size_bytes"] = sum(p.stat().st_size for p in dataset_dir.rglob("*") if p.is_file())
    (dataset_dir / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    write_readme(dataset_dir, record)
    return record


def write_readme(dataset_dir: Path, record: dict[str, Any]) -> None:
    lines = [f"# {DATASET_NAME}", "", (__doc__ or "").split("Usage")[0].strip(), "",
             f"Command: `{record['command']}` (seed {SEED}, torch {record['torch']}, "
             f"{record['seconds_total']} s on 2 shared CPU cores, {record['size_bytes'] / 1e6:.2f} MB).",
             "",
             "| model folder | network | normalization (mask) | patch | epochs x iterations | "
             "postprocessing | Dice organ / lesion (held-out, no mirroring) |",
             "|---|---|---|---|---|---|---|"]
    for name, entry in record["models"].items():
        spec = entry["spec"]
        dice = "; ".join(f"{c}: {d['organ']:.3f} / {d['lesion']:.3f}"
                         for c, d in entry["dice_no_mirroring"].items())
        pp = entry.get("postprocessing", {}).get("functions", "-")
        lines.append(f"| `{name}` | {entry['network_class'].rsplit('.', 1)[-1]} | "
                     f"{entry['normalization_schemes']} ({entry['use_mask_for_norm']}) | "
                     f"{entry['patch_size']} | "
                     f"{spec['num_epochs']} x {spec['num_iterations_per_epoch']} | {pp} | {dice} |")
    lines += ["", "Held-out cases: " + ", ".join(
        f"`{c['case']}` {c['shape']} at {[round(s, 3) for s in c['spacing']]} mm ({c['purpose']})"
        for c in record["held_out_cases"]), ""]
    (dataset_dir / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    run_generator(DATASET_NAME, build, argv, (__doc__ or "").split("\n\n")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
