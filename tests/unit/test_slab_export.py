"""The export fed slab by slab gives nnU-Net's label map bit for bit, whatever the slab and step sizes.

The geometries of ``test_export.py`` (passthrough, transposed and cropped, resampled, separate z, a 2D
configuration), labels and regions: the streamed labels equal nnU-Net's own
``convert_predicted_logits_to_segmentation_with_correct_shape`` and our whole-volume export exactly, and the
streamed probabilities equal our whole-volume export's bit for bit, for slabs of one row, uneven slabs and
one slab, with one output row per step or several, exported by one thread or two.
"""

from __future__ import annotations

import numpy as np
import pytest

from nnunet_triton.errors import InputValidationError, UnsupportedModelError
from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation
from nnunet_triton.numerics.preprocess import CaseProperties
from nnunet_triton.numerics.resampling import compute_new_shape
from nnunet_triton.numerics.slab_export import SlabExporter, export_logits, exports_by_rows, rows_per_step

try:
    from . import parity_support as ps
    from .test_export import CASES, _nnunet, _setup
except ImportError:  # run as a top-level module
    import parity_support as ps
    from test_export import CASES, _nnunet, _setup


def _slabs(n: int, kind: str, rng: np.random.Generator) -> list[tuple[int, int]]:
    if kind == "rows":
        return [(i, i + 1) for i in range(n)]
    if kind == "whole":
        return [(0, n)]
    edges = sorted({0, n, *(int(e) for e in rng.integers(1, max(n, 2), size=3))})
    return list(zip(edges, edges[1:], strict=False))


def _stream(logits, props, config, slabs, step, probabilities, workers):
    exporter = SlabExporter(props, config, tuple(logits.shape[1:]), logits.shape[0], rows_per_step=step,
                            return_probabilities=probabilities, workers=workers)
    for lo, hi in slabs:
        exporter.add(lo, logits[:, lo:hi].copy())
    return exporter, exporter.finalize()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("regions", [False, True], ids=["labels", "regions"])
@pytest.mark.parametrize(("slab_kind", "step", "workers"),
                         [("rows", 1, 1), ("uneven", 3, 2), ("whole", 4, 2)])
def test_streamed_export_equals_nnunets_labels_and_the_whole_volume_probabilities(case, regions, slab_kind,
                                                                                  step, workers):
    dataset_json = ps.make_dataset_json(regions=regions)
    rng = np.random.default_rng(len(case.name) + 7 * regions)
    plans, config, props, logits = _setup(case, dataset_json, rng)
    reference = _nnunet(plans, dataset_json, case.configuration, logits, props, False)
    whole_seg, whole_probs = convert_logits_to_segmentation(logits, props, config, return_probabilities=True)
    slabs = _slabs(logits.shape[1], slab_kind, rng)
    exporter, (seg, probs) = _stream(logits, props, config, slabs, step, True, workers)
    assert seg.dtype == reference.dtype and np.array_equal(seg, reference)
    assert seg.tobytes() == whole_seg.tobytes() and probs.tobytes() == whole_probs.tobytes()
    if slab_kind == "rows":  # one input row at a time: only the rows the next output rows read are held
        assert exporter.peak_input_rows <= 4


def test_slabs_out_of_order_or_of_the_wrong_shape_are_refused_naming_the_rows():
    dataset_json = ps.make_dataset_json()
    _, config, props, logits = _setup(CASES[2], dataset_json, np.random.default_rng(0))
    exporter = SlabExporter(props, config, tuple(logits.shape[1:]), logits.shape[0])
    with pytest.raises(InputValidationError, match="starts at row 2, expected row 0"):
        exporter.add(2, logits[:, 2:4])
    with pytest.raises(InputValidationError, match="does not fit"):
        exporter.add(0, logits[:1, 0:2])
    exporter.add(0, logits[:, 0:2])
    with pytest.raises(InputValidationError, match="finalize after 2 of"):
        exporter.finalize()


