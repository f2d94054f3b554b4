"""Step 3, ``fold_<k>`` on the Python backend: one exported fold (``fold_<k>/1/model.pt``).

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
    model_filename: TorchScript file next to the model's model.py (default ``model.pt``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.dtypes import numpy_dtype
from nnunet_triton.errors import NnunetTritonError, PlansError
from nnunet_triton.parameters import FoldRunnerParameters
from nnunet_triton.pipeline.fold_runner import load_runner
from nnunet_triton.pipeline.threads import budget_note, fold_threads_for_runner
from nnunet_triton.serving.responses import error_response, internal_error_response, ok_response
from nnunet_triton.serving.steps.base import Step, triton_model
from nnunet_triton.serving.tensors import input_array

__all__ = ["FoldRunnerStep", "TritonPythonModel"]


def _tensor_config(model_config: Mapping[str, Any], kind: str, name: str) -> Mapping[str, Any]:
    for tensor in model_config.get(kind, []):
        if tensor["name"] == name:
            return tensor
    raise PlansError(f"config.pbtxt declares no {kind} {name!r}.")


class FoldRunnerStep(Step):
    """Runs each dynamic batch of tiles through the fold's TorchScript network."""

    reads_options = False  # called by the orchestrator with tiles only
    has_metrics = False

    def setup(self) -> None:
        import torch

        self.torch = torch
        params = FoldRunnerParameters.from_parameters(self.parameters)
        # the config's torch_num_threads, else the launcher's thread budget, else nnU-Net's count capped
        threads = fold_threads_for_runner(params.torch_num_threads, torch_default=torch.get_num_threads())
        self.logger.log_info(f"{self.name}: {threads} torch thread(s); {budget_note()}")
        sample = _tensor_config(self.model_config, "input", io_names.FOLD_INPUT)
        output = _tensor_config(self.model_config, "output", io_names.FOLD_OUTPUT)
        self.runner = load_runner(
            self.model_dir / params.model_filename,
            device=self.device.torch_device,
            num_threads=threads,
            sample_shape=[int(d) for d in sample["dims"]],
            max_forward_batch=1 if params.per_sample_forward else 0,
            output_dtype=numpy_dtype(output["data_type"]).name,
        )

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        """One forward (or per-sample forwards) for every request of the dynamic batch together."""
        responses: list[Any] = [None] * len(requests)
        batches, indices = [], []
        for index, request in enumerate(requests):
            try:
                batches.append(input_array(request, io_names.FOLD_INPUT, xp=self.torch))
                indices.append(index)
            except NnunetTritonError as exc:
                responses[index] = error_response(exc)
        if batches:
            self._run_batches(batches, indices, responses)
        return responses

    def _run_batches(self, batches: list[Any], indices: list[int], responses: list[Any]) -> None:
        try:
            outputs = self.runner.run(batches)
        except NnunetTritonError as exc:
            for index in indices:
                responses[index] = error_response(exc)
            return
        except Exception as exc:  # one failed forward fails every request of the batch
            for index in indices:
                responses[index] = internal_error_response(exc, self.logger)
            return
        for index, output in zip(indices, outputs, strict=True):
            responses[index] = ok_response({io_names.FOLD_OUTPUT: output})


TritonPythonModel = triton_model(FoldRunnerStep)
