"""Where a model instance computes, and moving arrays there (style: one place decides the device).

Triton gives every instance a kind and a device id (``initialize``'s ``model_instance_kind`` /
``model_instance_device_id``). A KIND_GPU instance keeps its data on that GPU: the preprocess and stitch
models compute with CuPy, the orchestrator and the Python fold runner with torch CUDA tensors, and the
tensors they pass on stay in device memory (DLPack). A KIND_CPU instance computes with NumPy (preprocess,
stitch) or torch CPU tensors (orchestrator, fold runner). HTTP/gRPC inputs always arrive in host memory,
so the first GPU step copies them to the device once (:meth:`InstanceDevice.array` / :meth:`tensor`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from nnunet_triton.errors import ServerError
from nnunet_triton.numerics._xp import is_cupy_array, is_torch_tensor, to_numpy

__all__ = ["InstanceDevice"]


@dataclass(frozen=True)
class InstanceDevice:
    """A model instance's device: ``gpu`` is False for KIND_CPU (and KIND_MODEL/AUTO on a CPU server)."""

    gpu: bool = False
    index: int = 0

    @classmethod
    def from_args(cls, args: Mapping[str, str]) -> InstanceDevice:
        """From ``initialize``'s args (``model_instance_kind`` GPU -> that ``model_instance_device_id``)."""
        if args.get("model_instance_kind") == "GPU":
            return cls(gpu=True, index=int(args.get("model_instance_device_id", 0)))
        return cls()

    @property
    def torch_device(self) -> str:
        """``"cpu"`` or ``"cuda:<index>"``."""
        return f"cuda:{self.index}" if self.gpu else "cpu"

    @property
    def memory(self) -> str:
        """BLS ``output_device`` for outputs this instance reads: ``"cpu"`` or ``"gpu"``."""
        return "gpu" if self.gpu else "cpu"

    def watch(self, record: Any) -> Any:
        """The ``on_host`` hook for tensors that should reach this instance in device memory:
        ``record.host_fallback`` on a GPU instance, None (nothing to watch) on a CPU one."""
        return record.host_fallback if self.gpu else None

    def activate(self) -> None:
        """Make this GPU CuPy's current device in this stub and compile one kernel (a no-op on CPU).

        CuPy compiles kernels with NVRTC on first use; doing one here makes a missing or broken NVRTC (or
        an unusable GPU) fail the model load with the reason, not the first request.

        Raises:
            ServerError: CuPy cannot run a kernel on this GPU.
        """
        if not self.gpu:
            return
        import cupy

        try:
            cupy.cuda.Device(self.index).use()
            if float(cupy.arange(4, dtype=cupy.float32).sum()) != 6.0:
                raise RuntimeError("a reduction of [0, 1, 2, 3] did not give 6")
        except Exception as exc:
            raise ServerError(
                f"CuPy cannot run a kernel on GPU {self.index} ({type(exc).__name__}: {exc}); the GPU models "
                "need a working CUDA driver and NVRTC (cupy-cuda12x with the CUDA runtime of the image)."
            ) from exc

    def instances(self, model_config: Mapping[str, Any]) -> int:
        """Instances of the model that share this instance's memory (``initialize``'s parsed config).

        On a GPU: the KIND_GPU (or KIND_AUTO) groups placed on it; a group without ``gpus`` has ``count``
        instances on every GPU. On the host: every instance of the model.
        """
        total = 0
        for group in model_config.get("instance_group") or [{"count": 1}]:
            count = int(group.get("count", 1))
            if not self.gpu:
                total += count
            elif group.get("kind", "KIND_AUTO") in ("KIND_GPU", "KIND_AUTO"):
                gpus = [int(g) for g in group.get("gpus") or []]
                total += count if not gpus or self.index in gpus else 0
        return max(1, total)

    def available_memory(self) -> tuple[int, str]:
        """Bytes a new allocation of this instance can get now, and what they measure (for messages).

        GPU: the driver's free memory plus what torch's caching allocator holds without using it (this
        process reuses that without the driver). Host: ``MemAvailable`` of ``/proc/meminfo`` (the kernel's
        estimate of what can be allocated without swapping), else the free physical pages.
        """
        if self.gpu:
            import torch

            free, _total = torch.cuda.mem_get_info(self.index)
            cached = torch.cuda.memory_reserved(self.index) - torch.cuda.memory_allocated(self.index)
            return free + cached, f"GPU {self.index} free memory"
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "available host memory"
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"

    def array(self, array: Any) -> Any:
        """``array`` as this instance's NumPy (CPU) or CuPy (GPU) array, copied only if it lives elsewhere."""
        if array is None:
            return None
        if not self.gpu:
            return to_numpy(array)
        import cupy

        if is_cupy_array(array) and array.device.id == self.index:
            return array
        with cupy.cuda.Device(self.index):
            if is_torch_tensor(array):
                return cupy.from_dlpack(array.contiguous())
            return cupy.asarray(array)

    def tensor(self, array: Any) -> Any:
        """``array`` as a torch tensor on :attr:`torch_device` (NumPy/CuPy arrays are wrapped, then moved)."""
        import torch

        if not is_torch_tensor(array):
            if isinstance(array, np.ndarray):
                array = torch.from_numpy(array if array.flags.writeable else array.copy())
            else:
                array = torch.from_dlpack(array)
        return array.to(self.torch_device)
