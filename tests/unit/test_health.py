"""nnunet_triton.server.health without a server: instance names from configs, verdicts, shm region clean-up.

The checks against a real server (dead stubs, the CLI, Kubernetes' exec probe command) are in
tests/triton/test_recovery.py.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from nnunet_triton.server import health

REGION = health.SHM_REGION_PREFIX + "0000-test"


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"name": "fold_0", "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}, ("fold_0_0_0",)),
        ({"name": "stitch_model", "instance_group": [{"count": 2, "kind": "KIND_CPU"}]},
         ("stitch_model_0_0", "stitch_model_0_1")),
        ({"name": "m", "instance_group": [{"count": 1, "kind": "KIND_CPU"}, {"name": "g", "count": 1}]},
         ("m_0_0", "g_0")),
        ({"name": "fold_1", "instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]},
         ("fold_1_0_0", "fold_1_0_1")),
        ({"name": "preprocess_model"}, ("preprocess_model_0_0",)),  # Triton's default: one instance
    ],
)
def test_expected_instances_are_the_names_triton_gives_the_stubs(config, expected):
    assert health.expected_instances(config) == expected


def test_model_with_a_dead_process_is_broken_and_its_problem_names_model_and_instance():
    model = health.ModelHealth("fold_0", ready=True, backend="python", expected=("fold_0_0_0", "fold_0_0_1"),
                               alive=("fold_0_0_1",))
    assert (model.broken, model.ok, model.missing_processes) == (True, False, 1)
    assert model.problem() == ("model 'fold_0': 1 of 2 Python-backend processes alive (dead: fold_0_0_0); "
                               "Triton still reports it ready")


def test_report_is_healthy_only_when_server_and_every_model_are_ready_with_their_processes():
    ok = health.ModelHealth("fold_0", ready=True, backend="python", expected=("fold_0_0_0",),
                            alive=("fold_0_0_0",))
    unloaded = health.ModelHealth("fold_1", ready=False)
    libtorch = health.ModelHealth("fold_2", ready=True, backend="pytorch")  # no stub to count
    report = health.HealthReport("h:1", server_live=True, server_ready=True, server_pid=1,
                                 models=(ok, libtorch))
    assert report.healthy and report.problems() == []
    report = health.HealthReport("h:1", server_live=True, server_ready=True, server_pid=1,
                                 models=(ok, unloaded))
    assert not report.healthy and report.problems() == ["model 'fold_1' is not ready"]
    down = health.HealthReport("h:1", server_live=False, server_ready=False, server_pid=None)
    assert not down.healthy and down.problems() == ["tritonserver at h:1 is not live"]


def test_a_version_that_may_be_unloaded_is_fine_unloaded_but_broken_when_loaded_without_its_processes():
    unloaded = health.ModelHealth("liver__v1__fold_0", ready=False, required=False)
    broken = health.ModelHealth("liver__v1__fold_0", ready=True, backend="python",
                                expected=("liver__v1__fold_0_0_0",), alive=(), required=False)
    assert (unloaded.ok, unloaded.problem()) == (True, None)
    assert not broken.ok and "0 of 1 Python-backend processes alive" in broken.problem()


def test_a_registry_requires_the_public_endpoints_and_promoted_versions_and_allows_the_others(tmp_path):
    from nnunet_triton.registry import Registry, write_registry

    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "config.pbtxt").write_text('name: "stray"\n')
    assert health.repository_expectations(tmp_path) == (["stray"], [])  # no registry: every folder counts
    registry = Registry().with_version("liver", 1, {"models": ["liver__v1", "liver__v1__fold_0"]})
    registry = registry.with_version("liver", 2, {"models": ["liver__v2", "liver__v2__fold_0"]})
    write_registry(tmp_path, registry)
    required, optional = health.repository_expectations(tmp_path)
    assert required == ["liver", "liver__v1", "liver__v1__fold_0", "liver_fp16", "liver_int16",
                        "liver_uint16", "liver_uint8"]
    assert optional == ["liver__v2", "liver__v2__fold_0"]


def test_check_health_reports_an_unreachable_server_without_raising():
    report = health.check_health("127.0.0.1:9", ["nnunet"], timeout_s=1)  # port 9 (discard): refused
    assert not report.healthy and "is not reachable" in report.problems()[0]


def test_unmapped_regions_are_found_and_removed_and_a_mapped_one_is_kept(tmp_path: Path):
    (tmp_path / REGION).write_bytes(b"\0" * 4096)
    mapped = tmp_path / (health.SHM_REGION_PREFIX + "1111-test")
    mapped.write_bytes(b"\0" * 4096)
    (tmp_path / "other-file").write_bytes(b"x")
    with open(mapped, "r+b") as file, mmap.mmap(file.fileno(), 4096):  # this process maps it
        assert health.unmapped_shm_regions(tmp_path) == [REGION]
        assert health.remove_shm_regions(health.unmapped_shm_regions(tmp_path), tmp_path) == [REGION]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-file", mapped.name]


def test_remove_shm_regions_touches_only_python_backend_regions(tmp_path: Path):
    (tmp_path / "not-a-region").write_bytes(b"x")
    assert health.remove_shm_regions(["not-a-region", REGION], tmp_path) == []
    assert (tmp_path / "not-a-region").exists()


def test_repository_models_are_the_folders_with_a_config(tmp_path: Path):
    for name in ("nnunet", "fold_0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text("")
    (tmp_path / "notes").mkdir()
    assert health.repository_models(tmp_path) == ["fold_0", "nnunet"]
