"""Triton Python-backend runner for one exported fold (``fold_<k>/1/model.pt``).

A stand-in for the ``pytorch_libtorch`` backend with the same name and I/O (``INPUT__0`` ->
``OUTPUT__0``), for servers without libtorch (the embedded CPU server). Every ``execute`` gets the
requests of one dynamic batch; their tiles are concatenated along the batch axis and run as ONE
forward (or tile by tile with ``per_sample_forward``; see ``nnunet_triton.pipeline.fold_runner``), then split
back per request.

Config parameters (``model_specs.python_fold_spec``):
    torch_num_threads: ``torch.set_num_threads`` in this stub; "0" (default) keeps torch's default of one
        thread per physical core, which is also what an nnU-Net process uses (same thread count = same
        oneDNN rounding). With several fold instances on one machine, set cores / instances.
    per_sample_forward: "true" runs each tile of the dynamic batch as its own batch-1 forward, like
        nnU-Net (bit-identical on CPU; the builder's default on target cpu); "false" (default here)
        runs the whole dynamic batch as one forward.
    model_filename: TorchScript file next to this model.py (default ``model.pt``).
"""

from __future__ import annotations

import json
from pathlib import Path

from nnunet_triton import io_names, serving
from nnunet_triton.dtypes import numpy_dtype
from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.parameters import FoldRunnerParameters
from nnunet_triton.pipeline.fold_runner import load_runner
from nnunet_triton.pipeline.threads import budget_note, fold_threads_for_runner


class TritonPythonModel:
    """Runs each dynamic batch of tiles through the fold's TorchScript network."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import torch
            import triton_python_backend_utils as pb_utils

            self._logger = pb_utils.Logger
            config = json.loads(args["model_config"])
            params = FoldRunnerParameters.from_parameters(serving.model_parameters(args))
            # the config's torch_num_threads, else the launcher's thread budget, else torch's default capped
            threads = fold_threads_for_runner(params.torch_num_threads, torch_default=torch.get_num_threads())
            self._logger.log_info(f"{args['model_name']}: {threads} torch thread(s); {budget_note()}")
            input_config = pb_utils.get_input_config_by_name(config, io_names.FOLD_INPUT)
            output_config = pb_utils.get_output_config_by_name(config, io_names.FOLD_OUTPUT)
            self._runner = load_runner(
                Path(__file__).parent / params.model_filename,
                device=serving.InstanceDevice.from_args(args).torch_device,
                num_threads=threads,
                sample_shape=[int(d) for d in input_config["dims"]],
                max_forward_batch=1 if params.per_sample_forward else 0,
                output_dtype=numpy_dtype(output_config["data_type"]).name,
            )
        except Exception:
            raise serving.initialize_exception(args["model_name"]) from None

    def execute(self, requests: list) -> list:
        import torch

        responses: list = [None] * len(requests)
        batches, indices = [], []
        for index, request in enumerate(requests):
            try:
                batches.append(serving.input_array(request, io_names.FOLD_INPUT, xp=torch))
                indices.append(index)
            except NnunetTritonError as exc:
                responses[index] = serving.error_response(exc)
        if batches:
            self._run(requests, batches, indices, responses)
        return responses

    def _run(self, requests: list, batches: list, indices: list[int], responses: list) -> None:
        try:
            outputs = self._runner.run(batches)
        except NnunetTritonError as exc:
            for index in indices:
                responses[index] = serving.error_response(exc)
            return
        except Exception as exc:  # one failed forward fails every request of the batch
            for index in indices:
                responses[index] = serving.internal_error_response(exc, self._logger)
            return
        for index, output in zip(indices, outputs, strict=True):
            array = output.numpy() if output.device.type == "cpu" else output
            responses[index] = serving.ok_response({io_names.FOLD_OUTPUT: array})
