"""Memory sizing for one deployment: ``/dev/shm``, Triton's CUDA and pinned pools, host memory.

Inputs: the largest expected volume (shape in the reader's axis order, optionally its spacing), the
model's geometry (channels C, heads K, patch P, target spacing) and the repository's instance counts.
Per request (V_in = input voxels, V_res = voxels after resampling to the target spacing, P = patch voxels,
B = tile batch size)::

    IMAGE          C * V_in  * 4     client -> preprocess_model            (fp32)
    PREPROCESSED   C * V_res * 4     preprocess -> orchestrator            (fp32)
    LOGITS         K * V_res * 2     orchestrator -> stitch                (fp16, nnU-Net's buffers)
    SEGMENTATION   V_in * 1|2        stitch -> client                      (uint8 / uint16)
    PROBABILITIES  K * V_in  * 4     stitch -> client, only when requested (fp32)
    tile batch     B * P * (C * 4 + K * 2|4)   orchestrator <-> fold_<k>, per BLS call

Rules (Python backend): every Python-model instance is a stub process with its own /dev/shm
region that grows by whole steps for each CPU tensor that does not fit and is never shrunk; a
non-decoupled instance handles one request at a time; KIND_GPU instance groups without ``gpus`` are
created on every visible GPU. Data paths: the adapters compute on whatever device their input lives on;
client tensors arrive in host memory, so today whole volumes stay on the host (NumPy) and the tile
batches (orchestrator instances x max_inflight) cross shm and are staged to and from the libtorch fold
models through the pinned pool. Tensors that do travel on the GPU between models (CuPy adapters, BLS
GPU outputs, ensemble intermediates) come from the CUDA pool, and the pinned pool is the fallback when
it is full. Each plan covers both paths: it is an upper bound derived from these rules; only the shm
growth rule was measured (docs/deploy.md).

Device memory outside the pools: every orchestrator instance of a gpu target keeps its fold accumulators
(nnU-Net's fp16 logits and weights, (K + 1) x V_pad x 2 per fold alive) and the fold-order sum in torch's
own allocator on the GPU (``numerics.limits.FoldMemoryPlan``). The plan gives that per instance for all
folds at once and for one fold at a time (the least a request needs), and, when the GPU's memory is
given, how many folds the orchestrator will run at once on it (the pools come off first; what the fold
models' libtorch needs for weights and activations is not counted).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from nnunet_triton.numerics.limits import FoldMemoryPlan, padded_voxels
from nnunet_triton.numerics.resampling import compute_new_shape
from nnunet_triton.server.deploy.repository_info import ModelGeometry, PipelineInfo, RepositoryInfo
from nnunet_triton.server.server_config import CONTAINER, MemoryPools

__all__ = ["MiB", "GiB", "VolumeSpec", "TensorBytes", "MemoryPlan", "tensor_bytes", "stub_bytes",
           "fold_memory", "plan_memory"]

MiB = 2**20
GiB = 2**30
# the python backend's shm-default-byte-size and shm-growth-byte-size the containers run with
SHM_DEFAULT_BYTES = CONTAINER.shm_default_bytes
SHM_GROWTH_BYTES = CONTAINER.shm_growth_bytes
SHM_MARGIN_BYTES = 256 * MiB  # CUDA IPC handles, message queues, other users of /dev/shm
_TENSOR_OVERHEAD = 4096  # allocator header per tensor in a region
CUDA_POOL_MIN_BYTES = 64 * MiB  # tritonserver defaults
PINNED_POOL_MIN_BYTES = 256 * MiB
HEADROOM = 1.25  # alignment and fragmentation inside the CUDA and pinned pools
STUB_BYTES = 1 * GiB  # one Python stub: interpreter + numpy/scipy/cupy, CUDA context on the host side
TORCH_STUB_BYTES = 3 * GiB  # a stub that imports torch (the orchestrator, the Python fold runner)
SERVER_BYTES = 2 * GiB  # tritonserver itself (+ libtorch backend)


@dataclass(frozen=True)
class VolumeSpec:
    """The largest volume the deployment must serve.

    Attributes:
        shape: spatial shape in the reader's axis order (SimpleITK: z, y, x), 3 axes.
        spacing: its voxel spacing in the same order; None = already at the model's target spacing.
        probabilities: whether clients ask for PROBABILITIES (K x V_in fp32 more per request).
    """

    shape: tuple[int, int, int] = (600, 512, 512)
    spacing: tuple[float, float, float] | None = None
    probabilities: bool = False

    def __post_init__(self) -> None:
        if len(self.shape) != 3 or any(int(s) < 1 for s in self.shape):
            raise ValueError(f"volume shape must be 3 positive sizes (z, y, x), got {self.shape}.")
        if self.spacing is not None and (len(self.spacing) != 3 or any(s <= 0 for s in self.spacing)):
            raise ValueError(f"volume spacing must be 3 positive numbers (z, y, x), got {self.spacing}.")


@dataclass(frozen=True)
class TensorBytes:
    """Bytes of each tensor of one request of the sizing volume."""

    resampled_shape: tuple[int, ...]  # transposed order, after resampling
    image: int
    preprocessed: int
    logits: int
    segmentation: int
    probabilities: int
    tile_batch: int  # one BLS call: input + output of a full tile batch


@dataclass(frozen=True)
class MemoryPlan:
    """Sizes for the server flags and container limits (bytes)."""

    tensors: TensorBytes
    shm_bytes: int  # docker --shm-size / k8s /dev/shm emptyDir sizeLimit
    cuda_pool_bytes: int  # --cuda-memory-pool-byte-size per GPU; 0 on a cpu target
    pinned_pool_bytes: int  # --pinned-memory-pool-byte-size; 0 on a cpu target (flag left out)
    host_memory_bytes: int  # container memory request/limit (shm included: tmpfs pages count)
    shm_default_bytes: int = SHM_DEFAULT_BYTES
    shm_growth_bytes: int = SHM_GROWTH_BYTES
    # the share of each endpoint version ("liver v2"): shm, stubs, working memory, pools (MiB), and on a
    # gpu target its device memory per orchestrator instance for all folds at once and for one fold
    pipelines: tuple[tuple[str, dict[str, int]], ...] = ()
    gpu_memory_bytes: int | None = None  # the GPU's memory, when given: then the folds it runs at once

    def pools(self, gpus: int) -> MemoryPools:
        """The CUDA pool of each of ``gpus`` GPUs and the pinned pool (none on a cpu target: the plan's
        pools are 0 there)."""
        cuda = tuple((gpu, self.cuda_pool_bytes) for gpu in range(gpus if self.cuda_pool_bytes else 0))
        return MemoryPools(cuda, self.pinned_pool_bytes)

    def summary(self) -> dict[str, object]:
        """The pools and limits in MiB, with the tensors they were sized for (for logs and state files)."""
        t = self.tensors
        return {"cuda_pool_mib_per_gpu": _ceil_div(self.cuda_pool_bytes, MiB),
                "pinned_pool_mib": _ceil_div(self.pinned_pool_bytes, MiB), "shm_mib": self.shm_mib,
                "host_memory_mib": self.host_memory_mib,
                "tile_batch_mib": round(t.tile_batch / MiB, 1),
                "preprocessed_mib": round(t.preprocessed / MiB, 1), "logits_mib": round(t.logits / MiB, 1),
                "resampled_shape": list(t.resampled_shape),
                "gpu_memory_mib": None if self.gpu_memory_bytes is None else self.gpu_memory_bytes // MiB,
                "per_endpoint_version": {label: dict(share) for label, share in self.pipelines}}

    @property
    def shm_mib(self) -> int:
        return _ceil_div(self.shm_bytes, MiB)

    @property
    def host_memory_mib(self) -> int:
        return _ceil_div(self.host_memory_bytes, MiB)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(nbytes: float, step: int) -> int:
    return _ceil_div(math.ceil(nbytes), step) * step


def resampled_shape(geometry: ModelGeometry, volume: VolumeSpec) -> tuple[int, ...]:
    """Shape after preprocessing's resampling, transposed like nnU-Net (DefaultPreprocessor.run_case).

    2D configurations keep the first (transposed) axis' own spacing, as nnU-Net does; cropping to the
    nonzero region is ignored (it only makes volumes smaller).
    """
    shape_t = tuple(int(volume.shape[axis]) for axis in geometry.transpose_forward)
    if volume.spacing is None:
        return shape_t
    spacing_t = tuple(float(volume.spacing[axis]) for axis in geometry.transpose_forward)
    target = tuple(geometry.target_spacing)
    if len(target) < len(shape_t):
        target = (*spacing_t[: len(shape_t) - len(target)], *target)
    return compute_new_shape(shape_t, spacing_t, target)


def tensor_bytes(info: PipelineInfo, volume: VolumeSpec) -> TensorBytes:
    """Bytes per request of every pipeline tensor for ``volume`` (see the module docstring)."""
    geo = info.geometry
    v_in = math.prod(volume.shape)
    shape_res = resampled_shape(geo, volume)
    v_res = math.prod(shape_res)
    patch = math.prod(geo.patch_size)
    return TensorBytes(
        resampled_shape=shape_res,
        image=geo.channels * v_in * 4,
        preprocessed=geo.channels * v_res * 4,
        logits=geo.classes * v_res * 2,
        segmentation=v_in * geo.label_bytes,
        probabilities=geo.classes * v_in * 4 if volume.probabilities else 0,
        tile_batch=info.tile_batch_size * patch * (geo.channels * 4 + geo.classes * info.fold_output_bytes),
    )


def _region(tensors: tuple[int, ...], block: int = 0) -> int:
    """One stub's shm region after holding ``tensors`` (and a ``block`` of small ones) at once.

    Measured on the embedded 2.51 server (docs/deploy.md): a tensor that does not fit grows the region
    by its size rounded up to the growth step (64 MiB), e.g. preprocess with a 32 MiB IMAGE and a
    71 MiB PREPROCESSED ended at 16 + 64 + 128 = 208 MiB. Small tensors (tile batches) share the slack.
    """
    grown = sum(_round_up(size + _TENSOR_OVERHEAD, SHM_GROWTH_BYTES) for size in tensors if size)
    if block > SHM_DEFAULT_BYTES // 2:
        grown += _round_up(block, SHM_GROWTH_BYTES)
    return SHM_DEFAULT_BYTES + grown


def _working_bytes(info: PipelineInfo, t: TensorBytes, volume: VolumeSpec) -> int:
    """Process memory of one request outside shm, host-side upper bound (CPU code paths).

    preprocess resamples in float64 (input and output copies: 2 x IMAGE + 2 x PREPROCESSED); the
    orchestrator keeps nnU-Net's fp16 accumulator and one fp16 logits array per fold ((1 + folds) x
    LOGITS); stitch resamples fp32 logits and probabilities (2 x LOGITS + 2 x K x V_in x 4).
    """
    preprocess = 2 * t.image + 2 * t.preprocessed
    orchestrator = (1 + len(info.fold_models)) * t.logits
    stitch = 2 * t.logits + 2 * info.geometry.classes * math.prod(volume.shape) * 4
    return preprocess + orchestrator + stitch


def stub_bytes(info: PipelineInfo, per_gpu: int = 1) -> int:
    """Host memory of the Python stubs: torch is imported by the orchestrator (always: its fold loop runs
    on torch tensors) and by the Python fold runner, NumPy/SciPy (and CuPy) alone by preprocess and stitch."""
    torch_stubs = info.orchestrator_instances * info.stages
    if info.fold_runner == "python":
        torch_stubs += info.fold_instances * len(info.fold_models)
    plain_stubs = (info.preprocess_instances + info.stitch_instances) * info.stages
    return per_gpu * (plain_stubs * STUB_BYTES + torch_stubs * TORCH_STUB_BYTES)


@dataclass(frozen=True)
class _Share:
    """One pipeline's part of the plan (bytes)."""

    tensors: TensorBytes
    shm: int
    cuda: int
    pinned: int
    stubs: int
    working: int
    folds: FoldMemoryPlan | None = None  # gpu target: the accumulators of one orchestrator instance
    gpu_given: bool = False  # folds.available_bytes is the GPU's memory left for the orchestrators

    def mib(self) -> dict[str, int]:
        share = {"shm_mib": _ceil_div(self.shm, MiB), "stub_mib": _ceil_div(self.stubs, MiB),
                 "working_mib": _ceil_div(self.working, MiB), "cuda_pool_mib": _ceil_div(self.cuda, MiB),
                 "pinned_pool_mib": _ceil_div(self.pinned, MiB)}
        if self.folds is not None:
            share.update(device_all_folds_mib=_ceil_div(self.folds.bytes_for(self.folds.folds), MiB),
                         device_one_fold_mib=_ceil_div(self.folds.bytes_for(1), MiB))
            if self.gpu_given:
                share["concurrent_folds"] = self.folds.max_concurrent_folds
        return share


