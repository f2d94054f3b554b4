"""Array-module dispatch: the same numerics run on NumPy (CPU) and CuPy (GPU) arrays.

CuPy is imported lazily and only when an array is not a NumPy array, so that
``import nnunet_triton`` works on machines without CuPy or a GPU.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["get_array_module", "get_ndimage", "is_cupy_array", "is_torch_tensor", "is_torch_module",
           "tensor_namespace", "to_numpy"]


def is_cupy_array(array: Any) -> bool:
    """True if ``array`` is a CuPy array (without importing CuPy when it is not loaded)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(array, cupy.ndarray)


def is_torch_tensor(array: Any) -> bool:
    """True if ``array`` is a torch tensor (without importing torch when it is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)


def is_torch_module(xp: ModuleType | None) -> bool:
    """True if the array namespace ``xp`` is torch (``None``, NumPy and CuPy are not)."""
    return xp is not None and xp.__name__ == "torch"


def tensor_namespace(*arrays: Any) -> ModuleType:
    """``torch`` if any argument is a torch tensor, else :func:`get_array_module`.

    Only the sliding-window loop (``numerics.tiling``, ``numerics.sliding_window``) accepts torch tensors:
    it is the device-resident path of the orchestrator (CPU or CUDA tensors, nnU-Net's own arithmetic).
    """
    if any(is_torch_tensor(array) for array in arrays):
        return sys.modules["torch"]  # is_torch_tensor saw it loaded
    return get_array_module(*arrays)


def get_array_module(*arrays: Any) -> ModuleType:
    """Return ``cupy`` if any argument is a CuPy array, else ``numpy``."""
    for array in arrays:
        if is_cupy_array(array):
            import cupy

            return cupy
    return np


def get_ndimage(xp: ModuleType) -> ModuleType:
    """Return the ``scipy.ndimage`` implementation matching the array module ``xp``."""
    if xp is np:
        import scipy.ndimage

        return scipy.ndimage
    import cupyx.scipy.ndimage

    return cupyx.scipy.ndimage


def to_numpy(array: Any) -> np.ndarray:
    """Copy a CuPy array or torch tensor to the host; NumPy arrays are returned unchanged."""
    if is_cupy_array(array):
        return array.get()
    if is_torch_tensor(array):
        return array.detach().cpu().numpy()
    return np.asarray(array)
