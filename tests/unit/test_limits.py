"""The voxel-limit and memory-budget checks of ``nnunet_triton.numerics.limits``."""

from __future__ import annotations

import pytest

from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_VOXELS,
    check_request_memory,
    check_voxel_limit,
)
from nnunet_triton.parameters import PreprocessParameters


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
