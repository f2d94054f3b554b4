"""Fold models on the embedded tritonserver with the Python TorchScript runner.

Builds a repository with only the fold models (``repository/build.py --folds-only``, target cpu, so
``per_sample_forward`` is on), sends tile batches over HTTP and compares with nnU-Net's own network
(``nnUNetPredictor``) run one tile at a time as nnU-Net does: bit-identical; concurrent requests are
merged by the dynamic batcher into fewer executions.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nnunet_triton import io_names
from nnunet_triton.builder import repository as build
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.validate.oracle import nnunet_predictor
from tests.fixture_paths import require_fixture

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get(
    "NNUNET_TRITON_TEST_MODEL",
    REPO_ROOT / "tests" / "fixtures" / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny",
))
FOLDS = (0, 1)
TILE_BATCH = 4
# long enough that requests sent together on a busy 2-core machine land in one dynamic batch
QUEUE_DELAY_US = 300_000


@pytest.fixture(autouse=True)
def _committed_fixture() -> None:
    require_fixture(MODEL_DIR / "plans.json")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fold-repo") / "model_repository"
    # torch_threads=0: the stub keeps torch's default thread count, like this test process.
    options = BuildOptions(tile_batch_size=TILE_BATCH, fold_queue_delay_us=QUEUE_DELAY_US, torch_threads=0)
    assert options.per_sample_forward
    build.build_repository(MODEL_DIR, out, folds=FOLDS, folds_only=True, options=options)
    return out


@pytest.fixture(scope="module")
def server(triton_server, repository: Path):
    # The stub finds nnunet_triton through the environment when the package is not pip-installed.
    with pytest.MonkeyPatch.context() as patch:
        paths = [str(REPO_ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        patch.setenv("PYTHONPATH", os.pathsep.join(paths))
        with triton_server(repository) as handle:
            yield handle


@pytest.fixture()
def client(server):
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"), concurrency=8)
    yield client
    client.close()


def _networks() -> dict[int, torch.nn.Module]:
    return {fold: nnunet_predictor(MODEL_DIR, folds=(fold,)).network.eval() for fold in FOLDS}


@pytest.fixture(scope="module")
def networks() -> dict[int, torch.nn.Module]:
    return _networks()


def _tiles(n: int, seed: int) -> np.ndarray:
    from nnunet_triton.numerics.model_folder import read_model_folder

    config = read_model_folder(MODEL_DIR, folds=(0,))
    shape = (n, config.num_input_channels, *config.patch_size)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _request(tiles: np.ndarray) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput(io_names.FOLD_INPUT, list(tiles.shape), "FP32")
    tensor.set_data_from_numpy(tiles)
    return [tensor]


def _nnunet_tiles(network: torch.nn.Module, tiles: np.ndarray) -> np.ndarray:
    """One batch-1 forward per tile, as ``nnUNetPredictor._internal_maybe_mirror_and_predict``."""
    with torch.inference_mode():
        return np.concatenate([network(torch.from_numpy(tiles[i:i + 1])).numpy() for i in range(len(tiles))])


def _stats(client: httpclient.InferenceServerClient, model: str, headers: dict[str, str]) -> tuple[int, int]:
    (stats,) = client.get_inference_statistics(model, headers=headers)["model_stats"]
    return int(stats["inference_count"]), int(stats["execution_count"])


def _stats_counting(client: httpclient.InferenceServerClient, model: str, headers: dict[str, str],
                    inferences: int, timeout_s: float = 30.0) -> tuple[int, int]:
    """The statistics once they count ``inferences``: Triton records an execution after the backend's
    ``execute`` returns, which can be after the client already holds the responses."""
    deadline = time.monotonic() + timeout_s
    while True:
        counted = _stats(client, model, headers)
        if counted[0] >= inferences or time.monotonic() > deadline:
            return counted
        time.sleep(0.02)


def test_server_loads_fold_models_when_metadata_file_sits_at_repository_root(client, repository) -> None:
    assert (repository / "repository_metadata.json").is_file()
    assert all(client.is_model_ready(io_names.fold_model_name(f)) for f in FOLDS)


@pytest.mark.parametrize("fold", FOLDS)
def test_fold_model_output_equals_nnunet_per_tile_forwards_bitwise_when_batch_is_one_request(
    client, networks, fold: int
) -> None:
    tiles = _tiles(TILE_BATCH, seed=fold)
    result = client.infer(io_names.fold_model_name(fold), _request(tiles))
    output = result.as_numpy(io_names.FOLD_OUTPUT)
    expected = _nnunet_tiles(networks[fold], tiles)
    assert (output.dtype, output.shape) == (np.float32, expected.shape)
    np.testing.assert_array_equal(output, expected)


def test_concurrent_requests_run_in_fewer_executions_and_equal_nnunet_bitwise(server, client, networks):
    """One tile per request, sent together: the dynamic batcher merges them into fewer executions."""
    model = io_names.fold_model_name(0)
    tiles = _tiles(TILE_BATCH, seed=42)
    inferences_before, executions_before = _stats(client, model, server.control_headers)
    pending = [client.async_infer(model, _request(tiles[i:i + 1])) for i in range(TILE_BATCH)]
    outputs = np.concatenate([p.get_result().as_numpy(io_names.FOLD_OUTPUT) for p in pending])
    inferences_after, executions_after = _stats_counting(client, model, server.control_headers,
                                                         inferences_before + TILE_BATCH)
    assert inferences_after - inferences_before == TILE_BATCH
    assert executions_after - executions_before < TILE_BATCH
    np.testing.assert_array_equal(outputs, _nnunet_tiles(networks[0], tiles))


def test_fold_model_rejects_batch_larger_than_tile_cap(client) -> None:
    with pytest.raises(InferenceServerException, match="batch-size must be <= 4"):
        client.infer(io_names.fold_model_name(0), _request(_tiles(TILE_BATCH + 1, seed=0)))
