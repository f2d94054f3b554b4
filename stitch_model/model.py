"""Triton Python model ``stitch_model``: LOGITS + CASE_PROPERTIES -> SEGMENTATION (+ PROBABILITIES).

A thin adapter around
:func:`nnunet_triton.numerics.prediction_export.convert_logits_to_segmentation` (nnU-Net's
``convert_predicted_logits_to_segmentation_with_correct_shape``): resample the fold-averaged logits back
to the cropped original geometry, argmax (or region thresholds), uncrop, transpose back.

PROBABILITIES are computed only when the request parameter ``probabilities`` is true. A flag is needed
because an ensemble always asks a composing model for every output in its ``output_map``
(``requested_output_names`` lists PROBABILITIES even when the client did not ask for it); when the flag
is off the output is simply left out of the response, which the ensemble accepts (checked on 2.51).
On a KIND_GPU instance (``serving.InstanceDevice``) LOGITS are read in device memory (copied there when
they arrive on the host) and resampling, softmax/argmax, postprocessing and uncropping run with CuPy;
only SEGMENTATION (and PROBABILITIES when asked) are copied back to host memory. On KIND_CPU everything is
NumPy.

The repository's postprocessing (nnU-Net's ``postprocessing.pkl``, stored as ``postprocessing.json``
next to this file by the builder) is applied to SEGMENTATION unless the request parameter
``postprocessing`` is false; PROBABILITIES are never postprocessed, as in nnU-Net.
Custom metrics (``serving.StepMetrics``, docs/deploy.md "Metrics") time the conversion and postprocessing.

I/O (``max_batch_size: 0``):
    IN  LOGITS           FP16 [K, *resampled]
    IN  CASE_PROPERTIES  FP64 [-1]
    OUT SEGMENTATION     UINT8 or UINT16 (as declared in config.pbtxt) [*spatial], reader axis order
    OUT PROBABILITIES    FP32 [K, *spatial], only when requested
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton import io_names, serving
from nnunet_triton.errors import NnunetTritonError, PlansError
from nnunet_triton.numerics._xp import to_numpy
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.postprocessing import apply_postprocessing, load_deployed_postprocessing
from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation
from nnunet_triton.numerics.preprocess import CaseProperties
from nnunet_triton.options import ProbabilitiesOutput, RequestOptions
from nnunet_triton.parameters import StitchParameters


class TritonPythonModel:
    """Export step of the ``nnunet`` ensemble."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import triton_python_backend_utils as pb_utils

            self._logger = pb_utils.Logger
            self._device = serving.InstanceDevice.from_args(args)
            self._device.activate()
            self._config = InferenceConfig.load(Path(__file__).parent)
            self._seg_dtype = serving.declared_segmentation_dtype(json.loads(args["model_config"]))
            max_label = self._config.labels.max_label
            if max_label > np.iinfo(self._seg_dtype).max:
                raise PlansError(
                    f"output {io_names.SEGMENTATION!r} is {self._seg_dtype} but the model has label "
                    f"{max_label}."
                )
            self._metrics = serving.StepMetrics.create(args, self._config, host_tensors=(io_names.LOGITS,))
            # config parameter probabilities_output (request / always / never: parameters.StitchParameters)
            params = StitchParameters.from_parameters(serving.model_parameters(args))
            self._probabilities_output = params.probabilities_output
            self._postprocessing = load_deployed_postprocessing(Path(__file__).parent)
        except Exception:
            raise serving.initialize_exception(args["model_name"]) from None

    def execute(self, requests: list) -> list:
        return [self._metrics.observe(self._run, request) for request in requests]

    def _run(self, request: Any, record: serving.RequestRecord) -> Any:
        try:
            options = RequestOptions.from_parameters(serving.request_parameters(request), self._config)
            logits = self._device.array(
                serving.input_array(request, io_names.LOGITS, on_host=self._device.watch(record)))
            props = CaseProperties.from_array(  # a few numbers: read on the host wherever they arrive
                to_numpy(serving.input_array(request, io_names.CASE_PROPERTIES)))
            want_probabilities = self._probabilities_output is ProbabilitiesOutput.ALWAYS or (
                options.probabilities and self._probabilities_output is ProbabilitiesOutput.REQUEST
            )
            with record.timed():
                result = convert_logits_to_segmentation(
                    logits, props, self._config, return_probabilities=want_probabilities
                )
                segmentation, probabilities = result if want_probabilities else (result, None)
                segmentation = segmentation.astype(self._seg_dtype, copy=False)
                if self._postprocessing is not None and options.postprocessing:
                    segmentation = apply_postprocessing(segmentation, self._postprocessing)
            outputs = {io_names.SEGMENTATION: to_numpy(segmentation)}  # results go back to host memory
            if probabilities is not None:
                outputs[io_names.PROBABILITIES] = to_numpy(probabilities)
            return serving.ok_response(outputs)
        except NnunetTritonError as exc:
            return serving.error_response(exc)
        except Exception as exc:
            return serving.internal_error_response(exc, self._logger)
