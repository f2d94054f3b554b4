"""Every default is defined once: ``src/`` and ``tools/`` hold no second literal of the tile step, the tile
batch and batches in flight, the ports, the client timeout or the registry file name.

The source is read with ``ast`` (docstrings and comments may name a value; code may not). A literal counts
when the name it is given says what it is: the keyword, parameter, assigned name or command-line option it
sits in (``tile_step_size=0.5``, ``timeout_s: float = 600.0``, ``--timeout ... default=600.0``). Ports and
the file name count wherever they appear.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("src", "tools")

# Files other work owns at the time of writing: to be switched to the owners when that work is merged.
PENDING = {
    "src/nnunet_triton/server/watchdog.py": "falls back to port 8000 when argv names none",
    "tools/gpu_timings.py": "tile step 0.5 and client_timeout=600 of the GPU timings",
    "tools/gpu_parity.py": "tiles per fold batch 4 of the GPU parity check",
}


def _is_number(node: ast.AST, value: float) -> bool:
    return (isinstance(node, ast.Constant) and type(node.value) in (int, float)
            and node.value == value)


def _label_of_call_argument(call: ast.Call, keyword: str | None, position: int | None) -> str:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "?")
    if keyword == "default" and call.args and isinstance(call.args[0], ast.Constant):
        return str(call.args[0].value)  # add_argument("--tile-step-size", default=...)
    return keyword if keyword is not None else f"{name}[{position}]"


def _call_labels(node: ast.Call) -> Iterator[tuple[str, ast.AST]]:
    for i, arg in enumerate(node.args):
        yield _label_of_call_argument(node, None, i), arg
    for kw in node.keywords:
        yield _label_of_call_argument(node, kw.arg, None), kw.value


Function = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def _default_labels(node: Function) -> Iterator[tuple[str, ast.AST]]:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    yield from ((arg.arg, default) for arg, default in
                zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True))
    yield from ((arg.arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                if default is not None)


def _assign_labels(node: ast.Assign | ast.AnnAssign) -> Iterator[tuple[str, ast.AST]]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        if node.value is not None:
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "?")
            yield name, node.value


def labelled_constants(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(label, value) for every value with a name that says what it is (see the module docstring)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield from _call_labels(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _default_labels(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            yield from _assign_labels(node)
        elif isinstance(node, ast.Dict):
            yield from ((str(key.value), value) for key, value in zip(node.keys, node.values, strict=True)
                        if isinstance(key, ast.Constant))


def _strings(tree: ast.AST) -> Iterator[ast.Constant]:
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def _trees() -> Iterator[tuple[str, ast.AST]]:
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            yield relative, ast.parse(path.read_text(), filename=relative)


def _labelled(value: float, label: Callable[[str], bool]) -> Callable[[ast.AST], list[str]]:
    def find(tree: ast.AST) -> list[str]:
        return [name for name, node in labelled_constants(tree) if _is_number(node, value) and label(name)]
    return find


def _ports(tree: ast.AST) -> list[str]:
    found = {f"{node.lineno}:{node.value}" for node in ast.walk(tree)
             if any(_is_number(node, port) for port in (8000, 8001, 8002))}
    found |= {f"{node.lineno}:{node.value}" for node in _strings(tree)
              if re.search(r":800[012]\b", node.value)}
    return sorted(found)


def _metadata_file(tree: ast.AST) -> list[str]:
    literal = [f"{node.lineno}" for node in _strings(tree) if node.value == "repository_metadata.json"]
    aliases = [name for name, node in labelled_constants(tree)
               if isinstance(node, ast.Attribute) and node.attr == "REPOSITORY_METADATA_FILE"]
    return literal + [f"alias {name}" for name in aliases]


STEP_FUNCTIONS = {"compute_steps_for_sliding_window", "tile_slicers"}  # step is their 3rd argument


def _step(name: str) -> bool:
    return "step" in name.lower() or name.split("[")[0] in STEP_FUNCTIONS


# rule: (finder, {owner file: the literals it holds})
RULES = {
    "tile step 0.5": (_labelled(0.5, _step), {"src/nnunet_triton/options.py": 1}),
    "tile batch / in flight 4": (
        _labelled(4, lambda name: re.search(r"batch_size|inflight|in_flight", name.lower()) is not None),
        {"src/nnunet_triton/parameters.py": 2}),
    "ports 8000/8001/8002": (_ports, {"src/nnunet_triton/parameters.py": 3}),
    "client timeout 600 s": (_labelled(600, lambda name: "timeout" in name.lower()),
                             {"src/nnunet_triton/options.py": 1}),
    "repository_metadata.json": (_metadata_file, {"src/nnunet_triton/io_names.py": 1}),
}

# Literals of the same value that are not the same default, each with its reason.
TIMEOUT = "client timeout 600 s"
ALLOWED = {
    (TIMEOUT, "src/nnunet_triton/repository/registry.py"): "waiting for the repository lock, not a request",
    (TIMEOUT, "tools/container_host.py"): "apt-get update's time limit",
    (TIMEOUT, "src/nnunet_triton/server/deploy/image_check.py"):
        "how long the image check waits for the fixture's models to load",
    (TIMEOUT, "src/nnunet_triton/server/deploy/service.py"):
        "--ready-timeout (the server's start) and podman volume import's time limit",
    (TIMEOUT, "src/nnunet_triton/client/dicom/node.py"): "joining the node's worker at shutdown",
    (TIMEOUT, "tools/orthanc.py"): "installing Orthanc with apt-get",
    (TIMEOUT, "tools/soak.py"): "ready_timeout_s: the server's start",
}


def found_literals() -> dict[str, dict[str, list[str]]]:
    """{rule: {file: [where]}} over src/ and tools/."""
    found: dict[str, dict[str, list[str]]] = {rule: {} for rule in RULES}
    for relative, tree in _trees():
        for rule, (find, _owners) in RULES.items():
            hits = find(tree)
            if hits:
                found[rule][relative] = hits
    return found


@pytest.fixture(scope="module")
def literals() -> dict[str, dict[str, list[str]]]:
    return found_literals()


@pytest.mark.parametrize("rule", RULES)
def test_default_is_written_once_in_its_owner(rule, literals):
    _find, owners = RULES[rule]
    others = {path: hits for path, hits in literals[rule].items()
              if path not in owners and (rule, path) not in ALLOWED and path not in PENDING}
    assert others == {}, f"{rule}: a second literal; import the default from {sorted(owners)} instead"
    assert {owner: len(literals[rule].get(owner, [])) for owner in owners} == owners


def test_allow_list_names_only_files_that_still_hold_such_a_literal(literals):
    stale = sorted(key for key in ALLOWED if key[1] not in literals[key[0]])
    assert stale == []


def test_scanner_finds_a_second_literal_in_each_form():
    source = '''
def predict(tile_step_size=0.5, *, max_inflight=4, timeout_s: float = 600.0): ...
client = Client(url="127.0.0.1:8001", timeout_s=600)
parser.add_argument("--tile-step-size", default=0.5)
tile_slicers(shape, patch, 0.5)
METADATA = io_names.REPOSITORY_METADATA_FILE
NAME = "repository_metadata.json"
'''
    tree = ast.parse(source)
    assert {rule: find(tree) for rule, (find, _owners) in RULES.items()} == {
        "tile step 0.5": ["tile_step_size", "--tile-step-size", "tile_slicers[2]"],
        "tile batch / in flight 4": ["max_inflight"],
        "ports 8000/8001/8002": ["3:127.0.0.1:8001"],
        "client timeout 600 s": ["timeout_s", "timeout_s"],
        "repository_metadata.json": ["7", "alias METADATA"],
    }
