"""nnU-Net's own predictor, set up the one way this project compares against it.

``nnUNetPredictor`` with nnU-Net's defaults (Gaussian weighting), on the CPU unless told otherwise, no
progress bars, loaded from a trained model folder: ``validate``'s reference, the parity tests' oracle
and the benchmarks' baseline all come from :func:`nnunet_predictor`. torch and nnU-Net are imported
when it is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE

__all__ = ["nnunet_predictor"]


def nnunet_predictor(model_folder: str | Path, *, folds: Sequence[int | str] | None = None,
                     mirroring: bool = True, tile_step_size: float = DEFAULT_TILE_STEP_SIZE,
                     device: str = "cpu") -> Any:
    """An ``nnUNetPredictor`` initialised from ``model_folder`` (``folds``: None = the folds it finds).

    ``device`` "cpu" keeps everything on the host (``perform_everything_on_device=False``), as an nnU-Net
    process on a CPU server runs; a "cuda" device runs everything on the GPU, nnU-Net's GPU default.
    """
    import torch
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    predictor = nnUNetPredictor(
        tile_step_size=tile_step_size, use_gaussian=True, use_mirroring=mirroring,
        perform_everything_on_device=device.startswith("cuda"), device=torch.device(device), verbose=False,
        verbose_preprocessing=False, allow_tqdm=False,
    )
    predictor.initialize_from_trained_model_folder(str(model_folder),
                                                   use_folds=tuple(folds) if folds is not None else None)
    return predictor
