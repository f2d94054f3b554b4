"""nnU-Net's export (``convert_predicted_logits_to_segmentation_with_correct_shape``) fed slab by slab.

The fold-averaged float16 logits arrive as slabs of rows of the first spatial axis, in row order (what a
streaming merger hands on). :class:`SlabExporter` keeps only the input rows that output rows still to come
read (:class:`~nnunet_triton.numerics.slab_resampling.RowResampling` names them), resamples each ready range
of output rows to the cropped original geometry, and turns it into labels (argmax or region thresholds) and,
when asked, probabilities: every one of these is per voxel, so the label map is bit for bit the whole-volume
export's (``prediction_export.convert_logits_to_segmentation``, itself equal to nnU-Net's). The label map of
the case (uint8/uint16) is the one whole-volume array it holds; probabilities are ``K x volume`` by
definition and are assembled whole when asked for. At the end the crop is put back into the original shape
and transposed back, as in the whole-volume export.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from nnunet_triton.errors import InputValidationError, UnsupportedModelError
from nnunet_triton.numerics._xp import get_array_module
from nnunet_triton.numerics.cropping import insert_crop
from nnunet_triton.numerics.prediction_export import (
    _current_spacing,
    apply_inference_nonlin,
    check_logits_fit,
    convert_logits_to_segmentation,
    segmentation_dtype,
    segmentation_from_logits,
)
from nnunet_triton.numerics.releases import release_numerics
from nnunet_triton.numerics.resampling import determine_do_sep_z_and_axis
from nnunet_triton.numerics.slab_resampling import RowResampling, check_streamable

if TYPE_CHECKING:
    from nnunet_triton.numerics.plans import InferenceConfig
    from nnunet_triton.numerics.preprocess import CaseProperties

__all__ = ["STEP_BYTES", "SlabExporter", "export_logits", "exports_by_rows", "row_resampling",
           "rows_per_step"]

STEP_BYTES = 32 * 2**20
"""Memory one export step may take (the stitch model's whole-volume logits are cut into steps this size)."""


def exports_by_rows(config: InferenceConfig, *, gpu: bool = False) -> bool:
    """Whether :func:`export_logits` exports this configuration's cases by rows (no ``K x volume`` array):
    on the host, with nnU-Net's default resampling function at an order :func:`check_streamable` accepts
    (``order_z`` counted whether or not a case resamples z separately). The GPU exports whole volumes."""
    settings = config.resampling_probabilities
    if gpu or settings.function != "resample_data_or_seg_to_shape":
        return False
    try:
        check_streamable(settings.order, settings.order_z)
    except UnsupportedModelError:
        return False
    return True


def row_resampling(props: CaseProperties, config: InferenceConfig,
                   logits_shape: tuple[int, ...]) -> RowResampling:
    """The export's resampling of logits of spatial shape ``logits_shape`` for this case, by rows.

    Raises:
        UnsupportedModelError: the configuration's probability resampling cannot be cut into rows exactly
            (a spline order above 1, or ``order_z`` above 0 between thick slices).
    """
    settings = config.resampling_probabilities
    if settings.function != "resample_data_or_seg_to_shape":
        raise UnsupportedModelError(f"resampling function {settings.function!r} cannot be streamed.")
    current, original = _current_spacing(props, config)
    separate, axis = determine_do_sep_z_and_axis(settings.force_separate_z, current, original)
    return RowResampling(logits_shape, props.shape_after_cropping_and_before_resampling, axis=axis,
                         order=settings.order, do_separate_z=separate, order_z=settings.order_z)


def rows_per_step(num_heads: int, plane_voxels: int, step_bytes: int = STEP_BYTES) -> int:
    """Output rows one export step resamples so that it holds about ``step_bytes``: per output row the
    resampled logits (float16), their probabilities (float32) and one channel's float64 corners."""
    if step_bytes < 1:
        raise InputValidationError(f"step_bytes must be >= 1, got {step_bytes}.")
    per_row = max(1, int(plane_voxels)) * (6 * int(num_heads) + 4 * 8)
    return max(1, int(step_bytes) // per_row)


def export_logits(logits: Any, props: CaseProperties, config: InferenceConfig, *,
                  return_probabilities: bool = False, workers: int = 1, step_bytes: int = STEP_BYTES) -> Any:
    """:func:`~nnunet_triton.numerics.prediction_export.convert_logits_to_segmentation`, by output rows.

    The whole logits are one slab of a :class:`SlabExporter`: the same bits, but the resampled logits exist
    one step of ``step_bytes`` at a time per worker instead of ``K x volume`` float16 (float64 per channel)
    at once, and ``workers`` threads export ranges side by side. A resampling that cannot be cut into rows
    (spline orders) runs on the whole volume as before.
    """
    check_logits_fit(logits, props, config)
    spatial = tuple(int(s) for s in logits.shape[1:])
    heads = int(logits.shape[0])
    plane = math.prod(int(s) for s in props.shape_after_cropping_and_before_resampling[1:])
    try:  # the exporter refuses a resampling it cannot cut into rows before it allocates anything
        exporter = SlabExporter(props, config, spatial, heads,
                                rows_per_step=rows_per_step(heads, plane, step_bytes),
                                return_probabilities=return_probabilities, workers=workers,
                                xp=get_array_module(logits))
    except UnsupportedModelError:
        return convert_logits_to_segmentation(logits, props, config,
                                              return_probabilities=return_probabilities)
    exporter.add(0, logits)
    return exporter.finalize()


class SlabExporter:
    """Take fold-averaged logits slab by slab (:meth:`add`), give the exported case at :meth:`finalize`.

    Args:
        props: the case's properties (geometry of the crop and the original).
        config: the deployed configuration (labels, transpose, resampling, spacing).
        logits_shape: spatial shape of the logits (the preprocessed volume).
        num_heads: channels of the logits.
        rows_per_step: output rows resampled at once (memory per step: ``K x rows x plane`` float64).
        workers: threads exporting ready row ranges side by side (NumPy releases the GIL in its loops;
            each range writes its own rows, so the bits do not depend on it).
        return_probabilities: also assemble float32 probabilities ``(K, *original shape)``.
        xp: the array module of the slabs (NumPy or CuPy).

    Attributes:
        peak_input_rows: the most input rows held at once (for tests and memory reports).
    """

    def __init__(self, props: CaseProperties, config: InferenceConfig, logits_shape: tuple[int, ...],
                 num_heads: int, *, rows_per_step: int = 8, return_probabilities: bool = False,
                 workers: int = 1, xp: Any = None) -> None:
        import numpy as np

        self._xp = xp = np if xp is None else xp
        self._props, self._config = props, config
        self._labels = config.labels
        self._in_shape = tuple(int(s) for s in logits_shape)
        self._heads = int(num_heads)
        if self._heads != config.labels.num_segmentation_heads:
            raise InputValidationError(f"logits must have {config.labels.num_segmentation_heads} channels, "
                                       f"got {self._heads}.")
        if rows_per_step < 1:
            raise InputValidationError(f"rows_per_step must be >= 1, got {rows_per_step}.")
        self._step = int(rows_per_step)
        if workers < 1:
            raise InputValidationError(f"workers must be >= 1, got {workers}.")
        self._workers = int(workers)
        self._plan = row_resampling(props, config, self._in_shape)
        numerics = release_numerics(config.numerics)
        self._float32 = numerics.export_float32  # nnU-Net 2.0 / 2.1 resample float32 logits
        self._from_probabilities = numerics.labels_from_probabilities
        self._out_shape = tuple(int(s) for s in props.shape_after_cropping_and_before_resampling)
        self._seg = xp.zeros(self._out_shape, dtype=segmentation_dtype(config.labels))
        self._probs = xp.zeros((self._heads, *self._out_shape), dtype=xp.float32) if return_probabilities \
            else None
        self._buffer: Any = None  # input rows [buffer_start, received)
        self._buffer_start = 0
        self._received = 0
        self._next_row = 0  # first output row not yet exported
        self.peak_input_rows = 0

    def add(self, start: int, logits: Any) -> None:
        """Take rows ``start .. start + n`` of the logits ``(K, n, ...)``; rows must come in order, once."""
        if start != self._received:
            raise InputValidationError(f"logits slab starts at row {start}, expected row {self._received}.")
        if tuple(logits.shape[:1]) + tuple(logits.shape[2:]) != (self._heads, *self._in_shape[1:]):
            raise InputValidationError(f"logits slab of shape {tuple(logits.shape)} does not fit logits "
                                       f"({self._heads}, {', '.join(map(str, self._in_shape))}).")
        if start + logits.shape[1] > self._in_shape[0]:
            raise InputValidationError(f"logits slab rows {start}..{start + logits.shape[1]} exceed the "
                                       f"{self._in_shape[0]} rows of the logits.")
        xp = self._xp
        self._buffer = logits if self._buffer is None else xp.concatenate([self._buffer, logits], axis=1)
        self._received += int(logits.shape[1])
        self.peak_input_rows = max(self.peak_input_rows, int(self._buffer.shape[1]))
        self._export_ready()

    def finalize(self) -> Any:
        """The segmentation in the reader's axis order, or ``(segmentation, probabilities)``."""
        if self._received != self._in_shape[0]:
            raise InputValidationError(f"finalize after {self._received} of {self._in_shape[0]} logits rows.")
        self._export_ready()
        assert self._next_row == self._out_shape[0]
        xp, props, config = self._xp, self._props, self._config
        seg_full = xp.zeros(props.shape_before_cropping, dtype=self._seg.dtype)
        insert_crop(seg_full, self._seg, props.bbox)
        seg_full = xp.ascontiguousarray(seg_full.transpose(config.transpose_backward))
        if self._probs is None:
            return seg_full
        probs_full = xp.zeros((self._heads, *props.shape_before_cropping), dtype=xp.float32)
        if not self._labels.has_regions:
            probs_full[0] = 1
        insert_crop(probs_full, self._probs, props.bbox)
        axes = (0, *(i + 1 for i in config.transpose_backward))
        return seg_full, xp.ascontiguousarray(probs_full.transpose(axes))

    def _export_ready(self) -> None:
        ranges = []
        r0 = self._next_row
        while r0 < self._out_shape[0]:
            r1 = min(r0 + self._step, self._out_shape[0])
            while r1 > r0 and self._plan.source_rows((r0, r1))[1] > self._received:
                r1 -= 1
            if r1 == r0:
                break
            ranges.append((r0, r1))
            r0 = r1
        if not ranges:
            return
        if self._workers == 1 or len(ranges) == 1:
            for rows in ranges:
                self._export(rows)
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(self._workers, len(ranges))) as pool:
                list(pool.map(self._export, ranges))  # re-raises the first failure
        self._next_row = r0
        self._drop_rows_before(self._plan.source_rows((r0, r0 + 1))[0] if r0 < self._out_shape[0]
                               else self._received)

    def _export(self, rows: tuple[int, int]) -> None:
        lo, hi = self._plan.source_rows(rows)  # only these rows: the block is converted to float64
        first = self._buffer_start
        block = self._buffer[:, lo - first:hi - first]
        if self._float32:
            block = block.astype(self._xp.float32)
        resampled = self._plan.rows(block, lo, rows)
        probabilities = apply_inference_nonlin(resampled, self._labels) if self._probs is not None else None
        segmentation = segmentation_from_logits(resampled, self._labels, probabilities=probabilities,
                                                from_probabilities=self._from_probabilities
                                                or probabilities is not None)
        self._seg[rows[0]:rows[1]] = segmentation.astype(self._seg.dtype)
        if probabilities is not None:
            self._probs[:, rows[0]:rows[1]] = probabilities

    def _drop_rows_before(self, row: int) -> None:
        row = min(row, self._received)  # the next rows may read rows that have not arrived yet
        cut = row - self._buffer_start
        if cut > 0:
            self._buffer = self._buffer[:, cut:].copy()
            self._buffer_start = row
        if get_array_module(self._buffer) is not self._xp:
            raise InputValidationError("logits slabs must all be of one array type.")