def test_tiles_to_labels_streamed_end_to_end_equal_the_whole_volume_path_bit_for_bit():
    """Two folds' sliding windows (streaming mergers), the fold mean by slabs, the export by rows: the
    labels and probabilities of the whole-volume path, while no fold or export buffer covers the volume."""
    import asyncio
    import dataclasses

    from nnunet_triton.numerics.sliding_window import average_folds, predict_sliding_window
    from nnunet_triton.numerics.streaming import FoldSlabAverage, SlabMerger
    from nnunet_triton.numerics.window import SlidingWindowSettings
    from nnunet_triton.pipeline.orchestration import predict_folds_async

    dataset_json = ps.make_dataset_json(n_labels=4)
    case = next(c for c in CASES if c.name == "resampled_transposed_cropped")
    _, config, props, logits = _setup(case, dataset_json, np.random.default_rng(9))
    spatial = tuple(logits.shape[1:])
    data = np.random.default_rng(10).normal(size=(1, *spatial)).astype(np.float32)
    weights = np.random.default_rng(11).normal(size=(2, logits.shape[0])).astype(np.float32) * 6

    def net(fold):
        def predict(x):
            return np.stack([w * np.sin(x[:, 0] * (k + 1)) for k, w in enumerate(weights[fold])], axis=1)
        return predict

    window = SlidingWindowSettings(patch_size=(8, 8, 8), num_heads=logits.shape[0], mirror_axes=(0, 1, 2))
    whole = average_folds([predict_sliding_window(data, net(f), window) for f in range(2)])
    expected = convert_logits_to_segmentation(whole, props, config, return_probabilities=True)

    exporter = SlabExporter(props, config, spatial, logits.shape[0], rows_per_step=2,
                            return_probabilities=True)
    average = FoldSlabAverage(2, exporter.add)
    folds = iter(range(2))
    mergers: list[SlabMerger] = []

    def factory(splitter, settings):
        mergers.append(SlabMerger(splitter, settings, average.sink(next(folds))))
        return mergers[-1]

    def infer(fold):
        async def call(x):
            await asyncio.sleep(0)
            return net(fold)(x)
        return call

    streaming = dataclasses.replace(window, merger=factory)
    assert asyncio.run(predict_folds_async(data, [infer(f) for f in range(2)], streaming)) is None
    seg, probs = exporter.finalize()
    assert seg.tobytes() == expected[0].tobytes() and probs.tobytes() == expected[1].tobytes()
    assert all(m.band_rows == 8 for m in mergers) and exporter.peak_input_rows < spatial[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("regions", [False, True], ids=["labels", "regions"])
@pytest.mark.parametrize(("step_bytes", "workers"), [(1, 1), (1, 2), (10**9, 2)],
                         ids=["row_by_row", "row_by_row_two_threads", "one_step"])
def test_the_whole_logits_exported_by_row_steps_are_the_whole_volume_exports_bits(case, regions, step_bytes,
                                                                                  workers):
    dataset_json = ps.make_dataset_json(regions=regions)
    _, config, props, logits = _setup(case, dataset_json, np.random.default_rng(len(case.name) + 3 * regions))
    whole_seg, whole_probs = convert_logits_to_segmentation(logits, props, config, return_probabilities=True)
    seg, probs = export_logits(logits, props, config, return_probabilities=True, workers=workers,
                               step_bytes=step_bytes)
    assert seg.tobytes() == whole_seg.tobytes() and probs.tobytes() == whole_probs.tobytes()
    labels_only = export_logits(logits, props, config, workers=workers, step_bytes=step_bytes)
    assert labels_only.tobytes() == whole_seg.tobytes()


def test_a_spline_order_export_falls_back_to_the_whole_volume_and_bad_logits_are_refused():
    import dataclasses

    dataset_json = ps.make_dataset_json()
    _, config, props, logits = _setup(CASES[2], dataset_json, np.random.default_rng(1))
    spline = dataclasses.replace(config, resampling_probabilities=dataclasses.replace(
        config.resampling_probabilities, order=3))
    with pytest.raises(UnsupportedModelError):
        SlabExporter(props, spline, tuple(logits.shape[1:]), logits.shape[0])
    assert exports_by_rows(config) and not exports_by_rows(spline) and not exports_by_rows(config, gpu=True)
    expected = convert_logits_to_segmentation(logits, props, spline)
    assert export_logits(logits, props, spline, step_bytes=1).tobytes() == expected.tobytes()
    with pytest.raises(InputValidationError, match="logits must have shape"):
        export_logits(logits[:1], props, config)


def test_a_step_holds_about_its_bytes_and_at_least_one_row():
    assert rows_per_step(3, 512 * 512, 32 * 2**20) == 2  # 50 bytes per voxel of a row
    assert rows_per_step(105, 512 * 512, 32 * 2**20) == 1  # a row is over the step: one row at a time
    assert rows_per_step(3, 64 * 64, 10 * 2**20) == 10 * 2**20 // (64 * 64 * 50)
    with pytest.raises(InputValidationError, match="step_bytes must be >= 1, got 0"):
        rows_per_step(3, 10, 0)


def test_the_export_by_rows_never_holds_the_resampled_logits_of_the_volume():
    """Traced allocations (NumPy reports its buffers to tracemalloc): the whole-volume export holds the
    resampled ``K x volume`` logits (float16) and a float64 channel at once; the export by rows holds a
    step, so its peak above the label map and the input is a small fraction of that."""
    import tracemalloc

    dataset_json = ps.make_dataset_json(n_labels=12)
    case = next(c for c in CASES if c.name == "resampled_transposed_cropped")
    _, config, props, _ = _setup(case, dataset_json, np.random.default_rng(2))
    cropped = (36, 40, 44)  # transposed order; the case's spacing, so the logits are resampled
    whole_box = tuple((0, s) for s in cropped)
    big = CaseProperties(spacing=props.spacing, shape_before_cropping=cropped, bbox=whole_box,
                         shape_after_cropping_and_before_resampling=cropped)
    spacing_t = [props.spacing[i] for i in config.transpose_forward]
    shape = compute_new_shape(cropped, spacing_t, config.spacing)
    heads = config.labels.num_segmentation_heads
    logits = (np.random.default_rng(3).standard_normal((heads, *shape)) * 3).astype(np.float16)
    out_voxels = int(np.prod(cropped))

    def peak(function):
        tracemalloc.start()
        try:
            result = function()
            return tracemalloc.get_traced_memory()[1], result
        finally:
            tracemalloc.stop()

    whole_peak, whole = peak(lambda: convert_logits_to_segmentation(logits, big, config))
    rows_peak, rows = peak(lambda: export_logits(logits, big, config, workers=2, step_bytes=2**17))
    assert rows.tobytes() == whole.tobytes()
    assert whole_peak > heads * out_voxels * 2  # the resampled logits of the volume, float16
    assert rows_peak < whole_peak / 4, (rows_peak, whole_peak)
