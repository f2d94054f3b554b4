"""Every kind of bad input gets INVALID_ARG naming the input, the rule and the value; serving goes on.

Requests go to the real ``nnunet`` endpoint on the shared SynthCT server (see pipeline_support) through
the raw HTTP client, so that wire-level mistakes (dtype, shape, missing input, unknown output) reach
Triton unfiltered. After each rejected request the same connection sends a good request (the probe
case) and must get nnU-Net's segmentation.

Volumes over the repository's voxel limit (``max_voxels``, ``TEST_MAX_VOXELS`` in the test repository),
as sent or after resampling to the model's spacing, get INVALID_ARG naming the tensor, its size and the
limit.

Edge cases that nnU-Net itself segments (all-zero image, constant image, a one-voxel axis, a single
voxel) must segment here too, and give exactly ``nnUNetPredictor.predict_single_npy_array``'s result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from pipeline_support import (
    SYNTHCT,
    TEST_MAX_REQUEST_BYTES,
    TEST_MAX_VOXELS,
    predictor,
    probe_case,
    reference,
    shared_server,
)

from nnunet_triton import io_names
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.errors import InputValidationError

NO_MIRRORING = {"mirroring": False}  # keeps every request cheap; the option path is the same


@dataclass(frozen=True)
class BadRequest:
    """One malformed request and the message (regex) its INVALID_ARG answer must contain."""

    image: np.ndarray
    spacing: np.ndarray
    match: str
    image_dtype: str = "FP32"
    spacing_dtype: str = "FP64"
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_MIRRORING))
    outputs: tuple[str, ...] = (io_names.SEGMENTATION,)
    send_spacing: bool = True


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


@pytest.fixture()
def client(server):
    import tritonclient.http as http

    c = http.InferenceServerClient(server.http_url, network_timeout=900)
    yield c
    c.close()


def _with_voxel(image: np.ndarray, value: float) -> np.ndarray:
    bad = image.copy()
    bad[0, 3, 5, 7] = value
    return bad


def _bad_requests() -> dict[str, BadRequest]:
    probe = probe_case(SYNTHCT)
    image, spacing = probe.image, np.asarray(probe.spacing, np.float64)
    z, y, x = spacing
    triton_shape = r"unexpected shape for input '{name}' for model 'nnunet'\. Expected {expected}, got {got}"
    return {
        # --- rejected by Triton against the ensemble's config (name, rule, value all in Triton's text)
        "rank_3_image": BadRequest(
            image[0],
            spacing,
            triton_shape.format(name="IMAGE", expected=r"\[1,-1,-1,-1\]", got=r"\[12,24,24\]"),
        ),
        "rank_5_image": BadRequest(
            image[None],
            spacing,
            triton_shape.format(name="IMAGE", expected=r"\[1,-1,-1,-1\]", got=r"\[1,1,12,24,24\]"),
        ),
        "two_channels": BadRequest(
            np.concatenate([image, image]),
            spacing,
            triton_shape.format(name="IMAGE", expected=r"\[1,-1,-1,-1\]", got=r"\[2,12,24,24\]"),
        ),
        "spacing_two_entries": BadRequest(
            image, spacing[:2], triton_shape.format(name="SPACING", expected=r"\[3\]", got=r"\[2\]")
        ),
        "image_int64": BadRequest(
            image.astype(np.int64),
            spacing,
            r"inference input 'IMAGE' data-type is "
            r"'INT64', but model 'nnunet' expects 'FP32'",
            image_dtype="INT64",
        ),
        "spacing_fp32": BadRequest(
            image,
            spacing.astype(np.float32),
            r"inference input 'SPACING' data-type "
            r"is 'FP32', but model 'nnunet' expects 'FP64'",
            spacing_dtype="FP32",
        ),
        "spacing_missing": BadRequest(
            image, spacing, r"missing required input\(s\) \['SPACING'\]", send_spacing=False
        ),
        "nonexistent_output": BadRequest(
            image,
            spacing,
            r"unexpected inference output 'LOGITS' for model "
            r"'nnunet'",
            outputs=(io_names.SEGMENTATION, io_names.LOGITS),
        ),
        # --- rejected by preprocess_model (nnunet_triton.numerics.preprocess)
        "zero_length_axis": BadRequest(
            image[:, :, :0],
            spacing,
            r"image must not have an empty spatial "
            r"axis, got shape \(1, 12, 0, 24\)",
        ),
        "nan_voxel": BadRequest(
            _with_voxel(image, np.nan),
            spacing,
            r"image must contain only finite "
            r"values .*got 1 NaN/Inf voxels",
        ),
        "inf_voxel": BadRequest(
            _with_voxel(image, np.inf),
            spacing,
            r"image must contain only finite "
            r"values .*got 1 NaN/Inf voxels",
        ),
        "minus_inf_voxel": BadRequest(
            _with_voxel(image, -np.inf),
            spacing,
            r"image must contain only "
            r"finite values .*got 1 NaN/Inf voxels",
        ),
        "spacing_zero": BadRequest(
            image,
            np.array([z, 0.0, x]),
            r"spacing entries must be finite and > 0, "
            rf"got \({z}, 0\.0, {x}\)",
        ),
        "spacing_negative": BadRequest(
            image,
            np.array([z, y, -1.5]),
            r"spacing entries must be finite and "
            rf"> 0, got \({z}, {y}, -1\.5\)",
        ),
        "spacing_nan": BadRequest(
            image,
            np.array([np.nan, y, x]),
            r"spacing entries must be finite and > 0, "
            r"got \(nan, ",
        ),
        "spacing_inf": BadRequest(
            image,
            np.array([z, np.inf, x]),
            r"spacing entries must be finite and > 0, "
            rf"got \({z}, inf, {x}\)",
        ),
        # --- rejected by the request-option parser (options.RequestOptions.from_parameters)
        "tile_step_size_zero": BadRequest(
            image,
            spacing,
            r"request parameter 'tile_step_size' must be a "
            r"number in \(0, 1\], got 0\.0",
            parameters={"tile_step_size": 0.0},
        ),
        "tile_step_size_negative": BadRequest(
            image,
            spacing,
            r"'tile_step_size' must be a number in "
            r"\(0, 1\], got -0\.1",
            parameters={"tile_step_size": -0.1},
        ),
        "tile_step_size_over_one": BadRequest(
            image,
            spacing,
            r"'tile_step_size' must be a number in "
            r"\(0, 1\], got 1\.5",
            parameters={"tile_step_size": 1.5},
        ),
        "tile_step_size_not_a_number": BadRequest(
            image,
            spacing,
            r"'tile_step_size' must be a number in "
            r"\(0, 1\], got 'abc'",
            parameters={"tile_step_size": "abc"},
        ),
        "unknown_fold": BadRequest(
            image,
            spacing,
            r"request parameter 'folds': folds \[7\] are not deployed "
            r"\(available: \[0, 1\]\), got '7'",
            parameters={"folds": "7"},
        ),
        "empty_folds": BadRequest(
            image,
            spacing,
            r"request parameter 'folds' must be a comma-separated list",
            parameters={"folds": ""},
        ),
        "unknown_option": BadRequest(
            image,
            spacing,
            r"unknown request parameters \['tile_size'\]; supported: "
            r"\['mirroring', 'tile_step_size', 'folds', 'probabilities', 'postprocessing'\]",
            parameters={"tile_size": 0.5},
        ),
        "mirroring_not_bool": BadRequest(
            image,
            spacing,
            r"'mirroring' must be a boolean \(true/false\), "
            r"got 'maybe'",
            parameters={"mirroring": "maybe"},
        ),
        "postprocessing_not_bool": BadRequest(
            image,
            spacing,
            r"'postprocessing' must be a boolean \(true/false\), got 'sometimes'",
            parameters={"postprocessing": "sometimes"},
        ),
    }


# Static names (collection must not read fixture data); tests check they match the builders below.
BAD_KINDS = (
    "rank_3_image",
    "rank_5_image",
    "two_channels",
    "spacing_two_entries",
    "image_int64",
    "spacing_fp32",
    "spacing_missing",
    "nonexistent_output",
    "zero_length_axis",
    "nan_voxel",
    "inf_voxel",
    "minus_inf_voxel",
    "spacing_zero",
    "spacing_negative",
    "spacing_nan",
    "spacing_inf",
    "tile_step_size_zero",
    "tile_step_size_negative",
    "tile_step_size_over_one",
    "tile_step_size_not_a_number",
    "unknown_fold",
    "empty_folds",
    "unknown_option",
    "mirroring_not_bool",
    "postprocessing_not_bool",
)
EDGE_KINDS = ("all_zero", "constant", "one_voxel_z_axis", "one_voxel_x_axis", "single_voxel")


def _infer(
    client: Any,
    image: np.ndarray,
    spacing: np.ndarray,
    *,
    image_dtype: str = "FP32",
    spacing_dtype: str = "FP64",
    parameters: dict[str, Any] | None = None,
    outputs: tuple[str, ...] = (io_names.SEGMENTATION,),
    send_spacing: bool = True,
) -> Any:
    import tritonclient.http as http

    inputs = [http.InferInput(io_names.IMAGE, list(image.shape), image_dtype)]
    inputs[0].set_data_from_numpy(image, binary_data=True)
    if send_spacing:
        inputs.append(http.InferInput(io_names.SPACING, list(spacing.shape), spacing_dtype))
        inputs[1].set_data_from_numpy(spacing, binary_data=True)
    requested = [http.InferRequestedOutput(name, binary_data=True) for name in outputs]
    return client.infer(
        io_names.ENDPOINT_MODEL,
        inputs,
        outputs=requested,
        parameters=dict(NO_MIRRORING) if parameters is None else parameters,
    )


def _assert_probe_segments(client: Any) -> None:
    probe = probe_case(SYNTHCT)
    result = _infer(client, probe.image, np.asarray(probe.spacing, np.float64))
    np.testing.assert_array_equal(
        result.as_numpy(io_names.SEGMENTATION), reference(SYNTHCT, probe.name, False).segmentation
    )


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_request_gets_invalid_arg_naming_input_rule_value_and_next_request_succeeds(client, kind):
    from tritonclient.utils import InferenceServerException

    requests = _bad_requests()
    assert tuple(requests) == BAD_KINDS
    bad = requests[kind]
    with pytest.raises(InferenceServerException, match=bad.match) as info:
        _infer(
            client,
            bad.image,
            bad.spacing,
            image_dtype=bad.image_dtype,
            spacing_dtype=bad.spacing_dtype,
            parameters=bad.parameters,
            outputs=bad.outputs,
            send_spacing=bad.send_spacing,
        )
    assert info.value.status() == "400", (kind, info.value.status(), str(info.value))
    _assert_probe_segments(client)


def _edge_images() -> dict[str, np.ndarray]:
    image = probe_case(SYNTHCT).image
    return {
        # nnU-Net: crop_to_nonzero keeps the whole image (empty mask -> full bbox); CT normalization clips
        # and scales a constant -> all tiles identical.
        "all_zero": np.zeros_like(image),
        "constant": np.full_like(image, 100.0),
        # one voxel along an axis: nnU-Net pads to the patch and segments (checked with nnUNetPredictor).
        "one_voxel_z_axis": np.ascontiguousarray(image[:, :1]),
        "one_voxel_x_axis": np.ascontiguousarray(image[:, :, :, :1]),
        "single_voxel": np.ascontiguousarray(image[:, :1, :1, :1]),
    }


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_edge_case_image_segments_like_nnunet_when_nnunet_segments_it(client, kind):
    images = _edge_images()
    assert tuple(images) == EDGE_KINDS
    image = images[kind]
    spacing = probe_case(SYNTHCT).spacing
    expected = predictor(SYNTHCT, None, False, 0.5).predict_single_npy_array(
        image, {"spacing": list(spacing)}
    )
    result = _infer(client, image, np.asarray(spacing, np.float64))
    np.testing.assert_array_equal(result.as_numpy(io_names.SEGMENTATION), np.asarray(expected))


def test_client_rejects_non_real_image_before_sending(server):
    probe = probe_case(SYNTHCT)
    with NnunetClient(server.http_url, timeout_s=900) as client:
        with pytest.raises(
            InputValidationError, match=r"image must have a real numeric dtype, got complex64"
        ):
            client.segment(probe.image.astype(np.complex64), probe.spacing, mirroring=False)
        result = client.segment(probe.image, probe.spacing, mirroring=False)
    np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, probe.name, False).segmentation)


def _assert_over_limit_rejected(client: Any, image: np.ndarray, spacing: np.ndarray, message: str) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        _infer(client, image, spacing)
    assert info.value.status() == "400", (info.value.status(), str(info.value))
    assert message in str(info.value), str(info.value)


def test_image_over_voxel_limit_gets_invalid_arg_naming_limit_and_next_request_succeeds(client):
    shape = (1, 128, 128, 129)  # 2_113_536 voxels (8 MiB), just over TEST_MAX_VOXELS = 2**21
    voxels = math.prod(shape)
    assert voxels > TEST_MAX_VOXELS
    _assert_over_limit_rejected(
        client, np.zeros(shape, np.float32), np.asarray(probe_case(SYNTHCT).spacing, np.float64),
        f"IMAGE has {voxels} voxels (shape {shape}), more than the server's limit of {TEST_MAX_VOXELS} "
        "voxels (model parameter 'max_voxels')",
    )
    _assert_probe_segments(client)


def test_image_resampled_over_voxel_limit_gets_invalid_arg_naming_limit_and_next_request_succeeds(client):
    from nnunetv2.preprocessing.resampling.default_resampling import compute_new_shape

    probe = probe_case(SYNTHCT)
    image = np.full_like(probe.image, 100.0)  # nonzero everywhere: crop_to_nonzero keeps every voxel
    # voxels 8x coarser than the model's spacing: resampling upsamples each axis 8x (~512x the voxels)
    spacing = np.asarray(probe.spacing, np.float64) * 8
    p = predictor(SYNTHCT, None, False, 0.5)
    transpose = p.plans_manager.transpose_forward
    shape_t, spacing_t = [image.shape[1 + t] for t in transpose], [spacing[t] for t in transpose]
    new_shape = tuple(int(s) for s in compute_new_shape(shape_t, spacing_t, p.configuration_manager.spacing))
    voxels = math.prod(new_shape)
    assert image.size <= TEST_MAX_VOXELS < voxels, (image.size, voxels)
    _assert_over_limit_rejected(
        client, image, spacing,
        f"resampled image has {voxels} voxels (shape {(1, *new_shape)}), more than the server's limit of "
        f"{TEST_MAX_VOXELS} voxels (model parameter 'max_voxels')",
    )
    _assert_probe_segments(client)


def test_image_over_memory_budget_gets_invalid_arg_naming_sizes_and_next_request_succeeds(client):
    from nnunetv2.preprocessing.resampling.default_resampling import compute_new_shape

    probe = probe_case(SYNTHCT)
    shape = (1, 100, 128, 128)  # 1.6 M voxels: under the voxel limit, but 3 labels x 4 B = 19.7 MB > 16 MiB
    spacing = np.asarray(probe.spacing, np.float64)
    p = predictor(SYNTHCT, None, False, 0.5)
    transpose = p.plans_manager.transpose_forward
    shape_t, spacing_t = [shape[1 + t] for t in transpose], [spacing[t] for t in transpose]
    new_shape = tuple(int(s) for s in compute_new_shape(shape_t, spacing_t, p.configuration_manager.spacing))
    heads = len(p.dataset_json["labels"])
    assert math.prod(shape) <= TEST_MAX_VOXELS and math.prod(new_shape) <= TEST_MAX_VOXELS
    assert heads * math.prod(shape) * 4 > TEST_MAX_REQUEST_BYTES
    _assert_over_limit_rejected(
        client, np.zeros(shape, np.float32), spacing,
        f"float32, preprocessed geometry) and {heads * math.prod(shape) * 4 / 2**20:.1f} MiB for its "
        f"probabilities ({heads} x {tuple(shape_t)} float32, original geometry), more than the server's "
        f"budget of 16.0 MiB ({TEST_MAX_REQUEST_BYTES} bytes) per array "
        "(model parameter 'max_request_bytes')",
    )
    _assert_probe_segments(client)
