"""Stage (a) of ``tools.gpu_check``: every preprocessing, resampling, sliding-window and export function on
the committed fixture, NumPy against the device backend (CuPy on cuda; the sliding window on torch tensors of
the device), max abs differences against a tolerance. On CPU the xp functions compare NumPy with itself and
the sliding window compares torch CPU tensors with the NumPy loop (exact).

Each row feeds what production feeds: ``resize`` gets float64, as ``resample_data_or_seg_to_shape`` casts
before it (cupyx zoom works in its input's precision, coordinates included: float32 input is up to 4e-3
from SciPy's float64 for reasons production never meets). The exact rows (the sliding window) run with
deterministic cuDNN (``deterministic_cudnn``): the autotuner and non-deterministic algorithms would make two
runs of the same network differ. On CPU the xp rows compare NumPy with NumPy: they are reported
``skipped`` (verdict ``None``), never as passed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


@contextlib.contextmanager
def deterministic_cudnn() -> Iterator[None]:
    """cuDNN with deterministic algorithms and no autotuner for the block, the previous flags restored."""
    import torch

    flags = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags


def _max_abs(a: Any, b: Any) -> float:
    from nnunet_triton.numerics._xp import to_numpy

    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0



def stage_parity(stage: Any, setup: Any, model_dir: Path, case: Any, xp: Any, torchscript: Path) -> None:
    """Fill ``stage`` with one row per function: NumPy against ``xp`` (CuPy on cuda), the sliding window on
    torch tensors of the device against the NumPy loop, with the same fold network (``torchscript``)."""
    import torch

    from nnunet_triton.numerics._xp import to_numpy
    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation
    from nnunet_triton.numerics.preprocess import preprocess_case
    from nnunet_triton.numerics.resampling import resample_data_or_seg_to_shape, resize, resize_segmentation
    from nnunet_triton.numerics.sliding_window import predict_sliding_window
    from nnunet_triton.numerics.window import SlidingWindowSettings
    from nnunet_triton.pipeline.fold_runner import load_runner

    config = read_model_folder(model_dir)
    backend = "cupy" if setup.gpu else "numpy (dry run: NumPy against itself)"

    def row(function: str, diff: float, tolerance: float, what: str = "max abs") -> None:
        # NumPy against NumPy proves nothing: the row is skipped (None), not passed
        stage.rows.append({"function": function, "backend": backend, "metric": what, "value": diff,
                           "tolerance": tolerance, "ok": diff <= tolerance if setup.gpu else None})

    data, props = preprocess_case(case.image, case.spacing, config)
    data_d, props_d = preprocess_case(xp.asarray(case.image), case.spacing, config)
    row("preprocess_case (crop, normalize, resample)", _max_abs(data, data_d), 1e-4)
    image = case.image[0].astype(np.float64)  # what resample_data_or_seg_to_shape hands to resize
    shape = tuple(max(2, s * 3 // 4) for s in image.shape)
    row("resize (order 3, float64 as in production)",
        _max_abs(resize(image, shape, 3), resize(xp.asarray(image), shape, 3)), 1e-4)
    labels = (image > np.median(image)).astype(np.uint8)
    seg, seg_d = resize_segmentation(labels, shape, 1), resize_segmentation(xp.asarray(labels), shape, 1)
    row("resize_segmentation (order 1)", float(np.count_nonzero(to_numpy(seg) != to_numpy(seg_d))), 0,
        "differing voxels")
    anisotropic = (3.0, 0.8, 0.8)
    sep = resample_data_or_seg_to_shape(image[None], shape, anisotropic, (1.0,) * 3, order=3)
    sep_d = resample_data_or_seg_to_shape(xp.asarray(image[None]), shape, anisotropic, (1.0,) * 3, order=3)
    row("resample_data_or_seg_to_shape (separate z)", _max_abs(sep, sep_d), 1e-4)

    torch_device = "cuda:0" if setup.gpu else "cpu"
    runner = load_runner(torchscript, device=torch_device, max_forward_batch=1)

    def network(x: Any) -> Any:  # the same device forward for both loops: only the loops differ
        if isinstance(x, np.ndarray):
            return runner.forward(torch.from_numpy(x).to(torch_device)).cpu().numpy()
        return runner.forward(x)

    window = SlidingWindowSettings(patch_size=config.patch_size,
                                   num_heads=config.labels.num_segmentation_heads,
                                   mirror_axes=config.mirror_axes, batch_size=4)
    with deterministic_cudnn():  # an exact row: the same network must give the same tiles twice
        logits = predict_sliding_window(data, network, window)
        logits_d = predict_sliding_window(torch.from_numpy(data).to(torch_device), network, window)
    stage.rows.append({"function": "predict_sliding_window (tiles, TTA, Gaussian, fp16 sums; "
                                   "deterministic cuDNN)",
                       "backend": f"torch on {torch_device}", "metric": "max abs (fp16 logits)",
                       "value": _max_abs(logits, logits_d), "tolerance": 0.0,
                       "ok": _max_abs(logits, logits_d) == 0.0})
    seg, probs = convert_logits_to_segmentation(logits, props, config, return_probabilities=True)
    seg_d, probs_d = convert_logits_to_segmentation(xp.asarray(logits), props_d, config,
                                                    return_probabilities=True)
    row("convert_logits_to_segmentation: probabilities", _max_abs(probs, probs_d), 1e-4)
    row("convert_logits_to_segmentation: labels", float(np.count_nonzero(to_numpy(seg) != to_numpy(seg_d))),
        0, "differing voxels")
    if any(r["ok"] is False for r in stage.rows):
        stage.status = "failed"
    skipped = [r["function"] for r in stage.rows if r["ok"] is None]
    if skipped:
        stage.notes.append(f"skipped (NumPy against NumPy on this device, nothing compared): {len(skipped)} "
                           "rows; their ok column is None")


# --- (b) endpoint and (c) timings --------------------------------------------------------------------------
