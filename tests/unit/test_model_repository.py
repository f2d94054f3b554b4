"""``ModelRepository``: the one reader of a repository on disk, its configs parsed by ``repository.config``.

The fixture repository is what the builder writes for three endpoints (its own spec lists rendered by
``config_gen``, its public endpoints copied by ``write_public_endpoints``, its registry): a CPU Python
runner, a GPU libtorch build and a CPU libtorch build. The regular expressions and the substring test this
class replaced are kept below as the oracle (verbatim), so the facts are shown to be the same on built
configs and shown to differ where a hand-edited config fooled them.
"""

from __future__ import annotations

import ast
import logging
import math
import re
import sys
from pathlib import Path

import pytest
from deploy_support import GPU_OPTIONS, make_config

from nnunet_triton import io_names
from nnunet_triton.builder import config_gen
from nnunet_triton.builder.config_gen import InstanceGroup, ModelConfigInfo, ModelSpec, TensorSpec
from nnunet_triton.builder.model_specs import BuildOptions, namespaced_specs, repository_specs
from nnunet_triton.builder.repository import write_public_endpoints
from nnunet_triton.errors import RepositoryError
from nnunet_triton.repository import ModelRepository, Registry, read_registry, write_registry
from nnunet_triton.server import backends, rollout
from nnunet_triton.server import thread_budget as tb

SRC = Path(__file__).resolve().parents[2] / "src" / "nnunet_triton"
ENDPOINTS = {"liver": BuildOptions(fold_instances=2), "lung": GPU_OPTIONS,
             "kidney": BuildOptions(fold_runner="libtorch")}


def _build(root: Path, name: str, options: BuildOptions) -> None:
    """Version 1 of ``name`` as the builder writes it (minus the networks)."""
    specs, renaming = namespaced_specs(repository_specs(make_config(), options), name, 1)
    repository = ModelRepository(root)
    for spec in specs:
        config_gen.write_config(spec, repository.model_folder(spec.name))
    write_public_endpoints(root, root, name, 1)
    registry = read_registry(root) or Registry()
    write_registry(root, registry.with_version(name, 1, {"models": sorted(renaming.values())}))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for name, options in ENDPOINTS.items():
        _build(root, name, options)
    return root


# --- the readers ModelRepository replaced (the oracle) ----------------------------------------------------

_OLD_INSTANCE_COUNT = re.compile(r"instance_group\s*\{[^}]*?count:\s*(\d+)", re.S)
_OLD_INPUT_DIMS = re.compile(r"^input\s*\{(.*?)^\}", re.S | re.M)
_OLD_LIBTORCH = re.compile(r'^platform:\s*"pytorch_libtorch"', re.M)
_OLD_TOP_LEVEL = re.compile(r'^(backend|platform)\s*:\s*"([^"]+)"', re.MULTILINE)


def _old_fold_facts(repository: Path) -> tuple[int, int, bool]:
    """(fold instances, largest fold input, CPU libtorch folds) as ``thread_budget`` read them."""
    total, largest, libtorch = 0, 0, False
    for config in sorted(repository.glob("*/config.pbtxt")):
        text = config.read_text()
        on_libtorch = _OLD_LIBTORCH.search(text) is not None
        if 'key: "torch_num_threads"' not in text and not on_libtorch:
            continue
        libtorch = libtorch or (on_libtorch and "KIND_GPU" not in text)
        counts = _OLD_INSTANCE_COUNT.findall(text)
        total += sum(int(c) for c in counts) if counts else 1
        block = _OLD_INPUT_DIMS.search(text)
        dims = [int(d) for d in re.findall(r"dims:\s*(-?\d+)", block.group(1))] if block else []
        if dims and min(dims) > 0:
            largest = max(largest, math.prod(dims))
    return total, largest, libtorch


