"""Triton Python model ``preprocess_model``: IMAGE + SPACING -> PREPROCESSED + CASE_PROPERTIES.

A thin adapter around :func:`nnunet_triton.numerics.preprocess.preprocess_case` (nnU-Net's
``DefaultPreprocessor.run_case_npy``). It also validates the request parameters (the per-request
options, forwarded by the ``nnunet`` ensemble to every step) so that a bad option fails before any
expensive work. Each request is answered on its own: a bad one gets an INVALID_ARG response, the others
of the same batch are unaffected. Custom metrics (``serving.StepMetrics``, docs/deploy.md "Metrics")
time ``preprocess_case``.

On a KIND_GPU instance (``serving.InstanceDevice``) IMAGE is copied to the instance's GPU once (or taken
where it already is, e.g. CUDA shared memory) and ``preprocess_case`` runs with CuPy; PREPROCESSED leaves
as a device tensor (DLPack) for the orchestrator. On KIND_CPU everything is NumPy.

Config parameter ``max_voxels`` (``nnunet_triton.numerics.limits``; 0 = no limit): the IMAGE input and the
resampled volume (C x the shape nnU-Net resamples to) may hold at most that many voxels; larger requests
get INVALID_ARG naming the tensor, its voxel count and the limit before preprocessing allocates anything.
Config parameter ``max_request_bytes`` (0 = none): the request's float32 logits and probabilities may
not exceed it (``validation.check_request_memory``), checked at the same point.

In a cascade stage (``previous_stage`` in the configuration) the previous stage's SEGMENTATION arrives as
PREVIOUS_SEGMENTATION and :func:`nnunet_triton.numerics.preprocess.preprocess_case` appends its one-hot
encoding (nnU-Net's data iterators) to the preprocessed image.

I/O (``max_batch_size: 0``):
    IN  IMAGE            FP32 [C, *spatial]  reader axis order (SimpleITK: z, y, x); or, instead,
        IMAGE_FP16 / IMAGE_INT16 / IMAGE_UINT16 / IMAGE_UINT8 (all optional, exactly one per request: the
        typed endpoints nnunet_int16, ... map IMAGE onto them; the values are cast to float32 exactly)
    IN  SPACING          FP64 [n_spatial]    same axis order
    IN  PREVIOUS_SEGMENTATION UINT8/16 [*spatial]  cascade stages only
    OUT PREPROCESSED     FP32 [C (+K), *resampled] transposed axis order, normalized
    OUT CASE_PROPERTIES  FP64 [-1]           CaseProperties.to_array()
"""

from __future__ import annotations

from pathlib import Path

from nnunet_triton import io_names, serving
from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.numerics._xp import to_numpy
from nnunet_triton.numerics.limits import check_voxel_limit
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.preprocess import preprocess_case
from nnunet_triton.options import RequestOptions
from nnunet_triton.parameters import PreprocessParameters


class TritonPythonModel:
    """Preprocessing step of the ``nnunet`` ensemble."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import triton_python_backend_utils as pb_utils

            self._logger = pb_utils.Logger
            self._device = serving.InstanceDevice.from_args(args)
            self._device.activate()
            self._config = InferenceConfig.load(Path(__file__).parent)
            params = PreprocessParameters.from_parameters(serving.model_parameters(args))
            self._limits = {"max_voxels": params.max_voxels, "max_request_bytes": params.max_request_bytes}
            self._metrics = serving.StepMetrics.create(args, self._config)
        except Exception:
            raise serving.initialize_exception(args["model_name"]) from None

    def execute(self, requests: list) -> list:
        return [self._metrics.observe(self._run, request) for request in requests]

    def _run(self, request: object, record: serving.RequestRecord) -> object:
        try:
            RequestOptions.from_parameters(serving.request_parameters(request), self._config)
            image = serving.image_array(request)  # IMAGE or IMAGE_<dtype>; preprocess_case casts to float32
            check_voxel_limit(io_names.IMAGE, image.shape, self._limits["max_voxels"])
            spacing = to_numpy(serving.input_array(request, io_names.SPACING))  # on the host
            # a cascade stage: the previous stage's segmentation becomes one-hot input channels
            previous = serving.input_array(request, io_names.PREVIOUS_SEGMENTATION) \
                if self._config.previous_stage is not None else None
            image, previous = self._device.array(image), self._device.array(previous)
            with record.timed():
                data, props = preprocess_case(image, spacing, self._config, previous_segmentation=previous,
                                              **self._limits)
            return serving.ok_response(
                {io_names.PREPROCESSED: data, io_names.CASE_PROPERTIES: props.to_array()}
            )
        except NnunetTritonError as exc:
            return serving.error_response(exc)
        except Exception as exc:
            return serving.internal_error_response(exc, self._logger)
