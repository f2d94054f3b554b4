"""The embedded launch sizes Triton's CUDA and pinned memory pools for a GPU repository (as docker/k8s do)."""

from __future__ import annotations

from pathlib import Path

from deploy_support import write_repository

from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.server import embedded
from nnunet_triton.server.deploy import sizing
from nnunet_triton.server.deploy.repository_info import RepositoryInfo
from nnunet_triton.server.server_config import MemoryPools


def test_visible_gpus_follow_cuda_visible_devices_else_the_device_files(tmp_path: Path) -> None:
    assert embedded.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,2"}) == 2
    assert embedded.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert embedded.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert embedded.visible_gpus({}, dev=tmp_path) == 2


def test_a_gpu_repository_gets_pools_sized_from_its_plan_on_every_gpu(tmp_path: Path) -> None:
    repo = write_repository(tmp_path / "repo", BuildOptions(target="gpu", fold_precision="fp16"))
    volume = sizing.VolumeSpec(shape=(300, 512, 512))
    pools, summary = embedded._memory_plan(repo, volume, gpus=2)
    plan = sizing.plan_memory(RepositoryInfo.from_repository(repo), volume, gpus=2)
    assert plan.cuda_pool_bytes > 64 * 2**20  # more than Triton's default pool
    assert pools.args() == (f"--cuda-memory-pool-byte-size=0:{plan.cuda_pool_bytes}",
                    f"--cuda-memory-pool-byte-size=1:{plan.cuda_pool_bytes}",
                    f"--pinned-memory-pool-byte-size={plan.pinned_pool_bytes}")
    assert summary["gpus"] == 2 and summary["volume"] == [300, 512, 512]
    assert summary["cuda_pool_mib_per_gpu"] == plan.cuda_pool_bytes // 2**20


def test_a_bigger_volume_and_more_requests_at_once_get_a_bigger_cuda_pool(tmp_path: Path) -> None:
    one = write_repository(tmp_path / "one", BuildOptions(target="gpu", orchestrator_instances=1))
    two = write_repository(tmp_path / "two", BuildOptions(target="gpu", orchestrator_instances=2))
    small, large = sizing.VolumeSpec(shape=(100, 256, 256)), sizing.VolumeSpec(shape=(600, 512, 512))
    pool = {(name, v.shape): embedded._memory_plan(repo, v, gpus=1)[1]["cuda_pool_mib_per_gpu"]
            for name, repo in (("one", one), ("two", two)) for v in (small, large)}
    assert pool["one", small.shape] < pool["one", large.shape] < pool["two", large.shape]


def test_cpu_repositories_and_foreign_ones_keep_tritons_defaults(tmp_path: Path) -> None:
    cpu = write_repository(tmp_path / "cpu", BuildOptions(target="cpu"))
    assert embedded._memory_plan(cpu, sizing.VolumeSpec(), gpus=1) == (MemoryPools(), None)
    foreign = tmp_path / "foreign"
    (foreign / "identity").mkdir(parents=True)
    assert embedded._memory_plan(foreign, sizing.VolumeSpec(), gpus=1) == (MemoryPools(), None)


def test_no_visible_gpu_means_no_cuda_pool_flag_but_the_pinned_pool_stays(tmp_path: Path) -> None:
    repo = write_repository(tmp_path / "repo", BuildOptions(target="gpu"))
    pools, summary = embedded._memory_plan(repo, sizing.VolumeSpec(), gpus=0)
    assert [a.split("=")[0] for a in pools.args()] == ["--pinned-memory-pool-byte-size"]
    assert summary["gpus"] == 0
