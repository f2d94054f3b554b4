"""Endpoint names and the repository's registry (io_names, nnunet_triton.repository.registry), no build."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from nnunet_triton import io_names
from nnunet_triton.errors import RepositoryError
from nnunet_triton.repository import Registry, locked, read_registry, version_metadata, write_registry


@pytest.mark.parametrize(("model", "owner"), [
    ("liver__v2__fold_0", ("liver", 2)), ("liver__v2", ("liver", 2)), ("liver__v2_int16", ("liver", 2)),
    ("lung-ct_x__v12__member0_preprocess_model", ("lung-ct_x", 12)), ("fold_0", ("nnunet", 1)),
    ("preprocess_model", ("nnunet", 1)), ("nnunet", ("nnunet", 0)), ("nnunet_uint8", ("nnunet", 0)),
    ("liver", ("liver", 0)), ("liver_fp16", ("liver", 0)), ("nnunet__v1", ("nnunet", 1)),
])
def test_every_model_name_tells_its_endpoint_and_version(model, owner):
    assert io_names.endpoint_of_model(model) == owner


@pytest.mark.parametrize(("name", "rule"), [
    ("Liver", "lowercase"), ("a__b", "lowercase"), ("_a", "lowercase"), ("a_", "lowercase"), ("x" * 49, "48"),
    ("liver_int16", "typed-endpoint suffix"), ("fold_3", "reserved"), ("preprocess_model", "reserved"),
    ("member2", "reserved"), ("previous_stage_x", "reserved"), ("", "lowercase"),
])
def test_names_that_would_clash_or_break_a_path_are_refused_naming_the_rule(name, rule):
    with pytest.raises(ValueError, match=rule):
        io_names.check_endpoint_name(name)


def test_namespaces_keep_the_plain_names_for_the_default_first_version_only():
    assert io_names.model_namespace("nnunet", 1) == ""
    assert io_names.model_namespace("nnunet", 2) == "nnunet__v2__"
    assert io_names.model_namespace("liver", 1) == "liver__v1__"
    assert io_names.pinned_endpoint("liver", 3) == "liver__v3"
    assert io_names.public_endpoints("liver") == ("liver", "liver_fp16", "liver_int16", "liver_uint16",
                                                  "liver_uint8")
    for bad in (0, -1, "1.5", True, "x", " 2"):
        with pytest.raises(ValueError, match="integer >= 1"):
            io_names.check_version(bad)


def _two_versions() -> Registry:
    registry = Registry().with_version("liver", 1, {"models": ["liver__v1", "liver__v1__fold_0"]})
    return registry.with_version("liver", 2, {"models": ["liver__v2", "liver__v2__fold_0"]})


def test_a_new_name_promotes_its_first_version_and_later_ones_only_when_asked():
    registry = _two_versions()
    assert (registry.endpoint("liver").promoted, registry.endpoint("liver").previous) == (1, None)
    promoted = registry.with_promoted("liver", 2)
    assert (promoted.endpoint("liver").promoted, promoted.endpoint("liver").previous) == (2, 1)
    assert promoted.with_promoted("liver", 1).endpoint("liver").previous == 2  # a rollback can be undone
    assert registry.with_version("liver", 3, {"models": []}, promote=True).endpoint("liver").promoted == 3
    assert registry.owner("liver__v2__fold_0") == ("liver", 2)
    assert registry.owner("liver_int16") == ("liver", None)
    assert registry.owner("nope") is None


def test_the_promoted_version_cannot_be_removed_and_unknown_ones_are_named():
    registry = _two_versions()
    with pytest.raises(RepositoryError, match="version 1 of 'liver' is promoted"):
        registry.without_version("liver", 1)
    with pytest.raises(RepositoryError, match=r"has no version 5 \(versions: \[1, 2\], promoted: 1\)"):
        registry.without_version("liver", 5)
    with pytest.raises(RepositoryError, match=r"no endpoint 'lung' \(endpoints: \['liver'\]\)"):
        registry.endpoint("lung")
    assert registry.without_version("liver", 2).models() == ("liver", "liver__v1", "liver__v1__fold_0",
                                                              "liver_fp16", "liver_int16", "liver_uint16",
                                                              "liver_uint8")


def test_a_build_of_fold_models_only_has_no_public_endpoint():
    registry = Registry().with_version("nnunet", 1, {"models": ["fold_0"]})
    assert registry.models() == ("fold_0",)


def _endpoint(entry: dict) -> str:
    return json.dumps({"format": 2, "endpoints": {"a": entry}})


def test_the_registry_round_trips_and_malformed_files_are_refused_naming_the_rule(tmp_path: Path):
    assert read_registry(tmp_path) is None
    write_registry(tmp_path, _two_versions().with_promoted("liver", 2))
    assert read_registry(tmp_path) == _two_versions().with_promoted("liver", 2)
    assert version_metadata(tmp_path, "liver") == {"models": ["liver__v2", "liver__v2__fold_0"]}
    assert [p.name for p in tmp_path.iterdir()] == ["repository_metadata.json"]  # no temporary file left
    path = tmp_path / "repository_metadata.json"
    for text, rule in (
            ("{", "not valid JSON"), ("[]", "must hold a JSON object"),
            (json.dumps({"input_hash": "ab", "models": []}), "older nnunet-triton"),
            (json.dumps({"format": 3, "endpoints": {}}), "format 3"),
            (json.dumps({"format": 2, "endpoints": {"Bad": {}}}), "lowercase"),
            (json.dumps({"format": 2, "endpoints": {"a": {"versions": {}}}}), "non-empty 'versions'"),
            (_endpoint({"promoted": 2, "versions": {"1": {"models": []}}}),
             r"promotes version 2, which is not one of its versions \[1\]"),
            (_endpoint({"promoted": 1, "versions": {"0": {"models": []}}}), "integer >= 1"),
            (_endpoint({"promoted": 1, "versions": {"02": {"models": []}}}), "integer >= 1"),
            (_endpoint({"promoted": 1, "versions": {"1": {}}}), "'models' list"),
    ):
        path.write_text(text)
        with pytest.raises(RepositoryError, match=rule):
            read_registry(tmp_path)


def test_the_repository_lock_lets_one_change_at_a_time_and_times_out_naming_the_folder(tmp_path: Path):
    order: list[str] = []

    def second() -> None:
        with locked(tmp_path):
            order.append("second")

    with locked(tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        order.append("first")
    thread.join()
    assert order == ["first", "second"]
    folder = re.escape(repr(str(tmp_path)))
    with locked(tmp_path), pytest.raises(RepositoryError, match=f"could not lock repository {folder} "):
        with locked(tmp_path, timeout_s=0.2):
            pass
