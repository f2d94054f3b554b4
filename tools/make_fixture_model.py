"""Generate the nnU-Net-trained fixture models under ``tests/fixtures/`` (deterministic, CPU only).

Every model folder written here is produced by nnU-Net v2 itself: nnU-Net's fingerprint extractor,
``ExperimentPlanner``, ``DefaultPreprocessor`` and ``nnUNetTrainer`` run in-process on a small synthetic
CT-like dataset. The only thing added by hand is a small ``3d_tiny`` configuration (inheriting from
``3d_fullres``) whose topology comes from nnU-Net's own ``get_pool_and_conv_props``.

Fixtures:
    * ``Dataset901_SynthCT``: near-isotropic spacing (z coarsest, ratio < 3), identity ``transpose_forward``,
      zero-valued margins so that ``crop_to_nonzero`` crops, two folds.
    * ``Dataset902_SynthAniso``: in-plane 0.75-0.85 mm, 4-5 mm along the LAST array axis (x in SimpleITK
      order), so the planner transposes it first (``transpose_forward = [2, 0, 1]``) and resampling uses
      "separate z"; one held-out case is smaller than the patch size; one fold.

Usage (from the repository root)::

    python tools/make_fixture_model.py --out tests/fixtures --which all
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FIXTURES",
    "CaseGeometry",
    "FixtureSpec",
    "GeometryRanges",
    "main",
    "synthesize_case",
]

LOG = logging.getLogger("make_fixture_model")

Margins = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]

CONFIGURATION = "3d_tiny"
PLANS_IDENTIFIER = "nnUNetPlans"
TRAINER_NAME = "nnUNetTrainer"
LABELS = {"background": 0, "organ": 1, "lesion": 2}
# Hounsfield-like intensities of the synthetic tissues.
HU_AIR, HU_BODY, HU_ORGAN, HU_LESION, HU_NOISE_STD = -1000.0, 0.0, 80.0, 300.0, 20.0
# Checkpoint keys nnUNetPredictor.initialize_from_trained_model_folder reads (+ current_epoch, provenance).
CHECKPOINT_KEYS_KEPT = (
    "network_weights",
    "init_args",
    "trainer_name",
    "inference_allowed_mirroring_axes",
    "current_epoch",
)


@dataclass(frozen=True)
class GeometryRanges:
    """Ranges the per-case grid is drawn from. Array order is SimpleITK's (z, y, x).

    The "slice axis" is the coarse axis (the body cylinder runs along it); the two other axes share one
    in-plane spacing and draw their voxel counts independently.
    """

    slice_axis: int
    slice_count: tuple[int, int]
    slice_spacing: tuple[float, float]
    inplane_count: tuple[int, int]
    inplane_spacing: tuple[float, float]
    margin_probability: float


@dataclass(frozen=True)
class CaseGeometry:
    """Grid of one synthetic case: shape and spacing in array order (z, y, x), zero margins per axis."""

    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    slice_axis: int
    margins: Margins = ((0, 0), (0, 0), (0, 0))


@dataclass(frozen=True)
class HeldOutCase:
    """Overrides for one held-out case; None keeps the randomly drawn value."""

    slice_count: int | None = None
    slice_spacing: float | None = None
    inplane_count: int | None = None
    inplane_spacing: float | None = None
    margins: Margins | None = None
    purpose: str = ""


@dataclass(frozen=True)
class FixtureSpec:
    """Everything that defines one fixture model; the generator is a pure function of it."""

    dataset_id: int
    name: str
    seed: int
    geometry: GeometryRanges
    num_training: int
    held_out: tuple[HeldOutCase, ...]
    folds: tuple[int, ...]
    patch_size: tuple[int, int, int]
    batch_size: int
    features_per_stage_cap: tuple[int, ...]
    max_numpool: int
    num_epochs: int
    num_iterations_per_epoch: int
    num_val_iterations_per_epoch: int
    initial_lr: float = 1e-2

    @property
    def dataset_name(self) -> str:
        return f"Dataset{self.dataset_id:03d}_{self.name}"

    @property
    def model_folder_name(self) -> str:
        return f"{TRAINER_NAME}__{PLANS_IDENTIFIER}__{CONFIGURATION}"

    def case_id(self, index: int) -> str:
        return f"{self.name.lower()}_{index:03d}"


FIXTURES: dict[str, FixtureSpec] = {
    "synthct": FixtureSpec(
        dataset_id=901,
        name="SynthCT",
        seed=901,
        geometry=GeometryRanges(
            slice_axis=0,
            slice_count=(30, 40),
            slice_spacing=(1.6, 2.4),
            inplane_count=(44, 56),
            inplane_spacing=(0.9, 1.3),
            margin_probability=0.5,
        ),
        num_training=10,
        held_out=(
            HeldOutCase(purpose="typical case"),
            HeldOutCase(margins=((3, 4), (5, 0), (0, 6)), purpose="zero margins: crop_to_nonzero crops"),
            HeldOutCase(
                slice_count=20,
                slice_spacing=3.6,
                inplane_spacing=1.0,
                purpose="spacing ratio 3.6 > 3: separate-z resampling for this case only",
            ),
        ),
        folds=(0, 1),
        patch_size=(24, 32, 32),
        batch_size=2,
        features_per_stage_cap=(8, 16, 32, 32),
        max_numpool=3,
        num_epochs=12,
        num_iterations_per_epoch=25,
        num_val_iterations_per_epoch=2,
    ),
    "aniso": FixtureSpec(
        dataset_id=902,
        name="SynthAniso",
        seed=902,
        geometry=GeometryRanges(
            slice_axis=2,
            # Down to 5 slices / 40 voxels so that small fields of view (like the small held-out case)
            # are in the training distribution.
            slice_count=(5, 14),
            slice_spacing=(4.0, 5.0),
            inplane_count=(40, 58),
            inplane_spacing=(0.75, 0.85),
            margin_probability=0.5,
        ),
        num_training=10,
        held_out=(
            HeldOutCase(
                slice_count=12, margins=((4, 0), (0, 5), (1, 0)), purpose="typical case with zero margins"
            ),
            HeldOutCase(
                slice_count=5,
                slice_spacing=4.5,
                inplane_count=40,
                margins=((0, 0), (0, 0), (0, 0)),
                purpose="smaller than the patch size along every axis (padding)",
            ),
        ),
        folds=(0,),
        patch_size=(8, 48, 48),
        batch_size=2,
        features_per_stage_cap=(8, 16, 32, 32),
        max_numpool=3,
        num_epochs=20,
        num_iterations_per_epoch=25,
        num_val_iterations_per_epoch=2,
    ),
}


# --------------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------------


def _round_to(value: float, step: float) -> float:
    return round(float(np.round(value / step) * step), 6)


def sample_geometry(
    rng: np.random.Generator, ranges: GeometryRanges, held_out: HeldOutCase | None = None
) -> CaseGeometry:
    """Draw one case grid from ``ranges``; ``held_out`` fields, where set, replace the drawn values.

    The same number of random draws is made whatever the overrides, so editing one held-out case does
    not change the cases drawn after it.
    """
    held_out = held_out or HeldOutCase()
    slice_count = int(rng.integers(ranges.slice_count[0], ranges.slice_count[1] + 1))
    slice_spacing = _round_to(rng.uniform(*ranges.slice_spacing), 0.05)
    inplane_counts = [int(rng.integers(ranges.inplane_count[0], ranges.inplane_count[1] + 1)) for _ in "yx"]
    inplane_spacing = _round_to(rng.uniform(*ranges.inplane_spacing), 0.01)
    margin_draw = (rng.uniform(), rng.uniform(0.04, 0.12, size=(3, 2)), rng.uniform(size=(3, 2)))

    slice_count = held_out.slice_count or slice_count
    slice_spacing = held_out.slice_spacing or slice_spacing
    if held_out.inplane_count is not None:
        inplane_counts = [held_out.inplane_count, held_out.inplane_count + 4]
    inplane_spacing = held_out.inplane_spacing or inplane_spacing

    shape: list[int] = []
    spacing: list[float] = []
    inplane = iter(inplane_counts)
    for axis in range(3):
        is_slice = axis == ranges.slice_axis
        shape.append(slice_count if is_slice else next(inplane))
        spacing.append(slice_spacing if is_slice else inplane_spacing)
    margins = held_out.margins
    if margins is None:
        margins = _margins(margin_draw, ranges.margin_probability, shape)
    return CaseGeometry(tuple(shape), tuple(spacing), ranges.slice_axis, margins)  # type: ignore[arg-type]


def _margins(draw: tuple[float, np.ndarray, np.ndarray], probability: float, shape: Sequence[int]) -> Margins:
    """Zero-valued margins of 4-12 % of the axis length (at least 1 voxel) on some sides of some cases."""
    use_margins, fractions, side_draw = draw
    if use_margins >= probability:
        return ((0, 0), (0, 0), (0, 0))
    fractions = fractions * (side_draw < 0.4)
    if not fractions.any():
        fractions[int(np.argmin(side_draw)) // 2, 0] = 0.08
    widths = [
        tuple(max(1, round(f * n)) if f > 0 else 0 for f in pair)
        for pair, n in zip(fractions, shape, strict=True)
    ]
    return tuple(widths)  # type: ignore[return-value]


def _ellipsoid(coords: Sequence[np.ndarray], center: np.ndarray, semi_axes: np.ndarray) -> np.ndarray:
    return sum(((c - c0) / a) ** 2 for c, c0, a in zip(coords, center, semi_axes, strict=True)) <= 1.0


def _random_center(
    rng: np.random.Generator, room: np.ndarray, inplane_axes: Sequence[int], slice_axis: int
) -> np.ndarray:
    """A centre (mm) within +-60 % of ``room``, the free half-extent per axis (in-plane pair, then slice)."""
    center = np.empty(3)
    center[inplane_axes] = room[inplane_axes] * rng.uniform(-0.6, 0.6, 2)
    center[slice_axis] = max(room[slice_axis], 0.0) * rng.uniform(-0.6, 0.6)
    return center


def _object_masks(
    rng: np.random.Generator, geometry: CaseGeometry, coords: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Body cylinder, organ ellipsoid and lesion ellipsoid (boolean masks), sized in mm."""
    half_extent = (np.asarray(geometry.shape) - 1) / 2 * np.asarray(geometry.spacing)
    inplane_axes = [a for a in range(3) if a != geometry.slice_axis]
    s_ax = geometry.slice_axis

    body_semi = np.full(3, np.inf)
    body_semi[inplane_axes] = half_extent[inplane_axes] * rng.uniform(0.85, 0.95, size=2)
    body = _ellipsoid([coords[a] for a in inplane_axes], np.zeros(2), body_semi[inplane_axes])

    organ_semi = np.empty(3)
    organ_semi[inplane_axes] = np.minimum(rng.uniform(9.0, 13.0, size=2), 0.6 * body_semi[inplane_axes])
    organ_semi[s_ax] = min(rng.uniform(8.0, 14.0), 0.8 * half_extent[s_ax])
    room = np.where(np.isinf(body_semi), half_extent, body_semi) - organ_semi
    organ_center = _random_center(rng, room, inplane_axes, s_ax)
    organ = _ellipsoid(coords, organ_center, organ_semi) & body

    lesion_semi = np.empty(3)
    lesion_semi[inplane_axes] = rng.uniform(4.0, 6.5, size=2)
    lesion_semi[s_ax] = min(rng.uniform(5.0, 8.0), 0.8 * half_extent[s_ax])
    if rng.uniform() < 0.5:  # inside the organ
        lesion_center = organ_center + 0.5 * organ_semi * rng.uniform(-1.0, 1.0, 3)
    else:
        room = np.where(np.isinf(body_semi), half_extent, body_semi) - lesion_semi
        lesion_center = _random_center(rng, room, inplane_axes, s_ax)
    lesion = _ellipsoid(coords, lesion_center, lesion_semi) & body
    return body, organ, lesion


