"""The voxel-limit and memory-budget checks of ``nnunet_triton.numerics.limits``."""

from __future__ import annotations

import pytest

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_VOXELS,
    check_preprocessed,
    check_request_memory,
    check_stitch_request,
    check_voxel_limit,
)
from nnunet_triton.parameters import OrchestratorParameters, PreprocessParameters, StitchParameters


def test_check_voxel_limit_returns_count_when_under_limit():
    assert check_voxel_limit("IMAGE", (1, 10, 20, 30), 6000) == 6000


def test_check_voxel_limit_raises_invalid_arg_naming_input_count_and_limit_when_over():
    with pytest.raises(InputValidationError) as info:
        check_voxel_limit("IMAGE", (1, 10, 20, 31), 6000)
    assert str(info.value) == (
        "IMAGE has 6200 voxels (shape (1, 10, 20, 31)), more than the server's limit of 6000 voxels "
        "(model parameter 'max_voxels')."
    )
    assert info.value.triton_code == "INVALID_ARG"


def test_check_voxel_limit_accepts_anything_when_limit_is_zero():
    assert check_voxel_limit("IMAGE", (4, 4096, 4096, 4096), 0) == 4 * 4096**3


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, DEFAULT_MAX_VOXELS),
        ({"max_voxels": ""}, DEFAULT_MAX_VOXELS),
        ({"max_voxels": "1000"}, 1000),
        ({"max_voxels": "0"}, 0),
    ],
)
def test_max_voxels_from_parameters_reads_value_or_default(parameters, expected):
    assert PreprocessParameters.from_parameters(parameters).max_voxels == expected


@pytest.mark.parametrize("raw", ["-1", "1e6", "many"])
def test_max_voxels_from_parameters_raises_naming_value_when_not_a_non_negative_int(raw):
    with pytest.raises(ValueError, match=rf"'max_voxels' must be an integer >= 0, got '{raw}'"):
        PreprocessParameters.from_parameters({"max_voxels": raw})


def test_check_request_memory_returns_float32_logits_and_probabilities_bytes_when_within_budget():
    assert check_request_memory(3, (10, 20, 30), (12, 20, 30), 10**6) == (3 * 6000 * 4, 3 * 7200 * 4)


def test_check_request_memory_raises_naming_both_sizes_shapes_and_budget_when_probabilities_exceed_it():
    # 117 labels (TotalSegmentator-like) on a 512 x 512 x 600 CT resampled to 300 x 256 x 256
    with pytest.raises(InputValidationError) as info:
        check_request_memory(117, (300, 256, 256), (600, 512, 512), DEFAULT_MAX_REQUEST_BYTES)
    assert str(info.value) == (
        "request needs 8.57 GiB for its logits (117 x (300, 256, 256) float32, preprocessed geometry) and "
        "68.55 GiB for its probabilities (117 x (600, 512, 512) float32, original geometry), more than the "
        "server's budget of 8.00 GiB (8589934592 bytes) per array (model parameter 'max_request_bytes')."
    )
    assert info.value.triton_code == "INVALID_ARG"


def test_labels_exported_by_rows_are_bounded_by_their_logits_and_probabilities_by_the_budget_when_asked():
    # 105 heads (the many-class fixture) on a 512 x 512 x 100 CT at 1.5 mm: 2.9 GiB of logits but 10.3 GiB
    # of probabilities; labels exported by rows hold no K x original-volume array
    logits, probabilities = check_request_memory(105, (98, 273, 273), (100, 512, 512),
                                                 DEFAULT_MAX_REQUEST_BYTES, original_geometry=False)
    assert probabilities > DEFAULT_MAX_REQUEST_BYTES > logits
    with pytest.raises(InputValidationError, match=r"10.25 GiB for its probabilities \(105 x "
                       r"\(100, 512, 512\) float32, original geometry\), more than the server's budget of "
                       r"8.00 GiB .*"
                       r"'max_request_bytes'\); without probabilities the labels need no such array"):
        check_request_memory(105, (98, 273, 273), (100, 512, 512), DEFAULT_MAX_REQUEST_BYTES)
    with pytest.raises(InputValidationError, match=r"for its logits") as info:
        check_request_memory(105, (300, 512, 512), (100, 512, 512), DEFAULT_MAX_REQUEST_BYTES,
                             original_geometry=False)
    assert "without probabilities" not in str(info.value)


def test_check_request_memory_raises_when_only_the_preprocessed_logits_exceed_budget():
    with pytest.raises(InputValidationError, match=r"request needs 1.5 MiB for its logits"):
        check_request_memory(2, (64, 64, 48), (8, 8, 8), 2**20)


