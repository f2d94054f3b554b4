"""Typed specs of every model in the built repository (rendered to config.pbtxt by ``config_gen``).

One function per model; :func:`repository_specs` returns them all for an :class:`InferenceConfig`
and :class:`BuildOptions`. Tensor and model names come from ``io_names`` only.

Layout of a single-configuration repository (see ``repository/build.py``)::

    nnunet (ensemble): IMAGE, SPACING -> preprocess_model -> orchestrator_model -> stitch_model
                       -> SEGMENTATION, PROBABILITIES (only when the request parameter asks for it)
    fold_<k>: INPUT__0 [N, C_in, *patch] -> OUTPUT__0 [N, K, *patch], dynamic batching; either the
              ``pytorch_libtorch`` backend (target gpu) or the Python TorchScript runner (target cpu).

Ensembles of configurations and cascades: :mod:`.composite_specs`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from nnunet_triton import io_names
from nnunet_triton.builder import torch_compat
from nnunet_triton.builder.config_gen import (
    DynamicBatching,
    EnsembleStep,
    InstanceGroup,
    ModelSpec,
    ModelWarmup,
    TensorSpec,
    WarmupInput,
)
from nnunet_triton.dtypes import wire_dtype
from nnunet_triton.errors import InputValidationError
from nnunet_triton.numerics import prediction_export
from nnunet_triton.numerics.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_VOXELS
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.releases import DEFAULT_NUMERICS, release_numerics
from nnunet_triton.options import ProbabilitiesOutput
from nnunet_triton.parameters import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_TILE_BATCH_SIZE,
    DESCRIPTION_PARAMETER,
    PARAM_FOLD_MODELS,
    FoldRunnerParameters,
    OrchestratorParameters,
    PipelineParameters,
    PreprocessParameters,
    StitchParameters,
    description_parameters,
)

__all__ = [
    "Target",
    "FoldRunner",
    "BuildOptions",
    "N_IMAGE_SPATIAL_DIMS",
    "segmentation_dtype",
    "preprocess_spec",
    "orchestrator_spec",
    "stitch_spec",
    "fold_spec",
    "libtorch_fold_spec",
    "python_fold_spec",
    "ensemble_spec",
    "typed_endpoint_specs",
    "is_endpoint",
    "repository_specs",
    "namespaced_specs",
]

# Images always have 3 spatial axes on the wire: nnU-Net's readers return (C, z, y, x) even for 2D
# data (NaturalImage2DIO gives (C, 1, X, Y)); 2D configurations predict slice by slice.
N_IMAGE_SPATIAL_DIMS = 3
_VARIABLE = -1
# target gpu: requests worked on at once by default (their tile batches share the fold forwards)
GPU_ORCHESTRATOR_INSTANCES = 2


class Target(StrEnum):
    CPU = "cpu"
    GPU = "gpu"


class FoldRunner(StrEnum):
    PYTHON = "python"  # torch.jit.load in a Python-backend stub (CPU-only CI, the embedded server)
    LIBTORCH = "libtorch"  # Triton's pytorch_libtorch backend (NGC tritonserver container)


@dataclass(frozen=True)
class BuildOptions:
    """Deployment knobs that are not in the nnU-Net model.

    Attributes:
        target: ``cpu`` (Python models on KIND_CPU, inputs forced to host) or ``gpu``.
        tile_batch_size: tiles per fold request from the orchestrator.
        orchestrator_instances: requests the pipeline works on at once (set it to the expected
            concurrency: one orchestrator instance holds one request). The fold models'
            ``max_batch_size`` is ``tile_batch_size`` x this (:attr:`fold_max_batch_size`), so the
            dynamic batcher can run the tile batches of concurrent requests in one forward. Default
            (None): 1 on cpu (two cores are busy with one request's folds), ``GPU_ORCHESTRATOR_INSTANCES``
            (2) on gpu, so that tiles of two concurrent requests share a forward by default.
        fold_runner: defaults to ``python`` on cpu and ``libtorch`` on gpu.
        fold_precision: ``fp32``, or ``fp16`` (autocast export, FP16 OUTPUT__0; gpu only).
        fold_queue_delay_us: dynamic batcher ``max_queue_delay_microseconds`` of the fold models.
        torch_threads: Python runner ``torch.set_num_threads``; 0 keeps torch's default (one thread per
            core), which is right for a single fold instance on a dedicated machine and matches an
            nnU-Net process on the same machine (oneDNN's rounding depends on the thread count).
        per_sample_forward: every tile runs through the network as its own batch-1 forward, as nnU-Net
            does, which is bit-identical to nnU-Net on CPU (oneDNN picks other convolution kernels for
            other batch sizes, ~5e-6 apart): the Python runner splits each dynamic batch; for libtorch
            folds the orchestrator sends one tile per request and ``max_batch_size`` is 1
            (:attr:`libtorch_per_sample`). ``False`` runs each dynamic batch as one forward (faster,
            not exact). Default (None): True on target cpu, False on gpu.
        max_inflight: orchestrator's in-flight BLS batches per instance (< python thread-pool-size 32).
        max_voxels: the ``max_voxels`` parameter of preprocess, orchestrator and stitch: the most voxels an
            IMAGE, the volume it resamples to, and every volume a step's input declares may have
            (``nnunet_triton.numerics.limits``); 0 = no limit.
        max_request_bytes: their ``max_request_bytes`` parameter: the most bytes a request's float32
            logits or probabilities may take (``numerics.limits.check_request_memory``); 0 = none.
        metrics: the Python pipeline models export the custom ``nnunet_*`` metrics (``serving.metrics``);
            False writes their ``metrics`` parameter as "false".
        numerics: the nnU-Net release whose inference arithmetic the endpoint reproduces
            (``numerics.releases``: ``2.8`` (default, nnU-Net 2.6 to 2.8.1), ``2.5``, ``2.4``, ``2.3``,
            ``2.2.1``, ``2.2``, ``2.1``, ``2.0``); stored in every Python model's ``inference_config.json``.
        serving_torch: major.minor of the torch that loads the fold models where they are served
            (``builder.torch_compat``); default (None): the libtorch of tritonserver 26.09 (2.14) for the
            libtorch runner on gpu, else the serving environment's own torch (the Python runner, and the
            PyTorch backend `make triton-backends` builds against it for the embedded server).
    """

    target: Target = Target.CPU
    tile_batch_size: int = DEFAULT_TILE_BATCH_SIZE
    fold_runner: FoldRunner | None = None
    fold_precision: str = "fp32"
    fold_queue_delay_us: int = 2000
    fold_instances: int = 1
    torch_threads: int = 0
    per_sample_forward: bool | None = None
    preprocess_instances: int = 1
    orchestrator_instances: int | None = None
    stitch_instances: int = 1
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    max_voxels: int = DEFAULT_MAX_VOXELS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    gpus: tuple[int, ...] = ()
    metrics: bool = True
    serving_torch: str | None = None
    numerics: str = DEFAULT_NUMERICS

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", Target(self.target))
        _check_numerics(self.numerics)
        if self.orchestrator_instances is None:
            object.__setattr__(self, "orchestrator_instances",
                               GPU_ORCHESTRATOR_INSTANCES if self.target is Target.GPU else 1)
        if self.fold_runner is not None:
            object.__setattr__(self, "fold_runner", FoldRunner(self.fold_runner))
        counts = {name: getattr(self, name) for name in (
            "tile_batch_size", "fold_instances", "preprocess_instances", "orchestrator_instances",
            "stitch_instances", "max_inflight")}
        bad = {name: value for name, value in counts.items() if value < 1}
        if bad:
            raise ValueError(f"build options must be >= 1, got {bad}.")
        if self.torch_threads < 0 or self.fold_queue_delay_us < 0:
            raise ValueError(
                f"torch_threads and fold_queue_delay_us must be >= 0, got "
                f"{self.torch_threads} and {self.fold_queue_delay_us}."
            )
        for name in ("max_voxels", "max_request_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}.")
        if self.per_sample_forward is None:
            object.__setattr__(self, "per_sample_forward", self.target is Target.CPU)
        if self.fold_precision not in ("fp32", "fp16"):
            raise ValueError(f"fold_precision must be 'fp32' or 'fp16', got {self.fold_precision!r}.")
        if self.fold_precision == "fp16" and self.target is not Target.GPU:
            raise ValueError("fold_precision 'fp16' needs target 'gpu' (CUDA autocast export).")
        if self.serving_torch is not None:
            object.__setattr__(self, "serving_torch", torch_compat.torch_minor_text(self.serving_torch))
        if self.torch_threads and self.runner is FoldRunner.LIBTORCH:
            # the PyTorch backend never reads torch_num_threads: its threads come from the thread budget
            raise ValueError(f"torch_threads={self.torch_threads} is a Python fold runner setting; libtorch "
                             "folds take their threads from the server's thread budget "
                             "(NNUNET_TRITON_FOLD_THREADS): drop it or use fold_runner 'python'.")

    @property
    def runner(self) -> FoldRunner:
        if self.fold_runner is not None:
            return self.fold_runner
        return FoldRunner.LIBTORCH if self.target is Target.GPU else FoldRunner.PYTHON

    @property
    def libtorch_per_sample(self) -> bool:
        """libtorch folds with ``per_sample_forward``: the backend runs each dynamic batch as ONE forward
        (oneDNN's kernels, hence its rounding, differ by batch size: a batch of 4 is up to 3.8e-5 off
        nnU-Net's one-tile logits), so exactness needs one tile per request and no merging."""
        return self.runner is FoldRunner.LIBTORCH and bool(self.per_sample_forward)

    @property
    def fold_forward(self) -> str:
        """How the fold networks run, as ``info``, the metadata and ``validate`` label it."""
        if self.per_sample_forward:
            return "exact: one tile per forward, as nnU-Net"
        return "batched: one forward per dynamic batch (faster; on CPU not bitwise nnU-Net's logits)"

    @property
    def fold_request_tiles(self) -> int:
        """Tiles per orchestrator request to a fold model (1 for :attr:`libtorch_per_sample`)."""
        return 1 if self.libtorch_per_sample else self.tile_batch_size

    @property
    def fold_max_batch_size(self) -> int:
        """The fold models' ``max_batch_size``: one tile batch from every orchestrator instance (1 for
        :attr:`libtorch_per_sample`: Triton's batcher must not merge tiles into one forward)."""
        if self.libtorch_per_sample:
            return 1
        return self.tile_batch_size * self.orchestrator_instances

    @property
    def loading_torch(self) -> str | None:
        """major.minor of the torch that will load the fold models (None: the serving environment's own)."""
        if self.serving_torch is not None:
            return self.serving_torch
        if self.runner is FoldRunner.LIBTORCH and self.target is Target.GPU:
            return torch_compat.DEFAULT_LIBTORCH
        # cpu: the embedded server's PyTorch backend is built against the serving environment's own torch
        # (`make triton-backends`), like the Python runner
        return None

    @property
    def instance_kind(self) -> str:
        return "KIND_GPU" if self.target is Target.GPU else "KIND_CPU"

    @property
    def force_cpu_inputs(self) -> bool:
        """Python models get host copies of their inputs on cpu; on gpu tensors stay where they live."""
        return self.target is not Target.GPU

    @property
    def pipeline_fields(self) -> dict[str, bool]:
        """The :class:`~nnunet_triton.parameters.PipelineParameters` fields these options set."""
        return {"force_cpu_inputs": self.force_cpu_inputs, "metrics": self.metrics}

    @property
    def limit_fields(self) -> dict[str, int]:
        """The :class:`~nnunet_triton.parameters.LimitedParameters` fields these options set."""
        return {"max_voxels": self.max_voxels, "max_request_bytes": self.max_request_bytes}


def _check_numerics(name: str) -> None:
    try:
        release_numerics(name)
    except InputValidationError as exc:
        raise ValueError(str(exc)) from None


def segmentation_dtype(config: InferenceConfig) -> str:
    """The SEGMENTATION wire dtype: nnU-Net's rule (``prediction_export.segmentation_dtype``: UINT8 for
    fewer than 255 foreground labels, else UINT16)."""
    return wire_dtype(prediction_export.segmentation_dtype(config.labels))


def _spatial_dims() -> tuple[int, ...]:
    return (_VARIABLE,) * N_IMAGE_SPATIAL_DIMS


def _image_dims(channels: int) -> tuple[int, ...]:
    return (channels, *([_VARIABLE] * N_IMAGE_SPATIAL_DIMS))


def _python_spec(name: str, options: BuildOptions, count: int, *, inputs: tuple[TensorSpec, ...],
                 outputs: tuple[TensorSpec, ...], parameters: PipelineParameters | None = None) -> ModelSpec:
    return ModelSpec(
        name=name,
        backend="python",
        max_batch_size=0,
        inputs=inputs,
        outputs=outputs,
        instance_groups=(InstanceGroup(count=count, kind=options.instance_kind, gpus=options.gpus),),
        parameters=(parameters or PipelineParameters(**options.pipeline_fields)).to_config(),
    )


def preprocess_spec(config: InferenceConfig, options: BuildOptions) -> ModelSpec:
    """``preprocess_model``: IMAGE, SPACING -> PREPROCESSED, CASE_PROPERTIES; ``max_voxels`` parameter.

    A cascade stage also takes PREVIOUS_SEGMENTATION (the previous stage's SEGMENTATION) and its
    PREPROCESSED carries the one-hot channels after the image channels (the network's input channels).
    """
    n_in = config.num_input_channels
    previous = (TensorSpec(io_names.PREVIOUS_SEGMENTATION, segmentation_dtype(config), _spatial_dims()),) \
        if config.previous_stage is not None else ()
    return _python_spec(
        io_names.PREPROCESS_MODEL, options, options.preprocess_instances,
        inputs=(
            *(TensorSpec(io_names.image_input(dtype), dtype, _image_dims(n_in), optional=True)
              for dtype in io_names.IMAGE_DTYPES),  # exactly one per request (io_names.IMAGE_DTYPES)
            TensorSpec(io_names.SPACING, "FP64", (N_IMAGE_SPATIAL_DIMS,)),
            *previous,
        ),
        outputs=(
            TensorSpec(io_names.PREPROCESSED, "FP32", _image_dims(config.network.num_input_channels)),
            TensorSpec(io_names.CASE_PROPERTIES, "FP64", (_VARIABLE,)),
        ),
        parameters=PreprocessParameters(**options.pipeline_fields, **options.limit_fields),
    )


def orchestrator_spec(config: InferenceConfig, options: BuildOptions, *, prefix: str = "") -> ModelSpec:
    """``orchestrator_model`` (BLS): PREPROCESSED -> fold-averaged LOGITS (FP16, nnU-Net's buffers);
    it calls the fold models ``prefix + fold_<k>``."""
    return _python_spec(
        io_names.ORCHESTRATOR_MODEL, options, options.orchestrator_instances,
        inputs=(TensorSpec(io_names.PREPROCESSED, "FP32", _image_dims(config.network.num_input_channels)),),
        outputs=(TensorSpec(io_names.LOGITS, "FP16", _image_dims(config.labels.num_segmentation_heads)),),
        parameters=OrchestratorParameters(
            **options.pipeline_fields, **options.limit_fields,
            fold_models=tuple(prefix + io_names.fold_model_name(f) for f in config.folds),
            tile_batch_size=options.fold_request_tiles, max_inflight=options.max_inflight),
    )


def stitch_spec(config: InferenceConfig, options: BuildOptions, *,
                probabilities: ProbabilitiesOutput = ProbabilitiesOutput.REQUEST) -> ModelSpec:
    """``stitch_model``: LOGITS, CASE_PROPERTIES -> SEGMENTATION (+ PROBABILITIES as ``probabilities``)."""
    heads = config.labels.num_segmentation_heads
    return _python_spec(
        io_names.STITCH_MODEL, options, options.stitch_instances,
        inputs=(
            TensorSpec(io_names.LOGITS, "FP16", _image_dims(heads)),
            TensorSpec(io_names.CASE_PROPERTIES, "FP64", (_VARIABLE,)),
        ),
        outputs=(
            TensorSpec(io_names.SEGMENTATION, segmentation_dtype(config), _spatial_dims()),
            TensorSpec(io_names.PROBABILITIES, "FP32", _image_dims(heads)),
        ),
        parameters=StitchParameters(**options.pipeline_fields, **options.limit_fields,
                                    probabilities_output=probabilities),
    )


def _fold_io(config: InferenceConfig, options: BuildOptions) -> tuple[tuple[TensorSpec, ...], ...]:
    out_dtype = "FP16" if options.fold_precision == "fp16" else "FP32"
    n_in = config.network.num_input_channels  # image channels (+ one-hot previous stage in a cascade)
    inputs = (TensorSpec(io_names.FOLD_INPUT, "FP32", (n_in, *config.patch_size)),)
    outputs = (TensorSpec(io_names.FOLD_OUTPUT, out_dtype,
                          (config.labels.num_segmentation_heads, *config.patch_size)),)
    return inputs, outputs


def libtorch_fold_spec(config: InferenceConfig, fold: int | str, options: BuildOptions) -> ModelSpec:
    """``fold_<k>`` on Triton's ``pytorch_libtorch`` backend.

    ``DISABLE_OPTIMIZED_EXECUTION`` keeps TorchScript's profiling executor from re-optimizing the
    graph for every new batch size the dynamic batcher produces (server#3012); warm-up runs the
    sizes the fold model sees (1 for a last partial batch, ``tile_batch_size``, and the merged batches of
    concurrent requests up to ``fold_max_batch_size``) so the model is READY only after CUDA/cuDNN
    initialization. With ``per_sample_forward`` (the default on cpu) ``max_batch_size`` is 1 and the
    orchestrator sends one tile per request (``BuildOptions.libtorch_per_sample``): every forward is a
    batch-1 forward, bit-identical to nnU-Net's. ``INTRA_OP_THREAD_COUNT`` and the fold-slot resource come
    from the thread budget on cpu, as for the Python runner.
    """
    inputs, outputs = _fold_io(config, options)
    sample = WarmupInput(dtype="FP32", dims=inputs[0].dims, source="zero")
    warmup = tuple(
        ModelWarmup(name=f"batch_{size}", batch_size=size, inputs={io_names.FOLD_INPUT: sample})
        for size in sorted({1, options.fold_request_tiles, options.fold_max_batch_size})
    )
    return ModelSpec(
        name=io_names.fold_model_name(fold),
        platform="pytorch_libtorch",
        max_batch_size=options.fold_max_batch_size,
        inputs=inputs,
        outputs=outputs,
        instance_groups=(InstanceGroup(
            count=options.fold_instances, kind=options.instance_kind, gpus=options.gpus,
            # one of the thread budget's fold slots per execution, as the Python runner's
            rate_limiter_resources=((io_names.FOLD_SLOT_RESOURCE, 1),) if options.target is Target.CPU
            else ()),),
        dynamic_batching=DynamicBatching(max_queue_delay_us=options.fold_queue_delay_us),
        parameters={"INFERENCE_MODE": "true", "DISABLE_OPTIMIZED_EXECUTION": "true"},
        model_warmup=warmup,
        default_model_filename=io_names.TORCHSCRIPT_FILE,
    )


def python_fold_spec(config: InferenceConfig, fold: int | str, options: BuildOptions) -> ModelSpec:
    """``fold_<k>`` served by ``network_models/python_runner/model.py`` (same names and I/O as libtorch)."""
    inputs, outputs = _fold_io(config, options)
    return ModelSpec(
        name=io_names.fold_model_name(fold),
        backend="python",
        max_batch_size=options.fold_max_batch_size,
        inputs=inputs,
        outputs=outputs,
        instance_groups=(InstanceGroup(
            count=options.fold_instances, kind=options.instance_kind, gpus=options.gpus,
            # one of the thread budget's fold slots per execution (nnunet_triton.server.thread_budget)
            rate_limiter_resources=((io_names.FOLD_SLOT_RESOURCE, 1),) if options.target is Target.CPU
            else ()),),
        dynamic_batching=DynamicBatching(max_queue_delay_us=options.fold_queue_delay_us),
        parameters=FoldRunnerParameters(torch_num_threads=options.torch_threads,
                                        per_sample_forward=bool(options.per_sample_forward),
                                        force_cpu_inputs=options.force_cpu_inputs).to_config(),
    )


def fold_spec(config: InferenceConfig, fold: int | str, options: BuildOptions) -> ModelSpec:
    """``fold_<k>`` for the runner ``options`` selects."""
    if options.runner is FoldRunner.LIBTORCH:
        return libtorch_fold_spec(config, fold, options)
    return python_fold_spec(config, fold, options)


def ensemble_spec(config: InferenceConfig, *, fold_forward: str | None = None) -> ModelSpec:
    """``nnunet``: the one public endpoint (maps are ``{composing model tensor: ensemble tensor}``); its
    config parameter ``nnunet_description`` publishes the model (``parameters.description_parameters``:
    dataset, plans, configuration, trainer, folds, labels, ``fold_forward`` ...) for ``info``, the clients
    and ``validate``."""
    n = io_names
    parameters = description_parameters(config)
    if fold_forward is not None:
        described = json.loads(parameters[DESCRIPTION_PARAMETER]) | {"fold_forward": fold_forward}
        parameters = {DESCRIPTION_PARAMETER: json.dumps(described, sort_keys=True)}
    same = lambda *names: {name: name for name in names}  # noqa: E731
    return ModelSpec(
        name=n.ENDPOINT_MODEL,
        platform="ensemble",
        max_batch_size=0,
        parameters=parameters,
        inputs=(
            TensorSpec(n.IMAGE, "FP32", _image_dims(config.num_input_channels)),
            TensorSpec(n.SPACING, "FP64", (N_IMAGE_SPATIAL_DIMS,)),
        ),
        outputs=(
            TensorSpec(n.SEGMENTATION, segmentation_dtype(config), _spatial_dims()),
            TensorSpec(n.PROBABILITIES, "FP32", _image_dims(config.labels.num_segmentation_heads)),
        ),
        ensemble_steps=(
            EnsembleStep(n.PREPROCESS_MODEL, input_map=same(n.IMAGE, n.SPACING),
                         output_map=same(n.PREPROCESSED, n.CASE_PROPERTIES)),
            EnsembleStep(n.ORCHESTRATOR_MODEL, input_map=same(n.PREPROCESSED), output_map=same(n.LOGITS)),
            EnsembleStep(n.STITCH_MODEL, input_map=same(n.LOGITS, n.CASE_PROPERTIES),
                         output_map=same(n.SEGMENTATION, n.PROBABILITIES)),
        ),
    )


def typed_endpoint_specs(endpoint: ModelSpec) -> tuple[ModelSpec, ...]:
    """Copies of the FP32 endpoint ``endpoint`` for every other IMAGE dtype (``io_names.IMAGE_DTYPES``).

    Same steps, outputs and parameters; IMAGE has the copy's dtype and is mapped onto the matching
    optional input of every step that reads it (preprocess models of members and previous stages too).
    """
    n = io_names
    copies = []
    for dtype in (d for d in n.IMAGE_DTYPES if d != "FP32"):
        inputs = tuple(replace(t, dtype=dtype) if t.name == n.IMAGE else t for t in endpoint.inputs)
        steps = tuple(
            replace(step, input_map={(n.image_input(dtype) if tensor == n.IMAGE and key == n.IMAGE else key):
                                     tensor for key, tensor in step.input_map.items()})
            for step in endpoint.ensemble_steps or ())
        copies.append(replace(endpoint, name=n.typed_endpoint(dtype, endpoint.name), inputs=inputs,
                              ensemble_steps=steps))
    return tuple(copies)


def is_endpoint(spec: ModelSpec) -> bool:
    """An ensemble the clients call (``nnunet`` or one of its typed copies)."""
    return spec.platform == "ensemble"


def repository_specs(config: InferenceConfig, options: BuildOptions, *, folds_only: bool = False
                     ) -> tuple[ModelSpec, ...]:
    """Every model of the repository, fold models first, then the endpoints (``nnunet`` and its typed
    copies); ``folds_only`` leaves out the pipeline."""
    folds = tuple(fold_spec(config, fold, options) for fold in config.folds)
    if folds_only:
        return folds
    endpoint = ensemble_spec(config, fold_forward=options.fold_forward)
    return (*folds, preprocess_spec(config, options), orchestrator_spec(config, options),
            stitch_spec(config, options), endpoint, *typed_endpoint_specs(endpoint))


def namespaced_specs(specs: Sequence[ModelSpec], name: str, version: int, *,
                     described: Mapping[str, object] | None = None
                     ) -> tuple[tuple[ModelSpec, ...], dict[str, str]]:
    """The models of version ``version`` of endpoint ``name`` from the specs of one built pipeline.

    Every composing model gets the namespace ``io_names.model_namespace(name, version)`` (ensemble steps
    and the orchestrator's ``fold_models`` follow); the pipeline's endpoint ``nnunet`` and its typed copies
    become the pinned endpoint ``<name>__v<version>`` (+ typed copies), whose published description names
    the endpoint and the version (and whatever ``described`` adds: the deployed postprocessing). Returns the
    specs and the renaming ``{old name: new name}``.
    """
    described_extra = dict(described or {})
    namespace = io_names.model_namespace(name, version)
    pinned = io_names.pinned_endpoint(name, version)
    endpoints = dict(zip(io_names.public_endpoints(io_names.ENDPOINT_MODEL),
                         io_names.public_endpoints(pinned), strict=True))

    def rename(model: str) -> str:
        return endpoints.get(model, namespace + model)

    renamed = []
    for spec in specs:
        parameters = dict(spec.parameters)
        if PARAM_FOLD_MODELS in parameters:
            folds = [m.strip() for m in str(parameters[PARAM_FOLD_MODELS]).split(",") if m.strip()]
            parameters[PARAM_FOLD_MODELS] = ",".join(rename(m) for m in folds)
        if DESCRIPTION_PARAMETER in parameters:
            described = json.loads(str(parameters[DESCRIPTION_PARAMETER]))
            described |= {"endpoint": name, "version": version, **(described_extra or {})}
            parameters[DESCRIPTION_PARAMETER] = json.dumps(described, sort_keys=True)
        steps = tuple(replace(step, model_name=rename(step.model_name)) for step in spec.ensemble_steps) \
            if spec.ensemble_steps else spec.ensemble_steps
        renamed.append(replace(spec, name=rename(spec.name), ensemble_steps=steps, parameters=parameters))
    return tuple(renamed), {spec.name: rename(spec.name) for spec in specs}
