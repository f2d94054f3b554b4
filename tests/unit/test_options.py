"""The per-request options: one type for client, CLI, validate and the server steps, one default each."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nnunet_triton.errors import InputValidationError
from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE, KNOWN_OPTIONS, RequestOptions, parse_fold_ids

CONFIG = SimpleNamespace(folds=(0, 1, "all"))


def test_defaults_are_nnunets_and_every_deployed_fold_when_no_parameters():
    assert RequestOptions.from_parameters({}, CONFIG) == RequestOptions(
        mirroring=True, tile_step_size=0.5, folds=(0, 1, "all"), probabilities=False, postprocessing=True
    )
    assert RequestOptions().tile_step_size == DEFAULT_TILE_STEP_SIZE == 0.5


def test_every_option_is_read_when_given_typed_values():
    params = {"mirroring": False, "tile_step_size": 0.75, "folds": "1,0", "probabilities": True,
              "postprocessing": False}
    assert RequestOptions.from_parameters(params, CONFIG) == RequestOptions(
        mirroring=False, tile_step_size=0.75, folds=(1, 0), probabilities=True, postprocessing=False
    )


def test_strings_and_ints_are_accepted_as_sent_by_curl_or_perf_analyzer():
    params = {"mirroring": "FALSE", "tile_step_size": 1, "folds": 1, "probabilities": "true"}
    assert RequestOptions.from_parameters(params, CONFIG) == RequestOptions(
        mirroring=False, tile_step_size=1.0, folds=(1,), probabilities=True
    )


def test_fold_all_is_accepted_when_deployed():
    assert RequestOptions.from_parameters({"folds": " all "}, CONFIG).folds == ("all",)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"mirorring": True}, r"unknown request parameters \['mirorring'\]"),
        ({"mirroring": 1}, r"'mirroring' must be a boolean .* got 1"),
        ({"probabilities": "yes"}, r"'probabilities' must be a boolean .* got 'yes'"),
        ({"tile_step_size": 0}, r"'tile_step_size' must be a number in \(0, 1\], got 0"),
        ({"tile_step_size": 1.5}, r"'tile_step_size' must be a number in \(0, 1\], got 1.5"),
        ({"tile_step_size": "abc"}, r"'tile_step_size' must be a number in \(0, 1\], got 'abc'"),
        ({"tile_step_size": True}, r"'tile_step_size' must be a number in \(0, 1\], got True"),
        ({"tile_step_size": float("nan")}, r"'tile_step_size' must be a number in \(0, 1\], got nan"),
        ({"folds": "3"}, r"'folds': folds \[3\] are not deployed \(available: \[0, 1, 'all'\]\)"),
        ({"folds": "0,0"}, r"'folds' lists folds \['0'\] twice"),
        ({"folds": "0,x"}, r"'folds' must be a comma-separated list of fold ids .* got '0,x'"),
        ({"folds": ""}, r"'folds' must be a comma-separated list of fold ids"),
        ({"folds": True}, r"'folds' must be a comma-separated list of fold ids .* got True"),
    ],
)
def test_a_bad_request_parameter_is_refused_naming_option_and_value(params, match):
    with pytest.raises(InputValidationError, match=match):
        RequestOptions.from_parameters(params, CONFIG)


def test_fold_ids_keep_request_order_when_subset():
    assert parse_fold_ids([1, "0"], (0, 1)) == (1, 0)


@pytest.mark.parametrize("options", [
    RequestOptions(),
    RequestOptions(mirroring=False, tile_step_size=0.25, folds=(1,), probabilities=True,
                   postprocessing=False),
    RequestOptions(folds=("all",)),
])
def test_the_parameters_a_client_sends_are_read_back_as_the_same_options(options):
    params = options.to_parameters()
    assert set(params) <= set(KNOWN_OPTIONS)
    back = RequestOptions.from_parameters(params, CONFIG)
    assert back == (options if options.folds is not None else RequestOptions(folds=CONFIG.folds))


def test_the_client_side_options_refuse_bad_values_before_anything_is_sent():
    with pytest.raises(InputValidationError, match=r"tile_step_size must be in \(0, 1\], got 2"):
        RequestOptions(tile_step_size=2)
    with pytest.raises(InputValidationError, match=r"option 'mirroring' must be a boolean"):
        RequestOptions(mirroring="maybe")
    with pytest.raises(InputValidationError, match=r"lists folds \['1'\] twice"):
        RequestOptions(folds=(1, 1))


def test_the_recordable_form_names_every_option():
    assert RequestOptions(folds=(0,)).to_dict() == {
        "folds": ["0"], "mirroring": True, "tile_step_size": 0.5, "probabilities": False,
        "postprocessing": True}
