"""Faults: a missing fold model fails requests clearly and recovers; disconnecting clients wedge nothing.

Uses its OWN server in explicit model-control mode (so a test can unload and reload ``fold_0``) over the
SynthCT test repository that pipeline_support builds. Requests use the probe case without mirroring
(one tile per fold): cheap on 2 shared cores, same code path.

Cancellation goes to ``orchestrator_model`` directly over gRPC (the client's ``cancel()`` reaches the
model as ``request.is_cancelled()``); Triton's statistics API counts the tiles ``fold_0`` ran for it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from pipeline_support import SYNTHCT, build, model_dir, probe_case, reference

from nnunet_triton import io_names
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.errors import ClientError
from nnunet_triton.server.model_control import ModelControl

INTERNAL_OR_UNAVAILABLE = {"500", "503", "StatusCode.INTERNAL", "StatusCode.UNAVAILABLE"}


@pytest.fixture(scope="module")
def explicit_server(triton_server):
    with triton_server(build(SYNTHCT), model_control_mode="explicit", load_models=("*",)) as handle:
        yield handle


def _url(server, protocol: str) -> str:
    return server.http_url if protocol == "http" else server.grpc_url


def _assert_probe_segments(server, protocol: str = "http") -> None:
    probe = probe_case(SYNTHCT)
    with NnunetClient(_url(server, protocol), protocol=protocol, timeout_s=900) as client:
        result = client.segment(probe.image, probe.spacing, mirroring=False)
    np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, probe.name, False).segmentation)


def _wait_ready(client, model: str, ready: bool, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.is_model_ready(model) != ready:
        if time.monotonic() > deadline:
            raise TimeoutError(f"model {model!r} ready={not ready} after {timeout_s} s")
        time.sleep(0.2)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_request_fails_naming_fold_model_when_unloaded_and_succeeds_after_reload(explicit_server, protocol):
    import tritonclient.http as http

    probe = probe_case(SYNTHCT)
    control = http.InferenceServerClient(explicit_server.http_url, network_timeout=900)
    try:
        control.unload_model("fold_0", headers=explicit_server.control_headers)
        _wait_ready(control, "fold_0", ready=False)
        with NnunetClient(_url(explicit_server, protocol), protocol=protocol, timeout_s=900) as client:
            with pytest.raises(
                ClientError, match=r"model 'fold_0' failed: .*Model 'fold_0' is not ready"
            ) as info:
                client.segment(probe.image, probe.spacing, mirroring=False)
        assert info.value.status in INTERNAL_OR_UNAVAILABLE, (info.value.status, str(info.value))
    finally:
        control.load_model("fold_0", headers=explicit_server.control_headers)
        _wait_ready(control, "fold_0", ready=True)
        control.close()
    _assert_probe_segments(explicit_server, protocol)


def _raw_http_request(url: str, network_timeout: float) -> None:
    import tritonclient.http as http

    case = probe_case(SYNTHCT)  # with mirroring: 8 forwards per fold, seconds of work on the server
    client = http.InferenceServerClient(url, network_timeout=network_timeout, connection_timeout=60)
    try:
        image = http.InferInput(io_names.IMAGE, list(case.image.shape), "FP32")
        image.set_data_from_numpy(case.image, binary_data=True)
        spacing = http.InferInput(io_names.SPACING, [3], "FP64")
        spacing.set_data_from_numpy(np.asarray(case.spacing, np.float64), binary_data=True)
        client.infer(io_names.ENDPOINT_MODEL, [image, spacing], parameters={"mirroring": True})
    finally:
        client.close()


def test_http_clients_that_disconnect_mid_request_do_not_wedge_the_orchestrator(explicit_server):
    for _ in range(2):  # each gives up after 0.2 s and closes its socket while the server still works
        with pytest.raises(Exception, match=r"(?i)timed? ?out"):
            _raw_http_request(explicit_server.http_url, network_timeout=0.2)
    _assert_probe_segments(explicit_server, "http")


def test_grpc_client_deadline_mid_request_does_not_wedge_the_orchestrator(explicit_server):
    case = probe_case(SYNTHCT)
    with NnunetClient(explicit_server.grpc_url, protocol="grpc", timeout_s=0.2) as client:
        client.check_ready()
        with pytest.raises(ClientError, match=r"Deadline Exceeded") as info:
            client.segment(case.image, case.spacing, mirroring=True)
    assert info.value.status == "StatusCode.DEADLINE_EXCEEDED", (info.value.status, str(info.value))
    _assert_probe_segments(explicit_server, "grpc")


def _fold_items(stats_client, model: str = "fold_0") -> int:
    """Network inputs (tiles) ``model`` has run since the server started (a ``ModelControl``: statistics
    need the launcher's token)."""
    (stats,) = stats_client.statistics(model)["model_stats"]
    return int(stats["inference_count"])


def _orchestrator_requests_done(stats_client) -> int:
    (stats,) = stats_client.statistics(io_names.ORCHESTRATOR_MODEL)["model_stats"]
    return sum(int(stats["inference_stats"][k]["count"]) for k in ("success", "fail"))


def _wait_until(condition, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached after {timeout_s} s")
        time.sleep(0.05)


def test_grpc_cancel_stops_orchestrator_sending_tiles_and_next_request_is_correct(explicit_server,
                                                                                 record_property):
    import tritonclient.grpc as grpc

    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.numerics.sliding_window import mirror_combinations
    from nnunet_triton.numerics.tiling import tile_slicers

    config = read_model_folder(model_dir(SYNTHCT))
    # within the test repository's limits (3 x 80 x 128 x 128 float32 logits < TEST_MAX_REQUEST_BYTES): the
    # orchestrator refuses a volume the endpoint would refuse
    data = np.random.default_rng(0).standard_normal((1, 80, 128, 128), dtype=np.float32)
    variants = 1 + len(mirror_combinations(config.mirror_axes))
    full = len(tile_slicers(data.shape[1:], config.patch_size, 0.5)) * variants  # 294 tiles x 8 = 2352
    stats = ModelControl(explicit_server.http_url, explicit_server.control_token)
    client = grpc.InferenceServerClient(explicit_server.grpc_url)
    results: list = []
    try:
        items_before, done_before = _fold_items(stats), _orchestrator_requests_done(stats)
        tensor = grpc.InferInput(io_names.PREPROCESSED, list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        call = client.async_infer(
            io_names.ORCHESTRATOR_MODEL, [tensor], callback=lambda result, error: results.append(error),
            parameters={"mirroring": True, "folds": "0"},
        )
        _wait_until(lambda: _fold_items(stats) > items_before, "fold_0 running the request's tiles")
        call.cancel()
        try:  # without the cancellation check the request runs all its tiles (several minutes here)
            _wait_until(lambda: _orchestrator_requests_done(stats) > done_before, "end", timeout_s=120.0)
        except TimeoutError:
            raise AssertionError(
                f"orchestrator request still running 120 s after the cancel: fold_0 ran "
                f"{_fold_items(stats) - items_before} of its {full} tiles"
            ) from None
        ran = _fold_items(stats) - items_before
        _wait_until(lambda: bool(results), "client callback")
    finally:
        client.close()
    record_property("fold_items_run", ran)
    record_property("fold_items_full_request", full)
    assert "CANCELLED" in str(results[0].status()), results
    # fold_0 ran a few batches of 4 (those sent before the cancel was seen), not the full request
    assert 0 < ran < full // 4, (ran, full)
    _assert_probe_segments(explicit_server, "grpc")