def _outside_field_of_view(geometry: CaseGeometry) -> np.ndarray:
    outside = np.zeros(geometry.shape, dtype=bool)
    for axis, (lo, hi) in enumerate(geometry.margins):
        index: list[Any] = [slice(None)] * 3
        index[axis] = slice(0, lo)
        outside[tuple(index)] = True
        index[axis] = slice(geometry.shape[axis] - hi, geometry.shape[axis])
        outside[tuple(index)] = True
    return outside


def synthesize_case(rng: np.random.Generator, geometry: CaseGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Render one CT-like case in array order (z, y, x).

    Air (-1000 HU) surrounds an elliptic body cylinder along the slice axis (0 HU); inside it an ellipsoidal
    organ (80 HU, label 1) and a smaller bright lesion (300 HU, label 2, inside the organ half of the time).
    Gaussian noise (20 HU) is added, then the margins are set to exactly 0 ("outside the field of view").

    Returns:
        image: int16, shape ``geometry.shape``.
        label: uint8, shape ``geometry.shape``, values in {0, 1, 2}.
    """
    coords = np.meshgrid(
        *[(np.arange(n) - (n - 1) / 2) * s for n, s in zip(geometry.shape, geometry.spacing, strict=True)],
        indexing="ij",
    )
    body, organ, lesion = _object_masks(rng, geometry, coords)
    label = np.zeros(geometry.shape, dtype=np.uint8)
    label[organ] = LABELS["organ"]
    label[lesion] = LABELS["lesion"]
    image = np.full(geometry.shape, HU_AIR)
    image[body] = HU_BODY
    image[label == LABELS["organ"]] = HU_ORGAN
    image[label == LABELS["lesion"]] = HU_LESION
    image = np.round(image + rng.normal(0.0, HU_NOISE_STD, size=geometry.shape)).astype(np.int16)

    outside = _outside_field_of_view(geometry)
    image[outside] = 0
    label[outside] = 0
    return image, label


def _write_nifti(array: np.ndarray, spacing_zyx: Sequence[float], path: Path) -> None:
    import SimpleITK as sitk

    img = sitk.GetImageFromArray(array)
    spacing_xyz = tuple(float(s) for s in spacing_zyx[::-1])
    img.SetSpacing(spacing_xyz)
    # A centred, non-zero origin so that geometry round-trips are visible in the outputs.
    img.SetOrigin(tuple(-0.5 * (n - 1) * s for n, s in zip(array.shape[::-1], spacing_xyz, strict=True)))
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(img, str(path), useCompression=True)


def write_raw_dataset(spec: FixtureSpec, raw_root: Path, out_dataset_dir: Path) -> list[dict[str, Any]]:
    """Write the training cases in nnU-Net raw format and the held-out cases into the fixture folder.

    Returns:
        One record per held-out case: case id, geometry and purpose.
    """
    rng = np.random.default_rng(spec.seed)
    raw = raw_root / spec.dataset_name
    for index in range(spec.num_training):
        geometry = sample_geometry(rng, spec.geometry)
        image, label = synthesize_case(rng, geometry)
        _write_nifti(image, geometry.spacing, raw / "imagesTr" / f"{spec.case_id(index)}_0000.nii.gz")
        _write_nifti(label, geometry.spacing, raw / "labelsTr" / f"{spec.case_id(index)}.nii.gz")
    held_out_records = []
    for offset, held_out in enumerate(spec.held_out):
        case_id = spec.case_id(100 + offset)
        geometry = sample_geometry(rng, spec.geometry, held_out)
        image, label = synthesize_case(rng, geometry)
        _write_nifti(image, geometry.spacing, out_dataset_dir / "imagesTs" / f"{case_id}_0000.nii.gz")
        _write_nifti(label, geometry.spacing, out_dataset_dir / "labelsTs" / f"{case_id}.nii.gz")
        held_out_records.append({"case": case_id, "purpose": held_out.purpose, **asdict(geometry)})
    dataset_json = {
        "name": spec.dataset_name,
        "description": "Synthetic CT-like volumes (air, body, organ, lesion), tools/make_fixture_model.py",
        "reference": f"synthetic, seed {spec.seed}",
        "licence": "CC0-1.0",
        "channel_names": {"0": "CT"},
        "labels": LABELS,
        "numTraining": spec.num_training,
        "file_ending": ".nii.gz",
    }
    (raw / "dataset.json").write_text(json.dumps(dataset_json, indent=4))
    return held_out_records


# --------------------------------------------------------------------------------------------------
# nnU-Net steps (nnunetv2 is imported lazily, after the nnUNet_* variables point at the work dir)
# --------------------------------------------------------------------------------------------------


def configure_nnunet_environment(work_dir: Path) -> None:
    """Point nnU-Net at ``work_dir`` and keep it single-process and on CPU semantics."""
    for var in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
        path = work_dir / var
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(path)
    # 1 for planning (ExperimentPlanner calls torch.set_num_threads with it); training switches to 0.
    os.environ["nnUNet_n_proc_DA"] = "1"
    os.environ["nnUNet_compile"] = "false"


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Temporarily set environment variables, restoring the previous values afterwards."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run with ``torch.set_num_threads(num_threads)``, restoring the previous value afterwards.

    On 2 CPU cores shared with other jobs, OpenMP worker threads spin-wait for descheduled peers; one
    thread was about 9x faster than two for the fixture networks under load.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def plan_dataset(spec: FixtureSpec) -> Path:
    """Fingerprint + ``ExperimentPlanner`` as ``nnUNetv2_plan_and_preprocess`` runs them.

    Returns:
        Path of the written ``nnUNetPlans.json``.
    """
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (
        extract_fingerprint_dataset,
        plan_experiment_dataset,
    )
    from nnunetv2.paths import nnUNet_preprocessed

    extract_fingerprint_dataset(
        spec.dataset_id,
        num_processes=1,
        check_dataset_integrity=True,
        clean=True,
        verbose=False,
        show_progress_bar=False,
    )
    _, plans_identifier = plan_experiment_dataset(spec.dataset_id)
    if plans_identifier != PLANS_IDENTIFIER:
        raise RuntimeError(f"expected plans identifier {PLANS_IDENTIFIER!r}, got {plans_identifier!r}")
    return Path(str(nnUNet_preprocessed)) / spec.dataset_name / f"{PLANS_IDENTIFIER}.json"


def run_generator(dataset_name: str, build: Callable[[Path, Path], dict[str, Any]], argv: list[str] | None,
                  description: str) -> dict[str, Any]:
    """CLI of the other fixture generators: ``--out`` and ``--work-dir``, one torch thread, nnU-Net's
    worker pools at one process, nnU-Net's folders in ``<work dir>/<dataset>``; returns ``build``'s record."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures"), help="fixture root folder")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep nnUNet_raw/_preprocessed/_results here instead of a temporary folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="nnunet_fixture_") as tmp, torch_threads(1), \
            _environment(nnUNet_def_n_proc="1"):
        work_dir = (args.work_dir or Path(tmp)).resolve() / dataset_name
        if work_dir.exists():
            shutil.rmtree(work_dir)
        configure_nnunet_environment(work_dir)
        return build(args.out.resolve(), work_dir)