def _old_backends(repository: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for config in sorted(repository.glob("*/config.pbtxt")):
        fields = dict(match.groups() for match in _OLD_TOP_LEVEL.finditer(config.read_text()))
        backend = fields.get("backend") or {"pytorch_libtorch": "pytorch"}.get(fields.get("platform", ""))
        if backend:
            found.setdefault(backend, []).append(config.parent.name)
    return found


def _old_is_ensemble(repository: Path, model: str) -> bool:
    return 'platform: "ensemble"' in (repository / model / "config.pbtxt").read_text()


# --- a built repository -------------------------------------------------------------------------------------

def test_a_built_repository_gives_the_facts_the_regex_readers_found(built: Path) -> None:
    repository = ModelRepository(built)
    folds = tb.repository_folds(built)
    assert (folds.instances, folds.largest_input, folds.libtorch) == _old_fold_facts(built) == (
        2 * 2 + 2 + 2, 2 * 16 * 24 * 32, True)  # liver 2 x 2 Python, lung 2 GPU, kidney 2 CPU libtorch
    assert sorted((n.model, n.per_sample_forward, n.configured_threads) for n in folds.networks) == [
        ("kidney__v1__fold_0", True, 0), ("kidney__v1__fold_1", True, 0),
        ("liver__v1__fold_0", True, 0), ("liver__v1__fold_1", True, 0)]  # the GPU folds need no check
    assert backends.required_backends([built]) == _old_backends(built)
    assert set(backends.required_backends([built])) == {"python", "pytorch"}
    ensembles = [m for m in repository.model_folders() if repository.is_ensemble(m)]
    assert ensembles == [m for m in repository.model_folders() if _old_is_ensemble(built, m)]
    assert "liver" in ensembles and "liver__v1" in ensembles and "liver__v1__fold_0" not in ensembles
    assert repository.model_folders() == sorted(p.parent.name for p in built.glob("*/config.pbtxt"))


def test_the_registry_names_every_model_and_which_must_be_loaded(built: Path, tmp_path: Path) -> None:
    repository = ModelRepository(built)
    assert repository.models() == repository.model_folders()
    required, optional = repository.expected_models()
    assert (sorted(required), optional) == (repository.model_folders(), [])  # one version each: all required
    assert repository.require_registry().endpoint("lung").public_models == io_names.public_endpoints("lung")
    (tmp_path / "hand_made").mkdir()
    (tmp_path / "hand_made" / "config.pbtxt").write_text('name: "hand_made"\nbackend: "python"\n')
    (tmp_path / "not_a_model").mkdir()
    bare = ModelRepository(tmp_path)
    assert (bare.registry(), bare.models(), bare.expected_models()) == (
        None, ["hand_made"], (["hand_made"], []))
    with pytest.raises(RepositoryError, match="is not a model repository built by nnunet-triton"):
        bare.require_registry()


def test_both_readers_of_the_text_format_give_the_same_tree_for_every_built_config(built: Path) -> None:
    repository = ModelRepository(built)
    for model in repository.model_folders():
        text = repository.config_text(model)
        assert config_gen._TextReader(text).message() == config_gen.config_tree(text), model


def test_without_tritonclient_configs_are_read_by_the_standard_library(
        built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repository = ModelRepository(built)
    with_protobuf = repository.configs()
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)  # as in the server images
    with pytest.raises(ImportError):
        from tritonclient.grpc import model_config_pb2  # noqa: F401
    assert repository.configs() == with_protobuf


# --- writing and reading back --------------------------------------------------------------------------

def test_a_config_written_through_the_repository_reads_back_as_its_spec(tmp_path: Path) -> None:
    spec = ModelSpec(name="fold_7", platform="pytorch_libtorch", max_batch_size=1,
                     inputs=(TensorSpec("INPUT__0", "FP32", (2, 8, 8)), TensorSpec("MASK", "UINT8", (-1,))),
                     outputs=(TensorSpec("OUTPUT__0", "FP16", (3, 8, 8)),),
                     instance_groups=(InstanceGroup(count=3, kind="cpu",
                                                    rate_limiter_resources=(("slot", 1),)),
                                      InstanceGroup(count=1, kind="gpu", gpus=(0,))),
                     parameters={"INTRA_OP_THREAD_COUNT": 2, "INFERENCE_MODE": True},
                     default_model_filename="net.pt")
    repository = ModelRepository(tmp_path)
    path = config_gen.write_config(spec, repository.model_folder(spec.name))
    assert path == repository.config_path("fold_7") and repository.has_model("fold_7")
    assert repository.config("fold_7") == ModelConfigInfo(
        name="fold_7", platform="pytorch_libtorch", max_batch_size=1, default_model_filename="net.pt",
        instance_groups=((3, "KIND_CPU"), (1, "KIND_GPU")),
        inputs=(("INPUT__0", (2, 8, 8)), ("MASK", (-1,))),
        parameters={"INFERENCE_MODE": "true", "INTRA_OP_THREAD_COUNT": "2"})
    repository.write_config_text("copy", config_gen.renamed_config(repository.config_text("fold_7"), "copy"))
    copied = ModelConfigInfo(**{**vars(repository.config("fold_7")), "name": "copy"})
    assert repository.config("copy") == copied


# --- hand-edited configs the regular expressions misread ---------------------------------------------------

_FOLD = """# fold model, edited by hand
name: "fold_0"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 2, 16, 24, 32 ] } ]
instance_group {
  kind: KIND_CPU
  rate_limiter { resources { name: "nnunet_fold_slot" count: 1 } }
  count: 3
}
parameters { key: "torch_num_threads" value { string_value: "0" } }
"""
_LIBTORCH = """  # indented, as an editor may leave it
  platform : "pytorch_libtorch"
  name: "fold_1"
  input { name: "INPUT__0" data_type: TYPE_FP32 dims: [2, 16, 24, 32] }
  instance_group { kind: KIND_CPU }
"""
_NOT_ENSEMBLE = """name: "preprocess"
backend: "python"  # was platform: "ensemble" before the steps moved into the orchestrator
"""


def test_comments_reordered_fields_and_list_syntax_that_fooled_the_regexes_are_read_right(
        tmp_path: Path) -> None:
    for name, text in (("fold_0", _FOLD), ("fold_1", _LIBTORCH), ("preprocess", _NOT_ENSEMBLE)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(text)
    # the regexes: the rate limiter's count for the instances, no input block, no libtorch, an ensemble
    assert _old_fold_facts(tmp_path) == (1, 0, False)
    assert _old_backends(tmp_path) == {"python": ["fold_0", "preprocess"]}
    assert _old_is_ensemble(tmp_path, "preprocess")
    folds = tb.repository_folds(tmp_path)
    assert (folds.instances, folds.largest_input, folds.libtorch) == (3 + 1, 2 * 16 * 24 * 32, True)
    assert backends.required_backends([tmp_path]) == {"python": ["fold_0", "preprocess"],
                                                      "pytorch": ["fold_1"]}
    assert not ModelRepository(tmp_path).is_ensemble("preprocess")
    assert rollout._load_order(tmp_path, ["preprocess", "fold_0"]) == ["fold_0", "preprocess"]


def test_a_malformed_config_is_refused_naming_its_file_and_the_launch_checks_skip_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.pbtxt").write_text('name: "broken"\ninput { dims: [1, 2\n')
    repository = ModelRepository(tmp_path)
    with pytest.raises(RepositoryError, match=r"cannot read the config of model 'broken' .*config\.pbtxt"):
        repository.config("broken")
    assert not repository.is_ensemble("broken")
    with caplog.at_level(logging.WARNING):
        assert tb.repository_folds(tmp_path) == tb.FoldModels(0, 0)
        assert backends.required_backends([tmp_path]) == {}  # Triton refuses it itself, naming the error
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "thread budget", "backend check"]


# --- one owner ---------------------------------------------------------------------------------------------

def _names_in(path: Path) -> tuple[set[str], set[str]]:
    """(string constants, names and attributes) of a module."""
    tree = ast.parse(path.read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return strings, names


def test_config_pbtxt_is_opened_in_the_repository_layer_only_registry_read_in_one_place_no_regex() -> None:
    naming, regex = set(), set()
    for path in sorted(SRC.rglob("*.py")):
        strings, names = _names_in(path)
        module = str(path.relative_to(SRC))
        as_path = {t for t in strings if t == io_names.MODEL_CONFIG_FILE or t.endswith("/config.pbtxt")}
        if as_path or "MODEL_CONFIG_FILE" in names:
            naming.add(module)
            if "re" in names:
                regex.add(module)
    assert naming == {"io_names.py", "repository/config.py", "repository/model_repository.py"}
    assert regex == {"io_names.py"}  # its regexes check endpoint names
    registry_readers = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                        if "read_registry" in _names_in(p)[1]}
    assert registry_readers == {"repository/registry.py", "repository/model_repository.py"}
    _, layout = _names_in(SRC / "repository" / "model_repository.py")
    assert not layout & {"open", "read_text", "read_bytes", "write_text", "write_bytes"}
    for reader in ("server/thread_budget.py", "server/backends.py", "server/rollout.py", "server/health.py",
                   "server/deploy/repository_info.py", "builder/repository.py"):
        _, names = _names_in(SRC / reader)
        assert "ModelRepository" in names, reader
        if reader in ("server/thread_budget.py", "server/backends.py", "server/rollout.py"):
            assert "re" not in names, reader  # they held the regular expressions and the substring test


def test_the_embedded_server_loads_every_registry_model_or_every_folder(built: Path, tmp_path: Path) -> None:
    from nnunet_triton.server import embedded

    (tmp_path / "hand_made").mkdir()
    (tmp_path / "hand_made" / "config.pbtxt").write_text('name: "hand_made"\nbackend: "python"\n')
    assert embedded._repository_load_list([built, tmp_path]) == (*ModelRepository(built).model_folders(),
                                                                 "hand_made")
    (tmp_path / io_names.REPOSITORY_METADATA_FILE).write_text("{")
    with pytest.raises(ValueError, match="cannot serve .* is not valid JSON"):
        embedded._repository_load_list([tmp_path])
