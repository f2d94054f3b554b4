"""Generate Triton ``config.pbtxt`` files from typed, validated specs.

Follows pytriton's ``model_config/generator.py``: ``ModelSpec`` -> plain dict ->
``json_format.ParseDict(d, model_config_pb2.ModelConfig())`` -> ``text_format``. Parsing into the real
protobuf message means a misspelt field or a wrong type fails here, not at server start. Each ``_set_*``
helper owns one section of the config. ``tritonclient`` is imported lazily, inside the functions that
need the protobuf classes.

Reading a config back is the repository layer's (:mod:`nnunet_triton.repository.config`, the only module
that opens a ``config.pbtxt``: this one renders the text and hands it there to be written); its names
(``read_config``, ``parse_config``, ``ModelConfigInfo``, ...) are re-exported here for the callers that
import them from the builder.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nnunet_triton.dtypes import triton_dtype
from nnunet_triton.repository.config import (  # re-exported: the reading side lives in the repository layer
    ConfigTree,  # noqa: F401
    ModelConfigInfo,
    _TextReader,  # noqa: F401  (tests compare the two readers through this module)
    config_tree,
    parse_config,
    read_config,
    read_config_text,
    write_config_text,
)

__all__ = [
    "TensorSpec",
    "InstanceGroup",
    "DynamicBatching",
    "EnsembleStep",
    "WarmupInput",
    "ModelWarmup",
    "ModelSpec",
    "model_config_dict",
    "model_config_proto",
    "render_config",
    "write_config",
    "renamed_config",
    "ModelConfigInfo",
    "parse_config",
    "config_tree",
    "read_config",
    "read_config_text",
    "write_config_text",
]

LOGGER = logging.getLogger(__name__)

_INSTANCE_KINDS = frozenset({"KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"})
_WARMUP_SOURCES = frozenset({"zero", "random"})


def _check_dims(owner: str, dims: tuple[int, ...], *, allow_empty: bool = False) -> None:
    if not dims and not allow_empty:
        raise ValueError(f"{owner}: dims must not be empty (use [1] for a scalar), got {dims!r}.")
    bad = [d for d in dims if not isinstance(d, int) or isinstance(d, bool) or d < -1 or d == 0]
    if bad:
        raise ValueError(f"{owner}: every dim must be -1 (variable) or >= 1, got {dims!r}.")


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output. ``dims`` exclude the batch dim when ``max_batch_size > 0``."""

    name: str
    dtype: object
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    allow_ragged_batch: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError(f"tensor name must be non-empty, got {self.name!r}.")
        triton_dtype(self.dtype)
        _check_dims(f"tensor {self.name!r}", tuple(self.dims))
        if self.reshape is not None:
            _check_dims(f"tensor {self.name!r} reshape", tuple(self.reshape), allow_empty=True)


@dataclass(frozen=True)
class InstanceGroup:
    """``instance_group`` entry; ``kind`` is ``"cpu"``, ``"gpu"``, ``"model"``, ``"auto"`` or ``KIND_*``."""

    count: int = 1
    kind: str = "KIND_CPU"
    gpus: tuple[int, ...] = ()
    # rate_limiter resources {name: count} one execution of an instance holds; they only count when the
    # server runs with --rate-limit=execution_count (the thread budget's launchers set it)
    rate_limiter_resources: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"instance_group count must be >= 1, got {self.count}.")
        if any(not name or count < 1 for name, count in self.rate_limiter_resources):
            raise ValueError(
                f"rate_limiter resources need a name and a count >= 1, got {self.rate_limiter_resources}.")
        if _instance_kind(self.kind) not in _INSTANCE_KINDS:
            raise ValueError(
                f"instance_group kind must be one of {sorted(_INSTANCE_KINDS)}, got {self.kind!r}."
            )


def _instance_kind(kind: str) -> str:
    upper = kind.upper()
    return upper if upper.startswith("KIND_") else f"KIND_{upper}"


@dataclass(frozen=True)
class DynamicBatching:
    """``dynamic_batching``; leave ``preferred_batch_sizes`` empty unless some sizes are much faster."""

    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    preserve_ordering: bool = False

    def __post_init__(self) -> None:
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}.")


@dataclass(frozen=True)
class EnsembleStep:
    """One ensemble step; maps are ``{composing model tensor: ensemble tensor}``."""

    model_name: str
    input_map: Mapping[str, str]
    output_map: Mapping[str, str]
    model_version: int = -1