def tiny_topology(spacing: Sequence[float], patch_size: Sequence[int], max_numpool: int,
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """(strides, kernel sizes) from nnU-Net's ``get_pool_and_conv_props`` for ``spacing`` and ``patch_size``.

    Raises:
        ValueError: nnU-Net would pad ``patch_size`` (not divisible by the pooling).
    """
    from nnunetv2.experiment_planning.experiment_planners.network_topology import get_pool_and_conv_props

    _, strides, kernel_sizes, padded, _ = get_pool_and_conv_props(spacing, patch_size, 4, max_numpool)
    if tuple(int(p) for p in padded) != tuple(patch_size):
        raise ValueError(
            f"patch_size {tuple(patch_size)} is not divisible by the pooling for spacing {list(spacing)}; "
            f"nnU-Net would pad it to {tuple(padded)}."
        )
    return [list(s) for s in strides], [list(k) for k in kernel_sizes]


def train_nnunet(plans_file: Path, configuration: str, fold: int | str, *, trainer_name: str, seed: int,
                 num_epochs: int, num_iterations_per_epoch: int, num_val_iterations_per_epoch: int = 2,
                 initial_lr: float | None = None, validate: bool = False) -> float:
    """Train one fold with nnU-Net's trainer class ``trainer_name`` on CPU; returns wall-clock seconds.

    ``validate`` runs ``perform_actual_validation`` afterwards (validation predictions, and the
    ``predicted_next_stage`` export of a stage that has a next stage).
    """
    import torch
    from nnunetv2.utilities.find_objects import recursive_find_trainer_class_by_name

    seed_everything(seed)
    plans = json.loads(plans_file.read_text())
    plans["continue_training"] = False  # popped again by nnUNetTrainer.__init__ (see run_training.py)
    dataset_json = json.loads((plans_file.parent / "dataset.json").read_text())
    trainer_class = recursive_find_trainer_class_by_name(trainer_name)
    trainer = trainer_class(plans=plans, configuration=configuration, fold=fold, dataset_json=dataset_json,
                            device=torch.device("cpu"))
    trainer.num_epochs = num_epochs
    trainer.num_iterations_per_epoch = num_iterations_per_epoch
    trainer.num_val_iterations_per_epoch = num_val_iterations_per_epoch
    if initial_lr is not None:
        trainer.initial_lr = initial_lr
    trainer.save_every = num_epochs + 1  # no checkpoint_latest.pth
    start = time.perf_counter()
    # nnUNet_n_proc_DA=0: SingleThreadedAugmenter, data augmentation in this process (2 shared cores).
    with _environment(nnUNet_n_proc_DA="0"):
        trainer.run_training()
        if validate:
            trainer.perform_actual_validation(False)
    return time.perf_counter() - start


def export_slim_model_folder(src: Path, out_model_dir: Path, folds: Sequence[int | str], *, trainer_name: str,
                             configuration: str | None = None) -> None:
    """Copy a results folder keeping only what inference needs; checkpoints slimmed to CHECKPOINT_KEYS_KEPT.

    Raises:
        RuntimeError: a checkpoint names another trainer (or configuration, when given).
    """
    import torch

    out_model_dir.mkdir(parents=True, exist_ok=True)
    for name in ("dataset.json", "plans.json", "dataset_fingerprint.json"):
        shutil.copyfile(src / name, out_model_dir / name)
    for fold in folds:
        checkpoint = torch.load(src / f"fold_{fold}" / "checkpoint_final.pth", map_location="cpu",
                                weights_only=False)
        slim = {key: checkpoint[key] for key in CHECKPOINT_KEYS_KEPT}
        found = (slim["trainer_name"], slim["init_args"]["configuration"])
        if found[0] != trainer_name or (configuration is not None and found[1] != configuration):
            raise RuntimeError(
                f"fold {fold}: checkpoint says {found}, expected {(trainer_name, configuration)}"
            )
        (out_model_dir / f"fold_{fold}").mkdir(exist_ok=True)
        torch.save(slim, out_model_dir / f"fold_{fold}" / "checkpoint_final.pth")


def tiny_configuration(spec: FixtureSpec, fullres: dict[str, Any]) -> dict[str, Any]:
    """Build the ``3d_tiny`` configuration: 3d_fullres spacing/normalisation, a small patch and PlainConvUNet.

    The topology (strides, kernel sizes) comes from nnU-Net's ``get_pool_and_conv_props`` for the
    3d_fullres spacing, as ``ExperimentPlanner.get_plans_for_configuration`` computes it, capped at
    ``spec.max_numpool`` poolings per axis.
    """
    strides, kernel_sizes = tiny_topology(fullres["spacing"], spec.patch_size, spec.max_numpool)
    n_stages = len(strides)
    if n_stages > len(spec.features_per_stage_cap):
        raise ValueError(
            f"{n_stages} stages need {n_stages} feature counts, got {spec.features_per_stage_cap}."
        )
    architecture = json.loads(json.dumps(fullres["architecture"]))
    architecture["arch_kwargs"].update(
        n_stages=n_stages,
        features_per_stage=list(spec.features_per_stage_cap[:n_stages]),
        kernel_sizes=kernel_sizes,
        strides=strides,
        n_conv_per_stage=[2] * n_stages,
        n_conv_per_stage_decoder=[2] * (n_stages - 1),
    )
    return {
        "inherits_from": "3d_fullres",
        "data_identifier": f"{PLANS_IDENTIFIER}_{CONFIGURATION}",
        "patch_size": list(spec.patch_size),
        "batch_size": spec.batch_size,
        "architecture": architecture,
    }


def add_tiny_configuration_and_preprocess(spec: FixtureSpec, plans_file: Path) -> dict[str, Any]:
    """Add ``3d_tiny`` to plans.json and run nnU-Net's own preprocessing for it (one worker)."""
    from nnunetv2.experiment_planning.plan_and_preprocess_api import preprocess_dataset

    plans = json.loads(plans_file.read_text())
    plans["configurations"][CONFIGURATION] = tiny_configuration(spec, plans["configurations"]["3d_fullres"])
    plans_file.write_text(json.dumps(plans, indent=4))
    preprocess_dataset(
        spec.dataset_id,
        PLANS_IDENTIFIER,
        configurations=(CONFIGURATION,),
        num_processes=(1,),
        verbose=False,
        show_progress_bar=False,
    )
    return plans


def train_fold(spec: FixtureSpec, plans_file: Path, fold: int) -> float:
    """Train one fold with nnU-Net's own ``nnUNetTrainer`` on CPU; returns wall-clock seconds."""
    return train_nnunet(plans_file, CONFIGURATION, fold, trainer_name=TRAINER_NAME,
                        seed=spec.seed * 100 + fold, num_epochs=spec.num_epochs,
                        num_iterations_per_epoch=spec.num_iterations_per_epoch,
                        num_val_iterations_per_epoch=spec.num_val_iterations_per_epoch,
                        initial_lr=spec.initial_lr)


def export_model_folder(spec: FixtureSpec, out_model_dir: Path) -> None:
    """Copy the trainer's results folder, keeping only what inference needs and slimming the checkpoints."""
    from nnunetv2.paths import nnUNet_results

    src = Path(str(nnUNet_results)) / spec.dataset_name / spec.model_folder_name
    export_slim_model_folder(src, out_model_dir, spec.folds, trainer_name=TRAINER_NAME)


def dice_per_label(prediction: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Dice of every foreground label; 1.0 when a label is absent from both."""
    scores = {}
    for name, value in LABELS.items():
        if value == 0:
            continue
        p, r = prediction == value, reference == value
        denominator = int(p.sum()) + int(r.sum())
        scores[name] = 1.0 if denominator == 0 else 2.0 * int((p & r).sum()) / denominator
    return scores


def evaluate_model_folder(
    spec: FixtureSpec, dataset_dir: Path, *, use_mirroring: bool
) -> dict[str, dict[str, float]]:
    """Predict every held-out case with ``nnUNetPredictor`` (CPU, all folds) from the slimmed folder."""
    import torch
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE  # nnU-Net's default, the endpoint's

    predictor = nnUNetPredictor(
        tile_step_size=DEFAULT_TILE_STEP_SIZE,
        use_gaussian=True,
        use_mirroring=use_mirroring,
        perform_everything_on_device=False,
        device=torch.device("cpu"),
        verbose=False,
        verbose_preprocessing=False,
        allow_tqdm=False,
    )
    predictor.initialize_from_trained_model_folder(
        str(dataset_dir / spec.model_folder_name), use_folds=spec.folds
    )
    io = SimpleITKIO()
    results = {}
    for image_file in sorted((dataset_dir / "imagesTs").glob("*_0000.nii.gz")):
        case = image_file.name[: -len("_0000.nii.gz")]
        image, properties = io.read_images([str(image_file)])
        reference, _ = io.read_seg(str(dataset_dir / "labelsTs" / f"{case}.nii.gz"))
        prediction = predictor.predict_single_npy_array(image, properties, None, None, False)
        results[case] = {k: round(v, 4) for k, v in dice_per_label(prediction, reference[0]).items()}
    return results


def separate_z_report(plans: dict[str, Any], held_out: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """nnU-Net's ``determine_do_sep_z_and_axis`` for preprocessing and export of each held-out case."""
    from nnunetv2.preprocessing.resampling.default_resampling import determine_do_sep_z_and_axis

    transpose = plans["transpose_forward"]
    target = (
        plans["configurations"][CONFIGURATION].get("spacing")
        or plans["configurations"]["3d_fullres"]["spacing"]
    )
    report = {}
    for record in held_out:
        # SimpleITKIO reads the spacing as float32 values; reproduce that before transposing.
        original = [float(np.float32(s)) for s in record["spacing"]]
        transposed = [original[i] for i in transpose]
        pre = determine_do_sep_z_and_axis(None, transposed, target)
        export = determine_do_sep_z_and_axis(None, target, transposed)
        report[record["case"]] = {
            "spacing_transposed": transposed,
            "preprocessing": {"separate_z": bool(pre[0]), "axis": None if pre[1] is None else int(pre[1])},
            "export": {"separate_z": bool(export[0]), "axis": None if export[1] is None else int(export[1])},
        }
    return report


# --------------------------------------------------------------------------------------------------
# Orchestration, provenance and README
# --------------------------------------------------------------------------------------------------


def build_fixture(spec: FixtureSpec, out_root: Path, work_dir: Path, command: str) -> dict[str, Any]:
    """Run the whole pipeline for one fixture and return its provenance record."""
    import nnunetv2
    import torch

    start = time.perf_counter()
    dataset_dir = out_root / spec.dataset_name
    if dataset_dir.exists():
        shutil.rmtree(dataset_dir)
    held_out = write_raw_dataset(spec, work_dir / "nnUNet_raw", dataset_dir)
    plans_file = plan_dataset(spec)
    plans = add_tiny_configuration_and_preprocess(spec, plans_file)
    prepared_s = time.perf_counter() - start
    training_s = {f"fold_{fold}": round(train_fold(spec, plans_file, fold), 1) for fold in spec.folds}
    export_model_folder(spec, dataset_dir / spec.model_folder_name)
    eval_start = time.perf_counter()
    dice = {
        "mirroring": evaluate_model_folder(spec, dataset_dir, use_mirroring=True),
        "no mirroring": evaluate_model_folder(spec, dataset_dir, use_mirroring=False),
    }
    tiny = plans["configurations"][CONFIGURATION]
    fullres = plans["configurations"]["3d_fullres"]
    record = {
        "dataset": spec.dataset_name,
        "model_folder": spec.model_folder_name,
        "command": command,
        "seed": spec.seed,
        "training_seeds": {f"fold_{f}": spec.seed * 100 + f for f in spec.folds},
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "nnunetv2": nnunetv2.__version__ if hasattr(nnunetv2, "__version__") else _dist_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "spec": _jsonable(asdict(spec)),
        "plans": {
            "transpose_forward": plans["transpose_forward"],
            "transpose_backward": plans["transpose_backward"],
            "spacing": fullres["spacing"],
            "patch_size": tiny["patch_size"],
            "batch_size": tiny["batch_size"],
            "strides": tiny["architecture"]["arch_kwargs"]["strides"],
            "kernel_sizes": tiny["architecture"]["arch_kwargs"]["kernel_sizes"],
            "features_per_stage": tiny["architecture"]["arch_kwargs"]["features_per_stage"],
            "normalization_schemes": fullres["normalization_schemes"],
            "use_mask_for_norm": fullres["use_mask_for_norm"],
            "fullres_patch_size": fullres["patch_size"],
        },
        "held_out_cases": held_out,
        "separate_z": separate_z_report(plans, held_out),
        "dice": dice,
        "seconds": {
            "data_and_planning": round(prepared_s, 1),
            "training": training_s,
            "evaluation": round(time.perf_counter() - eval_start, 1),
            "total": round(time.perf_counter() - start, 1),
        },
        "size_bytes": sum(p.stat().st_size for p in dataset_dir.rglob("*") if p.is_file()),
    }
    (dataset_dir / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _dist_version() -> str:
    from importlib.metadata import version

    return version("nnunetv2")


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=list))


README_INTRO = """\
# nnU-Net-trained fixture models

Generated by `tools/make_fixture_model.py` (do not edit by hand; regenerate instead):

```
python tools/make_fixture_model.py --out tests/fixtures --which all
```

Each fixture is a standard nnU-Net v2 results folder made by nnU-Net itself (fingerprint extraction,
`ExperimentPlanner`, `DefaultPreprocessor`, `nnUNetTrainer`, all in-process on CPU) from a synthetic
CT-like dataset: air -1000 HU, body 0 HU, organ 80 HU = label 1, lesion 300 HU = label 2, Gaussian noise
20 HU, int16 images, varied spacings per case, some cases with a zero-valued margin ("outside the field of
view") so that `crop_to_nonzero` crops. The custom configuration `{configuration}` inherits from
`3d_fullres` and overrides patch size, batch size and the PlainConvUNet topology (strides and kernel sizes
from nnU-Net's `get_pool_and_conv_props` for the 3d_fullres spacing). Checkpoints keep only
{checkpoint_keys}; optimizer/grad-scaler state, logs, progress plots, `checkpoint_best.pth` and
validation outputs are dropped. `provenance.json` in each dataset folder holds the full machine-readable
record (spec, plans summary, held-out geometry, separate-z decisions, timings, Dice).

Training is seeded (data seed, `random`/`numpy`/`torch` seeds per fold) and single-process on CPU with
one torch thread; a repeated run on the same machine and library versions gave bit-identical weights and
images. Other CPUs, thread counts or torch builds may give slightly different weights, so tests assert
Dice thresholds, never exact weights. Wall-clock times were measured on 2 CPU cores shared with other
jobs and vary several-fold with their load.

`Dataset903_SynthMulti` (2D, region labels with an ignore label, two channels, ResEnc, a custom trainer,
postprocessing) is made by `tools/make_variety_fixtures.py`, `Dataset904_SynthCascade` (`3d_lowres_tiny` ->
`3d_cascade_tiny`, fold `all`) by `tools/make_cascade_fixture.py`; see the READMEs in their folders.
"""


def write_readme(out_root: Path) -> None:
    """Regenerate ``README.md`` from every ``provenance.json`` under ``out_root``."""
    # only this generator's fixtures (Dataset903/904 come from make_variety_fixtures / make_cascade_fixture)
    names = {spec.dataset_name for spec in FIXTURES.values()}
    records = [json.loads(p.read_text()) for p in sorted(out_root.glob("Dataset*/provenance.json"))
               if p.parent.name in names]
    keys = ", ".join(f"`{k}`" for k in CHECKPOINT_KEYS_KEPT)
    lines = README_INTRO.format(configuration=CONFIGURATION, checkpoint_keys=keys).split("\n")
    for record in records:
        lines += _readme_section(record)
    (out_root / "README.md").write_text("\n".join(lines))


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(float(v), 4) for v in values]


