"""Concurrent clients get nnU-Net's results; bad requests get INVALID_ARG and do not disturb the next one.

Uses the SynthCT fixture on the shared embedded server (see pipeline_support).
"""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pipeline_support import (
    SYNTHCT,
    TILE_BATCH_SIZE,
    build,
    cases,
    probe_case,
    reference,
    shared_server,
)

from nnunet_triton import io_names
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.errors import ClientError

INVALID_ARG = {"400", "StatusCode.INVALID_ARGUMENT"}  # HTTP / gRPC spelling of Triton's INVALID_ARG


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


def _url(server, protocol: str) -> str:
    return server.http_url if protocol == "http" else server.grpc_url


def test_four_concurrent_clients_get_nnunet_segmentations(server):
    jobs = [  # (protocol, case index, mirroring); every client has its own connection and thread
        ("http", 0, True), ("grpc", 1, False), ("http", 2, False), ("grpc", 0, False),
    ]

    def run(job):
        protocol, index, mirroring = job
        case = cases(SYNTHCT)[index]
        with NnunetClient(_url(server, protocol), protocol=protocol, timeout_s=1800) as client:
            return client.segment(case.image, case.spacing, mirroring=mirroring).segmentation

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (protocol, index, mirroring), segmentation in zip(jobs, results, strict=True):
        case = cases(SYNTHCT)[index]
        expected = reference(SYNTHCT, case.name, mirroring).segmentation
        np.testing.assert_array_equal(segmentation, expected, err_msg=f"{protocol} {case.name} {mirroring}")


def _fold_counts(server, model: str) -> tuple[float, float]:
    """Triton's ``nv_inference_request_success`` and ``nv_inference_exec_count`` of ``model``."""
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        text = response.read().decode()
    values = []
    for metric in ("nv_inference_request_success", "nv_inference_exec_count"):
        match = re.search(rf'^{metric}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.MULTILINE)
        assert match is not None, f"no {metric} for {model} in the metrics"
        values.append(float(match.group(1)))
    return values[0], values[1]


def test_fold_models_run_tile_batches_of_concurrent_requests_together_and_answers_stay_exact(triton_server):
    # a repository working on two requests at once: its fold models take 2 x TILE_BATCH_SIZE tiles per batch
    repository = build(SYNTHCT, orchestrator_instances=2)
    fold = io_names.fold_model_name(0)
    case = cases(SYNTHCT)[0]
    with triton_server(repository, metrics=True) as server:  # the counters: metrics are opened when asked
        requests_before, executions_before = _fold_counts(server, fold)

        def run(protocol: str):
            with NnunetClient(_url(server, protocol), protocol=protocol, timeout_s=1800) as client:
                return client.segment(case.image, case.spacing, mirroring=True).segmentation

        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(run, ["http", "grpc"]))
        after = _fold_counts(server, fold)
    requests, executions = after[0] - requests_before, after[1] - executions_before
    # every tile batch is one fold request; the dynamic batcher merged some (up to 2 x TILE_BATCH_SIZE tiles)
    assert requests > executions > 0, (requests, executions, TILE_BATCH_SIZE)
    expected = reference(SYNTHCT, case.name, True).segmentation
    for segmentation in results:
        np.testing.assert_array_equal(segmentation, expected)


def _bad_requests():
    case = cases(SYNTHCT)[0]
    image, spacing = case.image, case.spacing
    z, y, x = spacing
    nan_image = image.copy()
    nan_image[0, 0, 0, 0] = np.nan
    return {
        # rejected by Triton itself (shape checks against the ensemble's config)
        "two_channels": ((np.concatenate([image, image]), spacing, {}), r"unexpected shape|IMAGE"),
        "rank_5": ((image[None], spacing, {}), r"unexpected shape|IMAGE"),
        "spacing_2_entries": ((image, spacing[:2], {}), r"unexpected shape|SPACING"),
        # rejected by preprocess_model
        "spacing_zero": ((image, (z, 0.0, x), {}), r"spacing entries must be finite and > 0"),
        "spacing_nan": ((image, (z, float("nan"), x), {}), r"spacing entries must be finite"),
        "nan_voxel": ((nan_image, spacing, {}), r"image must contain only finite values"),
        "folds_not_deployed": ((image, spacing, {"folds": [4]}), r"folds \[4\] are not deployed"),
    }


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(
    "name",
    ["two_channels", "rank_5", "spacing_2_entries", "spacing_zero", "spacing_nan", "nan_voxel",
     "folds_not_deployed"],
)
def test_bad_request_gets_invalid_arg_and_next_request_succeeds(server, protocol, name):
    (image, spacing, options), match = _bad_requests()[name]
    good = probe_case(SYNTHCT)
    with NnunetClient(_url(server, protocol), protocol=protocol, timeout_s=1800) as client:
        with pytest.raises(ClientError, match=match) as info:
            client.segment(image, spacing, **options)
        assert info.value.status in INVALID_ARG, (info.value.status, str(info.value))
        result = client.segment(good.image, good.spacing, mirroring=False)
    np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, good.name, False).segmentation)


@pytest.mark.parametrize(
    ("parameters", "match"),
    [
        ({"mirroring": "maybe"}, r"'mirroring' must be a boolean \(true/false\), got 'maybe'"),
        ({"probabilities": 3}, r"'probabilities' must be a boolean \(true/false\), got 3"),
        ({"folds": "0,0"}, r"'folds' lists folds \['0'\] twice"),
        # the client refuses these before sending (RequestOptions); a raw request reaches the server's rule
        ({"tile_step_size": 0.0}, r"'tile_step_size' must be a number in \(0, 1\], got 0.0"),
        ({"tile_step_size": 2.0}, r"'tile_step_size' must be a number in \(0, 1\], got 2.0"),
        ({"tile_size": 0.5}, r"unknown request parameters \['tile_size'\]"),
    ],
)
def test_raw_request_with_bad_parameter_gets_invalid_arg_naming_it(server, parameters, match):
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    case = cases(SYNTHCT)[0]
    client = http.InferenceServerClient(server.http_url, network_timeout=1800)
    try:
        image = http.InferInput(io_names.IMAGE, list(case.image.shape), "FP32")
        image.set_data_from_numpy(case.image, binary_data=True)
        spacing = http.InferInput(io_names.SPACING, [3], "FP64")
        spacing.set_data_from_numpy(np.asarray(case.spacing, np.float64), binary_data=True)
        with pytest.raises(InferenceServerException, match=match) as info:
            client.infer(io_names.ENDPOINT_MODEL, [image, spacing], parameters=parameters)
        assert info.value.status() == "400"
    finally:
        client.close()
