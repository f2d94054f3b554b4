"""Triton Python model ``combine_model``: the last step of an ensemble of configurations.

``nnUNetv2_ensemble`` behind the one endpoint: every member pipeline (``member<i>_preprocess_model`` ->
``member<i>_orchestrator_model`` -> ``member<i>_stitch_model``, which always returns PROBABILITIES in the
original geometry) feeds ``PROBABILITIES_<i>``; this model averages them in member order
(:func:`nnunet_triton.numerics.ensembling.average_probabilities`), converts them to the segmentation like
``LabelManager.convert_probabilities_to_segmentation``, and applies the ensemble's postprocessing
(``postprocessing.json`` next to this file, from nnU-Net's ``postprocessing.pkl``) unless the request
parameter ``postprocessing`` is false. PROBABILITIES (the average) are returned only when the request
parameter ``probabilities`` is true.

I/O (``max_batch_size: 0``):
    IN  PROBABILITIES_<i>  FP32 [K, *spatial], one per member
    OUT SEGMENTATION       UINT8 or UINT16 [*spatial]
    OUT PROBABILITIES      FP32 [K, *spatial], only when requested
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nnunet_triton import io_names, serving
from nnunet_triton.errors import NnunetTritonError, PlansError
from nnunet_triton.numerics.ensembling import average_probabilities, segmentation_from_probabilities
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.postprocessing import apply_postprocessing, load_deployed_postprocessing
from nnunet_triton.options import RequestOptions


def _member_inputs(model_config: dict[str, Any]) -> list[str]:
    names = [t["name"] for t in model_config.get("input", [])]
    expected = [io_names.member_probabilities(i) for i in range(len(names))]
    if len(names) < 2 or names != expected:
        raise PlansError(f"combine_model inputs must be {expected} (two or more members), got {names}.")
    return names



class TritonPythonModel:
    """Averages the members' probabilities of one request."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import triton_python_backend_utils as pb_utils

            self._logger = pb_utils.Logger
            here = Path(__file__).parent
            self._config = InferenceConfig.load(here)
            model_config = json.loads(args["model_config"])
            self._inputs = _member_inputs(model_config)
            self._seg_dtype = serving.declared_segmentation_dtype(model_config)
            self._postprocessing = load_deployed_postprocessing(Path(__file__).parent)
            self._metrics = serving.StepMetrics.create(args, self._config)
        except Exception:
            raise serving.initialize_exception(args["model_name"]) from None

    def execute(self, requests: list) -> list:
        return [self._metrics.observe(self._run, request) for request in requests]

    def _run(self, request: Any, record: serving.RequestRecord) -> Any:
        try:
            options = RequestOptions.from_parameters(serving.request_parameters(request), self._config)
            members = [serving.input_array(request, n) for n in self._inputs]
            with record.timed():
                probabilities = average_probabilities(members)
                segmentation = segmentation_from_probabilities(probabilities, self._config.labels)
                segmentation = segmentation.astype(self._seg_dtype, copy=False)
                if self._postprocessing is not None and options.postprocessing:
                    segmentation = apply_postprocessing(segmentation, self._postprocessing)
            outputs = {io_names.SEGMENTATION: segmentation}
            if options.probabilities:
                outputs[io_names.PROBABILITIES] = probabilities
            return serving.ok_response(outputs)
        except NnunetTritonError as exc:
            return serving.error_response(exc)
        except Exception as exc:
            return serving.internal_error_response(exc, self._logger)