def fold_memory(info: PipelineInfo, volume: VolumeSpec, *, instances: int = 1,
                available_bytes: int = 0) -> FoldMemoryPlan:
    """The fold accumulators of one orchestrator request of ``volume`` (``numerics.limits``), with
    ``available_bytes`` shared by ``instances`` (0: nothing given, only the byte counts are meaningful)."""
    geo = info.geometry
    return FoldMemoryPlan(num_heads=geo.classes, channels=geo.channels,
                          voxels=padded_voxels(resampled_shape(geo, volume), geo.patch_size),
                          folds=max(1, len(info.folds)), instances=max(1, instances),
                          available_bytes=available_bytes, memory="GPU memory")


def _share(info: PipelineInfo, volume: VolumeSpec, gpus: int, in_flight_requests: int | None) -> _Share:
    """What one endpoint version adds to the server (see :func:`plan_memory`)."""
    t = tensor_bytes(info, volume)
    gpu_target = info.target == "gpu"
    per_gpu = max(1, gpus) if gpu_target else 1
    requests = in_flight_requests or info.orchestrator_instances
    tiles = info.max_inflight * t.tile_batch  # one orchestrator instance's tile batches in flight
    stubs = [  # (instances, shm region of one instance); every stage of an ensemble or cascade has its own
        (info.preprocess_instances * info.stages, _region((t.image, t.preprocessed))),
        (info.orchestrator_instances * info.stages, _region((t.preprocessed, t.logits), tiles)),
        (info.stitch_instances * info.stages, _region((t.logits, t.segmentation, t.probabilities))),
    ]
    if info.fold_runner == "python":
        stubs.append((info.fold_instances * len(info.fold_models), _region((), t.tile_batch)))
    shm = sum(n * per_gpu * region for n, region in stubs)
    cuda = pinned = 0
    if gpu_target:
        all_tiles = info.orchestrator_instances * tiles
        cuda = math.ceil((all_tiles + requests * (t.preprocessed + t.logits)) * HEADROOM)
        staged = all_tiles + requests * (t.image + t.segmentation + t.probabilities)
        pinned = math.ceil(staged * HEADROOM)
    return _Share(tensors=t, shm=shm, cuda=cuda, pinned=pinned, stubs=stub_bytes(info, per_gpu),
                  working=requests * info.stages * _working_bytes(info, t, volume),
                  folds=fold_memory(info, volume) if gpu_target else None)


