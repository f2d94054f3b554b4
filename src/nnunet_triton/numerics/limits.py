"""Size limits for requests: a voxel cap on the input and the resampled volume, and a memory budget.

nnU-Net has no such limit (``nnUNetPredictor`` processes whatever it is given until memory runs out).
A server does need one: a single oversized volume, or a small volume with a large (coarse) spacing
that resamples to a huge grid (``compute_new_shape`` scales each axis by ``spacing / target_spacing``),
would otherwise exhaust host memory, ``/dev/shm`` (Python-backend tensors) or GPU memory and take every
other request down with it. The checks are pure functions on shapes so they run before any copy.

Where they are called (see ``docs/reliability.md``):

* ``serving.steps.preprocess``: ``check_voxel_limit("IMAGE", image.shape, limit)`` right after the
  IMAGE input is read; ``preprocess_case(..., max_voxels=limit)`` checks
  ``("resampled image", (C, *new_shape))`` on the shape it is about to resample to (after cropping,
  before normalization and resampling).
* the limit comes from the model config parameter ``max_voxels`` (``parameters.PreprocessParameters``),
  which ``repository/build.py --max-voxels`` writes (``BuildOptions.max_voxels``, default
  :data:`DEFAULT_MAX_VOXELS`); ``0`` disables the check.
* ``serving.steps.orchestrator`` checks PREPROCESSED with :func:`check_preprocessed` and
  ``serving.steps.stitch`` checks LOGITS and the volume CASE_PROPERTIES declares with
  :func:`check_stitch_request` before computing anything: these internal models answer any client that
  reaches the port, and stitch's output shape comes from CASE_PROPERTIES alone (a 421-byte request could
  declare a 700^3 volume). Both read the same ``max_voxels``/``max_request_bytes`` parameters.
* the memory budget: the same place checks :func:`check_request_memory`, the float32 logits (K x the
  resampled shape: stitch_model converts the fp16 logits to float32 to resample them) and, when such an
  array will exist, the float32 probabilities in the original geometry (K x the image's shape: resampled
  logits, softmax, the PROBABILITIES output; a labels-only request exported by rows on the host holds none)
  against the model parameter ``max_request_bytes``
  (``repository/build.py --max-request-bytes``, default :data:`DEFAULT_MAX_REQUEST_BYTES`; 0 = none).
  A model with many labels reaches it long before the voxel cap (117 labels x 512 x 512 x 600 voxels
  is 73 GB of probabilities).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nnunet_triton.errors import InputValidationError, ResourceExhaustedError

__all__ = [
    "DEFAULT_MAX_VOXELS",
    "MAX_VOXELS_PARAMETER",
    "DEFAULT_MAX_REQUEST_BYTES",
    "MAX_REQUEST_BYTES_PARAMETER",
    "check_voxel_limit",
    "check_request_memory",
    "FoldMemoryPlan",
    "plan_fold_memory",
    "padded_voxels",
    "check_channels",
    "check_preprocessed",
    "check_stitch_request",
]

# 2**28 = 512 x 512 x 1024 voxels (a long CT at full in-plane resolution), 1 GiB per float32 copy. By the
# formulas of server.deploy.sizing one such request (1 channel, 2 classes, 5 folds) needs ~12 GiB of working
# memory (preprocess 2 x IMAGE + 2 x PREPROCESSED, orchestrator 6 x fp16 LOGITS, stitch 2 x LOGITS + 2 x
# fp32 probabilities) plus ~4 GiB of Python-backend shm: it fits a 32 GiB host. 2**30 would need 4x that;
# raise it (or 0 = no limit) on bigger machines.
DEFAULT_MAX_VOXELS = 2**28
MAX_VOXELS_PARAMETER = "max_voxels"
# 8 GiB per float32 array: at the default voxel cap (2^28) that allows 8 classes; the working memory of
# one such request is ~3x the largest array (docs/reliability.md "Memory limits").
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**30
MAX_REQUEST_BYTES_PARAMETER = "max_request_bytes"
_FLOAT32_BYTES = 4


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


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_request_memory(num_heads: int, preprocessed_shape: Sequence[int], original_shape: Sequence[int],
                         max_bytes: int, *, original_geometry: bool = True) -> tuple[int, int]:
    """Return the bytes of the request's float32 logits (``num_heads`` x ``preprocessed_shape``) and
    probabilities (``num_heads`` x ``original_shape``); raise when the logits, or (``original_geometry``)
    the probabilities, exceed ``max_bytes`` (0 = no budget). Pure arithmetic on shapes: call it before
    allocating.

    ``original_geometry`` says whether a ``num_heads`` x original-geometry array will exist: the
    probabilities were asked for, or the export resamples the whole volume at once (the GPU's, or a spline
    order). The host's export by rows (``slab_export.export_logits``) holds one step of rows at a time, so
    a labels-only request there is bounded by its logits alone.

    Raises:
        InputValidationError: (INVALID_ARG) naming both sizes, their shapes and the budget.
    """
    pre = tuple(int(s) for s in preprocessed_shape)
    orig = tuple(int(s) for s in original_shape)
    logits = num_heads * math.prod(pre) * _FLOAT32_BYTES
    probabilities = num_heads * math.prod(orig) * _FLOAT32_BYTES
    largest = max(logits, probabilities) if original_geometry else logits
    if max_bytes > 0 and largest > max_bytes:
        hint = "" if logits > max_bytes or not original_geometry else \
            "; without probabilities the labels need no such array on a CPU server: ask without them"
        raise InputValidationError(
            f"request needs {_size(logits)} for its logits ({num_heads} x {pre} float32, preprocessed "
            f"geometry) and {_size(probabilities)} for its probabilities ({num_heads} x {orig} float32, "
            f"original geometry), more than the server's budget of {_size(max_bytes)} ({max_bytes} bytes) "
            f"per array (model parameter {MAX_REQUEST_BYTES_PARAMETER!r}){hint}."
        )
    return logits, probabilities


# --- fold accumulators: device (or host) memory as a plan --------------------------------------------------
#
# The orchestrator runs nnU-Net's sliding window once per fold, each fold with its own float16 accumulator
# and weight buffer over the padded volume ((K + 1) x V x 2 bytes), and averages the folds in fold order
# (numerics.sliding_window.FoldAverage). nnUNetPredictor holds one fold's buffers at a time; running every
# fold at once is faster on a GPU (the fold models work in parallel) but needs folds x that: 22 GiB for
# 5 folds, 14 heads and 600 x 512 x 512 voxels, per orchestrator instance. The plan below chooses, per
# request, how many folds may be alive at once from the memory there is, and refuses the request when not
# even one fits.

_FP16_BYTES = 2


def padded_voxels(spatial_shape: Sequence[int], patch_size: Sequence[int]) -> int:
    """Voxels of the volume padded to at least the patch on its last ``len(patch_size)`` axes (as
    ``tiling.pad_to_patch`` pads; a 2D configuration leaves the first axis of a 3D volume alone)."""
    shape = tuple(int(s) for s in spatial_shape)
    lead = len(shape) - len(patch_size)
    return math.prod(shape[:lead]) * math.prod(
        max(s, int(p)) for s, p in zip(shape[lead:], patch_size, strict=True))


@dataclass(frozen=True)
class FoldMemoryPlan:
    """How many fold accumulators one request may hold at once in ``available_bytes / instances``.

    Bytes, for K = ``num_heads``, V = ``voxels`` (padded), C = ``channels``:

    * per fold alive: ``(K + 1) x V x 2``, nnU-Net's fp16 logits and weights (a finished fold waiting for
      its turn in the fold-order sum holds its K x V x 2 logits in the same place);
    * once per request: the padded input ``C x V x 4``, the running fp16 sum ``K x V x 2`` and the cropped
      copy a fold makes when it finishes ``K x V x 2`` (folds finish one at a time: finalize is synchronous).

    Attributes:
        num_heads, voxels, channels, folds: the request (``voxels`` from :func:`padded_voxels`).
        instances: model instances sharing the memory (orchestrator instances on this device or host).
        available_bytes: free device memory or available host memory now.
        memory: what ``available_bytes`` measures, for messages ("GPU 0 free memory").
    """

    num_heads: int
    voxels: int
    channels: int
    folds: int
    instances: int
    available_bytes: int
    memory: str = "memory"

    @property
    def fold_bytes(self) -> int:
        """One fold's fp16 accumulator and weights."""
        return (self.num_heads + 1) * self.voxels * _FP16_BYTES

    @property
    def fixed_bytes(self) -> int:
        """The padded input, the running sum and one finishing fold's cropped copy."""
        return self.channels * self.voxels * _FLOAT32_BYTES + 2 * self.num_heads * self.voxels * _FP16_BYTES

    @property
    def budget_bytes(self) -> int:
        """This instance's share of :attr:`available_bytes`."""
        return self.available_bytes // max(1, self.instances)

    def bytes_for(self, concurrent_folds: int) -> int:
        """Peak bytes of one request with ``concurrent_folds`` folds alive at once."""
        return self.fixed_bytes + concurrent_folds * self.fold_bytes

    @property
    def max_concurrent_folds(self) -> int:
        """Folds that may be alive at once (0: not even one fits), at most :attr:`folds`."""
        return max(0, min(self.folds, (self.budget_bytes - self.fixed_bytes) // self.fold_bytes))

    def describe(self) -> str:
        return (f"{self.folds} folds x {self.num_heads} heads x {self.voxels} voxels need "
                f"{_size(self.bytes_for(self.folds))} all at once, {_size(self.bytes_for(1))} one fold at a "
                f"time; {self.memory} {_size(self.available_bytes)} / {self.instances} instances = "
                f"{_size(self.budget_bytes)} per instance")


def plan_fold_memory(*, num_heads: int, voxels: int, channels: int, folds: int, instances: int,
                     available_bytes: int, memory: str = "memory") -> FoldMemoryPlan:
    """Return the request's :class:`FoldMemoryPlan`; refuse it when not even one fold fits.

    Raises:
        ResourceExhaustedError: (UNAVAILABLE) naming the limit, the request's sizes and the memory there is.
    """
    plan = FoldMemoryPlan(num_heads=int(num_heads), voxels=int(voxels), channels=int(channels),
                          folds=int(folds), instances=int(instances), available_bytes=int(available_bytes),
                          memory=memory)
    if plan.folds < 1 or plan.instances < 1:
        raise ValueError(f"folds and instances must be >= 1, got folds={folds}, instances={instances}.")
    if plan.max_concurrent_folds < 1:
        raise ResourceExhaustedError(
            f"request does not fit the fold-accumulator memory limit: {plan.describe()}, less than the "
            f"{_size(plan.bytes_for(1))} ({plan.bytes_for(1)} bytes) of one fold. Send a smaller volume, "
            "retry when other requests have finished, or run fewer orchestrator instances per device."
        )
    return plan


def check_channels(name: str, shape: Sequence[int], expected: int) -> None:
    """Raise unless ``shape`` is ``(expected, ...)``.

    Raises:
        InputValidationError: (INVALID_ARG) naming ``name``, the expected channels and the shape.
    """
    dims = tuple(int(s) for s in shape)
    if not dims or dims[0] != expected:
        raise InputValidationError(f"{name}: expected {expected} channel(s) on axis 0 (the model's), got "
                                   f"shape {dims}.")


def _check_spatial(name: str, shape: tuple[int, ...], ndim: int) -> None:
    if len(shape) != ndim + 1 or any(s < 1 for s in shape[1:]):
        raise InputValidationError(f"{name}: expected shape (channels, {ndim} spatial dims >= 1), got "
                                   f"{shape}.")


def check_preprocessed(name: str, shape: Sequence[int], *, channels: int, num_heads: int, max_voxels: int,
                       max_request_bytes: int, ndim: int = 3) -> None:
    """Bounds of the orchestrator's input (``channels`` x a volume; it makes ``num_heads`` logits of that
    volume): its rank, channels, voxels and the bytes of the logits it will make.

    Raises:
        InputValidationError: (INVALID_ARG) naming the input, the rule and the values.
    """
    dims = tuple(int(s) for s in shape)
    _check_spatial(name, dims, ndim)
    check_channels(name, dims, channels)
    check_voxel_limit(name, dims, max_voxels)
    check_request_memory(num_heads, dims[1:], dims[1:], max_request_bytes)


def check_stitch_request(logits_shape: Sequence[int], *, shape_before_cropping: Sequence[int],
                         bbox: Sequence[Sequence[int]], shape_after_cropping: Sequence[int], num_heads: int,
                         max_voxels: int, max_request_bytes: int, original_geometry: bool = True) -> None:
    """Bounds of a stitch request before anything is allocated: the LOGITS it got and the volume its
    CASE_PROPERTIES declare (the output's shape comes from them alone, whatever LOGITS' size);
    ``original_geometry`` as in :func:`check_request_memory`.

    Args:
        logits_shape: ``(num_heads, *resampled)``.
        shape_before_cropping, bbox, shape_after_cropping: ``CaseProperties``' fields (transposed order);
            ``bbox`` holds half-open ``(lo, hi)`` per axis.

    Raises:
        InputValidationError: (INVALID_ARG) naming the limit and the numbers.
    """
    before = tuple(int(s) for s in shape_before_cropping)
    logits = tuple(int(s) for s in logits_shape)
    _check_spatial("input 'LOGITS'", logits, len(before))
    check_channels("input 'LOGITS'", logits, num_heads)
    check_voxel_limit("input 'LOGITS'", logits, max_voxels)
    check_voxel_limit("the volume CASE_PROPERTIES declares (shape before cropping)", before, max_voxels)
    check_voxel_limit("the cropped volume CASE_PROPERTIES declares", shape_after_cropping, max_voxels)
    inside = len(bbox) == len(before) and all(0 <= int(lo) <= int(hi) <= size
                                              for (lo, hi), size in zip(bbox, before, strict=False))
    if not inside:
        raise InputValidationError(f"CASE_PROPERTIES: the bbox {[tuple(b) for b in bbox]} must lie within "
                                   f"the shape before cropping {before} on every axis (0 <= lo <= hi <= "
                                   f"size).")
    check_request_memory(num_heads, logits[1:], before, max_request_bytes,
                         original_geometry=original_geometry)
