"""The package's layers and the direction of imports between them (read from the source with ``ast``).

    core       errors exit_codes io_names options dtypes util segment_metadata (and the version in __init__)
    numerics   nnU-Net's numerics                        -> core
    repository ModelRepository, registry, config.pbtxt I/O -> core, numerics (``registry``: deprecated path)
    parameters config parameters of the models           -> core, numerics
    pipeline   the BLS loop, the fold runner              -> core, numerics, parameters
    serving    pb_utils glue                              -> core, numerics, parameters, pipeline
    builder    config.pbtxt and repository building       -> core, numerics, parameters, repository
    client     client, image and DICOM I/O, the DICOM node -> core, numerics, parameters
    server     embedded server, health, watchdog, deploy  -> core, numerics, parameters, pipeline, repository,
                                                            builder, client (the thread check runs the fold
                                                            runner)
    validate   the endpoint against nnU-Net               -> core, numerics, parameters, client
    cli        every command line (and ``python -m``)     -> everything; nothing imports it

Lazy imports inside functions count too: a layer that imports a higher one at run time still depends on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "nnunet_triton"
CORE = {"errors", "exit_codes", "io_names", "options", "dtypes", "util", "segment_metadata", "__init__"}
RENAMED = {"registry": "repository"}  # deprecated module paths: the layer of the module they re-export
ALLOWED = {
    "core": {"core"},
    "numerics": {"core", "numerics"},
    "repository": {"core", "numerics", "repository"},
    "parameters": {"core", "numerics", "parameters"},
    "pipeline": {"core", "numerics", "parameters", "pipeline"},
    "serving": {"core", "numerics", "parameters", "pipeline", "serving"},
    "builder": {"core", "numerics", "parameters", "repository", "builder"},
    "client": {"core", "numerics", "parameters", "client"},
    "server": {"core", "numerics", "parameters", "pipeline", "repository", "builder", "client", "server"},
    "validate": {"core", "numerics", "parameters", "client", "validate"},
    "cli": {"core", "numerics", "parameters", "pipeline", "serving", "repository", "builder", "client",
            "server", "validate", "cli"},
}


def layer_of(module: str) -> str:
    """``nnunet_triton.numerics.plans`` -> ``numerics``; core modules -> ``core``."""
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    if first == "__main__":  # ``python -m nnunet_triton`` is the command line
        return "cli"
    return "core" if first in CORE else RENAMED.get(first, first)


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_module(dotted: str) -> bool:
    return (PACKAGE.parent / dotted.replace(".", "/")).with_suffix(".py").exists()


def imports_of(path: Path) -> set[str]:
    """Every ``nnunet_triton`` module ``path`` imports, at module level or inside functions."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("nnunet_triton")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nnunet_triton"):
            found.add(node.module)
            # `from nnunet_triton.numerics import plans` imports the module nnunet_triton.numerics.plans
            found |= {f"{node.module}.{alias.name}" for alias in node.names
                      if _is_module(f"{node.module}.{alias.name}")}
    return found


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts).removesuffix(".__init__")


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_of_the_package_belongs_to_a_known_layer():
    assert {layer_of(module_name(p)) for p in MODULES} <= set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_module_imports_only_its_own_and_lower_layers(path: Path):
    layer = layer_of(module_name(path))
    wrong = sorted(
        target for target in imports_of(path)
        if layer_of(target) not in ALLOWED[layer]
    )
    assert wrong == [], f"{module_name(path)} ({layer}) imports {wrong}"


def test_numerics_imports_no_triton_client_or_build_code():
    # the layering rule, stated on its own: numerics is a pure library
    offenders = {module_name(p): sorted(t for t in imports_of(p) if layer_of(t) not in {"core", "numerics"})
                 for p in MODULES if layer_of(module_name(p)) == "numerics"}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_layering_check_detects_an_upward_import(tmp_path):
    # the check itself can fail: a numerics module importing the client is reported
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from nnunet_triton.client.client import NnunetClient\n")
    assert {layer_of(t) for t in imports_of(bad)} == {"client"}
    assert "client" not in ALLOWED["numerics"]


