"""The config.pbtxt ``parameters`` of every Python model: one frozen dataclass per model.

The builder writes them (``to_config()``, in ``builder.model_specs``) and the model's serving step
(``serving.steps``) reads them back (``from_parameters(serving.model_parameters(args))``), so each
parameter name, its type, its default and its rule live here only (pytriton's config generator + parser
pair). Values travel as strings; :func:`nnunet_triton.options.parse_bool` /
:func:`~nnunet_triton.options.parse_int` are the one reading of booleans and integers. A malformed value
raises :class:`ConfigParameterError` naming the parameter, the rule and the value.

Imports ``errors``, ``options`` and ``numerics.limits`` (for the limits' defaults) only. The ``nnunet``
endpoint's description (:func:`description_parameters`) is written here too and read by
``client.endpoint``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from nnunet_triton import __version__, io_names
from nnunet_triton.errors import ConfigParameterError
from nnunet_triton.numerics.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_VOXELS,
    MAX_REQUEST_BYTES_PARAMETER,
    MAX_VOXELS_PARAMETER,
)
from nnunet_triton.numerics.releases import release_numerics
from nnunet_triton.options import ProbabilitiesOutput, parse_bool, parse_int

if TYPE_CHECKING:
    from nnunet_triton.numerics.plans import InferenceConfig

__all__ = [
    "FORCE_CPU_ONLY_INPUT_TENSORS",
    "DEFAULT_TILE_BATCH_SIZE",
    "DEFAULT_MAX_INFLIGHT",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_GRPC_PORT",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_PORTS",
    "PARAM_METRICS",
    "PARAM_FOLD_MODELS",
    "PARAM_TORCH_NUM_THREADS",
    "PipelineParameters",
    "PreprocessParameters",
    "OrchestratorParameters",
    "StitchParameters",
    "FoldRunnerParameters",
    "DESCRIPTION_PARAMETER",
    "AXIS_ORDER",
    "description_parameters",
]

FORCE_CPU_ONLY_INPUT_TENSORS = "FORCE_CPU_ONLY_INPUT_TENSORS"  # Triton's own (python_backend), "yes"/"no"
PARAM_METRICS = "metrics"
PARAM_FOLD_MODELS = "fold_models"
PARAM_TILE_BATCH_SIZE = "tile_batch_size"
PARAM_MAX_INFLIGHT = "max_inflight"
PARAM_PROBABILITIES_OUTPUT = "probabilities_output"
PARAM_TORCH_NUM_THREADS = "torch_num_threads"
PARAM_PER_SAMPLE_FORWARD = "per_sample_forward"
PARAM_MODEL_FILENAME = "model_filename"
# the ``nnunet`` endpoint (an ensemble) publishes its model as JSON for ``info``, the clients and ``validate``
DESCRIPTION_PARAMETER = "nnunet_description"

# Defaults, defined here only (the builder, the orchestrator, the tools and tests import them).
DEFAULT_TILE_BATCH_SIZE = 4  # (tile, mirror variant) items per fold request
DEFAULT_MAX_INFLIGHT = 4  # fold requests in flight per fold
# tritonserver's own default ports: the container side of every deployment, and the client's default.
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002
DEFAULT_PORTS = MappingProxyType({"http": DEFAULT_HTTP_PORT, "grpc": DEFAULT_GRPC_PORT,
                                  "metrics": DEFAULT_METRICS_PORT})
AXIS_ORDER = "zyx"  # IMAGE is (C, z, y, x) and SPACING (z, y, x): SimpleITK's array order, as nnU-Net reads


def _bool(params: Mapping[str, str], name: str, default: bool) -> bool:
    raw = params.get(name, "")
    return default if raw.strip() == "" else parse_bool(name, raw, what="config parameter",
                                                         error=ConfigParameterError)


def _int(params: Mapping[str, str], name: str, default: int | None, minimum: int) -> int:
    raw = params.get(name, "")
    if raw.strip() == "" and default is not None:
        return default
    return parse_int(name, raw, minimum=minimum, error=ConfigParameterError)


def _force_cpu(params: Mapping[str, str]) -> bool:
    return params.get(FORCE_CPU_ONLY_INPUT_TENSORS, "yes").strip().lower() != "no"


def _pipeline_fields(params: Mapping[str, str]) -> dict[str, bool]:
    """The :class:`PipelineParameters` fields every pipeline model's parameters start with."""
    return {"force_cpu_inputs": _force_cpu(params), "metrics": _bool(params, PARAM_METRICS, True)}


