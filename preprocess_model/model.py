"""Triton Python model ``preprocess_model``: IMAGE + SPACING -> PREPROCESSED + CASE_PROPERTIES.

A thin adapter around :func:`nnunet_triton.preprocess.preprocess_case` (nnU-Net's
``DefaultPreprocessor.run_case_npy``). It also validates the request parameters (the per-request
options, forwarded by the ``nnunet`` ensemble to every step) so that a bad option fails before any
expensive work. Each request is answered on its own: a bad one gets an INVALID_ARG response, the others
of the same batch are unaffected.

I/O (``max_batch_size: 0``):
    IN  IMAGE            FP32 [C, *spatial]  reader axis order (SimpleITK: z, y, x)
    IN  SPACING          FP64 [n_spatial]    same axis order
    OUT PREPROCESSED     FP32 [C, *resampled] transposed axis order, normalized
    OUT CASE_PROPERTIES  FP64 [-1]           CaseProperties.to_array()
"""

from __future__ import annotations

from pathlib import Path

from nnunet_triton import io_names, serving
from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.orchestration import parse_request_options
from nnunet_triton.plans import InferenceConfig
from nnunet_triton.preprocess import preprocess_case

CONFIG_FILE = "inference_config.json"


class TritonPythonModel:
    """Preprocessing step of the ``nnunet`` ensemble."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import triton_python_backend_utils as pb_utils

            self._logger = pb_utils.Logger
            self._config = InferenceConfig.from_json((Path(__file__).parent / CONFIG_FILE).read_text())
        except Exception:
            raise serving.initialize_exception(args["model_name"]) from None

    def execute(self, requests: list) -> list:
        return [self._run(request) for request in requests]

    def _run(self, request: object) -> object:
        try:
            parse_request_options(serving.request_parameters(request), self._config)
            image = serving.input_array(request, io_names.IMAGE)
            spacing = serving.input_array(request, io_names.SPACING)
            data, props = preprocess_case(image, spacing, self._config)
            return serving.ok_response(
                {io_names.PREPROCESSED: data, io_names.CASE_PROPERTIES: props.to_array()}
            )
        except NnunetTritonError as exc:
            return serving.error_response(exc)
        except Exception as exc:
            return serving.internal_error_response(exc, self._logger)