def _separate_z_text(decision: dict[str, Any]) -> str:
    return f"yes, axis {decision['axis']}" if decision["separate_z"] else "no"


def _readme_section(record: dict[str, Any]) -> list[str]:
    spec, plans, seconds = record["spec"], record["plans"], record["seconds"]
    versions = record["versions"]
    lines = [
        f"## {record['dataset']}",
        "",
        f"- Command: `{record['command']}`",
        f"- Seeds: data {record['seed']}, training {record['training_seeds']}; torch threads "
        f"{record['torch_threads']}; nnunetv2 {versions['nnunetv2']}, torch {versions['torch']}, "
        f"numpy {versions['numpy']}.",
        f"- Model folder: `{record['model_folder']}` with {', '.join(record['training_seeds'])}.",
        f"- Plans: transpose_forward {plans['transpose_forward']}, spacing {_rounded(plans['spacing'])}, "
        f"`{CONFIGURATION}` patch_size {plans['patch_size']}, batch_size {plans['batch_size']}, "
        f"strides {plans['strides']}, kernel_sizes {plans['kernel_sizes']}, features "
        f"{plans['features_per_stage']}, normalization {plans['normalization_schemes']} "
        f"(use_mask_for_norm {plans['use_mask_for_norm']}); 3d_fullres patch_size "
        f"{plans['fullres_patch_size']}.",
        f"- Training: nnUNetTrainer on CPU, {spec['num_epochs']} epochs x {spec['num_iterations_per_epoch']} "
        f"iterations (val {spec['num_val_iterations_per_epoch']}), initial lr {spec['initial_lr']}, "
        f"{spec['num_training']} training cases, nnU-Net's default seeded 5-fold split.",
        f"- Wall-clock: data, planning and preprocessing {seconds['data_and_planning']} s; training "
        f"{seconds['training']} s; evaluation {seconds['evaluation']} s; total {seconds['total']} s.",
        f"- Size: {record['size_bytes'] / 1e6:.2f} MB.",
        "",
        "Held-out cases (separate z from nnU-Net's `determine_do_sep_z_and_axis`, axis in transposed order):",
        "",
        "| case | shape (z, y, x) | spacing (z, y, x) mm | zero margins | separate z: preprocessing / export "
        "| purpose |",
        "|---|---|---|---|---|---|",
    ]
    for case in record["held_out_cases"]:
        sep = record["separate_z"][case["case"]]
        lines.append(
            f"| {case['case']} | {case['shape']} | {_rounded(case['spacing'])} | {case['margins']} | "
            f"{_separate_z_text(sep['preprocessing'])} / {_separate_z_text(sep['export'])} | "
            f"{case['purpose']} |"
        )
    lines += [
        "",
        "Dice on the held-out cases (nnUNetPredictor on CPU, all folds, step 0.5, Gaussian, with and "
        "without mirror TTA):",
        "",
        "| prediction | case | " + " | ".join(n for n in LABELS if n != "background") + " |",
        "|---|---|" + "---|" * (len(LABELS) - 1),
    ]
    for model, per_case in record["dice"].items():
        for case, scores in per_case.items():
            lines.append(f"| {model} | {case} | " + " | ".join(f"{s:.4f}" for s in scores.values()) + " |")
    return lines + [""]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures"), help="fixture root folder")
    parser.add_argument("--which", choices=[*FIXTURES, "all"], default="all", help="fixture(s) to (re)build")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep nnUNet_raw/_preprocessed/_results here instead of a temporary folder",
    )
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument("--num-epochs", type=int, default=None, help="override the spec (experiments only)")
    parser.add_argument(
        "--iterations-per-epoch", type=int, default=None, help="override the spec (experiments only)"
    )
    return parser.parse_args(argv)


