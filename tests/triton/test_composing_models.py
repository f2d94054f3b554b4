"""Every model of the pipeline is callable on its own, with the I/O documented in docs/architecture.md.

Uses the SynthCT fixture (1 input channel, 3 labels, patch 24x32x32) on the shared embedded server.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pipeline_support import SYNTHCT, cases, probe_case, reference, shared_server

from nnunet_triton import io_names
from nnunet_triton.numerics.preprocess import CaseProperties

IMAGE_DIMS = [1, -1, -1, -1]
LOGIT_DIMS = [3, -1, -1, -1]
SPATIAL = [-1, -1, -1]
DOCUMENTED_IO = {
    io_names.ENDPOINT_MODEL: (
        {"IMAGE": ("FP32", IMAGE_DIMS), "SPACING": ("FP64", [3])},
        {"SEGMENTATION": ("UINT8", SPATIAL), "PROBABILITIES": ("FP32", LOGIT_DIMS)},
    ),
    **{io_names.typed_endpoint(dtype): (
        {"IMAGE": (dtype, IMAGE_DIMS), "SPACING": ("FP64", [3])},
        {"SEGMENTATION": ("UINT8", SPATIAL), "PROBABILITIES": ("FP32", LOGIT_DIMS)},
    ) for dtype in ("FP16", "INT16", "UINT16", "UINT8")},
    io_names.PREPROCESS_MODEL: (  # one of the IMAGE inputs per request (optional each)
        {"IMAGE": ("FP32", IMAGE_DIMS), "IMAGE_FP16": ("FP16", IMAGE_DIMS),
         "IMAGE_INT16": ("INT16", IMAGE_DIMS), "IMAGE_UINT16": ("UINT16", IMAGE_DIMS),
         "IMAGE_UINT8": ("UINT8", IMAGE_DIMS), "SPACING": ("FP64", [3])},
        {"PREPROCESSED": ("FP32", IMAGE_DIMS), "CASE_PROPERTIES": ("FP64", [-1])},
    ),
    io_names.ORCHESTRATOR_MODEL: ({"PREPROCESSED": ("FP32", IMAGE_DIMS)}, {"LOGITS": ("FP16", LOGIT_DIMS)}),
    io_names.STITCH_MODEL: (
        {"LOGITS": ("FP16", LOGIT_DIMS), "CASE_PROPERTIES": ("FP64", [-1])},
        {"SEGMENTATION": ("UINT8", SPATIAL), "PROBABILITIES": ("FP32", LOGIT_DIMS)},
    ),
    "fold_0": ({"INPUT__0": ("FP32", [-1, 1, 24, 32, 32])}, {"OUTPUT__0": ("FP32", [-1, 3, 24, 32, 32])}),
    "fold_1": ({"INPUT__0": ("FP32", [-1, 1, 24, 32, 32])}, {"OUTPUT__0": ("FP32", [-1, 3, 24, 32, 32])}),
}


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


@pytest.fixture()
def client(server):
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url, network_timeout=1800)
    yield client
    client.close()


def _infer(client, model: str, inputs: dict[str, np.ndarray], outputs: list[str], parameters=None):
    import tritonclient.http as http

    from nnunet_triton.dtypes import triton_dtype

    tensors = []
    for name, array in inputs.items():
        tensor = http.InferInput(name, list(array.shape), triton_dtype(array.dtype).removeprefix("TYPE_"))
        tensor.set_data_from_numpy(np.ascontiguousarray(array), binary_data=True)
        tensors.append(tensor)
    requested = [http.InferRequestedOutput(name, binary_data=True) for name in outputs]
    return client.infer(model, tensors, outputs=requested, parameters=parameters)


def _io(tensors) -> dict[str, tuple[str, list[int]]]:
    return {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in tensors}


def _case_properties(case_props: dict, spacing) -> np.ndarray:
    return CaseProperties(
        spacing=tuple(spacing),
        shape_before_cropping=tuple(int(s) for s in case_props["shape_before_cropping"]),
        bbox=tuple((int(lo), int(hi)) for lo, hi in case_props["bbox_used_for_cropping"]),
        shape_after_cropping_and_before_resampling=tuple(
            int(s) for s in case_props["shape_after_cropping_and_before_resampling"]
        ),
    ).to_array()


@pytest.mark.parametrize("model", list(DOCUMENTED_IO))
def test_model_metadata_declares_documented_io(client, model):
    metadata = client.get_model_metadata(model)
    assert (_io(metadata["inputs"]), _io(metadata["outputs"])) == DOCUMENTED_IO[model]


def test_preprocess_model_returns_nnunet_preprocessed_data_and_case_properties_when_called_alone(client):
    case = cases(SYNTHCT)[1]  # zero margins: crop_to_nonzero crops
    ref = reference(SYNTHCT, case.name, False)
    response = _infer(
        client, io_names.PREPROCESS_MODEL,
        {io_names.IMAGE: case.image, io_names.SPACING: np.asarray(case.spacing, np.float64)},
        [io_names.PREPROCESSED, io_names.CASE_PROPERTIES],
    )
    np.testing.assert_array_equal(response.as_numpy(io_names.PREPROCESSED), ref.preprocessed)
    np.testing.assert_array_equal(
        response.as_numpy(io_names.CASE_PROPERTIES), _case_properties(ref.properties, case.spacing)
    )


def test_orchestrator_model_returns_fp16_logits_shaped_like_its_input_when_called_alone(client):
    ref = reference(SYNTHCT, cases(SYNTHCT)[0].name, False)
    response = _infer(client, io_names.ORCHESTRATOR_MODEL, {io_names.PREPROCESSED: ref.preprocessed},
                      [io_names.LOGITS], parameters={"mirroring": False})
    logits = response.as_numpy(io_names.LOGITS)
    assert (logits.dtype, logits.shape) == (np.dtype(np.float16), (3, *ref.preprocessed.shape[1:]))
    np.testing.assert_array_equal(logits, ref.logits)


def test_stitch_model_returns_nnunet_segmentation_and_probabilities_only_when_requested(client):
    case = cases(SYNTHCT)[1]
    ref = reference(SYNTHCT, case.name, False)
    props = _case_properties(ref.properties, case.spacing)
    inputs = {io_names.LOGITS: ref.logits, io_names.CASE_PROPERTIES: props}
    outputs = [io_names.SEGMENTATION, io_names.PROBABILITIES]
    with_probs = _infer(client, io_names.STITCH_MODEL, inputs, outputs, parameters={"probabilities": True})
    np.testing.assert_array_equal(with_probs.as_numpy(io_names.SEGMENTATION), ref.segmentation)
    assert float(np.abs(with_probs.as_numpy(io_names.PROBABILITIES) - ref.probabilities).max()) <= 1e-6
    without = _infer(client, io_names.STITCH_MODEL, inputs, outputs)
    np.testing.assert_array_equal(without.as_numpy(io_names.SEGMENTATION), ref.segmentation)
    assert without.as_numpy(io_names.PROBABILITIES) is None


def test_fold_model_maps_a_batch_of_tiles_to_logits_when_called_alone(client):
    tiles = np.random.default_rng(0).normal(size=(2, 1, 24, 32, 32)).astype(np.float32)
    response = _infer(client, "fold_0", {io_names.FOLD_INPUT: tiles}, [io_names.FOLD_OUTPUT])
    output = response.as_numpy(io_names.FOLD_OUTPUT)
    assert (output.dtype, output.shape) == (np.dtype(np.float32), (2, 3, 24, 32, 32))
    assert np.isfinite(output).all()


def test_endpoint_omits_probabilities_unless_the_probabilities_parameter_is_true(client):
    case = probe_case(SYNTHCT)
    inputs = {io_names.IMAGE: case.image, io_names.SPACING: np.asarray(case.spacing, np.float64)}
    outputs = [io_names.SEGMENTATION, io_names.PROBABILITIES]
    params = {"mirroring": False}
    without = _infer(client, io_names.ENDPOINT_MODEL, inputs, outputs, parameters=params)
    with_probs = _infer(
        client, io_names.ENDPOINT_MODEL, inputs, outputs, parameters=params | {"probabilities": True}
    )
    ref = reference(SYNTHCT, case.name, False)
    np.testing.assert_array_equal(without.as_numpy(io_names.SEGMENTATION), ref.segmentation)
    assert without.as_numpy(io_names.PROBABILITIES) is None
    np.testing.assert_array_equal(with_probs.as_numpy(io_names.SEGMENTATION), ref.segmentation)
    assert float(np.abs(with_probs.as_numpy(io_names.PROBABILITIES) - ref.probabilities).max()) <= 1e-6


def test_tensors_handed_to_triton_by_dlpack_leave_no_capsule_errors_in_the_server_log(server, client):
    """The Python backend renames a consumed capsule 'used_dlpack' where DLPack says 'used_dltensor';
    without serving.tensors renaming it, NumPy's capsule destructor logs a ValueError per output tensor."""
    case = probe_case(SYNTHCT)
    inputs = {io_names.IMAGE: case.image, io_names.SPACING: np.asarray(case.spacing, np.float64)}
    _infer(client, io_names.ENDPOINT_MODEL, inputs, [io_names.SEGMENTATION], parameters={"mirroring": False})
    log = Path(server.log_file).read_text(errors="replace")
    assert "PyCapsule_GetPointer called with incorrect name" not in log
