"""Triton Python model ``orchestrator_model`` (BLS, ``async def execute``): PREPROCESSED -> LOGITS.

For each request: read the per-request options (request parameters, forwarded by the ``nnunet``
ensemble), then run nnU-Net's sliding window for every selected fold concurrently
(:func:`nnunet_triton.orchestration.predict_folds_async`): pad, plan tiles, send batches of tiles
(mirrored copies are extra batch items) to the ``fold_<k>`` models through BLS, un-flip, TTA-average,
Gaussian-accumulate in tile order, and average the folds' fp16 logits in fold order. All numerics are
library calls; this file only moves tensors. A fold model's error fails the request with a message
naming that model (``serving.infer`` raises ``SubmodelError``).

Config parameters (config.pbtxt ``parameters``):
    fold_models      comma list of fold model names, same length and order as inference_config.json folds
    tile_batch_size  network inputs per BLS call (<= the fold models' max_batch_size)
    max_inflight     BLS calls in flight per request over all folds (< python thread-pool-size, 32)

I/O (``max_batch_size: 0``):
    IN  PREPROCESSED FP32 [C, *resampled]
    OUT LOGITS       FP16 [K, *resampled]
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton import io_names, serving
from nnunet_triton.errors import NnunetTritonError, PlansError
from nnunet_triton.gaussian import compute_gaussian
from nnunet_triton.orchestration import RequestOptions, parse_request_options, predict_folds_async
from nnunet_triton.plans import InferenceConfig

CONFIG_FILE = "inference_config.json"
PARAM_FOLD_MODELS = "fold_models"
PARAM_TILE_BATCH_SIZE = "tile_batch_size"
PARAM_MAX_INFLIGHT = "max_inflight"


def _positive_int(params: dict[str, str], key: str) -> int:
    try:
        value = int(params[key])
    except (KeyError, ValueError):
        raise PlansError(
            f"config parameter {key!r} must be an integer >= 1, got {params.get(key)!r}."
        ) from None
    if value < 1:
        raise PlansError(f"config parameter {key!r} must be an integer >= 1, got {value}.")
    return value


def _device_of(data: Any) -> str:
    """Where fold outputs should land: host memory for NumPy data, the GPU for CuPy data."""
    return "cpu" if isinstance(data, np.ndarray) else "gpu"


class TritonPythonModel:
    """The tile loop of the ``nnunet`` ensemble."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import triton_python_backend_utils as pb_utils

            self._logger = pb_utils.Logger
            self._config = InferenceConfig.from_json((Path(__file__).parent / CONFIG_FILE).read_text())
            params = serving.model_parameters(args)
            names = [n.strip() for n in params.get(PARAM_FOLD_MODELS, "").split(",") if n.strip()]
            if len(names) != len(self._config.folds):
                raise PlansError(
                    f"config parameter {PARAM_FOLD_MODELS!r} must name one model per fold "
                    f"{list(self._config.folds)}, got {names}."
                )
            self._fold_models = dict(zip(self._config.folds, names, strict=True))
            self._tile_batch_size = _positive_int(params, PARAM_TILE_BATCH_SIZE)
            self._max_inflight = _positive_int(params, PARAM_MAX_INFLIGHT)
            self._gaussian = compute_gaussian(self._config.patch_size)
        except Exception:
            raise serving.initialize_exception(args["model_name"]) from None

    async def execute(self, requests: list) -> list:
        return [await self._run(request) for request in requests]

    async def _run(self, request: Any) -> Any:
        try:
            options = parse_request_options(serving.request_parameters(request), self._config)
            data = serving.input_array(request, io_names.PREPROCESSED)
            logits = await self._predict(data, options, request)
            return serving.ok_response({io_names.LOGITS: logits})
        except NnunetTritonError as exc:
            return serving.error_response(exc)
        except Exception as exc:
            return serving.internal_error_response(exc, self._logger)

    async def _predict(self, data: Any, options: RequestOptions, request: Any) -> Any:
        config = self._config
        return await predict_folds_async(
            data,
            [self._fold_infer(self._fold_models[fold], request, _device_of(data)) for fold in options.folds],
            patch_size=config.patch_size,
            num_heads=config.labels.num_segmentation_heads,
            mirror_axes=config.mirror_axes if options.mirroring else None,
            tile_step_size=options.tile_step_size,
            batch_size=self._tile_batch_size,
            max_inflight=self._max_inflight,
            gaussian=self._gaussian,
        )

    @staticmethod
    def _fold_infer(model_name: str, request: Any, device: str) -> Callable[[Any], Any]:
        async def infer(batch: Any) -> Any:
            outputs = await serving.infer(
                model_name, {io_names.FOLD_INPUT: batch}, [io_names.FOLD_OUTPUT], copy=True,
                output_device=device, parent=request,
            )
            return outputs[io_names.FOLD_OUTPUT]

        return infer