@dataclass(frozen=True)
class WarmupInput:
    """Warm-up sample for one input.

    ``source`` is ``"zero"``, ``"random"`` or the name of a raw file in ``<model>/warmup/``.
    """

    dtype: object
    dims: tuple[int, ...]
    source: str = "zero"

    def __post_init__(self) -> None:
        triton_dtype(self.dtype)
        _check_dims("warmup input", tuple(self.dims))
        if not self.source:
            raise ValueError("warmup input source must be 'zero', 'random' or a file name, got ''.")


@dataclass(frozen=True)
class ModelWarmup:
    """``model_warmup`` entry; the model is not READY until all warm-up requests ran."""

    name: str
    batch_size: int
    inputs: Mapping[str, WarmupInput]
    count: int = 1

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.count < 1:
            raise ValueError(
                f"warmup {self.name!r}: batch_size and count must be >= 1, "
                f"got {self.batch_size} and {self.count}."
            )


@dataclass(frozen=True)
class ModelSpec:
    """Everything ``config.pbtxt`` says about one model. Exactly one of backend/platform is usual;
    ``platform="ensemble"`` requires ``ensemble_steps``."""

    name: str
    backend: str | None = None
    platform: str | None = None
    max_batch_size: int = 0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    instance_groups: tuple[InstanceGroup, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    parameters: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    ensemble_steps: tuple[EnsembleStep, ...] | None = None
    model_warmup: tuple[ModelWarmup, ...] = ()
    default_model_filename: str | None = None
    decoupled: bool = False

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"model name must be non-empty and contain no '/', got {self.name!r}.")
        if self.backend is None and self.platform is None:
            raise ValueError(f"model {self.name!r}: set backend (e.g. 'python') or platform, got neither.")
        if self.max_batch_size < 0:
            raise ValueError(f"model {self.name!r}: max_batch_size must be >= 0, got {self.max_batch_size}.")
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            names = [t.name for t in tensors]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"model {self.name!r}: duplicate {kind} tensor names {duplicates}.")
        flagged = [t.name for t in self.outputs if t.optional or t.allow_ragged_batch]
        if flagged:
            raise ValueError(
                f"model {self.name!r}: optional/allow_ragged_batch apply to inputs only, got {flagged}."
            )
        self._check_batching()
        self._check_ensemble()

    def _check_batching(self) -> None:
        limit = max(self.max_batch_size, 1)
        sizes = self.dynamic_batching.preferred_batch_sizes if self.dynamic_batching else ()
        if any(s < 1 or s > limit for s in sizes):
            raise ValueError(
                f"model {self.name!r}: preferred batch sizes must be in [1, {limit}], got {list(sizes)}."
            )
        for warmup in self.model_warmup:
            if warmup.batch_size > limit:
                raise ValueError(
                    f"model {self.name!r}: warmup {warmup.name!r} batch_size {warmup.batch_size} exceeds "
                    f"max_batch_size {self.max_batch_size}."
                )

    def _check_ensemble(self) -> None:
        is_ensemble = self.platform == "ensemble"
        if is_ensemble != bool(self.ensemble_steps):
            raise ValueError(
                f"model {self.name!r}: platform 'ensemble' and non-empty ensemble_steps go together, "
                f"got platform={self.platform!r} with {len(self.ensemble_steps or ())} steps."
            )
        if is_ensemble and (self.instance_groups or self.dynamic_batching):
            raise ValueError(f"ensemble {self.name!r}: instance_groups/dynamic_batching belong on its steps.")


def _tensor_dict(tensor: TensorSpec, *, is_input: bool) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": tensor.name,
        "data_type": triton_dtype(tensor.dtype),
        "dims": list(tensor.dims),
    }
    if tensor.reshape is not None:
        d["reshape"] = {"shape": list(tensor.reshape)}
    if is_input and tensor.optional:
        d["optional"] = True
    if is_input and tensor.allow_ragged_batch:
        d["allow_ragged_batch"] = True
    return d


def _set_io(config: dict[str, Any], spec: ModelSpec) -> None:
    config["input"] = [_tensor_dict(t, is_input=True) for t in spec.inputs]
    config["output"] = [_tensor_dict(t, is_input=False) for t in spec.outputs]


