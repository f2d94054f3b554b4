"""Shared support for the pipeline tests: fixture models, built repositories, one shared server, nnU-Net.

The three pipeline test modules (parity, composing models, concurrency/errors) share ONE embedded
server per fixture dataset (2 shared CPU cores: every server start costs tens of seconds). The server
is cached here at module level; asking for another dataset stops the previous server first, and a
session finalizer stops the last one.

Repositories are built into ``build/test-repositories/<dataset>`` with the nnU-Net-exact CPU settings
(``per_sample_forward=True``: every tile runs through the network alone, as in nnU-Net, so logits are
bit-identical) and a small voxel limit (``TEST_MAX_VOXELS``). ``repository/build.py`` skips the rebuild
when nothing changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nnunet_triton.validate.oracle import nnunet_predictor
from tests.fixture_paths import require_fixture

REPO_ROOT = Path(__file__).resolve().parents[2]

FIXTURES = REPO_ROOT / "tests" / "fixtures"
MODEL_FOLDER = "nnUNetTrainer__nnUNetPlans__3d_tiny"
SYNTHCT = "Dataset901_SynthCT"
ANISO = "Dataset902_SynthAniso"
DATASETS = (SYNTHCT, ANISO)
BUILD_ROOT = REPO_ROOT / "build" / "test-repositories"
TILE_BATCH_SIZE = 4
MAX_INFLIGHT = 4
# preprocess_model's voxel limit in the test repositories: 20x the largest fixture case (~1e5 voxels),
# small enough that a request over it is cheap to send (test_bad_input.py).
TEST_MAX_VOXELS = 2**21
# ... and a memory budget of 16 MiB per float32 array: 3 labels x 1.4 M voxels (test_bad_input.py).
TEST_MAX_REQUEST_BYTES = 2**24


@dataclass(frozen=True)
class Case:
    """One held-out fixture case as SimpleITK reads it (nnU-Net's SimpleITKIO axis order)."""

    name: str
    image: np.ndarray  # float32 (C, z, y, x)
    spacing: tuple[float, ...]  # (z, y, x)
    label: np.ndarray  # (z, y, x)


def model_dir(dataset: str) -> Path:
    """The model folder of a fixture key: ``<Dataset>`` (its ``MODEL_FOLDER``), ``<Dataset>/<model folder>``
    or an absolute path to a model folder (a modified copy); held-out cases live in its parent."""
    path = Path(dataset) if Path(dataset).is_absolute() else FIXTURES / dataset
    if not (path / "plans.json").is_file():
        path = path / MODEL_FOLDER
    require_fixture(path / "plans.json")
    return path


@cache
def cases(dataset: str) -> tuple[Case, ...]:
    """Held-out cases of ``dataset`` (``imagesTs/<case>_0000.nii.gz`` + ``labelsTs/<case>.nii.gz``)."""
    import SimpleITK as sitk

    root = model_dir(dataset).parent
    found = []
    for first in sorted((root / "imagesTs").glob("*_0000.nii.gz")):
        name = first.name[: -len("_0000.nii.gz")]
        channels = sorted((root / "imagesTs").glob(f"{name}_[0-9][0-9][0-9][0-9].nii.gz"))
        images = [sitk.ReadImage(str(f)) for f in channels]
        image = np.stack([sitk.GetArrayFromImage(i) for i in images]).astype(np.float32)
        spacing = tuple(float(s) for s in reversed(images[0].GetSpacing()))
        label = sitk.GetArrayFromImage(sitk.ReadImage(str(root / "labelsTs" / f"{name}.nii.gz")))
        found.append(Case(name=name, image=image, spacing=spacing, label=label))
    if not found:
        pytest.fail(f"fixture {dataset} has no imagesTs/*_0000.nii.gz (the held-out cases are committed)",
                    pytrace=False)
    return tuple(found)


PROBE = "probe"


@cache
def probe_case(dataset: str) -> Case:
    """A small crop of the first case (a single tile after padding): a cheap request for checks that a
    server still answers correctly."""
    first = cases(dataset)[0]
    crop = (slice(None), slice(0, 12), slice(0, 24), slice(0, 24))
    return Case(name=PROBE, image=np.ascontiguousarray(first.image[crop]), spacing=first.spacing,
                label=np.ascontiguousarray(first.label[crop[1:]]))


def build(dataset: str, *, orchestrator_instances: int = 1) -> Path:
    """Build (or reuse) the test repository of ``dataset`` and return its path.

    ``orchestrator_instances`` > 1 (requests worked on at once; the fold models then batch that many tile
    batches) builds a separate copy next to the default one.
    """
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.builder.repository import build_repository

    options = BuildOptions(
        tile_batch_size=TILE_BATCH_SIZE, per_sample_forward=True, max_inflight=MAX_INFLIGHT,
        orchestrator_instances=orchestrator_instances, max_voxels=TEST_MAX_VOXELS,
        max_request_bytes=TEST_MAX_REQUEST_BYTES,
    )
    out = BUILD_ROOT / (Path("copies", *Path(dataset).parts[-2:]) if Path(dataset).is_absolute() else dataset)
    if orchestrator_instances != 1:
        out = out.with_name(f"{out.name}-orchestrators{orchestrator_instances}")
    return build_repository(model_dir(dataset), out, options=options).out


_ACTIVE: dict[str, Any] = {}


def stop_shared_server() -> None:
    """Stop the cached server (idempotent)."""
    stack = _ACTIVE.pop("stack", None)
    _ACTIVE.clear()
    if stack is not None:
        stack.close()


def shared_server(dataset: str, triton_server: Callable[..., Any], request: pytest.FixtureRequest) -> Any:
    """The running server for ``dataset`` (started on first use, replacing another dataset's server).

    Call from a session-scoped fixture; its ``request`` gets the finalizer that stops the server.
    """
    if _ACTIVE.get("dataset") == dataset:
        return _ACTIVE["handle"]
    stop_shared_server()
    repository = build(dataset)
    stack = contextlib.ExitStack()
    handle = stack.enter_context(triton_server(repository, metrics=True))  # test_metrics.py scrapes it
    _ACTIVE.update(dataset=dataset, handle=handle, stack=stack)
    request.addfinalizer(stop_shared_server)
    return handle


# --- nnU-Net references -----------------------------------------------------------------------------


@cache
def predictor(dataset: str, folds: tuple[int | str, ...] | None = None, mirroring: bool = True,
              tile_step_size: float = 0.5) -> Any:
    """``nnUNetPredictor`` on CPU (``perform_everything_on_device=False``) for the fixture model."""
    return nnunet_predictor(model_dir(dataset), folds=folds, mirroring=mirroring,
                            tile_step_size=tile_step_size)


@dataclass(frozen=True)
class Reference:
    """nnU-Net's results for one case."""

    segmentation: np.ndarray  # predict_single_npy_array
    preprocessed: np.ndarray  # float32 (C, *resampled)
    logits: np.ndarray  # float16 (K, *resampled), predict_logits_from_preprocessed_data
    probabilities: np.ndarray  # float32 (K, z, y, x)
    properties: dict[str, Any]  # nnU-Net's data_properties of the preprocessed case


@cache
def reference(dataset: str, case_name: str, mirroring: bool, folds: tuple[int | str, ...] | None = None,
              tile_step_size: float = 0.5) -> Reference:
    """nnU-Net's segmentation (``predict_single_npy_array``), preprocessed data, logits and probabilities.

    The network runs once: ``predict_logits_from_preprocessed_data`` is wrapped to record its input and
    output while ``predict_single_npy_array`` runs; probabilities come from the recorded logits through
    ``convert_predicted_logits_to_segmentation_with_correct_shape(..., return_probabilities=True)``.
    """
    import torch
    from nnunetv2.inference.data_iterators import PreprocessAdapterFromNpy
    from nnunetv2.inference.export_prediction import (
        convert_predicted_logits_to_segmentation_with_correct_shape as convert,
    )

    case = next(c for c in (*cases(dataset), probe_case(dataset)) if c.name == case_name)
    p = predictor(dataset, folds, mirroring, tile_step_size)
    recorded: dict[str, Any] = {}
    original = p.predict_logits_from_preprocessed_data

    def record(data: Any) -> Any:
        recorded["data"] = data.clone()
        recorded["logits"] = original(data)
        return recorded["logits"]

    p.predict_logits_from_preprocessed_data = record
    try:
        with torch.no_grad():
            segmentation = p.predict_single_npy_array(case.image, {"spacing": list(case.spacing)})
    finally:
        del p.predict_logits_from_preprocessed_data
    adapter = PreprocessAdapterFromNpy(  # preprocessing only, for nnU-Net's data_properties
        [case.image], None, [{"spacing": list(case.spacing)}], None, p.plans_manager, p.dataset_json,
        p.configuration_manager, num_threads_in_multithreaded=1,
    )
    properties = next(adapter)["data_properties"]
    logits = recorded["logits"].cpu()
    _, probabilities = convert(
        logits, p.plans_manager, p.configuration_manager, p.label_manager, properties,
        return_probabilities=True,
    )
    return Reference(
        segmentation=np.asarray(segmentation),
        preprocessed=recorded["data"].numpy(),
        logits=logits.numpy(),
        probabilities=np.asarray(probabilities),
        properties=properties,
    )


def dice_per_label(a: np.ndarray, b: np.ndarray, labels: tuple[int, ...]) -> dict[int, float]:
    """Dice of every label (1.0 when the label is absent from both)."""
    result = {}
    for label in labels:
        x, y = a == label, b == label
        total = int(x.sum()) + int(y.sum())
        result[label] = 1.0 if total == 0 else 2.0 * int((x & y).sum()) / total
    return result
