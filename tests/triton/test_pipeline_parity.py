"""The endpoint reproduces nnU-Net 2.8.1 (``nnUNetPredictor`` on CPU) through the real embedded Triton server.

For every held-out case of both fixture models, with mirroring on and off:

- SEGMENTATION of the ``nnunet`` endpoint == ``predict_single_npy_array`` (identical label maps);
- LOGITS of ``orchestrator_model`` fed nnU-Net's own preprocessed data ==
  ``predict_logits_from_preprocessed_data`` (bit-identical: the test repository runs every tile through
  the network alone, like nnU-Net; see pipeline_support);
- PROBABILITIES of the endpoint vs nnU-Net's ``convert_predicted_logits_to_segmentation_with_correct_shape``:
  max |diff| <= 1e-6 (our float32 exp is computed in float64 and rounded once; torch's vectorised expf may
  differ by an ulp).

Mirroring multiplies the work by 8 (2 CPU cores: minutes per case), so mirroring-on runs of all but the
first case of each fixture are marked ``slow``. The measured numbers (max diffs, Dice per label, time)
are printed at the end of the session and written to ``build/reports/pipeline_parity.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from pipeline_support import (
    ANISO,
    REPO_ROOT,
    SYNTHCT,
    cases,
    dice_per_label,
    model_dir,
    reference,
    shared_server,
)

from nnunet_triton import io_names
from nnunet_triton.client.client import NnunetClient

PROBABILITY_TOLERANCE = 1e-6
TIMEOUT_S = 1800.0
REPORT: list[dict] = []
# (dataset, held-out case index): SynthCT has 3 held-out cases (2 folds), SynthAniso 2 (1 fold).
CASES = [(SYNTHCT, 0), (SYNTHCT, 1), (SYNTHCT, 2), (ANISO, 0), (ANISO, 1)]


def _params() -> list:
    params = []
    for dataset, index in CASES:
        for mirroring in (True, False):
            marks = [pytest.mark.slow] if mirroring and index > 0 else []
            case_id = f"{dataset}-case{index}-{'mirroring' if mirroring else 'no_mirroring'}"
            params.append(pytest.param(dataset, index, mirroring, marks=marks, id=case_id))
    return params


@pytest.fixture(scope="session")
def report() -> Iterator[list[dict]]:
    yield REPORT
    if REPORT:
        path = REPO_ROOT / "build" / "reports" / "pipeline_parity.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(REPORT, indent=2))
        print(f"\npipeline parity ({path.relative_to(REPO_ROOT)}):")
        for row in REPORT:
            print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))


@pytest.fixture(scope="session")
def dataset_server(request, triton_server):
    """(dataset, server handle), parametrized indirectly so that tests are grouped by dataset."""
    return request.param, shared_server(request.param, triton_server, request)


def _case(dataset: str, index: int):
    found = cases(dataset)
    if index >= len(found):
        pytest.skip(f"{dataset} has only {len(found)} held-out cases")
    return found[index]


def _labels(dataset: str) -> tuple[int, ...]:
    from nnunet_triton.numerics.model_folder import read_model_folder

    return read_model_folder(model_dir(dataset)).labels.all_labels


@pytest.mark.parametrize(("dataset_server", "index", "mirroring"), _params(), indirect=["dataset_server"])
def test_endpoint_segmentation_equals_nnunet_predict_single_npy_array(
    dataset_server, index, mirroring, report
):
    dataset, server = dataset_server
    case = _case(dataset, index)
    with NnunetClient(server.http_url, timeout_s=TIMEOUT_S) as client:
        result = client.segment(case.image, case.spacing, mirroring=mirroring, probabilities=True)
    ref = reference(dataset, case.name, mirroring)
    prob_diff = float(np.abs(result.probabilities - ref.probabilities).max())
    report.append({
        "dataset": dataset, "case": case.name, "mirroring": mirroring,
        "labels_identical": bool(np.array_equal(result.segmentation, ref.segmentation)),
        "differing_voxels": int((result.segmentation != ref.segmentation).sum()),
        "dice": {str(k): round(v, 6) for k, v in dice_per_label(
            result.segmentation, ref.segmentation, _labels(dataset)).items()},
        "probabilities_max_abs_diff": prob_diff,
        "endpoint_seconds": round(result.elapsed_s, 2),
    })
    assert (result.segmentation.shape, result.segmentation.dtype) == (case.image.shape[1:], np.uint8)
    np.testing.assert_array_equal(result.segmentation, ref.segmentation)
    assert result.probabilities.shape == ref.probabilities.shape
    assert prob_diff <= PROBABILITY_TOLERANCE


def _orchestrator_logits(server, data: np.ndarray, mirroring: bool) -> np.ndarray:
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S)
    try:
        tensor = http.InferInput(io_names.PREPROCESSED, list(data.shape), "FP32")
        tensor.set_data_from_numpy(np.ascontiguousarray(data, dtype=np.float32), binary_data=True)
        response = client.infer(
            io_names.ORCHESTRATOR_MODEL, [tensor], outputs=[http.InferRequestedOutput(io_names.LOGITS)],
            parameters={"mirroring": mirroring},
        )
        return response.as_numpy(io_names.LOGITS)
    finally:
        client.close()


@pytest.mark.parametrize(("dataset_server", "index", "mirroring"), _params(), indirect=["dataset_server"])
def test_orchestrator_logits_equal_nnunet_predict_logits_from_preprocessed_data(
    dataset_server, index, mirroring, report
):
    dataset, server = dataset_server
    case = _case(dataset, index)
    ref = reference(dataset, case.name, mirroring)
    logits = _orchestrator_logits(server, ref.preprocessed, mirroring)
    diff = float(np.abs(logits.astype(np.float32) - ref.logits.astype(np.float32)).max())
    report.append(
        {"dataset": dataset, "case": case.name, "mirroring": mirroring, "logits_max_abs_diff": diff}
    )
    assert (logits.dtype, logits.shape) == (np.dtype(np.float16), ref.logits.shape)
    np.testing.assert_array_equal(logits, ref.logits)


@pytest.mark.parametrize("dataset_server", [SYNTHCT, ANISO], indirect=True)
def test_endpoint_follows_folds_and_tile_step_size_options_when_set_over_grpc(dataset_server):
    dataset, server = dataset_server
    case = cases(dataset)[-1]
    with NnunetClient(server.grpc_url, protocol="grpc", timeout_s=TIMEOUT_S) as client:
        result = client.segment(
            case.image, case.spacing, mirroring=False, folds=[0], tile_step_size=0.75, probabilities=True
        )
    ref = reference(dataset, case.name, False, (0,), 0.75)
    np.testing.assert_array_equal(result.segmentation, ref.segmentation)
    assert float(np.abs(result.probabilities - ref.probabilities).max()) <= PROBABILITY_TOLERANCE