def plan_memory(info: RepositoryInfo | PipelineInfo, volume: VolumeSpec, *, gpus: int = 1,
                in_flight_requests: int | None = None, gpu_memory_bytes: int | None = None) -> MemoryPlan:
    """Size shm, pools and host memory for a server of ``info`` serving ``volume``.

    A repository with several endpoints (or versions of one) loads every pipeline: their stubs, shm regions
    and pools add up, and each may hold its own requests at once (an upper bound: a version that is not
    promoted only gets pinned requests). The server itself and the shm margin count once.

    Args:
        gpus: GPUs visible to the server (KIND_GPU instance groups are created once per GPU).
        in_flight_requests: whole requests whose tensors coexist per pipeline (default: its orchestrator
            instances, the stage that holds a request longest).
        gpu_memory_bytes: memory of one GPU (gpu target): the CUDA pool comes off, the rest is shared by
            every orchestrator instance on the GPU, and each pipeline's share says how many folds a
            request runs at once (``concurrent_folds``; 0: not even one fold fits, requests are refused).
    """
    pipelines = info.pipelines if isinstance(info, RepositoryInfo) else (info,)
    gpu_target = info.target == "gpu"
    shares = [_share(p, volume, gpus, in_flight_requests) for p in pipelines]
    shm = _round_up(sum(s.shm for s in shares) + SHM_MARGIN_BYTES, MiB)
    cuda_pool = pinned = 0
    if gpu_target:
        cuda_pool = max(CUDA_POOL_MIN_BYTES, _round_up(sum(s.cuda for s in shares), 64 * MiB))
        pinned = max(PINNED_POOL_MIN_BYTES, _round_up(sum(s.pinned for s in shares), 64 * MiB))
    host = _round_up(shm + pinned + SERVER_BYTES + sum(s.stubs + s.working for s in shares), 256 * MiB)
    if gpu_target and gpu_memory_bytes is not None:
        instances = sum(p.orchestrator_instances * p.stages for p in pipelines)
        left = max(0, gpu_memory_bytes - cuda_pool)
        shares = [dataclasses.replace(s, folds=dataclasses.replace(s.folds, instances=instances,
                                                                    available_bytes=left),
                                      gpu_given=True)
                  for s in shares]
    return MemoryPlan(gpu_memory_bytes=gpu_memory_bytes if gpu_target else None,
                      tensors=shares[0].tensors, shm_bytes=shm, cuda_pool_bytes=cuda_pool,
                      pinned_pool_bytes=pinned, host_memory_bytes=host,
                      pipelines=tuple((p.label, s.mib()) for p, s in zip(pipelines, shares, strict=True)))