def test_check_request_memory_accepts_anything_when_budget_is_zero():
    assert check_request_memory(117, (600, 512, 512), (600, 512, 512), 0)[1] == 117 * 600 * 512 * 512 * 4


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [({}, DEFAULT_MAX_REQUEST_BYTES), ({"max_request_bytes": "0"}, 0), ({"max_request_bytes": "4096"}, 4096)],
)
def test_max_request_bytes_from_parameters_reads_value_or_default(parameters, expected):
    assert PreprocessParameters.from_parameters(parameters).max_request_bytes == expected


def test_max_request_bytes_from_parameters_raises_naming_value_when_negative():
    with pytest.raises(ValueError, match=r"'max_request_bytes' must be an integer >= 0, got '-5'"):
        PreprocessParameters.from_parameters({"max_request_bytes": "-5"})


def _stitch(logits=(3, 10, 10, 10), before=(20, 20, 20), bbox=((0, 10), (5, 15), (0, 10)),
            after=(10, 10, 10), **limits):
    check_stitch_request(logits, shape_before_cropping=before, bbox=bbox, shape_after_cropping=after,
                         num_heads=3, **{"max_voxels": 10_000, "max_request_bytes": 2**20, **limits})


def test_stitch_request_within_limits_passes():
    _stitch()


def test_stitch_request_declaring_a_700_cubed_volume_is_refused_naming_the_volume_and_the_limit():
    with pytest.raises(InputValidationError, match=r"the volume CASE_PROPERTIES declares \(shape before "
                       r"cropping\) has 343000000 voxels \(shape \(700, 700, 700\)\), more than the "
                       r"server's limit of 268435456 voxels \(model parameter 'max_voxels'\)") as info:
        _stitch(logits=(3, 1, 1, 1), before=(700, 700, 700), bbox=((0, 1),) * 3, after=(1, 1, 1),
                max_voxels=DEFAULT_MAX_VOXELS)
    assert info.value.triton_code == "INVALID_ARG"


@pytest.mark.parametrize(("case", "message"), [
    ({"logits": (2, 10, 10, 10)}, r"input 'LOGITS': expected 3 channel\(s\) on axis 0"),
    ({"logits": (3, 10, 10)}, r"input 'LOGITS': expected shape \(channels, 3 spatial dims >= 1\)"),
    ({"logits": (3, 30, 30, 30)}, r"input 'LOGITS' has 81000 voxels"),
    ({"after": (30, 30, 30)}, r"the cropped volume CASE_PROPERTIES declares has 27000 voxels"),
    ({"bbox": ((0, 10), (15, 25), (0, 10))}, r"bbox .* must lie within the shape before cropping \(20, 20, "),
    ({"max_request_bytes": 1000}, r"more than the server's budget of 0.0 MiB \(1000 bytes\)"),
])
def test_stitch_request_beyond_a_limit_is_refused_naming_the_rule(case, message):
    with pytest.raises(InputValidationError, match=message):
        _stitch(**case)


def test_preprocessed_volume_is_bounded_in_rank_channels_voxels_and_logit_bytes():
    limits = {"channels": 1, "num_heads": 3, "max_voxels": 1000, "max_request_bytes": 12_000}
    check_preprocessed("input 'PREPROCESSED'", (1, 10, 10, 10), **limits)
    with pytest.raises(InputValidationError, match=r"expected 1 channel\(s\) on axis 0 .*got shape \(2, 5, "):
        check_preprocessed("input 'PREPROCESSED'", (2, 5, 5, 5), **limits)
    with pytest.raises(InputValidationError, match=r"has 1331 voxels .* limit of 1000 voxels"):
        check_preprocessed("input 'PREPROCESSED'", (1, 11, 11, 11), **limits)
    with pytest.raises(InputValidationError, match=r"budget of 0.0 MiB \(11000 bytes\)"):
        check_preprocessed("input 'PREPROCESSED'", (1, 10, 10, 10), **{**limits, "max_request_bytes": 11_000})


@pytest.mark.parametrize("parameters", [StitchParameters, OrchestratorParameters])
def test_stitch_and_orchestrator_read_the_same_limits_as_preprocess(parameters):
    base = {"fold_models": "fold_0", "tile_batch_size": "1", "max_inflight": "1"}
    assert parameters.from_parameters(base).max_voxels == DEFAULT_MAX_VOXELS  # an older repository: bounded
    read = parameters.from_parameters({**base, "max_voxels": "5", "max_request_bytes": "7"})
    assert (read.max_voxels, read.max_request_bytes) == (5, 7)


def test_default_limits_let_a_512x512x1000_int16_ct_through():
    assert check_voxel_limit("IMAGE", (1, 1000, 512, 512), DEFAULT_MAX_VOXELS) == 512 * 512 * 1000