def test_no_module_manipulates_sys_path():
    roots = [PACKAGE.parents[1] / name for name in
             ("src", "tests", "tools", "repository", "network_models", "preprocess_model", "stitch_model")]
    offenders = [str(p) for root in roots for p in root.rglob("*.py")
                 if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()]
    offenders = [o for o in offenders if not o.endswith("test_layering.py")]
    assert offenders == []


TOP_LEVEL = PACKAGE.parents[1]
# the source tree's Triton model files import their serving step only; its `python -m` entry points the CLI
MODEL_FILES = sorted(p for folder in ("preprocess_model", "stitch_model", "network_models", "repository")
                     for p in (TOP_LEVEL / folder).rglob("model.py"))
ENTRY_FILES = [TOP_LEVEL / "repository" / "build.py", TOP_LEVEL / "network_models" / "export.py"]
# the benchmarks' own Triton model (``nnunet_monolith``), copied whole into the perf repository
BENCHMARK_MODEL = TOP_LEVEL / "tools" / "perf" / "monolith_step.py"


def test_the_top_level_folders_hold_the_five_model_files_and_two_entry_points():
    assert [str(p.relative_to(TOP_LEVEL)) for p in MODEL_FILES] == [
        "network_models/python_runner/model.py", "preprocess_model/model.py",
        "repository/ensemble_combine/model.py", "repository/orchestrator/model.py", "stitch_model/model.py"]
    assert all(p.is_file() for p in ENTRY_FILES)


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: str(p.relative_to(TOP_LEVEL)))
def test_a_model_file_imports_nothing_but_its_serving_step(path: Path):
    (target,) = imports_of(path)
    assert target.startswith("nnunet_triton.serving.steps.")


@pytest.mark.parametrize("path", ENTRY_FILES, ids=lambda p: str(p.relative_to(TOP_LEVEL)))
def test_an_entry_point_imports_nothing_but_the_cli(path: Path):
    assert {layer_of(t) for t in imports_of(path)} == {"cli"}


def _stub_numpy_api_calls(tree: ast.AST) -> list[str]:
    """``x.as_numpy(...)`` and ``pb_utils.Tensor(...)`` calls: the stub's NumPy C API, which corrupts tensors
    under numpy 2 in pytriton's stub (pybind11 < 2.12); ``pb_utils.Tensor.from_dlpack`` is the route."""
    return [f"line {node.lineno}: .{node.func.attr}(...)" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"as_numpy", "Tensor"}]


def test_no_model_passes_tensors_through_the_stubs_numpy_api():
    serving = sorted((PACKAGE / "serving").rglob("*.py"))
    found = {str(p.relative_to(TOP_LEVEL)): calls for p in (*serving, *MODEL_FILES, BENCHMARK_MODEL)
             if (calls := _stub_numpy_api_calls(ast.parse(p.read_text())))}
    assert found == {}
    example = "pb_utils.Tensor('Y', t.as_numpy())\npb_utils.Tensor.from_dlpack('Y', a)"
    assert _stub_numpy_api_calls(ast.parse(example)) == ["line 1: .Tensor(...)", "line 1: .as_numpy(...)"]


def test_the_package_does_not_know_the_benchmarks_monolith():
    mentions = sorted(str(p.relative_to(TOP_LEVEL)) for p in PACKAGE.rglob("*")
                      if p.is_file() and p.suffix in {".py", ".pbtxt", ".json", ".md", ".txt"}
                      and "monolith" in p.read_text().lower())
    assert mentions == []


def test_the_benchmark_model_imports_the_serving_layer_and_below_never_tools():
    # its model.py is this file, copied into a repository: the Triton stub has the package, not tools/
    tree = ast.parse(BENCHMARK_MODEL.read_text())
    roots = {alias.name.split(".")[0] for node in _runtime_nodes(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in _runtime_nodes(tree)
              if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert "tools" not in roots
    layers = {layer_of(t) for t in imports_of(BENCHMARK_MODEL)}
    assert "serving" in layers and layers <= ALLOWED["serving"]