def _common(force_cpu_inputs: bool, metrics: bool | None) -> dict[str, str]:
    # "no" lets GPU tensors reach the Python models where they live (python_backend README,
    # FORCE_CPU_ONLY_INPUT_TENSORS); on cpu the default "yes" is written out so the config says what
    # happens. metrics: written only when off.
    config = {FORCE_CPU_ONLY_INPUT_TENSORS: "yes" if force_cpu_inputs else "no"}
    if metrics is False:
        config[PARAM_METRICS] = "false"
    return config


@dataclass(frozen=True)
class PipelineParameters:
    """What every Python pipeline model has (``combine_model`` has nothing else).

    Attributes:
        force_cpu_inputs: Triton's ``FORCE_CPU_ONLY_INPUT_TENSORS`` (inputs copied to host memory).
        metrics: export the custom ``nnunet_*`` metrics (``serving.metrics``).
    """

    force_cpu_inputs: bool = True
    metrics: bool = True

    def to_config(self) -> dict[str, str]:
        return _common(self.force_cpu_inputs, self.metrics)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> PipelineParameters:
        return cls(**_pipeline_fields(params))


def _limit_fields(params: Mapping[str, str]) -> dict[str, int]:
    """The :class:`LimitedParameters` fields (absent: the defaults, so older repositories stay bounded)."""
    return {"max_voxels": _int(params, MAX_VOXELS_PARAMETER, DEFAULT_MAX_VOXELS, 0),
            "max_request_bytes": _int(params, MAX_REQUEST_BYTES_PARAMETER, DEFAULT_MAX_REQUEST_BYTES, 0)}


@dataclass(frozen=True)
class LimitedParameters(PipelineParameters):
    """A pipeline model that bounds what it accepts and makes (``numerics.limits``; 0 = no limit): the
    builder's ``--max-voxels`` / ``--max-request-bytes``, the same for every step of an endpoint."""

    max_voxels: int = DEFAULT_MAX_VOXELS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def to_config(self) -> dict[str, str]:
        return {**super().to_config(), MAX_VOXELS_PARAMETER: str(self.max_voxels),
                MAX_REQUEST_BYTES_PARAMETER: str(self.max_request_bytes)}


@dataclass(frozen=True)
class PreprocessParameters(LimitedParameters):
    """``preprocess_model``: the request limits only."""

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> PreprocessParameters:
        return cls(**_pipeline_fields(params), **_limit_fields(params))


@dataclass(frozen=True)
class OrchestratorParameters(LimitedParameters):
    """``orchestrator_model``: the fold models in fold order, tiles per fold request, batches in flight."""

    fold_models: tuple[str, ...] = field(default_factory=tuple)
    tile_batch_size: int = DEFAULT_TILE_BATCH_SIZE
    max_inflight: int = DEFAULT_MAX_INFLIGHT

    def to_config(self) -> dict[str, str]:
        return {**super().to_config(), PARAM_FOLD_MODELS: ",".join(self.fold_models),
                PARAM_TILE_BATCH_SIZE: str(self.tile_batch_size), PARAM_MAX_INFLIGHT: str(self.max_inflight)}

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> OrchestratorParameters:
        names = tuple(n.strip() for n in params.get(PARAM_FOLD_MODELS, "").split(",") if n.strip())
        return cls(**_pipeline_fields(params), **_limit_fields(params), fold_models=names,
                   tile_batch_size=_int(params, PARAM_TILE_BATCH_SIZE, None, 1),
                   max_inflight=_int(params, PARAM_MAX_INFLIGHT, None, 1))


