"""Triton Python model ``nnunet_monolith``: the one-model baseline, nnUNetPredictor wrapped whole.

What a user would write without this project: one Python model whose ``execute`` calls
``nnUNetPredictor.predict_single_npy_array`` (nnunetv2/inference/predict_from_raw_data.py) per
request, on CPU. It exists to be benchmarked against the ``nnunet`` ensemble (tools/perf), so it has
the endpoint's I/O (IMAGE FP32 [C, z, y, x], SPACING FP64 [3] -> SEGMENTATION, PROBABILITIES only when
asked) and reads the same request parameters (``mirroring``, ``tile_step_size``, ``folds``,
``probabilities``, validated by ``nnunet_triton.options.RequestOptions.from_parameters``). Requests run
one after another per instance: preprocessing, every fold's sliding window and the export share one
thread of control, as in nnU-Net.

Files next to this one (written by ``tools/perf/monolith.py``): ``inference_config.json`` (the
deployed folds) and ``nnunet_model/`` (plans.json, dataset.json, fold_<k>/checkpoint_final.pth).

Config parameters: ``torch_num_threads`` ("0" keeps torch's default, one thread per core, like an
nnU-Net process). The device follows the instance kind: KIND_GPU runs nnUNetPredictor on that GPU
with ``perform_everything_on_device=True`` (nnU-Net's GPU default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton import io_names, serving
from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.options import RequestOptions
from nnunet_triton.parameters import FoldRunnerParameters

MODEL_DIR = "nnunet_model"


class TritonPythonModel:
    """nnUNetPredictor behind the endpoint's tensors."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import torch
            import triton_python_backend_utils as pb_utils
            from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

            self._logger = pb_utils.Logger
            here = Path(__file__).parent
            self._config = InferenceConfig.load(here)
            threads = FoldRunnerParameters.from_parameters(serving.model_parameters(args)).torch_num_threads
            if threads:
                torch.set_num_threads(threads)
            device = serving.InstanceDevice.from_args(args)
            self._predictor = nnUNetPredictor(
                tile_step_size=0.5, use_gaussian=True, use_mirroring=True,
                perform_everything_on_device=device.gpu, device=torch.device(device.torch_device),
                verbose=False, verbose_preprocessing=False, allow_tqdm=False,
            )
            self._predictor.initialize_from_trained_model_folder(str(here / MODEL_DIR),
                                                                 use_folds=self._config.folds)
            self._weights = dict(zip(self._config.folds, self._predictor.list_of_parameters, strict=True))
            segmentation = pb_utils.get_output_config_by_name(json.loads(args["model_config"]),
                                                              io_names.SEGMENTATION)
            self._segmentation_dtype = pb_utils.triton_string_to_numpy(segmentation["data_type"])
        except Exception:
            raise serving.initialize_exception(args["model_name"]) from None

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(self._segment(request))
            except NnunetTritonError as exc:
                responses.append(serving.error_response(exc))
            except Exception as exc:
                responses.append(serving.internal_error_response(exc, self._logger))
        return responses

    def _segment(self, request: Any) -> Any:
        options = RequestOptions.from_parameters(serving.request_parameters(request), self._config)
        image = serving.input_array(request, io_names.IMAGE)  # nnU-Net's preprocessing copies it
        spacing = serving.input_array(request, io_names.SPACING)
        predictor = self._predictor
        predictor.use_mirroring = options.mirroring
        predictor.tile_step_size = options.tile_step_size
        predictor.list_of_parameters = [self._weights[fold] for fold in options.folds]
        result = predictor.predict_single_npy_array(
            image, {"spacing": [float(s) for s in spacing]}, None, None, options.probabilities
        )
        segmentation, probabilities = result if options.probabilities else (result, None)
        segmentation = np.asarray(segmentation).astype(self._segmentation_dtype, copy=False)
        outputs = {io_names.SEGMENTATION: segmentation}
        if probabilities is not None:
            outputs[io_names.PROBABILITIES] = np.asarray(probabilities, dtype=np.float32)
        return serving.ok_response(outputs)
