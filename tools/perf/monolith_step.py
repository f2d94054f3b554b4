"""``nnunet_monolith``: the one-model baseline of the benchmarks, nnUNetPredictor wrapped whole.

What a user would write without this project: one Python model whose ``execute`` calls
``nnUNetPredictor.predict_single_npy_array`` (nnunetv2/inference/predict_from_raw_data.py) per
request, on CPU. It exists only to be benchmarked against the ``nnunet`` ensemble (``make perf``), so it
lives with the benchmarks, not in the package; it has the endpoint's I/O (IMAGE FP32 [C, z, y, x],
SPACING FP64 [3] -> SEGMENTATION, PROBABILITIES only when asked) and reads the same request parameters
(``mirroring``, ``tile_step_size``, ``folds``, ``probabilities``, validated by
``nnunet_triton.options.RequestOptions.from_parameters``). Requests run one after another per instance:
preprocessing, every fold's sliding window and the export share one thread of control, as in nnU-Net.

This file is the model's ``model.py``: ``tools/perf/monolith.py`` copies it whole into the repository,
so it imports the installed package only, never ``tools``. Files next to it: ``inference_config.json``
(the deployed folds) and ``nnunet_model/`` (plans.json, dataset.json, fold_<k>/checkpoint_final.pth).

Config parameters: ``torch_num_threads`` ("0" keeps torch's default, one thread per core, like an
nnU-Net process). The device follows the instance kind: KIND_GPU runs nnUNetPredictor on that GPU
with ``perform_everything_on_device=True`` (nnU-Net's GPU default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from nnunet_triton import io_names
from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE, RequestOptions
from nnunet_triton.parameters import FoldRunnerParameters
from nnunet_triton.serving.metrics import RequestRecord
from nnunet_triton.serving.steps.base import Step, triton_model
from nnunet_triton.serving.steps.fold_runner import _tensor_config
from nnunet_triton.serving.tensors import input_array

__all__ = ["MODEL_DIR", "MonolithStep", "TritonPythonModel"]

MODEL_DIR = "nnunet_model"


class MonolithStep(Step):
    """nnUNetPredictor behind the endpoint's tensors."""

    def setup(self) -> None:
        import torch
        from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

        from nnunet_triton.dtypes import numpy_dtype

        threads = FoldRunnerParameters.from_parameters(self.parameters).torch_num_threads
        if threads:
            torch.set_num_threads(threads)
        self.predictor = nnUNetPredictor(
            tile_step_size=DEFAULT_TILE_STEP_SIZE, use_gaussian=True, use_mirroring=True,
            perform_everything_on_device=self.device.gpu, device=torch.device(self.device.torch_device),
            verbose=False, verbose_preprocessing=False, allow_tqdm=False,
        )
        self.predictor.initialize_from_trained_model_folder(str(self.model_dir / MODEL_DIR),
                                                            use_folds=self.config.folds)
        self.weights = dict(zip(self.config.folds, self.predictor.list_of_parameters, strict=True))
        segmentation = _tensor_config(self.model_config, "output", io_names.SEGMENTATION)
        self.segmentation_dtype = numpy_dtype(segmentation["data_type"])

    def inputs(self, request: Any, record: RequestRecord) -> dict[str, Any]:
        return {io_names.IMAGE: input_array(request, io_names.IMAGE),  # nnU-Net's preprocessing copies it
                io_names.SPACING: input_array(request, io_names.SPACING)}

    def run(self, arrays: Mapping[str, Any], options: RequestOptions,
            record: RequestRecord) -> dict[str, Any]:
        predictor = self.predictor
        predictor.use_mirroring = options.mirroring
        predictor.tile_step_size = options.tile_step_size
        predictor.list_of_parameters = [self.weights[fold] for fold in options.folds]
        spacing = [float(s) for s in arrays[io_names.SPACING]]
        result = predictor.predict_single_npy_array(arrays[io_names.IMAGE], {"spacing": spacing}, None, None,
                                                    options.probabilities)
        segmentation, probabilities = result if options.probabilities else (result, None)
        segmentation = np.asarray(segmentation).astype(self.segmentation_dtype, copy=False)
        outputs = {io_names.SEGMENTATION: segmentation}
        if probabilities is not None:
            outputs[io_names.PROBABILITIES] = np.asarray(probabilities, dtype=np.float32)
        return outputs


TritonPythonModel = triton_model(MonolithStep)
