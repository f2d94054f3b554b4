"""The repository layer (``nnunet_triton.repository``) sits below the builder and the server.

It is read in fresh interpreters (``python -c``), as the container's health probe and entry point read it:
importing the layer and reading a repository through it (model folders, registry, configs, an endpoint's
inference configuration) loads neither the builder nor the server, and the health probe loads no builder.
The "not built by nnunet-triton" refusal is written once and is what every reader says.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from deploy_support import make_config, write_repository

from nnunet_triton import io_names
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.builder.repository import remove_endpoint
from nnunet_triton.errors import DeployError, NotBuiltRepositoryError, RepositoryError
from nnunet_triton.repository import ModelRepository, require_registry, version_metadata
from nnunet_triton.server.deploy.repository_info import RepositoryInfo

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "nnunet_triton"


def _loaded_in_a_fresh_interpreter(script: str, repository: Path) -> dict:
    """Run ``script`` (``repository`` is bound to the folder) in a new interpreter; what it printed as JSON
    (its ``result``) and the ``nnunet_triton`` modules it had loaded at the end."""
    program = (f"import json, sys\nfrom pathlib import Path\nrepository = Path({str(repository)!r})\n"
               f"{script}\n"
               "print(json.dumps({'result': result, 'modules': sorted(m for m in sys.modules "
               "if m.startswith('nnunet_triton'))}))")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _message_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings]


def _layers(modules: list[str]) -> set[str]:
    return {m.split(".")[1] for m in modules if m.count(".") >= 1}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    write_repository(root, BuildOptions(), name="liver")
    write_repository(root, BuildOptions(), name="liver", version=2)
    return root


def test_the_repository_layer_reads_a_repository_without_the_builder_or_the_server(repository: Path) -> None:
    script = ("from nnunet_triton.repository import ModelRepository\n"
              "r = ModelRepository(repository)\n"
              "result = [r.has_registry(), r.model_folders() == r.models(), r.expected_models()[0][:1],\n"
              "          [c.name for c in r.configs()][:1], r.inference_config('liver').patch_size,\n"
              "          r.inference_config('liver', 2).num_input_channels]")
    seen = _loaded_in_a_fresh_interpreter(script, repository)
    assert seen["result"] == [True, True, ["liver"], ["liver"], list(make_config().patch_size),
                              make_config().num_input_channels]
    assert not _layers(seen["modules"]) & {"builder", "server", "client", "cli", "serving", "pipeline"}, \
        seen["modules"]


def test_the_health_probe_reads_a_repository_without_importing_the_builder(repository: Path) -> None:
    script = ("from nnunet_triton.server import health\n"
              "required, optional = health.repository_expectations(repository)\n"
              "result = [required[:1], optional, len(health.repository_models(repository))]")
    seen = _loaded_in_a_fresh_interpreter(script, repository)
    assert seen["result"][:2] == [["liver"], sorted(ModelRepository(repository).require_registry()
                                                    .endpoint("liver").version(2).models)]
    assert seen["result"][2] == len(ModelRepository(repository).model_folders())
    assert "builder" not in _layers(seen["modules"]), seen["modules"]


def test_the_layer_imports_nothing_above_it_even_lazily() -> None:
    # the source says the same as the fresh interpreter: no import of builder, server, client or cli
    found = set()
    for path in sorted((PACKAGE / "repository").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
    ours = {m for m in found if m.startswith("nnunet_triton.")}
    assert {m.split(".")[1] for m in ours} <= {"repository", "errors", "io_names", "util", "numerics"}, ours


def test_one_refusal_for_a_folder_not_built_by_nnunet_triton(tmp_path: Path) -> None:
    messages = []
    for read in (lambda: ModelRepository(tmp_path).require_registry(), lambda: require_registry(tmp_path),
                 lambda: version_metadata(tmp_path), lambda: remove_endpoint(tmp_path, "liver"),
                 lambda: ModelRepository(tmp_path).inference_config("liver")):
        with pytest.raises(NotBuiltRepositoryError) as caught:
            read()
        messages.append(str(caught.value))
    with pytest.raises(DeployError) as deploy:  # deploy reports it as a deployment that cannot work
        RepositoryInfo.from_repository(tmp_path)
    assert {*messages, str(deploy.value)} == {
        f"{str(tmp_path)!r} is not a model repository built by nnunet-triton (no "
        f"{io_names.REPOSITORY_METADATA_FILE}): build one with `nnunet-triton build --model-dir <results "
        "folder> --model-repository <folder>`."}
    assert not ModelRepository(tmp_path).has_registry()
    # ... and it is written in one place of the package (docstrings aside)
    writers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if any("built by nnunet-triton" in text for text in _message_strings(p)))
    assert writers == ["repository/registry.py"]


def test_an_endpoint_version_without_a_pipeline_is_named(repository: Path, tmp_path: Path) -> None:
    write_repository(tmp_path, BuildOptions(), name="lung", drop=("lung__v1__preprocess_model",))
    with pytest.raises(RepositoryError, match=r"lung version 1 .* has no 1/inference_config.json"):
        ModelRepository(tmp_path).inference_config("lung")
    with pytest.raises(RepositoryError, match="has no version 3"):
        ModelRepository(repository).inference_config("liver", 3)


@pytest.mark.parametrize(("old", "new"), [
    ("nnunet_triton.registry", "nnunet_triton.repository.registry"),
    ("nnunet_triton.builder.model_repository", "nnunet_triton.repository")])
def test_the_old_import_paths_still_work_and_say_they_are_deprecated(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = __import__(old, fromlist=["_"])
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    replacement = __import__(new, fromlist=["_"])
    for name in module.__all__:
        assert getattr(module, name) is getattr(replacement, name), name


def test_model_dirs_is_the_deprecated_name_of_model_folders(repository: Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"model_dirs\(\) is deprecated .* use model_folders\(\)"):
        assert ModelRepository(repository).model_dirs() == ModelRepository(repository).model_folders()
