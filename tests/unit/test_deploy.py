"""server.deploy: repository info from the builder's metadata, the TorchScript/libtorch check, sizing.

The repositories are fakes laid out like ``repository/build.py`` output (``deploy_support``); sizes are
compared with the per-tensor formulas of ``nnunet_triton.server.deploy.sizing`` written out by hand, and the
resampled shape with nnU-Net's own ``compute_new_shape``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from deploy_support import GPU_OPTIONS, PATCH, MiB, geometry, make_config, two_endpoints, write_repository
from nnunetv2.preprocessing.resampling.default_resampling import compute_new_shape

from nnunet_triton import io_names
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.errors import DeployError
from nnunet_triton.server.deploy import docker, sizing
from nnunet_triton.server.deploy.repository_info import PipelineInfo, RepositoryInfo, check_torch_compatible

# --- repository info and the torch check ------------------------------------------------------------------


NNUNET_MODELS = ("fold_0", "fold_1", "nnunet", "nnunet__v1", "nnunet__v1_fp16", "nnunet__v1_int16",
                 "nnunet__v1_uint16", "nnunet__v1_uint8", "nnunet_fp16", "nnunet_int16", "nnunet_uint16",
                 "nnunet_uint8", "orchestrator_model", "preprocess_model", "stitch_model")


def _pipeline(**changes: object) -> PipelineInfo:
    """The pipeline ``write_repository`` records for the default endpoint, with ``changes``."""
    values = {
        "models": tuple(m for m in NNUNET_MODELS if m not in io_names.public_endpoints("nnunet")),
        "folds": (0, 1), "target": "gpu", "fold_runner": "libtorch", "fold_precision": "fp16",
        "tile_batch_size": 4, "max_inflight": 4, "preprocess_instances": 1, "orchestrator_instances": 1,
        "stitch_instances": 1, "fold_instances": 1, "geometry": geometry(),
        "torch_versions": (("fold_0/1/model.pt", "2.5.1"), ("fold_1/1/model.pt", "2.5.1"),
                           ("the build of nnunet version 1", "2.5.1")),
        "input_hash": "ab" * 32,
    }
    return PipelineInfo(**{**values, **changes})


def test_repository_info_equals_the_registry_when_repository_is_built(tmp_path: Path) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path, input_hash="ab" * 32))
    assert info.pipelines == (_pipeline(),)
    assert info.models == NNUNET_MODELS  # the version's models and the name's public endpoints
    assert (info.target, info.fold_runner, info.endpoints, info.first) == ("gpu", "libtorch", ("nnunet",),
                                                                          _pipeline())
    assert info.input_hash is not None and len(info.input_hash) == 64


def test_planned_info_equals_built_info_when_builder_options_match(tmp_path: Path) -> None:
    built = RepositoryInfo.from_repository(write_repository(tmp_path))
    planned = RepositoryInfo.planned(make_config(), GPU_OPTIONS)
    assert planned == RepositoryInfo(
        pipelines=tuple(replace(p, torch_versions=(), input_hash=None) for p in built.pipelines),
        models=built.models, input_hash=None)


def test_repository_info_lists_every_endpoint_and_version_promoted_first(tmp_path: Path) -> None:
    two_endpoints(tmp_path)
    write_repository(tmp_path, name="liver", version=2)  # built, not promoted
    info = RepositoryInfo.from_repository(tmp_path)
    assert [p.label for p in info.pipelines] == ["liver v1", "lung v1", "liver v2"]
    assert info.endpoints == ("liver", "lung")
    namespaced = [m for m in info.models if "__" in m]
    assert info.models == tuple(sorted({*namespaced, *io_names.public_endpoints("liver"),
                                        *io_names.public_endpoints("lung")}))
    assert all(m.startswith(f"{p.name}__v{p.version}") for p in info.pipelines for m in p.models)
    assert info.pipelines[0].fold_models == ("liver__v1__fold_0", "liver__v1__fold_1")
    promoted = RepositoryInfo.from_repository(write_repository(tmp_path, name="liver", version=2,
                                                               promote=True))
    assert promoted.input_hash != info.input_hash  # what the public endpoints run is part of the hash


def test_repository_info_refuses_when_a_model_dir_is_missing_or_unlisted(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match=r"without config.pbtxt \['fold_1'\], .* not in the registry \[\]"):
        RepositoryInfo.from_repository(write_repository(tmp_path / "a", drop=("fold_1",)))
    with pytest.raises(DeployError, match=r"without config.pbtxt \[\], .* not in the registry \['fold_2'\]"):
        RepositoryInfo.from_repository(write_repository(tmp_path / "b", extra_dirs=("fold_2",)))


def test_repository_info_refuses_when_metadata_is_missing(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match=r"not a model repository built by nnunet-triton \(no "
                                          r"repository_metadata.json\)"):
        RepositoryInfo.from_repository(tmp_path)


@pytest.mark.parametrize("version", ["2.5.1", "2.5.0a0+e000cf0ad9.nv24.10", "2.4.1+cu121", "1.13.1"])
def test_check_torch_compatible_accepts_when_export_torch_is_not_newer(tmp_path: Path, version: str) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path, torch_version=version))
    check_torch_compatible(info, "2.5", "libtorch of the image")


def test_check_torch_compatible_refuses_naming_file_and_versions_when_export_torch_is_newer(
    tmp_path: Path,
) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path, torch_version="2.14.1+cu130"))
    with pytest.raises(DeployError) as error:
        check_torch_compatible(
            info, "2.5.0a0+e000cf0ad9", "libtorch of nvcr.io/nvidia/tritonserver:24.10-py3"
        )
    message = str(error.value)
    assert message.startswith(
        "fold_0/1/model.pt was exported with torch 2.14.1+cu130, newer than torch 2.5 "
        "(libtorch of nvcr.io/nvidia/tritonserver:24.10-py3)"
    )
    assert "Re-export with torch 2.5.x" in message and "docs/deploy.md" in message


def test_triton_release_refuses_when_release_unknown_and_no_torch_version_given() -> None:
    with pytest.raises(DeployError, match=r"release '25.01'.*--image-torch-version"):
        docker.triton_release("25.01")
    assert docker.triton_release("25.01", "2.6.0a0").libtorch == "2.6"


# --- sizing -----------------------------------------------------------------------------------------------


def test_resampled_shape_equals_nnunet_compute_new_shape_when_axes_are_transposed() -> None:
    volume = sizing.VolumeSpec(shape=(40, 60, 80), spacing=(4.0, 0.5, 3.0))
    shape_t, spacing_t = (80, 40, 60), (3.0, 4.0, 0.5)  # transpose_forward (2, 0, 1)
    expected = tuple(int(s) for s in compute_new_shape(shape_t, spacing_t, (2.0, 1.0, 1.0)))
    assert sizing.resampled_shape(geometry(), volume) == expected == (120, 160, 30)


def test_tensor_bytes_equal_per_tensor_formulas_when_volume_is_resampled(tmp_path: Path) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path)).first
    volume = sizing.VolumeSpec(shape=(40, 60, 80), spacing=(4.0, 0.5, 3.0), probabilities=True)
    v_in, v_res, patch = 40 * 60 * 80, 120 * 160 * 30, math.prod(PATCH)
    assert sizing.tensor_bytes(info, volume) == sizing.TensorBytes(
        resampled_shape=(120, 160, 30),
        image=2 * v_in * 4,
        preprocessed=2 * v_res * 4,
        logits=3 * v_res * 2,
        segmentation=v_in,
        probabilities=3 * v_in * 4,
        tile_batch=4 * patch * (2 * 4 + 3 * 2),  # fp16 out
    )


def _up64(nbytes: int) -> int:
    return -(-(nbytes + 4096) // (64 * MiB)) * 64 * MiB


def _pool(nbytes: int) -> int:
    return -(-int(nbytes * 1.25) // (64 * MiB)) * 64 * MiB


def test_plan_memory_sizes_shm_and_pools_when_gpu_target_serves_a_ct_volume(tmp_path: Path) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path))
    plan = sizing.plan_memory(info, sizing.VolumeSpec(shape=(600, 512, 512)))
    voxels = 600 * 512 * 512
    image = pre = 2 * voxels * 4
    logits, seg, tiles = 3 * voxels * 2, voxels, 4 * 4 * math.prod(PATCH) * (2 * 4 + 3 * 2)
    regions = [
        16 * MiB + _up64(image) + _up64(pre),  # preprocess
        16 * MiB + _up64(pre) + _up64(logits),  # orchestrator (its 2.6 MiB of tiles fit the default region)
        16 * MiB + _up64(logits) + _up64(seg),  # stitch
    ]
    assert plan.shm_bytes == sum(regions) + 256 * MiB == 6064 * MiB
    assert plan.cuda_pool_bytes == _pool(tiles + pre + logits) == 2688 * MiB
    assert plan.pinned_pool_bytes == _pool(tiles + image + seg) == 1728 * MiB
    assert plan.host_memory_bytes % (256 * MiB) == 0 and plan.host_memory_bytes > plan.shm_bytes + 3 * 2**30


def test_plan_memory_gives_the_device_memory_of_the_fold_accumulators_per_orchestrator_instance(
        tmp_path: Path) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path))  # 2 channels, 3 heads, 2 folds
    volume = sizing.VolumeSpec(shape=(600, 512, 512))
    v = 600 * 512 * 512
    one_fold, per_fold = 2 * v * 4 + 2 * 3 * v * 2 + 4 * v * 2, 4 * v * 2  # fixed part + (K + 1) x V x 2
    share = dict(sizing.plan_memory(info, volume).pipelines)[info.first.label]
    assert (share["device_all_folds_mib"], share["device_one_fold_mib"]) == (
        -(-(one_fold + per_fold) // MiB), -(-one_fold // MiB)) == (5400, 4200)
    assert "concurrent_folds" not in share  # the GPU's memory not given
    pool = sizing.plan_memory(info, volume).cuda_pool_bytes
    counts = [dict(sizing.plan_memory(info, volume, gpu_memory_bytes=pool + free).pipelines)[info.first.label]
              ["concurrent_folds"] for free in (one_fold + per_fold, one_fold + per_fold - 1, one_fold - 1)]
    assert counts == [2, 1, 0]
    cpu = RepositoryInfo.from_repository(write_repository(tmp_path / "cpu", BuildOptions(target="cpu")))
    assert "device_one_fold_mib" not in dict(sizing.plan_memory(cpu, volume).pipelines)[cpu.first.label]


def test_plan_memory_counts_tiles_and_runner_stubs_in_shm_when_cpu_target(tmp_path: Path) -> None:
    options = BuildOptions(target="cpu", tile_batch_size=8, max_inflight=6)
    info = RepositoryInfo.from_repository(write_repository(tmp_path, options))
    volume = sizing.VolumeSpec(shape=(80, 96, 96))
    plan = sizing.plan_memory(info, volume, gpus=4)  # gpus are ignored for KIND_CPU models
    t = sizing.tensor_bytes(info.first, volume)
    tiles = 6 * t.tile_batch  # 6 in-flight batches of 8 fp32 tiles = 28.3 MiB > half the default region
    assert t.tile_batch == 8 * math.prod(PATCH) * (2 * 4 + 3 * 4)
    regions = [
        16 * MiB + _up64(t.image) + _up64(t.preprocessed),
        16 * MiB + _up64(t.preprocessed) + _up64(t.logits) + _up64(tiles - 4096),
        16 * MiB + _up64(t.logits) + _up64(t.segmentation),
        2 * 16 * MiB,
    ]  # two python fold runners, one batch each fits the default region
    assert (plan.shm_bytes, plan.cuda_pool_bytes, plan.pinned_pool_bytes) == (sum(regions) + 256 * MiB, 0, 0)


def test_plan_memory_multiplies_python_instances_when_gpu_target_has_several_gpus(tmp_path: Path) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path))
    volume = sizing.VolumeSpec(shape=(100, 128, 128))
    one, two = (sizing.plan_memory(info, volume, gpus=n) for n in (1, 2))
    assert two.shm_bytes - 256 * MiB == 2 * (one.shm_bytes - 256 * MiB)
    assert two.cuda_pool_bytes == one.cuda_pool_bytes  # per GPU


def test_the_orchestrators_torch_is_counted_in_host_memory_whatever_the_fold_runner(tmp_path: Path) -> None:
    """The orchestrator imports torch on every target; the Python fold runner too; preprocess/stitch not."""
    libtorch = RepositoryInfo.from_repository(write_repository(tmp_path / "gpu")).first
    cpu = write_repository(tmp_path / "cpu", BuildOptions(target="cpu"))
    python = RepositoryInfo.from_repository(cpu).first
    GiB = 2**30
    assert sizing.stub_bytes(libtorch) == 2 * 1 * GiB + 1 * 3 * GiB
    assert sizing.stub_bytes(python) == 2 * 1 * GiB + (1 + len(python.fold_models)) * 3 * GiB
    assert sizing.stub_bytes(libtorch, per_gpu=2) == 2 * sizing.stub_bytes(libtorch)


# --- several endpoints behind one server ------------------------------------------------------------------


def test_plan_memory_adds_up_every_endpoint_with_the_server_and_shm_margin_once(tmp_path: Path) -> None:
    """Two endpoints in one repository: each keeps the share it has alone; stubs, shm regions, working memory
    and the pools are summed; tritonserver itself and the shm margin are counted once."""
    volume = sizing.VolumeSpec(shape=(600, 512, 512))
    one = sizing.plan_memory(RepositoryInfo.from_repository(write_repository(tmp_path / "one")), volume)
    two = sizing.plan_memory(RepositoryInfo.from_repository(two_endpoints(tmp_path / "two")), volume)
    ((label, share),) = one.pipelines
    assert label == "nnunet v1"
    assert two.pipelines == (("liver v1", share), ("lung v1", share))
    voxels, GiB = 600 * 512 * 512, 2**30
    image = pre = 2 * voxels * 4
    logits, seg, tiles = 3 * voxels * 2, voxels, 4 * 4 * math.prod(PATCH) * (2 * 4 + 3 * 2)
    assert two.shm_bytes - 256 * MiB == 2 * (one.shm_bytes - 256 * MiB) == 2 * share["shm_mib"] * MiB
    assert two.cuda_pool_bytes == _pool(2 * (tiles + pre + logits)) > one.cuda_pool_bytes
    assert two.pinned_pool_bytes == _pool(2 * (tiles + image + seg)) > one.pinned_pool_bytes
    stubs = 2 * 1 * GiB + 1 * 3 * GiB  # preprocess + stitch, the orchestrator (torch)
    working = 2 * image + 2 * pre + (1 + 2) * logits + 2 * logits + 2 * 3 * voxels * 4  # one request
    host = two.shm_bytes + two.pinned_pool_bytes + 2 * GiB + 2 * (stubs + working)
    assert two.host_memory_bytes == -(-host // (256 * MiB)) * 256 * MiB
    assert two.host_memory_bytes > one.host_memory_bytes + stubs + working
    assert two.summary()["per_endpoint_version"] == {"liver v1": share, "lung v1": share}


def test_a_repository_whose_endpoints_mix_targets_is_refused_naming_each(tmp_path: Path) -> None:
    write_repository(tmp_path, name="liver")
    write_repository(tmp_path, BuildOptions(target="cpu"), name="lung")
    info = RepositoryInfo.from_repository(tmp_path)
    message = r"mixes targets \['cpu', 'gpu'\] \(liver v1: gpu, lung v1: cpu\).*same --target"
    with pytest.raises(DeployError, match=message):
        sizing.plan_memory(info, sizing.VolumeSpec())
    with pytest.raises(DeployError, match=message):
        docker.DeploySpec(info=info, plan=sizing.plan_memory(info.first, sizing.VolumeSpec()),
                          repository="/r")


def test_info_shows_the_gpu_memory_of_the_fold_accumulators_per_orchestrator_instance(tmp_path: Path) -> None:
    from nnunet_triton.cli.predict import _split_lines

    info = RepositoryInfo.from_repository(write_repository(tmp_path))
    plan = sizing.plan_memory(info, sizing.VolumeSpec(shape=(600, 512, 512)))
    lines = _split_lines({"memory": {**plan.summary(), "volume": [600, 512, 512], "fold_models": {}}})
    assert lines[-1].strip() == ("GPU memory per orchestrator instance (fold accumulators): 5400 MiB with "
                                 "all folds at once, at least 4200 MiB (one fold at a time)")
