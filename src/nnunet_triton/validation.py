"""Size limits for requests: a configurable voxel cap on the input and on the resampled volume.

nnU-Net has no such limit (``nnUNetPredictor`` processes whatever it is given until memory runs out).
A server does need one: a single oversized volume, or a small volume with a large (coarse) spacing
that resamples to a huge grid (``compute_new_shape`` scales each axis by ``spacing / target_spacing``),
would otherwise exhaust host memory, ``/dev/shm`` (Python-backend tensors) or GPU memory and take every
other request down with it. The checks are pure functions on shapes so they run before any copy.

Where they are called (see ``docs/reliability.md``):

* ``preprocess_model/model.py``: ``check_voxel_limit("IMAGE", image.shape, limit)`` right after the
  IMAGE input is read; ``preprocess_case(..., max_voxels=limit)`` checks
  ``("resampled image", (C, *new_shape))`` on the shape it is about to resample to (after cropping,
  before normalization and resampling).
* the limit comes from the model config parameter ``max_voxels`` (:func:`max_voxels_from_parameters`),
  which ``repository/build.py --max-voxels`` writes (``BuildOptions.max_voxels``, default
  :data:`DEFAULT_MAX_VOXELS`); ``0`` disables the check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from nnunet_triton.errors import InputValidationError

__all__ = [
    "DEFAULT_MAX_VOXELS",
    "MAX_VOXELS_PARAMETER",
    "check_voxel_limit",
    "max_voxels_from_parameters",
]

# 2**28 = 512 x 512 x 1024 voxels (a long CT at full in-plane resolution), 1 GiB per float32 copy. By the
# formulas of deploy/sizing.py one such request (1 channel, 2 classes, 5 folds) needs ~12 GiB of working
# memory (preprocess 2 x IMAGE + 2 x PREPROCESSED, orchestrator 6 x fp16 LOGITS, stitch 2 x LOGITS + 2 x
# fp32 probabilities) plus ~4 GiB of Python-backend shm: it fits a 32 GiB host. 2**30 would need 4x that;
# raise it (or 0 = no limit) on bigger machines.
DEFAULT_MAX_VOXELS = 2**28
MAX_VOXELS_PARAMETER = "max_voxels"


def check_voxel_limit(name: str, shape: Sequence[int], max_voxels: int) -> int:
    """Return the number of elements of ``shape``; raise when it exceeds ``max_voxels`` (0 = no limit).

    Raises:
        InputValidationError: (INVALID_ARG) naming ``name``, the shape, its voxel count and the limit.
    """
    count = math.prod(int(s) for s in shape)
    if max_voxels > 0 and count > max_voxels:
        raise InputValidationError(
            f"{name} has {count} voxels (shape {tuple(int(s) for s in shape)}), more than the server's "
            f"limit of {max_voxels} voxels (model parameter {MAX_VOXELS_PARAMETER!r})."
        )
    return count


def max_voxels_from_parameters(parameters: Mapping[str, str], default: int = DEFAULT_MAX_VOXELS) -> int:
    """The ``max_voxels`` model parameter (``{key: string_value}``), ``default`` when absent.

    Raises:
        ValueError: the value is not an integer >= 0.
    """
    raw = parameters.get(MAX_VOXELS_PARAMETER)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(
            f"model parameter {MAX_VOXELS_PARAMETER!r} must be an integer >= 0, got {raw!r}."
        ) from None
    if value < 0:
        raise ValueError(f"model parameter {MAX_VOXELS_PARAMETER!r} must be an integer >= 0, got {raw!r}.")
    return value
