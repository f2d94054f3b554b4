"""The voxel-limit checks of ``nnunet_triton.validation``."""

from __future__ import annotations

import pytest

from nnunet_triton.errors import InputValidationError
from nnunet_triton.validation import (
    DEFAULT_MAX_VOXELS,
    check_voxel_limit,
    max_voxels_from_parameters,
)


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
    assert max_voxels_from_parameters(parameters) == expected


@pytest.mark.parametrize("raw", ["-1", "1e6", "many"])
def test_max_voxels_from_parameters_raises_naming_value_when_not_a_non_negative_int(raw):
    with pytest.raises(ValueError, match=rf"'max_voxels' must be an integer >= 0, got '{raw}'"):
        max_voxels_from_parameters({"max_voxels": raw})
