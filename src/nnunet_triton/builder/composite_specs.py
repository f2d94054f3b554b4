"""Specs of composite repositories: ensembles of configurations (``nnUNetv2_ensemble``) and cascades.

Both reuse the single-configuration specs of :mod:`.model_specs` with a prefix on every model name.

An ensemble of configurations (``nnUNetv2_ensemble`` behind the same endpoint) prefixes every model of
member ``i`` with ``member<i>_`` (its stitch model always returns PROBABILITIES) and ends in
``combine_model``::

    nnunet (ensemble): IMAGE, SPACING -> member<i>_preprocess_model -> member<i>_orchestrator_model
                       -> member<i>_stitch_model -> PROBABILITIES_<i> (all members run concurrently)
                       -> combine_model -> SEGMENTATION, PROBABILITIES
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from nnunet_triton import io_names
from nnunet_triton.builder.config_gen import (
    EnsembleStep,
    ModelSpec,
    TensorSpec,
)
from nnunet_triton.builder.model_specs import (
    BuildOptions,
    _image_dims,
    _python_spec,
    _spatial_dims,
    ensemble_spec,
    fold_spec,
    is_endpoint,
    orchestrator_spec,
    preprocess_spec,
    repository_specs,
    segmentation_dtype,
    stitch_spec,
    typed_endpoint_specs,
)
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.options import ProbabilitiesOutput

__all__ = [
    "member_specs",
    "combine_spec",
    "configuration_ensemble_spec",
    "ensemble_repository_specs",
    "prefixed_pipeline_specs",
    "cascade_ensemble_spec",
    "cascade_repository_specs",
]


def member_specs(config: InferenceConfig, options: BuildOptions, index: int) -> tuple[ModelSpec, ...]:
    """The models of ensemble member ``index``: the single-configuration models, names prefixed."""
    return prefixed_pipeline_specs(config, options, io_names.member_prefix(index),
                                   probabilities=ProbabilitiesOutput.ALWAYS)


def prefixed_pipeline_specs(config: InferenceConfig, options: BuildOptions, prefix: str, *,
                            probabilities: ProbabilitiesOutput) -> tuple[ModelSpec, ...]:
    """Fold, preprocess, orchestrator and stitch models of one pipeline with ``prefix`` on every name."""
    folds = tuple(replace(fold_spec(config, fold, options), name=prefix + io_names.fold_model_name(fold))
                  for fold in config.folds)
    return (
        *folds,
        replace(preprocess_spec(config, options), name=prefix + io_names.PREPROCESS_MODEL),
        replace(orchestrator_spec(config, options, prefix=prefix),
                name=prefix + io_names.ORCHESTRATOR_MODEL),
        replace(stitch_spec(config, options, probabilities=probabilities),
                name=prefix + io_names.STITCH_MODEL),
    )


def combine_spec(configs: Sequence[InferenceConfig], options: BuildOptions) -> ModelSpec:
    """``combine_model``: PROBABILITIES_<i> of every member -> SEGMENTATION (+ averaged PROBABILITIES)."""
    heads = configs[0].labels.num_segmentation_heads
    return _python_spec(
        io_names.COMBINE_MODEL, options, options.stitch_instances,
        inputs=tuple(TensorSpec(io_names.member_probabilities(i), "FP32", _image_dims(heads))
                     for i in range(len(configs))),
        outputs=(
            TensorSpec(io_names.SEGMENTATION, segmentation_dtype(configs[0]), _spatial_dims()),
            TensorSpec(io_names.PROBABILITIES, "FP32", _image_dims(heads)),
        ),
    )


def _prefixed_steps(prefix: str, stitch_outputs: dict[str, str]) -> list[EnsembleStep]:
    """Steps of one prefixed pipeline: IMAGE, SPACING in, ``stitch_outputs`` out, tensors prefixed."""
    n = io_names
    return [
        EnsembleStep(prefix + n.PREPROCESS_MODEL, input_map={n.IMAGE: n.IMAGE, n.SPACING: n.SPACING},
                     output_map={n.PREPROCESSED: prefix + n.PREPROCESSED,
                                 n.CASE_PROPERTIES: prefix + n.CASE_PROPERTIES}),
        EnsembleStep(prefix + n.ORCHESTRATOR_MODEL, input_map={n.PREPROCESSED: prefix + n.PREPROCESSED},
                     output_map={n.LOGITS: prefix + n.LOGITS}),
        EnsembleStep(prefix + n.STITCH_MODEL,
                     input_map={n.LOGITS: prefix + n.LOGITS, n.CASE_PROPERTIES: prefix + n.CASE_PROPERTIES},
                     output_map=stitch_outputs),
    ]


def configuration_ensemble_spec(configs: Sequence[InferenceConfig]) -> ModelSpec:
    """``nnunet`` over several member pipelines and ``combine_model`` (the same public I/O)."""
    n = io_names
    steps: list[EnsembleStep] = []
    for index in range(len(configs)):
        steps += _prefixed_steps(n.member_prefix(index), {n.PROBABILITIES: n.member_probabilities(index)})
    inputs = {n.member_probabilities(i): n.member_probabilities(i) for i in range(len(configs))}
    steps.append(EnsembleStep(n.COMBINE_MODEL, input_map=inputs,
                              output_map={n.SEGMENTATION: n.SEGMENTATION, n.PROBABILITIES: n.PROBABILITIES}))
    base = ensemble_spec(configs[0])
    return replace(base, ensemble_steps=tuple(steps))


def ensemble_repository_specs(configs: Sequence[InferenceConfig], options: BuildOptions
                              ) -> tuple[ModelSpec, ...]:
    """Every model of an ensemble-of-configurations repository, member by member, then combine and nnunet."""
    members = tuple(spec for index, config in enumerate(configs)
                    for spec in member_specs(config, options, index))
    endpoint = configuration_ensemble_spec(configs)
    return (*members, combine_spec(configs, options), endpoint, *typed_endpoint_specs(endpoint))


def cascade_ensemble_spec(config: InferenceConfig) -> ModelSpec:
    """``nnunet`` over a cascade: the previous stage's pipeline (models prefixed ``previous_stage_``) feeds
    its SEGMENTATION to ``preprocess_model`` of the cascade stage as PREVIOUS_SEGMENTATION."""
    n = io_names
    p = n.PREVIOUS_STAGE_PREFIX
    base = ensemble_spec(config)
    steps = (
        *_prefixed_steps(p, {n.SEGMENTATION: p + n.SEGMENTATION}),
        EnsembleStep(n.PREPROCESS_MODEL,
                     input_map={n.IMAGE: n.IMAGE, n.SPACING: n.SPACING,
                                n.PREVIOUS_SEGMENTATION: p + n.SEGMENTATION},
                     output_map={n.PREPROCESSED: n.PREPROCESSED, n.CASE_PROPERTIES: n.CASE_PROPERTIES}),
        *(base.ensemble_steps or ())[1:],
    )
    return replace(base, ensemble_steps=steps)


def cascade_repository_specs(previous: InferenceConfig, config: InferenceConfig, options: BuildOptions
                             ) -> tuple[ModelSpec, ...]:
    """The previous stage's models (prefixed), the cascade stage's models, and the cascade ``nnunet``."""
    own = tuple(spec for spec in repository_specs(config, options) if not is_endpoint(spec))
    endpoint = cascade_ensemble_spec(config)
    return (*prefixed_pipeline_specs(previous, options, io_names.PREVIOUS_STAGE_PREFIX,
                                     probabilities=ProbabilitiesOutput.NEVER),
            *own, endpoint, *typed_endpoint_specs(endpoint))
