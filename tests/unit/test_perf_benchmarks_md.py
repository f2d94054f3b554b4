"""BENCHMARKS.md's one block writer: a block replaced in place, refused when its markers are wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.perf import benchmarks_md, defaults, report, two_models

REPO_ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = benchmarks_md.markers("perf-x")


def test_block_between_its_markers_is_replaced_and_the_rest_kept_byte_for_byte(tmp_path: Path):
    page = tmp_path / "BENCHMARKS.md"
    other_begin, other_end = benchmarks_md.markers("perf-y")
    rest = f"\n\nmid\n{other_begin}\nkept\n{other_end}\nend"
    page.write_text(f"# B\n\nintro\n{BEGIN}\nold\nlines\n{END}{rest}")
    benchmarks_md.replace_block(page, "perf-x", "new table")
    assert page.read_text() == f"# B\n\nintro\n{BEGIN}\nnew table\n{END}{rest}"
    benchmarks_md.replace_block(page, "perf-x", "new table\n")
    assert page.read_text().count("new table") == 1
    assert list(tmp_path.iterdir()) == [page]  # no temporary file left beside it


@pytest.mark.parametrize(("text", "match"), [
    ("# B\n\nno block here\n", "marker '<!-- perf-x:begin -->' is missing"),
    (f"{BEGIN}\nonly the start\n", "marker '<!-- perf-x:end -->' is missing"),
    (f"{BEGIN}\na\n{END}\n{BEGIN}\nb\n{END}\n", "marker '<!-- perf-x:begin -->' appears 2 times"),
    (f"{END}\nswapped\n{BEGIN}\n", "'<!-- perf-x:end -->' comes before '<!-- perf-x:begin -->'"),
])
def test_page_with_missing_duplicated_or_swapped_markers_is_refused_and_left_unchanged(
        tmp_path: Path, text: str, match: str):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(text)
    with pytest.raises(benchmarks_md.MarkerError, match=re.escape(match)) as caught:
        benchmarks_md.replace_block(page, "perf-x", "new\n")
    assert str(page) in str(caught.value)
    assert page.read_text() == text


def test_missing_page_is_an_error_not_a_new_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        benchmarks_md.replace_block(tmp_path / "BENCHMARKS.md", "perf-x", "new\n")
    assert not (tmp_path / "BENCHMARKS.md").exists()


@pytest.mark.parametrize("name", [report.BLOCK, defaults.BLOCK, two_models.BLOCK])
def test_rewriting_each_harness_block_with_its_own_text_leaves_benchmarks_md_identical(name: str):
    text = (REPO_ROOT / "BENCHMARKS.md").read_text()
    begin, end = benchmarks_md.markers(name)
    inner = text[text.index(begin) + len(begin): text.index(end)]
    assert inner.startswith("\n")
    assert benchmarks_md.replace_block_text(text, name, inner[1:]) == text
