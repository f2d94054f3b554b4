"""``--numerics <release>`` reproduces that nnU-Net release's own answers, bit for bit, on the CPU.

Each old release runs from its own PyPI sdist (``make nnunet-releases``: ``tools.nnunet_releases``), in a
subprocess whose ``import nnunetv2`` is that release's code on this venv's torch (``tools.release_oracle``).
Against it, ``validate.local.LocalPredictor`` runs the library's numerics with the release's variants
(``numerics.releases``), on the same fold networks and one torch thread on both sides:

- label maps of the many-class fixture (Dataset905, 105 heads, folds 0 and 1: the fold fusion of 2.0, the
  float32 export of 2.0/2.1 and the float16 Gaussian of 2.2 all change labels there), read by releases
  before 2.3 from a copy in their flat plans format (``tools.fixtures.old_plans``), which the library reads
  too;
- every release's importance map for 3D and 2D patches;
- the export's spacing (releases before 2.5.1 pass the reader-order spacing): the releases' own
  ``convert_predicted_logits_to_segmentation_with_correct_shape`` on logits of a 2D configuration of a
  transposed dataset (Dataset902's plans), where 2.4.1 and 2.5.1 disagree.

The test also pins where the releases differ from nnU-Net 2.8.1 on these inputs, so that a variant that
stopped mattering (or a reference that stopped differing) shows.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nnunet_triton.builder.fold_network import load_fold_network
from nnunet_triton.numerics.model_folder import load_inference_config, read_model_folder
from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation
from nnunet_triton.numerics.preprocess import CaseProperties
from nnunet_triton.numerics.releases import GaussianRule, release_numerics
from nnunet_triton.validate.local import LocalPredictor
from tests.fixture_paths import require_fixture
from tools.fixtures.old_plans import write_flat_model_folder
from tools.nnunet_releases import RELEASES, release_path
from tools.release_oracle import run_release

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MANY = FIXTURES / "Dataset905_SynthManyClass"
MANY_MODEL = MANY / "nnUNetTrainer__nnUNetPlans__3d_tiny"
MANY_CASE = "synthmanyclass_101"
ANISO_MODEL = FIXTURES / "Dataset902_SynthAniso" / "nnUNetTrainer__nnUNetPlans__3d_tiny"
FOLDS = (0, 1)
NUMERICS = {"2.0": "2.0", "2.1": "2.1", "2.2": "2.2", "2.2.1": "2.2.1", "2.3.1": "2.3", "2.4.1": "2.4",
            "2.5.1": "2.5"}
FLAT_PLANS = ("2.0", "2.1", "2.2", "2.2.1")  # read only the pre-2.3 plans format
DIFFER_FROM_2_8 = {"2.0", "2.1", "2.2"}  # labels of MANY_CASE that are not nnU-Net 2.8.1's
PATCHES = ((8, 8, 8), (24, 20, 16), (64, 64, 64), (128, 128, 128), (20, 30), (512, 512))
EXPORTS = ("2.4.1", "2.5.1")  # the export-spacing switch


@pytest.fixture(scope="module")
def releases() -> None:
    for release in NUMERICS:
        if not (release_path(release) / "nnunetv2" / "__init__.py").is_file():
            pytest.fail(f"nnU-Net {release} is not cached at {release_path(release)}: `make setup` runs "
                        "`make nnunet-releases`", pytrace=False)


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_fixture(MANY_MODEL / "plans.json")
    return write_flat_model_folder(MANY_MODEL, tmp_path_factory.mktemp("flat") / MANY_MODEL.name)


@pytest.fixture(scope="module")
def case_image() -> tuple[np.ndarray, tuple[float, ...], Path]:
    import SimpleITK as sitk

    path = MANY / "imagesTs" / f"{MANY_CASE}_0000.nii.gz"
    image = sitk.ReadImage(str(path))
    return sitk.GetArrayFromImage(image)[None].astype(np.float32), tuple(reversed(image.GetSpacing())), path


def _export_case(folder: Path) -> tuple[Path, np.ndarray, CaseProperties, dict, dict]:
    """Logits of Dataset902's 2d configuration (transpose_forward (2, 0, 1)) for a case whose reader-order
    spacing differs from its transposed one, written as the npz ``tools.release_oracle --export`` reads."""
    plans = json.loads((ANISO_MODEL / "plans.json").read_text())
    dataset = json.loads((ANISO_MODEL / "dataset.json").read_text())
    rng = np.random.default_rng(46)
    spacing = (0.785, 0.785, 3.0)  # reader order; transposed by (2, 0, 1): (3.0, 0.785, 0.785)
    cropped = (6, 14, 15)  # transposed order
    props = CaseProperties(spacing=spacing, shape_before_cropping=(7, 16, 15),
                           bbox=((1, 7), (1, 15), (0, 15)),
                           shape_after_cropping_and_before_resampling=cropped)
    logits = rng.normal(0, 2, size=(3, 6, 11, 12)).astype(np.float16)
    properties = {"spacing": list(spacing), "shape_before_cropping": list(props.shape_before_cropping),
                  "bbox_used_for_cropping": [list(b) for b in props.bbox],
                  "shape_after_cropping_and_before_resampling": list(cropped)}
    path = folder / "export_case.npz"
    np.savez(path, logits=logits, plans=json.dumps(plans), dataset=json.dumps(dataset), configuration="2d",
             properties=json.dumps(properties))
    return path, logits, props, plans, dataset


@pytest.fixture(scope="module")
def oracle(releases: None, flat_model: Path, case_image: tuple, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, dict]:
    """Per release: its label map of MANY_CASE, its Gaussian maps and (2.4.1, 2.5.1) its export."""
    from concurrent.futures import ThreadPoolExecutor

    import SimpleITK as sitk

    folder = tmp_path_factory.mktemp("oracle")
    export_npz = _export_case(folder)[0]

    def run(release: str) -> None:
        model = flat_model if release in FLAT_PLANS else MANY_MODEL
        run_release(release, model, folder / release, [[case_image[2]]], folds=FOLDS, gaussians=PATCHES,
                    export=export_npz if release in EXPORTS else None)

    with ThreadPoolExecutor(2) as pool:  # two subprocesses at a time, one torch thread each
        list(pool.map(run, NUMERICS))
    found: dict[str, dict] = {}
    for release in NUMERICS:
        out = folder / release
        found[release] = {
            "labels": sitk.GetArrayFromImage(sitk.ReadImage(str(out / f"{MANY_CASE}.nii.gz"))),
            "gaussians": dict(np.load(out / "gaussians.npz")),
            "used_gaussian": np.load(out / "used_gaussian.npy"),
            "export": np.load(out / "export.npy") if release in EXPORTS else None,
        }
    return found


@pytest.fixture(scope="module")
def ours(flat_model: Path, case_image: tuple) -> dict[str, np.ndarray]:
    """The library's label map of MANY_CASE under every numerics, from the flat-format copy."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the oracle's torch thread count (oneDNN's rounding depends on it)
    try:
        predictor = LocalPredictor(flat_model, lambda folder, fold: load_fold_network(folder, fold).network,
                                   folds=FOLDS)
        image, spacing, _ = case_image
        return {name: predictor.predict(image, spacing, numerics=name)
                for name in [*NUMERICS.values(), "2.8"]}
    finally:
        torch.set_num_threads(threads)


def test_the_release_cache_holds_every_release_of_the_table() -> None:
    assert set(NUMERICS) == set(RELEASES)
    assert {release_numerics(n).name for n in NUMERICS.values()} == set(NUMERICS.values())


@pytest.mark.parametrize("release", list(NUMERICS))
def test_numerics_of_a_release_give_that_releases_own_labels(release: str, oracle: dict, ours: dict) -> None:
    theirs = oracle[release]["labels"]
    mine = ours[NUMERICS[release]]
    assert mine.shape == theirs.shape
    differing = int(np.count_nonzero(mine != theirs))
    assert differing == 0, f"--numerics {NUMERICS[release]}: {differing} voxels differ from nnU-Net {release}"


def test_old_releases_differ_from_2_8_where_the_table_says_and_nowhere_else(oracle: dict, ours: dict) -> None:
    differing = {release: int(np.count_nonzero(oracle[release]["labels"] != ours["2.8"]))
                 for release in NUMERICS}
    assert {release for release, n in differing.items() if n} == DIFFER_FROM_2_8, differing


@pytest.mark.parametrize("release", list(NUMERICS))
def test_the_gaussian_of_a_release_is_that_releases_map_bit_for_bit(release: str, oracle: dict) -> None:
    from nnunet_triton.numerics.gaussian import compute_gaussian

    rule = release_numerics(NUMERICS[release]).gaussian
    used = oracle[release]["used_gaussian"]  # what its predictor computed, with its own arguments
    assert np.array_equal(compute_gaussian(used.shape, rule=rule).view(np.uint16), used.view(np.uint16))
    for patch in PATCHES:
        theirs = oracle[release]["gaussians"]["x".join(map(str, patch))]
        mine = compute_gaussian(patch, rule=rule)
        assert mine.dtype == theirs.dtype == np.float16
        assert np.array_equal(mine.view(np.uint16), theirs.view(np.uint16)), (release, patch)
    if rule in (GaussianRule.PEAK1_NUMPY, GaussianRule.FP16_PEAK1000):  # (2.2.1-2.3's form rounds like
        assert not np.array_equal(compute_gaussian((64, 64, 64), rule=rule),  # 2.4's on these patches)
                                  compute_gaussian((64, 64, 64)))


def test_the_export_spacing_of_releases_before_2_5_1_is_in_reader_order(oracle: dict, tmp_path: Path) -> None:
    _, logits, props, plans, dataset = _export_case(tmp_path)
    config = load_inference_config(plans, dataset, "2d", trainer_name="nnUNetTrainer", mirror_axes=None,
                                   folds=(0,))
    assert not np.array_equal(oracle["2.4.1"]["export"], oracle["2.5.1"]["export"])  # the switch matters here
    for release in EXPORTS:
        mine = convert_logits_to_segmentation(logits, props, replace(config, numerics=NUMERICS[release]))
        assert np.array_equal(mine, oracle[release]["export"]), release


def test_a_model_folder_in_the_flat_plans_format_reads_as_the_same_configuration(flat_model: Path) -> None:
    flat, current = read_model_folder(flat_model, folds=FOLDS), read_model_folder(MANY_MODEL, folds=FOLDS)
    plans = json.loads((flat_model / "plans.json").read_text())
    assert "architecture" not in plans["configurations"]["3d_tiny"]
    assert flat == current


@pytest.fixture(scope="module")
def folder_validated_by_2_0(releases: None, flat_model: Path, case_image: tuple,
                            tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A copy of the flat-plans folder whose fold_0/validation/ holds nnU-Net 2.0's prediction of MANY_CASE by
    fold 0 alone (what 2.0's validation writes), and a folder with that case's image."""
    import shutil

    root = tmp_path_factory.mktemp("validated")
    model = Path(shutil.copytree(flat_model, root / flat_model.name))
    run_release("2.0", model, model / "fold_0" / "validation", [[case_image[2]]], folds=(0,))
    images = root / "imagesTr"
    images.mkdir()
    shutil.copy(case_image[2], images / case_image[2].name)
    return model, images


def test_detect_release_names_the_release_that_wrote_a_folders_validation(folder_validated_by_2_0,
                                                                          tmp_path: Path) -> None:
    from nnunet_triton.cli import main

    model, images = folder_validated_by_2_0
    assert main(["validate", "--detect-release", "--model-dir", str(model), "-i", str(images),
                 "--report", str(tmp_path)]) == 0
    found = json.loads((tmp_path / "release_detection.json").read_text())
    assert found["possible"] == ["2.8", "2.5", "2.4", "2.3", "2.2.1", "2.2", "2.1", "2.0"]  # flat: any
    assert found["cases"] == 1 and "2.0" in found["reproducing"]
    assert set(found["reproducing"]) <= {"2.0", "2.1"}  # one fold: 2.0's fold fusion cannot show
    assert found["differences"]["2.2.1"]["fold_0/" + MANY_CASE] > 0


def test_detect_release_without_validation_outputs_reports_the_plans_range_and_fails(tmp_path: Path) -> None:
    from nnunet_triton.cli import main

    images = tmp_path / "images"
    images.mkdir()
    assert main(["validate", "--detect-release", "--model-dir", str(MANY_MODEL), "-i", str(images),
                 "--report", str(tmp_path / "report")]) == 1
    found = json.loads((tmp_path / "report" / "release_detection.json").read_text())
    assert found["cases"] == 0 and found["reproducing"] == []
    assert found["possible"] == ["2.8", "2.5", "2.4", "2.3"]
    assert "2.3 or newer" in found["reasons"][0]
