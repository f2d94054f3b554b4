"""Step 5, ``combine_model``: the last step of an ensemble of configurations.

``nnUNetv2_ensemble`` behind the one endpoint: every member pipeline (``member<i>_preprocess_model`` ->
``member<i>_orchestrator_model`` -> ``member<i>_stitch_model``, which always returns PROBABILITIES in the
original geometry) feeds ``PROBABILITIES_<i>``; this model averages them in member order
(:func:`nnunet_triton.numerics.ensembling.average_probabilities`), converts them to the segmentation like
``LabelManager.convert_probabilities_to_segmentation``, and applies the ensemble's postprocessing
(``postprocessing.json`` next to the model's model.py, from nnU-Net's ``postprocessing.pkl``) unless the
request parameter ``postprocessing`` is false. PROBABILITIES (the average) are returned only when the request
parameter ``probabilities`` is true.

I/O (``max_batch_size: 0``):
    IN  PROBABILITIES_<i>  FP32 [K, *spatial], one per member
    OUT SEGMENTATION       UINT8 or UINT16 [*spatial]
    OUT PROBABILITIES      FP32 [K, *spatial], only when requested
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.errors import PlansError
from nnunet_triton.numerics.ensembling import average_probabilities, segmentation_from_probabilities
from nnunet_triton.numerics.postprocessing import apply_postprocessing, load_deployed_postprocessing
from nnunet_triton.options import RequestOptions
from nnunet_triton.serving.metrics import RequestRecord
from nnunet_triton.serving.steps.base import Step, triton_model
from nnunet_triton.serving.tensors import declared_segmentation_dtype, input_array

__all__ = ["CombineStep", "TritonPythonModel"]


def _member_inputs(model_config: Mapping[str, Any]) -> list[str]:
    names = [t["name"] for t in model_config.get("input", [])]
    expected = [io_names.member_probabilities(i) for i in range(len(names))]
    if len(names) < 2 or names != expected:
        raise PlansError(f"combine_model inputs must be {expected} (two or more members), got {names}.")
    return names


class CombineStep(Step):
    """Averages the members' probabilities of one request."""

    def setup(self) -> None:
        self.member_inputs = _member_inputs(self.model_config)
        self.seg_dtype = declared_segmentation_dtype(self.model_config)
        self.postprocessing = load_deployed_postprocessing(self.model_dir)

    def inputs(self, request: Any, record: RequestRecord) -> dict[str, Any]:
        return {name: input_array(request, name) for name in self.member_inputs}

    def run(self, arrays: Mapping[str, Any], options: RequestOptions,
            record: RequestRecord) -> dict[str, Any]:
        probabilities = average_probabilities([arrays[name] for name in self.member_inputs])
        segmentation = segmentation_from_probabilities(probabilities, self.config.labels)
        segmentation = segmentation.astype(self.seg_dtype, copy=False)
        if self.postprocessing is not None and options.postprocessing:
            segmentation = apply_postprocessing(segmentation, self.postprocessing)
        outputs = {io_names.SEGMENTATION: segmentation}
        if options.probabilities:
            outputs[io_names.PROBABILITIES] = probabilities
        return outputs


TritonPythonModel = triton_model(CombineStep)
