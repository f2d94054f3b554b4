"""The internal models of the pipeline answer any client that reaches the port: each bounds what it accepts
and what it makes (``numerics.limits``), with the repository's ``max_voxels``/``max_request_bytes``.

Requests go straight to ``stitch_model``, ``orchestrator_model`` and ``fold_0`` of the shared SynthCT server
(test repository: ``TEST_MAX_VOXELS``), as an attacker would send them. Once, a 421-byte request to
``stitch_model`` declaring a 700^3 volume got a 343 MB answer and left the stub's shared-memory region grown
from 16 to 400 MiB. Each refused request is INVALID_ARG naming the limit and the numbers; the server keeps
answering the probe case correctly.
"""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_support import SYNTHCT, TEST_MAX_VOXELS, probe_case, reference, shared_server

from nnunet_triton import io_names
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.server import health

SHM = "/dev/shm"


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


@pytest.fixture()
def client(server):
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url, network_timeout=300)
    yield client
    client.close()


def _tensor(name: str, array: np.ndarray, dtype: str):
    import tritonclient.http as http

    tensor = http.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def _region_bytes(server, model: str) -> int:
    (stub,) = [s for s in health.stub_processes(server.pid) if s.model == model]
    with open(f"{SHM}/{stub.shm_region}", "rb") as region:
        return region.seek(0, 2)


def _refused(client, model: str, inputs: list, outputs: list[str], match: str) -> None:
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=match) as info:
        client.infer(model, inputs, outputs=[http.InferRequestedOutput(o, binary_data=True) for o in outputs])
    assert info.value.status() == "400", (info.value.status(), str(info.value))


def _still_segments(server) -> None:
    case = probe_case(SYNTHCT)
    with NnunetClient(server.http_url) as nnunet:
        result = nnunet.segment(case.image, case.spacing, mirroring=False)
    np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, case.name, False).segmentation)


def test_stitch_request_declaring_a_700_cubed_volume_is_refused_and_its_shm_region_does_not_grow(server,
                                                                                                client):
    heads = int(client.get_model_config(io_names.STITCH_MODEL)["input"][0]["dims"][0])
    logits = np.zeros((heads, 1, 1, 1), np.float16)
    properties = np.array([1.0, 1.0, 1.0, 700, 700, 700, 0, 1, 0, 1, 0, 1, 1, 1, 1], np.float64)
    before = _region_bytes(server, io_names.STITCH_MODEL)
    inputs = [_tensor(io_names.LOGITS, logits, "FP16"), _tensor(io_names.CASE_PROPERTIES, properties, "FP64")]
    _refused(client, io_names.STITCH_MODEL, inputs,
             [io_names.SEGMENTATION], r"shape before cropping\) has 343000000 voxels .* limit of "
             rf"{TEST_MAX_VOXELS} voxels \(model parameter 'max_voxels'\)")
    assert _region_bytes(server, io_names.STITCH_MODEL) == before
    _still_segments(server)


def test_orchestrator_request_over_the_voxel_limit_is_refused_before_any_tile_runs(server, client):
    side = round(TEST_MAX_VOXELS ** (1 / 3)) + 2  # one channel (SynthCT): just over the limit
    volume = np.zeros((1, side, side, side), np.float32)
    _refused(client, io_names.ORCHESTRATOR_MODEL, [_tensor(io_names.PREPROCESSED, volume, "FP32")],
             [io_names.LOGITS], rf"input 'PREPROCESSED' has {side ** 3} voxels .* limit of {TEST_MAX_VOXELS}")
    _still_segments(server)


def test_fold_model_refuses_tiles_of_another_shape_than_its_patch(server, client):
    config = client.get_model_config(io_names.fold_model_name(0))
    channels, *patch = (int(d) for d in config["input"][0]["dims"])
    tiles = np.zeros((1, channels, patch[0] * 2, *patch[1:]), np.float32)
    _refused(client, io_names.fold_model_name(0), [_tensor(io_names.FOLD_INPUT, tiles, "FP32")],
             [io_names.FOLD_OUTPUT], r"unexpected shape for input")
    _still_segments(server)
