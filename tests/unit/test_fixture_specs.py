"""The committed fixtures and the one generator's specs (``tools/fixtures/specs.py``) name the same things.

Cheap: nothing is regenerated here. Regenerating is ``make fixtures`` (minutes per fixture, it trains).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixture_paths import FIXTURES_DIR, generator_command, require_fixture
from tests.unit.test_makefile_variables import _make
from tools.fixtures import generate
from tools.fixtures.specs import FIXTURES


def test_every_committed_fixture_folder_has_a_spec_and_every_spec_a_folder():
    # seg_metadata/: the hand-written segment metadata of the fixtures (build --seg-metadata), not a model
    committed = {path.name for path in FIXTURES_DIR.iterdir() if path.is_dir()} - {"seg_metadata"}
    assert committed == {spec.dataset_name for spec in FIXTURES.values()}


def test_every_model_folder_a_spec_names_is_committed_with_its_plans():
    expected = {(spec.dataset_name, folder)
                for spec in FIXTURES.values() for folder in spec.model_folder_names}
    committed = {(path.parent.parent.name, path.parent.name)
                 for path in FIXTURES_DIR.glob("Dataset*/*/plans.json")}
    assert committed == expected


def test_every_spec_has_a_builder_and_a_name_the_command_line_accepts():
    assert {type(spec) for spec in FIXTURES.values()} <= set(generate.BUILDERS)
    for key in (*FIXTURES, "all"):
        assert generate.parse_args(["--which", key]).which == key
    with pytest.raises(SystemExit):
        generate.parse_args(["--which", "Dataset901_SynthCT"])


def test_make_fixtures_runs_the_one_generator_for_all_or_for_the_named_fixture(tmp_path):
    assert _make(tmp_path, "fixtures") == [
        ["-m", "tools.fixtures", "--out", "tests/fixtures", "--which", "all"]]
    assert _make(tmp_path, "fixtures", "FIXTURE=cascade") == [
        ["-m", "tools.fixtures", "--out", "tests/fixtures", "--which", "cascade"]]


def test_a_missing_fixture_fails_naming_the_command_that_regenerates_it():
    missing = FIXTURES_DIR / "Dataset904_SynthCascade" / "no_such_model" / "plans.json"
    assert generator_command(missing) == "python -m tools.fixtures --out tests/fixtures --which cascade"
    with pytest.raises(pytest.fail.Exception, match=r"missing.*--which cascade`\); a missing fixture fails"):
        require_fixture(missing)
    assert require_fixture(FIXTURES_DIR / "Dataset901_SynthCT") == FIXTURES_DIR / "Dataset901_SynthCT"
    assert generator_command(Path("/elsewhere/plans.json")).endswith("--which all")
