"""Step 4, ``stitch_model``: LOGITS + CASE_PROPERTIES -> SEGMENTATION (+ PROBABILITIES).

Runs nnU-Net's ``convert_predicted_logits_to_segmentation_with_correct_shape``: resample the
fold-averaged logits back to the cropped original geometry, argmax (or region thresholds), uncrop,
transpose back. On the host (NumPy) it runs by ranges of output rows
(:func:`nnunet_triton.numerics.slab_export.export_logits`, the same bits): the resampled logits exist one
step at a time instead of ``K x volume`` at once, and ``NNUNET_TRITON_EXPORT_THREADS`` threads (default:
every available CPU, ``pipeline.threads.export_threads``) export ranges side by side. On the GPU it runs
on the whole volume (:func:`nnunet_triton.numerics.prediction_export.convert_logits_to_segmentation`).

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

from collections.abc import Mapping
from typing import Any

import numpy as np

from nnunet_triton import io_names
from nnunet_triton.errors import PlansError
from nnunet_triton.numerics._xp import is_cupy_array, to_numpy
from nnunet_triton.numerics.limits import check_request_memory, check_stitch_request
from nnunet_triton.numerics.postprocessing import apply_postprocessing, load_deployed_postprocessing
from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation
from nnunet_triton.numerics.preprocess import CaseProperties
from nnunet_triton.numerics.slab_export import export_logits, exports_by_rows
from nnunet_triton.options import ProbabilitiesOutput, RequestOptions
from nnunet_triton.parameters import StitchParameters
from nnunet_triton.pipeline.threads import export_threads
from nnunet_triton.serving.metrics import RequestRecord
from nnunet_triton.serving.steps.base import Step, triton_model
from nnunet_triton.serving.tensors import declared_segmentation_dtype, input_array

__all__ = ["StitchStep", "TritonPythonModel"]


class StitchStep(Step):
    """Export step of the ``nnunet`` ensemble."""

    host_tensors = (io_names.LOGITS,)

    def setup(self) -> None:
        self.device.activate()
        self.seg_dtype = declared_segmentation_dtype(self.model_config)
        max_label = self.config.labels.max_label
        if max_label > np.iinfo(self.seg_dtype).max:
            raise PlansError(
                f"output {io_names.SEGMENTATION!r} is {self.seg_dtype} but the model has label {max_label}."
            )
        # config parameter probabilities_output (request / always / never: parameters.StitchParameters)
        self.probabilities_output = StitchParameters.from_parameters(self.parameters).probabilities_output
        self.postprocessing = load_deployed_postprocessing(self.model_dir)
        self.limits = StitchParameters.from_parameters(self.parameters)
        self.export_threads = export_threads()
        # a K x original-volume array for every request (GPU, spline orders), or only with probabilities
        self.whole_volume_export = not exports_by_rows(self.config, gpu=self.device.gpu)

    def inputs(self, request: Any, record: RequestRecord) -> dict[str, Any]:
        logits = input_array(request, io_names.LOGITS, on_host=self.device.watch(record))
        props = CaseProperties.from_array(  # a few numbers: read on the host wherever they arrive
            to_numpy(input_array(request, io_names.CASE_PROPERTIES)))
        check_stitch_request(logits.shape, shape_before_cropping=props.shape_before_cropping, bbox=props.bbox,
                             shape_after_cropping=props.shape_after_cropping_and_before_resampling,
                             num_heads=self.config.labels.num_segmentation_heads,
                             max_voxels=self.limits.max_voxels,
                             max_request_bytes=self.limits.max_request_bytes,
                             original_geometry=self.whole_volume_export)
        return {io_names.LOGITS: self.device.array(logits), io_names.CASE_PROPERTIES: props}

    def run(self, arrays: Mapping[str, Any], options: RequestOptions,
            record: RequestRecord) -> dict[str, Any]:
        want_probabilities = self.probabilities_output is ProbabilitiesOutput.ALWAYS or (
            options.probabilities and self.probabilities_output is ProbabilitiesOutput.REQUEST
        )
        logits, props = arrays[io_names.LOGITS], arrays[io_names.CASE_PROPERTIES]
        if want_probabilities and not self.whole_volume_export:  # inputs() left the probabilities out
            check_request_memory(self.config.labels.num_segmentation_heads, logits.shape[1:],
                                 props.shape_before_cropping, self.limits.max_request_bytes)
        if not is_cupy_array(logits):
            result = export_logits(logits, props, self.config, return_probabilities=want_probabilities,
                                   workers=self.export_threads)
        else:
            result = convert_logits_to_segmentation(logits, props, self.config,
                                                    return_probabilities=want_probabilities)
        segmentation, probabilities = result if want_probabilities else (result, None)
        segmentation = segmentation.astype(self.seg_dtype, copy=False)
        if self.postprocessing is not None and options.postprocessing:
            segmentation = apply_postprocessing(segmentation, self.postprocessing)
        outputs = {io_names.SEGMENTATION: segmentation}
        if probabilities is not None:
            outputs[io_names.PROBABILITIES] = probabilities
        return outputs

    def outputs(self, result: dict[str, Any]) -> dict[str, Any]:
        return {name: to_numpy(array) for name, array in result.items()}  # results go back to host memory


TritonPythonModel = triton_model(StitchStep)