def _spec_and_command(key: str, args: argparse.Namespace) -> tuple[FixtureSpec, str]:
    """The fixture spec with the CLI overrides applied, and the command line that reproduces it."""
    spec = FIXTURES[key]
    command = f"python tools/make_fixture_model.py --out tests/fixtures --which {key}"
    if args.num_epochs is not None:
        spec = replace(spec, num_epochs=args.num_epochs)
        command += f" --num-epochs {args.num_epochs}"
    if args.iterations_per_epoch is not None:
        spec = replace(spec, num_iterations_per_epoch=args.iterations_per_epoch)
        command += f" --iterations-per-epoch {args.iterations_per_epoch}"
    if args.num_threads != 1:
        command += f" --num-threads {args.num_threads}"
    return spec, command


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    keys = list(FIXTURES) if args.which == "all" else [args.which]
    out_root = args.out.resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nnunet_fixture_") as tmp, torch_threads(args.num_threads):
        work_root = args.work_dir.resolve() if args.work_dir is not None else Path(tmp)
        for key in keys:
            spec, command = _spec_and_command(key, args)
            work_dir = work_root / spec.dataset_name
            if work_dir.exists():
                shutil.rmtree(work_dir)
            configure_nnunet_environment(work_dir)
            record = build_fixture(spec, out_root, work_dir, command)
            LOG.info(
                "%s done in %.0f s; Dice %s", spec.dataset_name, record["seconds"]["total"], record["dice"]
            )
    write_readme(out_root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
