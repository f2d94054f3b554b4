"""libtorch fold models (Triton's PyTorch backend, built by ``make triton-backends``) on the embedded server.

- Exact default (target cpu, ``per_sample_forward``): fold ``max_batch_size`` 1 and one tile per orchestrator
  request, so every forward is nnU-Net's batch-1 forward: the endpoint's label map equals nnUNetPredictor's,
  its probabilities are within the parity tolerance and the orchestrator's LOGITS are bit-identical.
- Batched mode (``per_sample_forward=False``): labelled so; tiles of concurrent requests are merged into one
  forward (visible in the fold's batch statistics); the fold logits are measured against nnU-Net's one-tile
  forwards and stay within a bound.

The backend is built (or taken from its cache) once per session by ``server.backend_build``; the test is
skipped only where the Triton sources are absent.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import BUILD_ROOT, REPO_ROOT, SYNTHCT, cases, model_dir, reference

from nnunet_triton import io_names
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.builder.repository import build_repository
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.client.endpoint import describe_endpoint
from nnunet_triton.errors import ServerError
from nnunet_triton.server.handle import ServerHandle

FOLDS = (0,)
TILE_BATCH = 4
PROBABILITY_TOLERANCE = 1e-6  # as test_pipeline_parity: float32 exp computed in float64 (an ulp apart)
# fold logits of a batch of 4 differed by up to 3.8e-5 from nnU-Net's one-tile forwards on our machines
BATCHED_LOGITS_BOUND = 1e-3
QUEUE_DELAY_US = 300_000  # requests sent together on a busy 2-core machine land in one dynamic batch
TIMEOUT_S = 900.0


@pytest.fixture(scope="session")
def backend_dir() -> Path:
    from nnunet_triton.server.backend_build import DEFAULT_OUT, build_pytorch_backend, find_source

    try:
        find_source(start=REPO_ROOT)
    except ServerError as exc:
        pytest.skip(str(exc))
    build_pytorch_backend(out=REPO_ROOT / DEFAULT_OUT)
    return REPO_ROOT / DEFAULT_OUT


def _build(name: str, options: BuildOptions, *, folds_only: bool = False) -> Path:
    out = BUILD_ROOT / name
    return build_repository(model_dir(SYNTHCT), out, options=options, folds=FOLDS, folds_only=folds_only).out


@pytest.fixture(scope="module")
def exact_server(triton_server, backend_dir):
    repository = _build("libtorch-exact", BuildOptions(fold_runner="libtorch", tile_batch_size=TILE_BATCH,
                                                       max_inflight=4))
    with triton_server(repository, backend_dirs=[backend_dir]) as handle:
        yield handle, repository


@pytest.fixture(scope="module")
def batched_server(triton_server, backend_dir):
    options = BuildOptions(fold_runner="libtorch", tile_batch_size=TILE_BATCH, per_sample_forward=False,
                           orchestrator_instances=2, fold_queue_delay_us=QUEUE_DELAY_US)
    repository = _build("libtorch-batched", options, folds_only=True)
    with triton_server(repository, backend_dirs=[backend_dir]) as handle:
        yield handle


def _orchestrator_logits(url: str, data: np.ndarray) -> np.ndarray:
    import tritonclient.http as http

    client = http.InferenceServerClient(url, network_timeout=TIMEOUT_S)
    try:
        tensor = http.InferInput(io_names.PREPROCESSED, list(data.shape), "FP32")
        tensor.set_data_from_numpy(np.ascontiguousarray(data, dtype=np.float32), binary_data=True)
        response = client.infer(io_names.ORCHESTRATOR_MODEL, [tensor],
                                outputs=[http.InferRequestedOutput(io_names.LOGITS)],
                                parameters={"mirroring": False})
        return response.as_numpy(io_names.LOGITS)
    finally:
        client.close()


def test_libtorch_folds_equal_nnunet_bitwise_at_the_default(exact_server):
    server, repository = exact_server
    case = cases(SYNTHCT)[0]
    ref = reference(SYNTHCT, case.name, False, FOLDS)
    with NnunetClient(server.http_url, timeout_s=TIMEOUT_S) as client:
        result = client.segment(case.image, case.spacing, mirroring=False, folds=list(FOLDS),
                                probabilities=True)
    logits = _orchestrator_logits(server.http_url, ref.preprocessed)
    published = describe_endpoint(server.http_url).published
    fold_config = (repository / "fold_0" / "config.pbtxt").read_text()
    recorded = json.loads((repository / "repository_metadata.json").read_text())["endpoints"]["nnunet"]
    version = recorded["versions"][str(recorded["promoted"])]

    assert 'platform: "pytorch_libtorch"' in fold_config and "max_batch_size: 1\n" in fold_config
    assert published["fold_forward"].startswith("exact")
    assert (version["per_sample_forward"], version["fold_request_tiles"]) == (True, 1)
    np.testing.assert_array_equal(result.segmentation, ref.segmentation)
    assert float(np.abs(result.probabilities - ref.probabilities).max()) <= PROBABILITY_TOLERANCE
    np.testing.assert_array_equal(logits, ref.logits)


def _tiles(n: int, seed: int) -> np.ndarray:
    from nnunet_triton.numerics.model_folder import read_model_folder

    config = read_model_folder(model_dir(SYNTHCT), folds=FOLDS)
    return np.random.default_rng(seed).normal(size=(n, config.num_input_channels, *config.patch_size)
                                              ).astype(np.float32)


def _fold_infer(url: str, tiles: np.ndarray) -> np.ndarray:
    import tritonclient.http as http

    client = http.InferenceServerClient(url, network_timeout=TIMEOUT_S)
    try:
        tensor = http.InferInput(io_names.FOLD_INPUT, list(tiles.shape), "FP32")
        tensor.set_data_from_numpy(tiles, binary_data=True)
        return client.infer("fold_0", [tensor]).as_numpy(io_names.FOLD_OUTPUT)
    finally:
        client.close()


def _batch_sizes(server: ServerHandle) -> dict[int, int]:
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url)
    try:  # the statistics API is restricted to the launcher's token
        stats = client.get_inference_statistics("fold_0", headers=server.control_headers)["model_stats"][0]
    finally:
        client.close()
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])}


def test_libtorch_batched_mode_merges_concurrent_requests_within_the_bound(batched_server):
    import torch

    from nnunet_triton.validate.oracle import nnunet_predictor

    requests = [_tiles(TILE_BATCH, seed) for seed in (1, 2)]
    before = _batch_sizes(batched_server)  # the warm-up ran batches of 1, 4 and 8 already
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda tiles: _fold_infer(batched_server.http_url, tiles), requests))
    network = nnunet_predictor(model_dir(SYNTHCT), folds=FOLDS).network.eval()
    with torch.inference_mode():  # nnU-Net's way: one tile per forward
        expected = [np.concatenate([network(torch.from_numpy(t[None])).numpy() for t in tiles])
                    for tiles in requests]
    diff = max(float(np.abs(a - e).max()) for a, e in zip(answers, expected, strict=True))
    deadline = time.monotonic() + 30.0
    while True:  # the backend reports an execution's statistics after it sent the responses
        after = _batch_sizes(batched_server)
        sizes = {size: n - before.get(size, 0) for size, n in after.items() if n > before.get(size, 0)}
        if sum(size * n for size, n in sizes.items()) >= 2 * TILE_BATCH or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    report = REPO_ROOT / "build" / "reports" / "libtorch_batched.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps({"fold_logits_max_abs_diff": diff, "batch_sizes": sizes}, indent=2))

    assert sizes == {2 * TILE_BATCH: 1}  # the two requests ran as one forward
    assert diff <= BATCHED_LOGITS_BOUND