def _set_instance_groups(config: dict[str, Any], spec: ModelSpec) -> None:
    groups = []
    for group in spec.instance_groups:
        entry: dict[str, Any] = {"count": group.count, "kind": _instance_kind(group.kind)}
        if group.gpus:
            entry["gpus"] = list(group.gpus)
        if group.rate_limiter_resources:
            entry["rate_limiter"] = {"resources": [{"name": name, "count": count}
                                                   for name, count in group.rate_limiter_resources]}
        groups.append(entry)
    if groups:
        config["instance_group"] = groups


def _set_batching(config: dict[str, Any], spec: ModelSpec) -> None:
    batching = spec.dynamic_batching
    if batching is None:
        return
    entry: dict[str, Any] = {}
    if batching.preferred_batch_sizes:
        entry["preferred_batch_size"] = list(batching.preferred_batch_sizes)
    if batching.max_queue_delay_us:
        entry["max_queue_delay_microseconds"] = batching.max_queue_delay_us
    if batching.preserve_ordering:
        entry["preserve_ordering"] = True
    config["dynamic_batching"] = entry


def _parameter_value(value: object) -> str:
    # Backends parse booleans as lowercase "true"/"false" (pytorch_backend libtorch.cc ParseParameter).
    return str(value).lower() if isinstance(value, bool) else str(value)


def _set_parameters(config: dict[str, Any], spec: ModelSpec) -> None:
    if spec.parameters:
        config["parameters"] = {
            key: {"string_value": _parameter_value(v)} for key, v in spec.parameters.items()
        }


def _set_ensemble(config: dict[str, Any], spec: ModelSpec) -> None:
    if spec.ensemble_steps:
        config["ensemble_scheduling"] = {
            "step": [
                {
                    "model_name": step.model_name,
                    "model_version": step.model_version,
                    "input_map": dict(step.input_map),
                    "output_map": dict(step.output_map),
                }
                for step in spec.ensemble_steps
            ]
        }


def _warmup_input_dict(sample: WarmupInput) -> dict[str, Any]:
    d: dict[str, Any] = {"data_type": triton_dtype(sample.dtype), "dims": list(sample.dims)}
    if sample.source in _WARMUP_SOURCES:
        d[f"{sample.source}_data"] = True
    else:
        d["input_data_file"] = sample.source
    return d


def _set_warmup(config: dict[str, Any], spec: ModelSpec) -> None:
    if spec.model_warmup:
        config["model_warmup"] = [
            {
                "name": w.name,
                "batch_size": w.batch_size,
                "inputs": {name: _warmup_input_dict(sample) for name, sample in w.inputs.items()},
                "count": w.count,
            }
            for w in spec.model_warmup
        ]


def model_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """Return ``spec`` as a dict in protobuf JSON form (field names of ``model_config.proto``)."""
    config: dict[str, Any] = {"name": spec.name, "max_batch_size": spec.max_batch_size}
    if spec.backend is not None:
        config["backend"] = spec.backend
    if spec.platform is not None:
        config["platform"] = spec.platform
    if spec.default_model_filename is not None:
        config["default_model_filename"] = spec.default_model_filename
    if spec.decoupled:
        config["model_transaction_policy"] = {"decoupled": True}
    for setter in (_set_io, _set_instance_groups, _set_batching, _set_parameters, _set_ensemble, _set_warmup):
        setter(config, spec)
    return config


def model_config_proto(spec: ModelSpec) -> Any:
    """Return ``spec`` as a ``model_config_pb2.ModelConfig`` message (validated by protobuf)."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    return json_format.ParseDict(model_config_dict(spec), model_config_pb2.ModelConfig())


def render_config(spec: ModelSpec) -> str:
    """Return the ``config.pbtxt`` text for ``spec``."""
    from google.protobuf import text_format

    return text_format.MessageToString(model_config_proto(spec))


def write_config(spec: ModelSpec, model_folder: str | Path) -> Path:
    """Write ``<model_folder>/config.pbtxt`` (creating the Triton model folder ``model_folder``) and return
    its path; the file is replaced atomically, so a server loading the model reads the old config or the new
    one, never half of one."""
    path = write_config_text(model_folder, render_config(spec))
    LOGGER.info("wrote %s", path)
    return path


def renamed_config(text: str, name: str) -> str:
    """The ``config.pbtxt`` ``text`` of one model as the config of model ``name`` (everything else equal).

    Raises:
        ValueError: ``text`` is not a model config (names the parse error).
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        message = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"not a Triton model config: {exc}") from None
    message.name = name
    return text_format.MessageToString(message)
