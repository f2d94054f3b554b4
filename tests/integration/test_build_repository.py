"""repository/build.py: layout, registry, no-op re-runs, rebuilds on change, nothing half-written; endpoint
names and versions side by side in one repository."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from nnunet_triton.builder import build_inputs
from nnunet_triton.builder import repository as build
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.cli import build as repository_cli
from nnunet_triton.errors import ExportError, PlansError, RepositoryError, UnsupportedModelError
from nnunet_triton.registry import read_registry, version_metadata
from tests.fixture_paths import require_fixture

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get(
    "NNUNET_TRITON_TEST_MODEL",
    REPO_ROOT / "tests" / "fixtures" / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny",
))


@pytest.fixture(autouse=True)
def _committed_fixture() -> None:
    require_fixture(MODEL_DIR / "plans.json")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _copy_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model, ignore=shutil.ignore_patterns("fold_[1-9]*"))
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, build.BuildResult]:
    out = tmp_path_factory.mktemp("build") / "model_repository"
    return out, build.build_repository(MODEL_DIR, out, folds=(0,))


def test_build_writes_every_model_and_metadata_when_target_cpu(built) -> None:
    out, result = built
    assert result.rebuilt
    assert _files(out) == [
        "fold_0/1/__pycache__", "fold_0/1/inference_config.json", "fold_0/1/model.pt", "fold_0/1/model.py",
        "fold_0/config.pbtxt",
        "nnunet/config.pbtxt", "nnunet__v1/config.pbtxt", "nnunet__v1_fp16/config.pbtxt",
        "nnunet__v1_int16/config.pbtxt", "nnunet__v1_uint16/config.pbtxt", "nnunet__v1_uint8/config.pbtxt",
        "nnunet_fp16/config.pbtxt", "nnunet_int16/config.pbtxt",
        "nnunet_uint16/config.pbtxt", "nnunet_uint8/config.pbtxt",
        "orchestrator_model/1/__pycache__", "orchestrator_model/1/inference_config.json",
        "orchestrator_model/1/model.py", "orchestrator_model/config.pbtxt",
        "preprocess_model/1/__pycache__", "preprocess_model/1/inference_config.json",
        "preprocess_model/1/model.py", "preprocess_model/config.pbtxt",
        "repository_metadata.json",
        "stitch_model/1/__pycache__", "stitch_model/1/inference_config.json", "stitch_model/1/model.py",
        "stitch_model/config.pbtxt",
    ]
    assert (out / "nnunet" / "1").is_dir() and (out / "nnunet__v1" / "1").is_dir()
    # the public endpoint is the pinned endpoint of the promoted version under its own name
    assert (out / "nnunet" / "config.pbtxt").read_text() == (out / "nnunet__v1" / "config.pbtxt").read_text(
        ).replace('name: "nnunet__v1"', 'name: "nnunet"')
    for step, written in (("orchestrator", "orchestrator_model/1/model.py"),
                          ("fold_runner", "fold_0/1/model.py")):
        assert (out / written).read_text() == build_inputs.adapter_source(step)
    for config in out.glob("*/config.pbtxt"):
        message = text_format.Parse(config.read_text(), model_config_pb2.ModelConfig())
        assert message.name == config.parent.name
    # a file where Python would put model.py's bytecode: serving must not change the repository (Triton
    # would take the model for a changed one and reload it when anything depending on it is loaded)
    assert all(p.is_file() and p.stat().st_size == 0 for p in out.glob("*/1/__pycache__"))


def test_build_metadata_records_versions_hashes_and_export_checks(built) -> None:
    out, result = built
    registry = json.loads((out / "repository_metadata.json").read_text())
    assert (registry["format"], list(registry["endpoints"])) == (2, ["nnunet"])
    entry = registry["endpoints"]["nnunet"]
    assert (entry["promoted"], entry["previous"]) == (1, None)
    metadata = registry["endpoints"]["nnunet"]["versions"]["1"]
    assert metadata["input_hash"] == result.input_hash
    assert metadata["plans_sha256"] == build_inputs.sha256_file(MODEL_DIR / "plans.json")
    assert metadata["torch_version"] == torch.__version__
    assert (metadata["folds"], metadata["target"], metadata["fold_runner"], metadata["fold_precision"]) == (
        [0], "cpu", "python", "fp32")
    assert metadata["models"] == [
        "fold_0", "nnunet__v1", "nnunet__v1_fp16", "nnunet__v1_int16", "nnunet__v1_uint16",
        "nnunet__v1_uint8", "orchestrator_model", "preprocess_model", "stitch_model"
    ]
    (fold,) = metadata["exports"]
    assert (fold["path"], fold["max_abs_diff"]) == ("fold_0/1/model.pt", [[2, 0.0], [1, 0.0], [3, 0.0]])
    assert fold["sha256"] == build_inputs.sha256_file(out / "fold_0" / "1" / "model.pt")


def test_build_is_a_noop_when_run_again_with_same_inputs(built) -> None:
    out, first = built
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = build.build_repository(MODEL_DIR, out, folds=(0,))
    assert (again.rebuilt, again.input_hash) == (False, first.input_hash)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_build_rebuilds_when_a_checkpoint_or_option_changes(tmp_path: Path) -> None:
    model, out = _copy_model(tmp_path), tmp_path / "repo"
    first = build.build_repository(model, out, folds_only=True)
    checkpoint_path = model / "fold_0" / "checkpoint_final.pth"
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    name = next(k for k, v in checkpoint["network_weights"].items() if v.is_floating_point())
    checkpoint["network_weights"][name] = checkpoint["network_weights"][name] + 1.0
    torch.save(checkpoint, checkpoint_path)
    second = build.build_repository(model, out, folds_only=True)
    third = build.build_repository(model, out, folds_only=True, options=BuildOptions(tile_batch_size=2))
    assert [r.rebuilt for r in (first, second, third)] == [True, True, True]
    assert len({first.input_hash, second.input_hash, third.input_hash}) == 3
    assert "max_batch_size: 2" in (out / "fold_0" / "config.pbtxt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "repo"]


def test_build_leaves_previous_repository_untouched_when_export_fails(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    model, out = _copy_model(tmp_path), tmp_path / "repo"
    build.build_repository(model, out, folds_only=True)
    before = {str(p): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def fail(*args, **kwargs):
        raise ExportError("fold 0: simulated mismatch")

    monkeypatch.setattr(build.export, "export_fold", fail)
    with pytest.raises(ExportError, match="simulated mismatch"):
        build.build_repository(model, out, folds_only=True, force=True)
    assert {str(p): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "repo"]


def test_the_input_hash_covers_every_module_the_builder_runs_and_the_adapters() -> None:
    """Computed, not listed: prediction_export decides the SEGMENTATION dtype of the generated config."""
    modules = build_inputs.generating_code()
    assert {"nnunet_triton.builder.repository", "nnunet_triton.numerics.prediction_export",
            "nnunet_triton.parameters", "nnunet_triton"} <= set(modules)
    assert not any(name.startswith(("nnunet_triton.serving", "nnunet_triton.client", "nnunet_triton.cli"))
                   for name in modules)  # what a build writes does not depend on them
    assert all(path.is_file() for path in modules.values())


def test_build_refuses_to_replace_a_directory_it_did_not_build(tmp_path: Path) -> None:
    out = tmp_path / "repo"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(PlansError, match="exists but has no repository_metadata.json; refusing to replace"):
        build.build_repository(MODEL_DIR, out, folds=(0,), folds_only=True)
    assert _files(out) == ["precious.txt"]


def test_build_raises_when_configuration_differs_from_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(PlansError, match="--configuration '2d' does not match"):
        build.build_repository(MODEL_DIR, tmp_path / "repo", folds=(0,), configuration="2d")


def test_build_cli_returns_2_and_logs_when_model_folder_is_missing(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    assert repository_cli.main(["--model-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "repo")]) == 2
    assert "has no dataset.json" in caplog.text


def _write_pp_pkl(path: Path, kwargs: list[dict]) -> Path:
    from batchgenerators.utilities.file_and_folder_operations import save_pickle
    from nnunetv2.postprocessing.remove_connected_components import (
        remove_all_but_largest_component_from_segmentation,
    )

    path.parent.mkdir(parents=True, exist_ok=True)
    save_pickle(([remove_all_but_largest_component_from_segmentation] * len(kwargs), kwargs), str(path))
    return path


def test_build_deploys_postprocessing_found_in_nnunets_crossval_folder_and_rebuilds_when_it_changes(
    tmp_path: Path,
) -> None:
    model = _copy_model(tmp_path)
    out = tmp_path / "repo"
    pkl = _write_pp_pkl(model / "crossval_results_folds_0" / "postprocessing.pkl",
                        [{"labels_or_regions": [1, 2]}])
    first = build.build_repository(model, out, folds=(0,))
    deployed = json.loads((out / "stitch_model" / "1" / "postprocessing.json").read_text())
    assert deployed["steps"] == [{"function": "remove_all_but_largest_component_from_segmentation",
                                  "labels_or_regions": [1, 2], "background_label": 0}]
    metadata = version_metadata(out)
    assert metadata["postprocessing"]["steps"] == deployed["steps"]
    _write_pp_pkl(pkl, [{"labels_or_regions": 2}])
    second = build.build_repository(model, out, folds=(0,))
    assert second.rebuilt and second.input_hash != first.input_hash
    none = build.build_repository(model, out, folds=(0,), postprocessing="none")
    assert none.rebuilt and not (out / "stitch_model" / "1" / "postprocessing.json").exists()


def test_build_uses_an_explicit_postprocessing_pkl_and_refuses_an_unknown_function(tmp_path: Path) -> None:
    import pickle

    model = _copy_model(tmp_path)
    pkl = _write_pp_pkl(tmp_path / "elsewhere" / "postprocessing.pkl", [{"labels_or_regions": 1}])
    out = tmp_path / "repo"
    build.build_repository(model, out, folds=(0,), postprocessing=pkl)
    assert json.loads((out / "stitch_model" / "1" / "postprocessing.json").read_text())["steps"][0][
        "labels_or_regions"] == [1]
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(([os.system], [{"labels_or_regions": 1}])))
    with pytest.raises(UnsupportedModelError, match="system"):
        build.build_repository(model, tmp_path / "repo2", folds=(0,), postprocessing=evil)
    assert not (tmp_path / "repo2").exists()


def test_input_hash_changes_with_max_voxels_and_build_writes_it_into_preprocess_config(built) -> None:
    from nnunet_triton.builder.torchscript import ExportOptions
    from nnunet_triton.numerics.model_folder import read_model_folder

    config, export_options = read_model_folder(MODEL_DIR, folds=(0,)), ExportOptions()
    hashes = {
        voxels: build_inputs.compute_input_hash(MODEL_DIR, config, BuildOptions(max_voxels=voxels),
                                                folds_only=False, export_options=export_options)
        for voxels in (0, 1000, BuildOptions().max_voxels)
    }
    assert len(set(hashes.values())) == 3
    out, result = built
    assert hashes[BuildOptions().max_voxels] == result.input_hash  # the default build's hash
    preprocess = text_format.Parse((out / "preprocess_model" / "config.pbtxt").read_text(),
                                   model_config_pb2.ModelConfig())
    assert preprocess.parameters["max_voxels"].string_value == str(2**28)


def _description(out: Path, model: str) -> dict:
    config = text_format.Parse((out / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return json.loads(config.parameters["nnunet_description"].string_value)


def test_a_second_name_lands_beside_the_first_in_its_own_namespace_and_leaves_it_untouched(tmp_path) -> None:
    out = tmp_path / "repo"
    build.build_repository(MODEL_DIR, out, folds=(0,))
    before = {str(p): p.read_bytes() for p in out.rglob("*")
              if p.is_file() and p.name != "repository_metadata.json"}
    liver = build.build_repository(MODEL_DIR, out, folds=(0,), endpoint=build.VersionChoice(name="liver"))
    assert (liver.name, liver.version, liver.promoted, liver.rebuilt) == ("liver", 1, True, True)
    assert {str(p): p.read_bytes() for p in out.rglob("*") if str(p) in before} == before
    registry = read_registry(out)
    assert sorted(registry.endpoints) == ["liver", "nnunet"]
    assert registry.endpoint("liver").version(1).models == (
        "liver__v1", "liver__v1__fold_0", "liver__v1__orchestrator_model", "liver__v1__preprocess_model",
        "liver__v1__stitch_model", "liver__v1_fp16", "liver__v1_int16", "liver__v1_uint16", "liver__v1_uint8")
    on_disk = {p.parent.name for p in out.glob("*/config.pbtxt")}
    assert on_disk == set(registry.models())
    orchestrator = (out / "liver__v1__orchestrator_model" / "config.pbtxt").read_text()
    assert 'string_value: "liver__v1__fold_0"' in orchestrator  # the BLS callees are in the namespace
    steps = text_format.Parse((out / "liver" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert [s.model_name for s in steps.ensemble_scheduling.step] == [
        "liver__v1__preprocess_model", "liver__v1__orchestrator_model", "liver__v1__stitch_model"]
    assert (_description(out, "liver")["endpoint"], _description(out, "liver")["version"]) == ("liver", 1)
    assert version_metadata(out, "liver")["exports"][0]["path"] == "liver__v1__fold_0/1/model.pt"


def test_a_new_version_keeps_the_promoted_one_until_promotion_and_equal_inputs_make_none(tmp_path) -> None:
    model, out = _copy_model(tmp_path), tmp_path / "repo"
    first = build.build_repository(model, out)
    again = build.build_repository(model, out, endpoint=build.VersionChoice(new_version=True))
    assert (again.rebuilt, again.version) == (False, 1)  # the same inputs are version 1 already
    second = build.build_repository(model, out, postprocessing="none",
                                    options=BuildOptions(tile_batch_size=2),
                                    endpoint=build.VersionChoice(new_version=True))
    assert (second.version, second.promoted, second.rebuilt) == (2, False, True)
    assert "not promoted: call it as 'nnunet__v2'" in second.summary()
    entry = read_registry(out).endpoint("nnunet")
    assert (entry.promoted, sorted(entry.versions)) == (1, [1, 2])
    assert _description(out, "nnunet")["version"] == 1 and _description(out, "nnunet__v2")["version"] == 2
    assert "max_batch_size: 2" in (out / "nnunet__v2__fold_0" / "config.pbtxt").read_text()
    assert "max_batch_size: 4" in (out / "fold_0" / "config.pbtxt").read_text()
    third = build.build_repository(model, out, options=BuildOptions(tile_batch_size=3),
                                   endpoint=build.VersionChoice(new_version=True, promote=True))
    entry = read_registry(out).endpoint("nnunet")
    assert (third.version, entry.promoted, entry.previous) == (3, 3, 1)
    assert _description(out, "nnunet")["version"] == 3
    assert first.input_hash == read_registry(out).endpoint("nnunet").version(1).input_hash


def test_rebuilding_a_version_in_place_replaces_only_its_folders(tmp_path) -> None:
    model, out = _copy_model(tmp_path), tmp_path / "repo"
    build.build_repository(model, out, endpoint=build.VersionChoice(name="liver"))
    build.build_repository(model, out, options=BuildOptions(tile_batch_size=2),
                           endpoint=build.VersionChoice(name="liver", new_version=True))
    v1 = {str(p): p.read_bytes() for p in out.glob("liver__v1*/**/*") if p.is_file()}
    rebuilt = build.build_repository(model, out, options=BuildOptions(tile_batch_size=3),
                                     endpoint=build.VersionChoice(name="liver", version=2))
    assert (rebuilt.version, rebuilt.rebuilt) == (2, True)
    assert {str(p): p.read_bytes() for p in out.glob("liver__v1*/**/*") if p.is_file()} == v1
    assert "max_batch_size: 3" in (out / "liver__v2__fold_0" / "config.pbtxt").read_text()
    assert {p.parent.name for p in out.glob("*/config.pbtxt")} == set(read_registry(out).models())


def test_remove_deletes_a_version_or_a_name_and_refuses_the_promoted_version(tmp_path) -> None:
    model, out = _copy_model(tmp_path), tmp_path / "repo"
    build.build_repository(model, out)
    build.build_repository(model, out, options=BuildOptions(tile_batch_size=2),
                           endpoint=build.VersionChoice(new_version=True))
    build.build_repository(model, out, endpoint=build.VersionChoice(name="liver"))
    with pytest.raises(RepositoryError, match="version 1 of 'nnunet' is promoted"):
        build.remove_endpoint(out, "nnunet", 1)
    with pytest.raises(RepositoryError, match=r"has no version 7 \(versions: \[1, 2\], promoted: 1\)"):
        build.remove_endpoint(out, "nnunet", 7)
    removed = build.remove_endpoint(out, "nnunet", 2)
    assert "nnunet__v2__fold_0" in removed and not (out / "nnunet__v2__fold_0").exists()
    build.remove_endpoint(out, "liver")
    assert sorted(read_registry(out).endpoints) == ["nnunet"]
    assert {p.parent.name for p in out.glob("*/config.pbtxt")} == set(read_registry(out).models())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "repo"]


def test_names_that_would_clash_with_other_models_are_refused_before_anything_is_built(tmp_path) -> None:
    for bad, rule in (("liver_int16", "typed-endpoint suffix"), ("fold_3", "reserved"), ("a__b", "lowercase"),
                      ("Liver", "lowercase")):
        with pytest.raises(ValueError, match=rule):
            build.VersionChoice(name=bad)
    with pytest.raises(SystemExit) as exit_info:
        repository_cli.main(["--model-dir", str(MODEL_DIR), "--out", str(tmp_path / "r"),
                             "--endpoint", "x__v1"])
    assert exit_info.value.code == 2 and not (tmp_path / "r").exists()


def test_an_older_single_model_repository_is_rebuilt_as_the_default_name_and_kept_from_other_names(
        tmp_path) -> None:
    out = tmp_path / "repo"
    out.mkdir()
    (out / "repository_metadata.json").write_text(json.dumps({"input_hash": "ab" * 32, "models": ["nnunet"]}))
    (out / "nnunet").mkdir()
    with pytest.raises(PlansError, match="was built by an older nnunet-triton .* building 'liver' beside it"):
        build.build_repository(MODEL_DIR, out, folds=(0,), folds_only=True,
                               endpoint=build.VersionChoice(name="liver"))
    assert sorted(p.name for p in out.iterdir()) == ["nnunet", "repository_metadata.json"]
    build.build_repository(MODEL_DIR, out, folds=(0,), folds_only=True)  # the default name: as it always was
    assert sorted(p.name for p in out.iterdir()) == ["fold_0", "repository_metadata.json"]


def test_promote_and_rollback_without_a_server_rewrite_the_public_endpoint_and_the_registry(tmp_path) -> None:
    from nnunet_triton.server import rollout

    model, out = _copy_model(tmp_path), tmp_path / "repo"
    build.build_repository(model, out)
    build.build_repository(model, out, options=BuildOptions(tile_batch_size=2),
                           endpoint=build.VersionChoice(new_version=True))
    step = rollout.promote(out, "nnunet", 2)
    assert (step.promoted, step.server) == (2, None)
    assert "in the repository only" in step.summary("promoted")
    for public, pinned in zip(("nnunet", "nnunet_int16"), ("nnunet__v2", "nnunet__v2_int16"), strict=True):
        assert (out / public / "config.pbtxt").read_text() == (out / pinned / "config.pbtxt").read_text(
            ).replace(f'name: "{pinned}"', f'name: "{public}"')
    assert _description(out, "nnunet")["version"] == 2
    rollout.rollback(out, "nnunet")
    entry = read_registry(out).endpoint("nnunet")
    assert (entry.promoted, entry.previous, _description(out, "nnunet")["version"]) == (1, 2, 1)
    rows = rollout.versions(out)
    assert [(r["version"], r["promoted"], r["previous"], r["loaded"]) for r in rows] == [
        (1, True, False, None), (2, False, True, None)]
    with pytest.raises(RepositoryError, match="has no version 9"):
        rollout.promote(out, "nnunet", 9)
    rollout.remove(out, "nnunet", 2)
    with pytest.raises(RepositoryError, match="nothing to roll back to"):
        rollout.rollback(out, "nnunet")


def test_two_builds_of_the_same_new_version_at_once_keep_the_first_and_refuse_the_second(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, out = _copy_model(tmp_path), tmp_path / "repo"
    build.build_repository(model, out)
    install = build._install
    raced: list[build.BuildResult] = []

    def install_after_another_build(*args, **kwargs):
        if not raced:  # another process lands version 2 while this build was exporting
            monkeypatch.setattr(build, "_install", install)
            raced.append(build.build_repository(model, out, options=BuildOptions(tile_batch_size=3),
                                                endpoint=build.VersionChoice(new_version=True)))
        return install(*args, **kwargs)

    monkeypatch.setattr(build, "_install", install_after_another_build)
    with pytest.raises(RepositoryError, match="another build wrote nnunet version 2 .* build again"):
        build.build_repository(model, out, options=BuildOptions(tile_batch_size=2),
                               endpoint=build.VersionChoice(new_version=True))
    assert raced[0].version == 2
    assert "max_batch_size: 3" in (out / "nnunet__v2__fold_0" / "config.pbtxt").read_text()
    assert {p.parent.name for p in out.glob("*/config.pbtxt")} == set(read_registry(out).models())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "repo"]


def test_a_build_killed_before_its_registry_landed_leaves_folders_the_next_build_takes_over(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, out = _copy_model(tmp_path), tmp_path / "repo"
    build.build_repository(model, out)

    def killed(*args, **kwargs):  # the process dies after the folders moved in, before the commit point
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "write_registry", killed)
    with pytest.raises(KeyboardInterrupt):
        build.build_repository(model, out, options=BuildOptions(tile_batch_size=2),
                               endpoint=build.VersionChoice(new_version=True))
    monkeypatch.undo()
    assert (out / "nnunet__v2__fold_0").is_dir()  # left behind, but listed nowhere
    assert sorted(read_registry(out).endpoint("nnunet").versions) == [1]
    again = build.build_repository(model, out, options=BuildOptions(tile_batch_size=3),
                                   endpoint=build.VersionChoice(new_version=True))
    assert again.version == 2
    assert "max_batch_size: 3" in (out / "nnunet__v2__fold_0" / "config.pbtxt").read_text()
    assert {p.parent.name for p in out.glob("*/config.pbtxt")} == set(read_registry(out).models())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "repo"]


class _RefusingControl:
    """A server that loads the version but refuses the public endpoint with its new steps."""

    url = "127.0.0.1:1"

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load(self, model: str) -> None:
        self.loaded.append(model)
        if model == "nnunet" and self.loaded.count("nnunet") == 1:
            from nnunet_triton.errors import ServerError

            raise ServerError("load of model 'nnunet' answered 400: refused")


def test_a_promotion_the_server_refuses_puts_the_public_endpoint_back_and_keeps_the_registry(tmp_path):
    from nnunet_triton.errors import ServerError
    from nnunet_triton.server import rollout

    model, out = _copy_model(tmp_path), tmp_path / "repo"
    build.build_repository(model, out)
    build.build_repository(model, out, options=BuildOptions(tile_batch_size=2),
                           endpoint=build.VersionChoice(new_version=True))
    before = (out / "nnunet" / "config.pbtxt").read_text()
    control = _RefusingControl()
    with pytest.raises(ServerError, match="refused"):
        rollout.promote(out, "nnunet", 2, control)
    assert (out / "nnunet" / "config.pbtxt").read_text() == before  # version 1's steps again
    assert control.loaded.count("nnunet") == 2  # and loaded again with them
    assert read_registry(out).endpoint("nnunet").promoted == 1
