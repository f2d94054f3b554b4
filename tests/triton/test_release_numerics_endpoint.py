"""An old model folder built with ``--numerics 2.0`` is served by the real Triton server with nnU-Net 2.0's
own answer.

The many-class fixture (Dataset905, 105 heads, folds 0 and 1) is rewritten in the flat plans format nnU-Net
2.0 to 2.2.x wrote (``tools.fixtures.old_plans``) and built with ``BuildOptions(numerics="2.0")``: the
orchestrator fuses the folds as 2.0 does (``/ n`` after every fold), with 2.0's Gaussian, and the stitch
model resamples float32 logits and takes the labels from the probabilities. nnU-Net 2.0 itself
(``tools.release_oracle``, from its PyPI sdist) segments the same case from the same folder on torch's
default threads, as the server's exact thread policy does: the endpoint's label map must be identical, and
it must differ from nnU-Net 2.8.1's (1380 voxels here), so the served variants are the ones that matter.
The endpoint publishes the numerics it reproduces.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pipeline_support import BUILD_ROOT, FIXTURES

from nnunet_triton.client.client import NnunetClient
from nnunet_triton.client.endpoint import describe_endpoint
from nnunet_triton.validate.oracle import nnunet_predictor
from tests.fixture_paths import require_fixture
from tools.fixtures.old_plans import write_flat_model_folder
from tools.nnunet_releases import release_path
from tools.release_oracle import run_release

MANY = FIXTURES / "Dataset905_SynthManyClass"
MODEL = MANY / "nnUNetTrainer__nnUNetPlans__3d_tiny"
CASE = "synthmanyclass_101"
FOLDS = (0, 1)
TIMEOUT_S = 1800.0


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_fixture(MODEL / "plans.json")
    return write_flat_model_folder(MODEL, tmp_path_factory.mktemp("flat") / MODEL.name)


@pytest.fixture(scope="module")
def numerics_2_0_server(triton_server, flat_model: Path):
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.builder.repository import build_repository

    options = BuildOptions(tile_batch_size=4, per_sample_forward=True, numerics="2.0")
    result = build_repository(flat_model, BUILD_ROOT / "numerics-2.0", options=options, folds=FOLDS)
    with triton_server(result.out) as handle:
        yield handle


def _case() -> tuple[np.ndarray, tuple[float, ...], Path]:
    import SimpleITK as sitk

    path = MANY / "imagesTs" / f"{CASE}_0000.nii.gz"
    image = sitk.ReadImage(str(path))
    return sitk.GetArrayFromImage(image)[None].astype(np.float32), tuple(reversed(image.GetSpacing())), path


def test_an_old_folder_served_with_numerics_2_0_answers_nnunet_2_0s_labels(numerics_2_0_server, flat_model,
                                                                            tmp_path) -> None:
    import SimpleITK as sitk

    if not (release_path("2.0") / "nnunetv2" / "__init__.py").is_file():
        pytest.fail("nnU-Net 2.0 is not cached: `make setup` runs `make nnunet-releases`", pytrace=False)
    image, spacing, path = _case()
    run_release("2.0", flat_model, tmp_path, [[path]], folds=FOLDS, threads=None)
    theirs = sitk.GetArrayFromImage(sitk.ReadImage(str(tmp_path / f"{CASE}.nii.gz")))
    with NnunetClient(numerics_2_0_server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        served = client.segment(image, spacing).segmentation
    assert int(np.count_nonzero(served != theirs)) == 0
    current = np.asarray(nnunet_predictor(MODEL, folds=FOLDS).predict_single_npy_array(
        image, {"spacing": list(spacing)}))
    assert np.count_nonzero(current != theirs) > 100  # 2.0's fold fusion and export change these labels


def test_the_endpoint_publishes_the_numerics_it_reproduces(numerics_2_0_server) -> None:
    described = describe_endpoint(numerics_2_0_server.grpc_url, "grpc", timeout_s=60.0)
    numerics = described.published["numerics"]
    assert numerics["numerics"] == "2.0"
    assert numerics["fold_fusion"] == "divide after every fold" and numerics["export_dtype"] == "float32"
