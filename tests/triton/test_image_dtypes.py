"""IMAGE travels in its own dtype: the typed endpoints give the answer of the same values sent as FP32.

The SynthCT cases are int16 CTs on disk. Sent as FP16/INT16/UINT16/UINT8 (values shifted into the
unsigned range where needed, the FP32 reference gets the same values) to ``nnunet_<dtype>`` through
the real server, the segmentation and probabilities must be identical to the FP32 request, and the
int16 one identical to nnUNetPredictor. preprocess_model refuses a request carrying no image or two.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from pipeline_support import SYNTHCT, cases, probe_case, reference, shared_server

from nnunet_triton import io_names
from nnunet_triton.client.client import NnunetClient

TIMEOUT_S = 600.0


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.uint8, np.float16])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_typed_endpoint_answers_exactly_like_fp32_with_the_same_values(server, dtype, protocol):
    case = probe_case(SYNTHCT)
    values = case.image.astype(np.float64)
    if np.dtype(dtype).kind == "u":  # shift into the unsigned range (and clip to uint8's for UINT8)
        values = values - values.min()
        values = np.minimum(values, np.iinfo(dtype).max)
    if dtype is np.float16:
        values = values.astype(np.float16).astype(np.float64)
    native = values.astype(dtype)
    url = server.http_url if protocol == "http" else server.grpc_url
    with NnunetClient(url, protocol=protocol, timeout_s=TIMEOUT_S) as client:
        typed = client.segment(native, case.spacing, mirroring=False, probabilities=True)
        assert client._endpoint_for(native.dtype)[0] == io_names.typed_endpoint(
            {np.int16: "INT16", np.uint16: "UINT16", np.uint8: "UINT8", np.float16: "FP16"}[dtype])
        as_fp32 = client.segment(native.astype(np.float32), case.spacing, mirroring=False, probabilities=True)
    np.testing.assert_array_equal(typed.segmentation, as_fp32.segmentation)
    np.testing.assert_array_equal(typed.probabilities, as_fp32.probabilities)


def test_int16_case_through_its_endpoint_equals_nnunet(server):
    case = cases(SYNTHCT)[0]
    image = case.image.astype(np.int16)
    assert np.array_equal(image, case.image)  # the file is an int16 CT
    with NnunetClient(server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        result = client.segment(image, case.spacing, mirroring=True)
    np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, case.name, True).segmentation)


def _executions(url: str, headers: dict[str, str]) -> dict[str, int]:
    """Requests each endpoint (``nnunet``, ``nnunet_int16``, ...) has answered, from Triton's statistics."""
    import tritonclient.http as http

    client = http.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(headers=headers)["model_stats"]
    finally:
        client.close()
    typed = (io_names.typed_endpoint(d) for d in io_names.IMAGE_DTYPES if d != "FP32")
    endpoints = {io_names.ENDPOINT_MODEL, *typed}
    return {s["name"]: int(s["inference_stats"]["success"]["count"]) for s in stats if s["name"] in endpoints}


def _routed(server, send) -> dict[str, int]:
    """Which endpoints answered the requests ``send()`` made (their success counts' increase)."""
    before = _executions(server.http_url, server.control_headers)
    send()
    deadline = time.monotonic() + 30.0
    while True:  # Triton counts a request once it is released, which can follow the response
        after = _executions(server.http_url, server.control_headers)
        routed = {name: after[name] - before.get(name, 0) for name in after
                  if after[name] != before.get(name, 0)}
        if routed or time.monotonic() > deadline:
            return routed
        time.sleep(0.02)


def test_native_dtype_off_sends_float32_to_the_fp32_endpoint(server):
    case = probe_case(SYNTHCT)
    with NnunetClient(server.http_url, native_dtype=False) as client:
        answers = {}
        route = _routed(server, lambda: answers.setdefault(
            "result", client.segment(case.image.astype(np.int16), case.spacing, mirroring=False)))
    assert route == {io_names.ENDPOINT_MODEL: 1}
    with NnunetClient(server.http_url) as client:
        native = _routed(server, lambda: client.segment(case.image.astype(np.int16), case.spacing,
                                                                  mirroring=False))
        expected = client.segment(case.image, case.spacing, mirroring=False)
    assert native == {io_names.typed_endpoint("INT16"): 1}  # the default route, for contrast
    np.testing.assert_array_equal(answers["result"].segmentation, expected.segmentation)


def _preprocess_request(url: str, inputs: dict[str, np.ndarray]) -> None:
    import tritonclient.http as http

    tensors = []
    for name, array in inputs.items():
        tensor = http.InferInput(name, list(array.shape), {np.dtype(np.float32): "FP32",
                                                          np.dtype(np.int16): "INT16",
                                                          np.dtype(np.float64): "FP64"}[array.dtype])
        tensor.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor)
    client = http.InferenceServerClient(url)
    try:
        client.infer(io_names.PREPROCESS_MODEL, tensors)
    finally:
        client.close()


@pytest.mark.parametrize("images", [(), (io_names.IMAGE, "IMAGE_INT16")], ids=["none", "two"])
def test_preprocess_refuses_a_request_without_exactly_one_image(server, images):
    from tritonclient.utils import InferenceServerException

    case = probe_case(SYNTHCT)
    inputs = {io_names.SPACING: np.asarray(case.spacing, np.float64)}
    for name in images:
        inputs[name] = case.image.astype(np.float32 if name == io_names.IMAGE else np.int16)
    with pytest.raises(InferenceServerException, match="exactly one of the inputs"):
        _preprocess_request(server.http_url, inputs)


def test_an_unknown_typed_endpoint_falls_back_to_fp32(server):
    case = probe_case(SYNTHCT)
    answers = {}
    with NnunetClient(server.http_url) as client:
        client._typed_ready[io_names.typed_endpoint("INT16")] = False  # as on an older repository
        route = _routed(server, lambda: answers.setdefault(
            "fallback", client.segment(case.image.astype(np.int16), case.spacing, mirroring=False)))
        direct = client.segment(case.image, case.spacing, mirroring=False)
    assert route == {io_names.ENDPOINT_MODEL: 1}
    np.testing.assert_array_equal(answers["fallback"].segmentation, direct.segmentation)
