"""Triton Python model ``orchestrator_model`` (BLS, ``async def execute``): PREPROCESSED -> LOGITS.

For each request: read the per-request options (request parameters, forwarded by the ``nnunet``
ensemble), then run nnU-Net's sliding window for every selected fold concurrently
(:func:`nnunet_triton.pipeline.orchestration.predict_folds_async`): pad, plan tiles, send batches of tiles
(mirrored copies are extra batch items) to the ``fold_<k>`` models through BLS, un-flip, TTA-average,
Gaussian-accumulate in tile order, and average the folds' fp16 logits in fold order. All numerics are
library calls; this file only moves tensors.

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

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnunet_triton import io_names, serving
from nnunet_triton.errors import NnunetTritonError, PlansError, RequestCancelledError
from nnunet_triton.numerics.gaussian import compute_gaussian
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.sliding_window import mirror_combinations
from nnunet_triton.options import RequestOptions
from nnunet_triton.parameters import PARAM_FOLD_MODELS, OrchestratorParameters
from nnunet_triton.pipeline.orchestration import predict_folds_async


class TritonPythonModel:
    """The tile loop of the ``nnunet`` ensemble."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import torch
            import triton_python_backend_utils as pb_utils

            self._torch = torch
            self._logger = pb_utils.Logger
            self._device = serving.InstanceDevice.from_args(args)
            if not self._device.gpu:
                torch.set_num_threads(1)  # elementwise fp16 sums; more threads would compete with the folds
            self._config = InferenceConfig.load(Path(__file__).parent)
            params = OrchestratorParameters.from_parameters(serving.model_parameters(args))
            names = list(params.fold_models)
            if len(names) != len(self._config.folds):
                raise PlansError(
                    f"config parameter {PARAM_FOLD_MODELS!r} must name one model per fold "
                    f"{list(self._config.folds)}, got {names}."
                )
            self._fold_models = dict(zip(self._config.folds, names, strict=True))
            self._tile_batch_size = params.tile_batch_size
            self._max_inflight = params.max_inflight
            self._gaussian = self._device.tensor(compute_gaussian(self._config.patch_size))
            self._metrics = serving.StepMetrics.create(
                args, self._config, counts=serving.ORCHESTRATOR_COUNTS,
                host_tensors=(io_names.PREPROCESSED, io_names.FOLD_OUTPUT))
        except Exception:
            raise serving.initialize_exception(args["model_name"]) from None

    async def execute(self, requests: list) -> list:
        return [await self._metrics.observe_async(self._run, request) for request in requests]

    async def _run(self, request: Any, record: serving.RequestRecord) -> Any:
        try:
            options = RequestOptions.from_parameters(serving.request_parameters(request), self._config)
            data = self._device.tensor(serving.input_array(request, io_names.PREPROCESSED, xp=self._torch,
                                                           on_host=self._device.watch(record)))
            with record.timed():
                logits = await self._predict(data, options, request, record)
            return serving.ok_response({io_names.LOGITS: logits})
        except NnunetTritonError as exc:
            return serving.error_response(exc)
        except Exception as exc:
            return serving.internal_error_response(exc, self._logger)

    async def _predict(self, data: Any, options: RequestOptions, request: Any,
                       record: serving.RequestRecord) -> Any:
        config = self._config
        mirror_axes = config.mirror_axes if options.mirroring else None
        logits = await predict_folds_async(
            data,
            [self._fold_infer(self._fold_models[fold], request, record) for fold in options.folds],
            patch_size=config.patch_size,
            num_heads=config.labels.num_segmentation_heads,
            mirror_axes=mirror_axes,
            tile_step_size=options.tile_step_size,
            batch_size=self._tile_batch_size,
            max_inflight=self._max_inflight,
            gaussian=self._gaussian,
        )
        per_tile = len(options.folds) * (1 + len(mirror_combinations(mirror_axes)))  # inputs per tile
        record.add(folds=len(options.folds), tiles=record.counts.get("forwards", 0) // per_tile)
        return logits

    def _fold_infer(self, model_name: str, request: Any,
                    record: serving.RequestRecord) -> Callable[[Any], Any]:
        device = self._device

        async def infer(batch: Any) -> Any:
            if request.is_cancelled():  # checked before every tile batch: a cancelled request sends no more
                raise RequestCancelledError(
                    f"request cancelled by the client; stopped before sending a tile batch to {model_name!r}."
                )
            outputs = await serving.infer(
                model_name, {io_names.FOLD_INPUT: batch}, [io_names.FOLD_OUTPUT], xp=self._torch, copy=True,
                output_device=device.memory, device_id=device.index, parent=request,
                on_host=device.watch(record),
            )
            record.add(forwards=len(batch), fold_calls=1)
            return device.tensor(outputs[io_names.FOLD_OUTPUT])

        return infer
