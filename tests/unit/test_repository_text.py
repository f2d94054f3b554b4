"""The project's text says what is true: read from the files, no server.

* No citation of a document that is not in the repository (a tracker's issue number, a numbered style rule,
  private notes), so a reader can follow every reference.
* Messages of the installed console scripts name console commands: a ``make`` target exists only in a
  checkout, so a message may name one only next to the command (saying it is the checkout's way).
* Every test file and every ``nnunet_triton.<module>.<name>`` the source and the docs cite exists.
* Every list of the request options in the docs lists all of them.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from nnunet_triton.options import KNOWN_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nnunet_triton"
DOCS = (ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")))
# every tracked text file a reader meets (the fixtures are data)
TEXT_FILES = (
    *DOCS, ROOT / "Makefile",
    *(p for folder in ("src", "tools", "tests", "repository", "network_models", "preprocess_model",
                       "stitch_model", "docker", "benchmarks")
      for p in sorted((ROOT / folder).rglob("*"))
      if p.suffix in {".py", ".md", ".sh", ".pbtxt", ".toml", ".txt"} and "fixtures" not in p.parts
      and "__pycache__" not in p.parts),
)
# the project's own tracker and notes; an upstream project's public issue (``server#7888``) is a citation
OUTSIDE_REFERENCE = re.compile(r"\bissues? #?\d+|\bstyle rules? \d+|\btriton\.md\b", re.I)
# a target of the checkout's Makefile as a command (``make serve``, `make deploy TARGET=docker`)
MAKE_TARGETS = sorted(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M),
                      key=len, reverse=True)
MAKE_TARGET = re.compile(rf"\bmake (?:{'|'.join(MAKE_TARGETS)})\b")


def _lines_citing_outside_documents(path: Path) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for match in OUTSIDE_REFERENCE.finditer(line):
            found.append(f"{path.relative_to(ROOT)}:{number}: {match.group()!r} in {line.strip()!r}")
    return found


def test_no_text_cites_an_issue_number_or_a_document_outside_the_repository() -> None:
    offenders = [hit for path in TEXT_FILES if path != Path(__file__).resolve()
                 for hit in _lines_citing_outside_documents(path)]
    assert not offenders, "\n".join(offenders)


def _message_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """The text of every string expression that is not a docstring (f-strings with their literal parts)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    inside_fstring = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                      for part in node.values}
    texts = []
    for node in ast.walk(tree):
        if id(node) in docstrings or id(node) in inside_fstring:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr):
            texts.append((node.lineno, "".join(p.value if isinstance(p, ast.Constant) else "{}"
                                               for p in node.values)))
    return texts


def _make_targets_without_a_console_command(source: str, name: str) -> list[str]:
    return [f"{name}:{line}: {text!r}" for line, text in _message_literals(ast.parse(source))
            if MAKE_TARGET.search(text) and "checkout" not in text]


def test_console_messages_name_console_commands_not_make_targets() -> None:
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py"))
                 for hit in _make_targets_without_a_console_command(path.read_text(),
                                                                    str(path.relative_to(ROOT)))]
    assert not offenders, "messages of the installed package naming a make target:\n" + "\n".join(offenders)


def test_make_target_rule_flags_a_message_and_passes_docstrings_and_checkout_notes() -> None:
    source = '''
def f():
    """Started by ``make serve``."""
    raise ValueError(f"run `make setup` first ({1})")
    print("run `pip install x` (a checkout: `make setup`)")
'''
    found = _make_targets_without_a_console_command(source, "m.py")
    assert found == ["m.py:4: 'run `make setup` first ({})'"]


def test_source_and_docs_cite_only_test_files_that_exist() -> None:
    tests = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    cited = {(path.relative_to(ROOT), name) for path in (*DOCS, *sorted(PACKAGE.rglob("*.py")))
             for name in re.findall(r"\b(test_\w+\.py)\b", path.read_text())}
    assert sorted((str(path), name) for path, name in cited if name not in tests) == []


def _missing_attribute(dotted: str) -> str | None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return f"{'.'.join(parts[:cut])} has no {'.'.join(parts[cut:])!r}"
            target = getattr(target, attribute)
        return None
    return "no such module"


def test_docs_name_only_modules_and_functions_that_exist() -> None:
    pytest.importorskip("torch")  # some modules the docs name import torch
    missing = {f"{path.relative_to(ROOT)}: `{name}`: {why}"
               for path in DOCS for name in re.findall(r"`(nnunet_triton(?:\.\w+)+)", path.read_text())
               if (why := _missing_attribute(name))}
    assert sorted(missing) == []


def test_every_list_of_request_options_in_the_docs_lists_all_of_them() -> None:
    incomplete = []
    for path in DOCS:
        for listed in re.findall(r"\(((?:`\w+`, )+`\w+`)\)", path.read_text()):
            names = re.findall(r"`(\w+)`", listed)
            if len(set(names) & set(KNOWN_OPTIONS)) >= 3 and set(names) != set(KNOWN_OPTIONS):
                incomplete.append(f"{path.relative_to(ROOT)}: {listed}")
    assert incomplete == [], f"every request option is {KNOWN_OPTIONS}"
