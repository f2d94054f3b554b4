"""Step 1, ``preprocess_model``: IMAGE + SPACING -> PREPROCESSED + CASE_PROPERTIES.

Runs :func:`nnunet_triton.numerics.preprocess.preprocess_case` (nnU-Net's
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
not exceed it (``numerics.limits.check_request_memory``), checked at the same point.

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

from collections.abc import Mapping
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.numerics._xp import to_numpy
from nnunet_triton.numerics.limits import check_voxel_limit
from nnunet_triton.numerics.preprocess import preprocess_case
from nnunet_triton.numerics.slab_export import exports_by_rows
from nnunet_triton.options import RequestOptions
from nnunet_triton.parameters import PreprocessParameters
from nnunet_triton.serving.metrics import RequestRecord
from nnunet_triton.serving.steps.base import Step, triton_model
from nnunet_triton.serving.tensors import image_array, input_array

__all__ = ["PreprocessStep", "TritonPythonModel"]


class PreprocessStep(Step):
    """Preprocessing step of the ``nnunet`` ensemble."""

    def setup(self) -> None:
        self.device.activate()
        params = PreprocessParameters.from_parameters(self.parameters)
        self.limits = {"max_voxels": params.max_voxels, "max_request_bytes": params.max_request_bytes}
        # the stitch model exports by rows on a CPU server: K x the original volume only with probabilities
        self.whole_volume_export = not exports_by_rows(self.config, gpu=self.device.gpu)

    def inputs(self, request: Any, record: RequestRecord) -> dict[str, Any]:
        image = image_array(request)  # IMAGE or IMAGE_<dtype>; preprocess_case casts to float32
        check_voxel_limit(io_names.IMAGE, image.shape, self.limits["max_voxels"])
        spacing = to_numpy(input_array(request, io_names.SPACING))  # on the host
        # a cascade stage: the previous stage's segmentation becomes one-hot input channels
        previous = input_array(request, io_names.PREVIOUS_SEGMENTATION) \
            if self.config.previous_stage is not None else None
        return {io_names.IMAGE: self.device.array(image), io_names.SPACING: spacing,
                io_names.PREVIOUS_SEGMENTATION: self.device.array(previous)}

    def run(self, arrays: Mapping[str, Any], options: RequestOptions,
            record: RequestRecord) -> dict[str, Any]:
        data, props = preprocess_case(arrays[io_names.IMAGE], arrays[io_names.SPACING], self.config,
                                      previous_segmentation=arrays[io_names.PREVIOUS_SEGMENTATION],
                                      original_geometry=options.probabilities or self.whole_volume_export,
                                      **self.limits)
        return {io_names.PREPROCESSED: data, io_names.CASE_PROPERTIES: props.to_array()}


TritonPythonModel = triton_model(PreprocessStep)
