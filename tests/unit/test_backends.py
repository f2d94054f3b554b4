"""The launcher's backend folder: the wheel's Python backend merged with built ones, checked before start."""

from __future__ import annotations

from pathlib import Path

import pytest

from nnunet_triton.errors import ServerError
from nnunet_triton.server import backends


def _backend(folder: Path, name: str) -> Path:
    (folder / name).mkdir(parents=True)
    (folder / name / f"libtriton_{name}.so").write_bytes(b"")
    return folder


def _model(repository: Path, name: str, header: str) -> Path:
    (repository / name).mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(f'name: "{name}"\n{header}\nmax_batch_size: 1\n')
    return repository


def test_required_backends_maps_platforms_and_skips_ensembles(tmp_path):
    repository = _model(tmp_path, "fold_0", 'platform: "pytorch_libtorch"')
    _model(repository, "preprocess_model", 'backend: "python"')
    _model(repository, "nnunet", 'platform: "ensemble"')

    assert backends.required_backends([repository]) == {"pytorch": ["fold_0"], "python": ["preprocess_model"]}


def test_merged_backend_dir_links_own_and_extra_backends_in_one_folder(tmp_path):
    own = _backend(tmp_path / "own", "python")
    built = _backend(tmp_path / "built", "pytorch")
    (built / "pytorch-0123").mkdir()  # a cached build beside the current link is no backend

    merged = backends.merged_backend_dir(own, [built], tmp_path / "home")

    assert backends.available_backends(merged) == ["python", "pytorch"]
    assert (merged / "pytorch").resolve() == (built / "pytorch").resolve()
    assert backends.merged_backend_dir(own, [built], tmp_path / "home") == merged


def test_merged_backend_dir_refuses_a_folder_without_backends(tmp_path):
    own = _backend(tmp_path / "own", "python")
    (tmp_path / "empty").mkdir()

    with pytest.raises(ServerError, match=r"--backend-directory '.*empty' holds no backend"):
        backends.merged_backend_dir(own, [tmp_path / "empty"], tmp_path / "home")


def test_server_start_refuses_a_repository_whose_backend_is_missing_before_starting(tmp_path):
    from nnunet_triton.server import embedded

    repository = _model(tmp_path / "repo", "fold_0", 'platform: "pytorch_libtorch"')
    log = tmp_path / "run" / "tritonserver.log"

    with pytest.raises(ServerError) as refused:
        embedded.start(repository, backend_dirs=[], log_file=log, pid_file=tmp_path / "run" / "pid",
                       state_file=tmp_path / "run" / "server.json", model_control_mode="none",
                       recovery=False)

    assert str(refused.value) == (
        "model 'fold_0' needs Triton backend 'pytorch', which this server lacks (it has python): build it "
        "with `nnunet-triton install-backend pytorch` (a checkout: `make triton-backends`).")
    assert not log.exists()  # refused before tritonserver ran


def test_serve_command_refuses_a_missing_backend_in_one_line(tmp_path, capsys):
    from nnunet_triton.cli import main

    repository = _model(tmp_path / "repo", "fold_0", 'platform: "pytorch_libtorch"')
    other = _backend(tmp_path / "backends", "onnxruntime")

    code = main(["serve", "--model-repository", str(repository), "--backend-directory", str(other),
                 "--no-recovery"])

    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert lines[-1] == (
        "nnunet-triton: model 'fold_0' needs Triton backend 'pytorch', which this server lacks (it has "
        "onnxruntime, python): build it with `nnunet-triton install-backend pytorch` (a "
        "checkout: `make triton-backends`).")
