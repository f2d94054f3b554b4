"""The whole inference of one model folder in this process, under a chosen release's numerics.

What the served pipeline does, without Triton: ``numerics.preprocess.preprocess_case``, nnU-Net's sliding
window per fold (``numerics.sliding_window.predict_sliding_window``; each tile and each mirrored copy its own
batch-1 forward of the fold's eager network on the CPU, as ``nnUNetPredictor``), the fold fusion
(``sliding_window.FoldAverage``) and the export (``numerics.prediction_export``), each taking the release's
variant from ``numerics.releases``. ``validate --detect-release`` re-predicts a folder's validation cases
with it under every release's numerics; tests compare it with the old releases' own predictors.

The fold networks come from ``load_network(model_dir, fold)`` (the CLI passes the builder's
``load_fold_network``, which rebuilds them as ``nnUNetPredictor`` does); torch is imported when predicting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.errors import UnsupportedModelError
from nnunet_triton.numerics.model_folder import read_model_folder
from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation
from nnunet_triton.numerics.preprocess import preprocess_case
from nnunet_triton.numerics.releases import release_numerics
from nnunet_triton.numerics.sliding_window import FoldAverage, predict_sliding_window
from nnunet_triton.numerics.window import SlidingWindowSettings
from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE, RequestOptions

__all__ = ["LocalPredictor"]


class LocalPredictor:
    """A model folder's folds, loaded once, predicting cases under any release's numerics.

    Args:
        model_dir: the nnU-Net results folder (one configuration; a cascade stage is refused).
        load_network: ``load_network(model_dir, fold)`` returns the fold's eager network (eval mode, CPU).
        folds: the folds to use (None: every ``fold_<k>`` with a final checkpoint).
        mirroring: test-time mirroring over the checkpoint's axes (nnU-Net's default).
        tile_step_size: nnU-Net's ``tile_step_size``.
    """

    def __init__(self, model_dir: str | Path, load_network: Callable[[Path, int | str], Any], *,
                 folds: Sequence[int | str] | None = None, mirroring: bool = True,
                 tile_step_size: float = DEFAULT_TILE_STEP_SIZE) -> None:
        self.config = read_model_folder(model_dir, folds=folds)
        if self.config.previous_stage is not None:
            raise UnsupportedModelError(
                f"{str(model_dir)!r} is a cascade stage; the local predictor runs one configuration.")
        self.options = RequestOptions(mirroring=mirroring, tile_step_size=tile_step_size)
        self.networks = [load_network(Path(model_dir), fold) for fold in self.config.folds]

    def predict(self, image: np.ndarray, spacing: Sequence[float], *,
                numerics: str | None = None) -> np.ndarray:
        """The label map of ``image`` (C, Z, Y, X, reader order) under ``numerics`` (default: 2.8)."""
        import torch

        config = replace(self.config, numerics=release_numerics(numerics).name)
        data, props = preprocess_case(np.asarray(image), spacing, config)
        window = SlidingWindowSettings.for_request(config, self.options)
        fusion = FoldAverage(len(self.networks), divide_each_fold=release_numerics(numerics).divide_each_fold)
        for network in self.networks:

            def forward(x: np.ndarray, network: Any = network) -> np.ndarray:
                with torch.inference_mode():
                    return network(torch.from_numpy(np.ascontiguousarray(x))).numpy()

            fusion.add(predict_sliding_window(data, forward, window))
        return convert_logits_to_segmentation(fusion.finalize(), props, config)
