"""What users install: ``nnunet_triton`` never imports the checkout's developer folders, and the wheel
holds the package and its data (``server/cves.json``) and nothing else (no ``tools/``, no ``tests/``, no
fixtures or other developer data).

A repository's ``model.py`` files are written by the builder (``builder.build_inputs.adapter_source``),
so the Triton model folders of the source tree (``preprocess_model/``, ``repository/`` ...) are not
needed at run time: the installed wheel, outside the checkout, finds every serving step they import.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nnunet_triton.builder import build_inputs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nnunet_triton"
# Top-level folders of the checkout that hold Python: never importable by an installed package.
DEVELOPER_PACKAGES = frozenset(
    path.name for path in ROOT.iterdir()
    if path.is_dir() and path.name not in {"src", ".venv", "build"} and any(path.rglob("*.py"))
)
SERVING_STEPS = (*build_inputs.ADAPTERS.values(), build_inputs.FOLD_RUNNER_ADAPTER,
                 build_inputs.COMBINE_ADAPTER)

_DYNAMIC_IMPORTS = {"import_module", "__import__"}
# offline and quiet: everything is local, and the version check would reach for the network
PIP_QUIET = ("-q", "--no-index", "--disable-pip-version-check")


def imported_top_levels(path: Path) -> set[str]:
    """Top-level names ``path`` imports: import statements anywhere (lazy ones too) and the string
    argument of ``importlib.import_module`` / ``__import__``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) in _DYNAMIC_IMPORTS):
            found.add(node.args[0].value.split(".")[0])
    return found


def test_developer_folders_are_known_to_the_import_check():
    assert {"tools", "tests", "repository", "network_models"} <= DEVELOPER_PACKAGES


def test_package_imports_nothing_from_the_checkouts_developer_folders():
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_top_levels(path) & DEVELOPER_PACKAGES)
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_import_check_sees_lazy_and_dynamic_imports(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import importlib\n\ndef f():\n    from tools.perf import report\n"
                      "    return importlib.import_module('tests.fixture_paths')\n")
    assert imported_top_levels(module) == {"importlib", "tools", "tests"}


def _source_copy(dest: Path) -> Path:
    """The files git would commit (tracked and untracked, not ignored), so that stale build outputs of
    the checkout (``build/lib``) cannot reach the wheel."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know which files a build sees")
    source = _source_copy(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", *PIP_QUIET, "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(source)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("nnunet_triton-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_only_the_package_sources_and_its_metadata(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    package = set(names) - dist_info
    expected = {str(p.relative_to(PACKAGE.parent)) for pattern in ("*.py", "*.json")
                for p in PACKAGE.rglob(pattern) if "__pycache__" not in p.parts}
    assert package == expected
    assert {n.split("/", 1)[1] for n in dist_info} == {
        "METADATA", "WHEEL", "RECORD", "top_level.txt", "entry_points.txt"}


@pytest.mark.slow
def test_installed_wheel_finds_every_serving_step_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", *PIP_QUIET, "--no-deps", "--no-compile",
                    "--target", str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    child = (
        "import importlib.util, json, nnunet_triton\n"
        f"steps = {SERVING_STEPS!r}\n"
        "print(json.dumps({'package': nnunet_triton.__file__, 'tools': importlib.util.find_spec('tools') "
        "is not None, 'steps': {s: importlib.util.find_spec(f'nnunet_triton.serving.steps.{s}').origin "
        "for s in steps}}))\n"
    )
    # PYTHONPATH comes before site-packages (where the checkout's editable install points at src/),
    # and the working directory is outside the checkout.
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert Path(found["package"]).is_relative_to(site)
    assert found["tools"] is False
    assert {s: Path(o).relative_to(site).as_posix() for s, o in found["steps"].items()} == {
        s: f"nnunet_triton/serving/steps/{s}.py" for s in SERVING_STEPS}
    for step in SERVING_STEPS:
        assert f"from nnunet_triton.serving.steps.{step} import" in build_inputs.adapter_source(step)
