"""Step 2, ``orchestrator_model`` (BLS, ``async def execute``): PREPROCESSED -> LOGITS.

For each request: read the per-request options (request parameters, forwarded by the ``nnunet``
ensemble), then run nnU-Net's sliding window for every selected fold concurrently
(:func:`nnunet_triton.pipeline.orchestration.predict_folds_async`): pad, plan tiles, send batches of tiles
(mirrored copies are extra batch items) to the ``fold_<k>`` models through BLS, un-flip, TTA-average,
Gaussian-accumulate in tile order, and average the folds' fp16 logits in fold order. The window's settings
are one ``numerics.window.SlidingWindowSettings`` per request
(:func:`~nnunet_triton.pipeline.orchestration.window_settings`: the deployed model's patch, heads and mirror
axes, the config parameters below, the request's mirroring and tile step, the instance's Gaussian map). All
numerics are library calls; this module only moves tensors.

Fold accumulators are planned per request (``numerics.limits.plan_fold_memory``): from the instance's
free device memory (KIND_GPU) or the available host memory (KIND_CPU), divided by the orchestrator
instances sharing it, as many folds run at once as their fp16 buffers fit (nnUNetPredictor's one at a
time at least; the result's bits do not depend on it), and a request whose single fold does not fit is
refused with UNAVAILABLE and a message naming the sizes and the memory there is.

The data is a torch tensor on the instance's device from PREPROCESSED to LOGITS (``serving.InstanceDevice``):
on a KIND_GPU instance PREPROCESSED is taken from device memory (or copied there once), tiles go to the
fold models and their outputs come back as CUDA tensors (BLS outputs requested in GPU memory, DLPack),
and flips, TTA averaging, Gaussian weighting and the fp16 accumulation run on the GPU; LOGITS leave as a
device tensor. On KIND_CPU the same code runs on torch CPU tensors with one torch thread (the cores
belong to the fold models), which is nnU-Net's own CPU arithmetic.

A fold model's error fails the request with a message naming that model (``serving.infer`` raises
``SubmodelError``). Before each tile batch is sent the request's ``is_cancelled()`` is checked: once the
client has cancelled, no further fold request is issued (batches already sent finish on the fold models
and are dropped), and the request ends with CANCELLED.

Config parameters (``nnunet_triton.parameters.OrchestratorParameters``):
    fold_models      comma list of fold model names, same length and order as inference_config.json folds
    tile_batch_size  network inputs per BLS call (<= the fold models' max_batch_size)
    max_inflight     BLS calls in flight per request over all folds (< python thread-pool-size, 32)
    metrics          "false" switches the custom nnunet_* metrics off (default on; ``serving.StepMetrics``:
                     time of the fold loop, tiles, network forwards, folds, fold calls per request, and on
                     KIND_GPU the PREPROCESSED / fold outputs that arrived in host memory)

I/O (``max_batch_size: 0``):
    IN  PREPROCESSED FP32 [C, *resampled]
    OUT LOGITS       FP16 [K, *resampled]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.errors import PlansError, RequestCancelledError
from nnunet_triton.numerics.gaussian import compute_gaussian
from nnunet_triton.numerics.limits import check_preprocessed, padded_voxels, plan_fold_memory
from nnunet_triton.numerics.releases import release_numerics
from nnunet_triton.options import RequestOptions
from nnunet_triton.parameters import PARAM_FOLD_MODELS, OrchestratorParameters
from nnunet_triton.pipeline.orchestration import predict_folds_async, window_settings
from nnunet_triton.serving.bls import infer
from nnunet_triton.serving.metrics import ORCHESTRATOR_COUNTS, RequestRecord
from nnunet_triton.serving.steps.base import AsyncStep, triton_model
from nnunet_triton.serving.tensors import input_array

__all__ = ["OrchestratorStep", "TritonPythonModel"]


class OrchestratorStep(AsyncStep):
    """The tile loop of the ``nnunet`` ensemble."""

    counts = ORCHESTRATOR_COUNTS
    host_tensors = (io_names.PREPROCESSED, io_names.FOLD_OUTPUT)

    def setup(self) -> None:
        import torch

        self.torch = torch
        if not self.device.gpu:
            torch.set_num_threads(1)  # elementwise fp16 sums; more threads would compete with the folds
        params = OrchestratorParameters.from_parameters(self.parameters)
        names = list(params.fold_models)
        if len(names) != len(self.config.folds):
            raise PlansError(
                f"config parameter {PARAM_FOLD_MODELS!r} must name one model per fold "
                f"{list(self.config.folds)}, got {names}."
            )
        self.fold_models = dict(zip(self.config.folds, names, strict=True))
        self.limits = params  # also the window's tile_batch_size and max_inflight
        self.gaussian = self.device.tensor(compute_gaussian(
            self.config.patch_size, rule=release_numerics(self.config.numerics).gaussian))
        self.instances = self.device.instances(json.loads(self.args.get("model_config") or "{}"))

    def inputs(self, request: Any, record: RequestRecord) -> dict[str, Any]:
        data = input_array(request, io_names.PREPROCESSED, xp=self.torch, on_host=self.device.watch(record))
        check_preprocessed(f"input {io_names.PREPROCESSED!r}", tuple(data.shape),
                           channels=self.config.network.num_input_channels,
                           num_heads=self.config.labels.num_segmentation_heads,
                           max_voxels=self.limits.max_voxels,  # 3 spatial dims for 2D configurations too
                           max_request_bytes=self.limits.max_request_bytes)
        return {io_names.PREPROCESSED: self.device.tensor(data), "request": request}

    async def run(self, arrays: Mapping[str, Any], options: RequestOptions,  # type: ignore[override]
                  record: RequestRecord) -> dict[str, Any]:
        config, request, data = self.config, arrays["request"], arrays[io_names.PREPROCESSED]
        window = window_settings(config, self.limits, options, gaussian=self.gaussian)
        available, memory = self.device.available_memory()
        plan = plan_fold_memory(  # refuses the request (UNAVAILABLE) when not even one fold fits
            num_heads=window.num_heads, channels=data.shape[0],
            voxels=padded_voxels(data.shape[1:], window.patch_size), folds=len(options.folds),
            instances=self.instances, available_bytes=available, memory=memory,
        )
        logits = await predict_folds_async(
            data,
            [self._fold_infer(self.fold_models[fold], request, record) for fold in options.folds],
            window,
            max_concurrent_folds=plan.max_concurrent_folds,
            divide_each_fold=release_numerics(config.numerics).divide_each_fold,
        )
        per_tile = len(options.folds) * window.variants_per_tile  # inputs per tile
        record.add(folds=len(options.folds), tiles=record.counts.get("forwards", 0) // per_tile)
        return {io_names.LOGITS: logits}

    def _fold_infer(self, model_name: str, request: Any, record: RequestRecord) -> Callable[[Any], Any]:
        device = self.device

        async def fold_infer(batch: Any) -> Any:
            if request.is_cancelled():  # checked before every tile batch: a cancelled request sends no more
                raise RequestCancelledError(
                    f"request cancelled by the client; stopped before sending a tile batch to {model_name!r}."
                )
            outputs = await infer(
                model_name, {io_names.FOLD_INPUT: batch}, [io_names.FOLD_OUTPUT], xp=self.torch, copy=True,
                output_device=device.memory, device_id=device.index, parent=request,
                on_host=device.watch(record),
            )
            record.add(forwards=len(batch), fold_calls=1)
            return device.tensor(outputs[io_names.FOLD_OUTPUT])

        return fold_infer


TritonPythonModel = triton_model(OrchestratorStep)