@dataclass(frozen=True)
class StitchParameters(LimitedParameters):
    """``stitch_model``: when PROBABILITIES are returned (``ProbabilitiesOutput``).

    ``request`` (default: the ``probabilities`` request option decides); ``always`` (an ensemble member,
    whose PROBABILITIES feed combine_model); ``never`` (a cascade's previous stage: only SEGMENTATION is
    used, so a client's probabilities=true must not make it compute them). Written only when not
    ``request``.
    """

    probabilities_output: ProbabilitiesOutput = ProbabilitiesOutput.REQUEST

    def to_config(self) -> dict[str, str]:
        config = super().to_config()
        if self.probabilities_output is not ProbabilitiesOutput.REQUEST:
            config[PARAM_PROBABILITIES_OUTPUT] = self.probabilities_output.value
        return config

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> StitchParameters:
        raw = params.get(PARAM_PROBABILITIES_OUTPUT, "").strip() or ProbabilitiesOutput.REQUEST.value
        try:
            mode = ProbabilitiesOutput(raw)
        except ValueError:
            raise ConfigParameterError(
                f"config parameter {PARAM_PROBABILITIES_OUTPUT!r} must be one of "
                f"{tuple(m.value for m in ProbabilitiesOutput)}, got {raw!r}."
            ) from None
        return cls(**_pipeline_fields(params), **_limit_fields(params), probabilities_output=mode)


@dataclass(frozen=True)
class FoldRunnerParameters:
    """``fold_<k>`` on the Python runner (``serving.steps.fold_runner``).

    Attributes:
        torch_num_threads: ``torch.set_num_threads``; 0 keeps torch's default.
        per_sample_forward: run each tile of a dynamic batch as its own batch-1 forward (as nnU-Net).
        model_filename: the TorchScript file in the model's version folder (next to ``model.py``).
        force_cpu_inputs: Triton's ``FORCE_CPU_ONLY_INPUT_TENSORS``.
    """

    torch_num_threads: int = 0
    per_sample_forward: bool = False
    model_filename: str = io_names.TORCHSCRIPT_FILE
    force_cpu_inputs: bool = True

    def to_config(self) -> dict[str, str]:
        return {**_common(self.force_cpu_inputs, None), PARAM_TORCH_NUM_THREADS: str(self.torch_num_threads),
                PARAM_PER_SAMPLE_FORWARD: "true" if self.per_sample_forward else "false",
                PARAM_MODEL_FILENAME: self.model_filename}

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> FoldRunnerParameters:
        return cls(torch_num_threads=_int(params, PARAM_TORCH_NUM_THREADS, 0, 0),
                   per_sample_forward=_bool(params, PARAM_PER_SAMPLE_FORWARD, False),
                   model_filename=params.get(PARAM_MODEL_FILENAME, "").strip() or io_names.TORCHSCRIPT_FILE,
                   force_cpu_inputs=_force_cpu(params))


def description_parameters(config: InferenceConfig) -> dict[str, str]:
    """Config parameters for the ``nnunet`` ensemble that publish ``config`` (an ``InferenceConfig``)."""
    labels = {name: list(v) if isinstance(v, tuple) else v for name, v in config.labels.label_names}
    description = {
        "dataset_name": config.dataset_name,
        "plans_name": config.plans_name,
        "configuration": config.configuration,
        "trainer_name": config.network.trainer_name,
        "folds": list(config.folds),
        "labels": labels,
        "regions_class_order": list(config.labels.regions_class_order or []) or None,
        "channel_names": {str(k): name for k, name in enumerate(config.channel_names)},
        "file_ending": config.file_ending,
        "image_reader_writer": config.image_reader_writer,
        "patch_size": list(config.patch_size),
        "spacing": list(config.spacing),
        "mirror_axes": list(config.mirror_axes) if config.mirror_axes is not None else None,
        "axis_order": AXIS_ORDER,
        "nnunet_triton_version": __version__,
        "numerics": release_numerics(config.numerics).to_dict(),
    }
    return {DESCRIPTION_PARAMETER: json.dumps(description, sort_keys=True)}
