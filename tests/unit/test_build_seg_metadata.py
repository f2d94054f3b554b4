"""``build --seg-metadata``: the file is checked against the model's labels at build time and published with
the endpoint version it was built with (so a rollout carries its own)."""

from __future__ import annotations

import json
import shutil

import pytest

from nnunet_triton import io_names
from nnunet_triton.builder.config_gen import read_config
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.builder.repository import VersionChoice, build_repository
from nnunet_triton.errors import PlansError
from nnunet_triton.parameters import DESCRIPTION_PARAMETER
from nnunet_triton.registry import read_registry
from nnunet_triton.segment_metadata import PUBLISHED_KEY
from tests.fixture_paths import FIXTURES_DIR, SYNTH_CT

METADATA = FIXTURES_DIR / "seg_metadata"


def _published(repo, model):
    config = read_config(repo / model)
    return json.loads(config.parameters[DESCRIPTION_PARAMETER])


def test_build_refuses_metadata_that_misses_a_label_naming_it_before_writing_anything(tmp_path):
    data = json.loads((METADATA / "organ_lesion.json").read_text())
    data["segmentAttributes"][0].pop()  # no entry for label 2
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(data))
    with pytest.raises(PlansError, match=r"for label\(s\) 'lesion' \(labelID 2\)"):
        build_repository(SYNTH_CT.model_dir, tmp_path / "repo", seg_metadata=partial)
    broken = json.loads((METADATA / "organ_lesion.json").read_text())
    broken["segmentAttributes"][0][0]["SegmentedPropertyTypeCodeSequence"]["CodeValue"] = "T-62000"
    partial.write_text(json.dumps(broken))
    with pytest.raises(PlansError, match=r"labelID 1\.SegmentedPropertyTypeCodeSequence\.CodeValue"):
        build_repository(SYNTH_CT.model_dir, tmp_path / "repo", seg_metadata=partial)
    assert not (tmp_path / "repo").exists()


def test_each_endpoint_version_publishes_the_segment_metadata_it_was_built_with(tmp_path):
    repo = tmp_path / "repo"
    options = BuildOptions(tile_batch_size=1)
    first = build_repository(SYNTH_CT.model_dir, repo, options=options, folds=[0],
                             endpoint=VersionChoice(name="organ"))
    recoloured = json.loads((METADATA / "organ_lesion.json").read_text())
    recoloured["segmentAttributes"][0][0]["recommendedDisplayRGBValue"] = [0, 151, 206]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(recoloured))
    second = build_repository(SYNTH_CT.model_dir, repo, options=options, folds=[0],
                              endpoint=VersionChoice(name="organ", new_version=True), seg_metadata=path)
    assert (first.version, second.version, second.rebuilt) == (1, 2, True)  # new metadata: a new build

    v1 = _published(repo, io_names.pinned_endpoint("organ", 1))
    v2 = _published(repo, io_names.pinned_endpoint("organ", 2))
    assert PUBLISHED_KEY not in v1  # built without: private codes on the client side
    segments = v2[PUBLISHED_KEY]["segmentAttributes"][0]
    assert [(s["labelID"], s["SegmentLabel"], s["recommendedDisplayRGBValue"]) for s in segments] == [
        (1, "Organ", [0, 151, 206]), (2, "Lesion", [255, 255, 0])]
    assert all(len(s["RecommendedDisplayCIELabValue"]) == 3 for s in segments)
    assert PUBLISHED_KEY not in _published(repo, "organ")  # the public endpoint still runs version 1
    version = read_registry(repo).endpoint("organ").version(2)
    assert len(version.metadata["segment_metadata_sha256"]) == 64
    shutil.rmtree(repo)
