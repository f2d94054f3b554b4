"""The one writer of BENCHMARKS.md's generated blocks, shared by every perf harness.

Each harness owns one block, named after its make target, between two HTML comments::

    <!-- perf-defaults:begin -->
    ...generated Markdown...
    <!-- perf-defaults:end -->

Only the text between the markers changes; the prose around them is written by hand. A page without
the block's markers (or with them twice, or in the wrong order) is refused with an error naming the
markers to add: a harness never guesses where a section belongs. The file is replaced atomically, so
an interrupted run leaves the old page, not half of a new one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["MarkerError", "markers", "replace_block", "replace_block_text"]


class MarkerError(ValueError):
    """The page lacks a block's markers, or holds them twice or out of order."""


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name`` (e.g. ``perf-defaults``)."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block_text(text: str, name: str, markdown: str) -> str:
    """``text`` with the lines between block ``name``'s markers replaced by ``markdown``.

    The begin marker is followed by a newline, then ``markdown`` (a newline is added when it lacks its
    last one), then the end marker.

    Raises:
        MarkerError: if either marker is missing or appears more than once, or the end comes first.
    """
    begin, end = markers(name)
    for marker in (begin, end):
        count = text.count(marker)
        if count != 1:
            found = "is missing" if count == 0 else f"appears {count} times"
            raise MarkerError(f"block {name!r}: marker {marker!r} {found}; the page needs exactly one "
                              f"{begin!r} line followed by one {end!r} line.")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise MarkerError(f"block {name!r}: {end!r} comes before {begin!r}.")
    body = markdown if markdown.endswith("\n") else markdown + "\n"
    return f"{text[:start]}\n{body}{text[stop:]}"


def replace_block(path: Path, name: str, markdown: str) -> None:
    """Rewrite block ``name`` of the Markdown file ``path`` in place (atomically).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        MarkerError: as :func:`replace_block_text`, naming ``path``.
    """
    text = path.read_text()
    try:
        new = replace_block_text(text, name, markdown)
    except MarkerError as exc:
        raise MarkerError(f"{path}: {exc}") from None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(new)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
