"""The orchestrator's fold loop alone, NumPy arrays against torch tensors, side by side in one run.

Times ``pipeline.orchestration.predict_folds_async`` (padding, tiling, flips, TTA mean, Gaussian weighting,
fp16 accumulation, fold average) with a network that costs nothing (it hands back stored outputs), so the
numbers are the loop's own cost on this machine's CPU with one thread, as the orchestrator runs it.
Both paths give the same bits (tests/unit/test_device_path.py).

    python -m tools.perf.fold_loop
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np
import torch

from nnunet_triton.numerics.gaussian import compute_gaussian
from nnunet_triton.numerics.window import SlidingWindowSettings
from nnunet_triton.parameters import DEFAULT_MAX_INFLIGHT, DEFAULT_TILE_BATCH_SIZE
from nnunet_triton.pipeline.orchestration import predict_folds_async

CASES = (  # (name, patch, heads, preprocessed shape, mirror axes, folds)
    ("fixture, 2 folds, mirroring", (24, 32, 32), 3, (31, 46, 49), (0, 1, 2), 2),
    ("default plans, 1 tile, 1 fold, mirroring", (112, 160, 128), 3, (110, 158, 126), (0, 1, 2), 1),
    ("default plans, 2 tiles, 5 folds, no mirroring", (112, 160, 128), 3, (220, 158, 126), None, 5),
)


def _time(data, outputs, patch: Sequence[int], heads: int, mirror, folds: int, reps: int) -> float:
    window = SlidingWindowSettings(patch_size=patch, num_heads=heads, mirror_axes=mirror,
                                   batch_size=DEFAULT_TILE_BATCH_SIZE, max_inflight=DEFAULT_MAX_INFLIGHT,
                                   gaussian=compute_gaussian(patch))

    async def infer(x):
        n = x.shape[0]
        return outputs[:n].clone() if isinstance(outputs, torch.Tensor) else outputs[:n].copy()

    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        asyncio.run(predict_folds_async(data, [infer] * folds, window))
        best = min(best, time.perf_counter() - start)
    return best


def main(reps: int = 2) -> int:
    torch.set_num_threads(1)  # the orchestrator's setting
    rng = np.random.default_rng(0)
    print("| case | NumPy s | torch s | torch / NumPy |\n|---|---:|---:|---:|")
    for name, patch, heads, shape, mirror, folds in CASES:
        data = rng.standard_normal((1, *shape)).astype(np.float32)
        outputs = rng.standard_normal((4, heads, *patch)).astype(np.float32)
        t_np = _time(data, outputs, patch, heads, mirror, folds, reps)
        t_torch = _time(torch.from_numpy(data), torch.from_numpy(outputs), patch, heads, mirror, folds, reps)
        print(f"| {name} | {t_np:.3f} | {t_torch:.3f} | {t_torch / t_np:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
