"""model_specs: each generated config.pbtxt parsed back into a ``ModelConfig`` message, field by field."""

from __future__ import annotations

import copy
import json

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from nnunet_triton import io_names
from nnunet_triton.builder.composite_specs import ensemble_repository_specs
from nnunet_triton.builder.config_gen import render_config
from nnunet_triton.builder.model_specs import (
    BuildOptions,
    FoldRunner,
    Target,
    ensemble_spec,
    fold_spec,
    libtorch_fold_spec,
    orchestrator_spec,
    preprocess_spec,
    python_fold_spec,
    repository_specs,
    stitch_spec,
)
from nnunet_triton.numerics.model_folder import load_inference_config
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.parameters import PreprocessParameters

PATCH = (16, 24, 32)
_CONFIGURATION = {
    "data_identifier": "nnUNetPlans_3d_fullres",
    "preprocessor_name": "DefaultPreprocessor",
    "batch_size": 2,
    "patch_size": list(PATCH),
    "median_image_size_in_voxels": [40, 60, 80],
    "spacing": [2.0, 1.0, 1.0],
    "normalization_schemes": ["ZScoreNormalization", "ZScoreNormalization"],
    "use_mask_for_norm": [False, False],
    "resampling_fn_data": "resample_data_or_seg_to_shape",
    "resampling_fn_data_kwargs": {"is_seg": False, "order": 3, "order_z": 0, "force_separate_z": None},
    "resampling_fn_seg": "resample_data_or_seg_to_shape",
    "resampling_fn_seg_kwargs": {"is_seg": True, "order": 1, "order_z": 0, "force_separate_z": None},
    "resampling_fn_probabilities": "resample_data_or_seg_to_shape",
    "resampling_fn_probabilities_kwargs": {
        "is_seg": False, "order": 1, "order_z": 0, "force_separate_z": None,
    },
    "architecture": {
        "network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
        "arch_kwargs": {"n_stages": 2},
        "_kw_requires_import": [],
    },
}
PLANS = {
    "dataset_name": "Dataset902_Specs",
    "plans_name": "nnUNetPlans",
    "transpose_forward": [0, 1, 2],
    "transpose_backward": [0, 1, 2],
    "image_reader_writer": "SimpleITKIO",
    "configurations": {"3d_fullres": _CONFIGURATION},
    "foreground_intensity_properties_per_channel": {},
}
DATASET = {
    "channel_names": {"0": "T1", "1": "T2"},
    "labels": {"background": 0, "a": 1, "b": 2},
    "file_ending": ".nii.gz",
}


def _config(labels: dict | None = None, folds: tuple = (0, 1)) -> InferenceConfig:
    dataset = copy.deepcopy(DATASET)
    if labels is not None:
        dataset["labels"] = labels
    return load_inference_config(PLANS, dataset, "3d_fullres", trainer_name="nnUNetTrainer",
                                 mirror_axes=(0, 1, 2), folds=folds)


def _parse(spec) -> model_config_pb2.ModelConfig:
    return text_format.Parse(render_config(spec), model_config_pb2.ModelConfig())


def _params(message: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in message.parameters.items()}


def _io(tensors) -> list[tuple[str, str, list[int]]]:
    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in tensors]


def test_libtorch_fold_config_equals_expected_message_when_target_gpu() -> None:
    message = _parse(libtorch_fold_spec(_config(), 3, BuildOptions(target=Target.GPU, tile_batch_size=6,
                                                                     fold_queue_delay_us=500,
                                                                     orchestrator_instances=1)))
    expected = text_format.Parse(
        """
        name: "fold_3" platform: "pytorch_libtorch" max_batch_size: 6 default_model_filename: "model.pt"
        input { name: "INPUT__0" data_type: TYPE_FP32 dims: [2, 16, 24, 32] }
        output { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [3, 16, 24, 32] }
        instance_group { count: 1 kind: KIND_GPU }
        dynamic_batching { max_queue_delay_microseconds: 500 }
        parameters { key: "INFERENCE_MODE" value { string_value: "true" } }
        parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value { string_value: "true" } }
        model_warmup { name: "batch_1" batch_size: 1 count: 1 inputs { key: "INPUT__0" value {
            data_type: TYPE_FP32 dims: [2, 16, 24, 32] zero_data: true } } }
        model_warmup { name: "batch_6" batch_size: 6 count: 1 inputs { key: "INPUT__0" value {
            data_type: TYPE_FP32 dims: [2, 16, 24, 32] zero_data: true } } }
        """,
        model_config_pb2.ModelConfig(),
    )
    assert message == expected


def test_libtorch_fold_output_is_fp16_when_precision_fp16() -> None:
    message = _parse(libtorch_fold_spec(_config(), 0, BuildOptions(target="gpu", fold_precision="fp16")))
    assert _io(message.input) == [("INPUT__0", "TYPE_FP32", [2, *PATCH])]
    assert _io(message.output) == [("OUTPUT__0", "TYPE_FP16", [3, *PATCH])]


def test_libtorch_fold_warmup_has_one_entry_when_tile_batch_size_is_one() -> None:
    message = _parse(libtorch_fold_spec(_config(), 0, BuildOptions(target="gpu", tile_batch_size=1,
                                                                     orchestrator_instances=1)))
    assert [(w.name, w.batch_size) for w in message.model_warmup] == [("batch_1", 1)]


@pytest.mark.parametrize(("target", "instances"), [("cpu", 1), ("gpu", 2)])
def test_gpu_target_works_on_two_requests_at_once_by_default_so_their_tiles_share_forwards(target, instances):
    options = BuildOptions(target=target, tile_batch_size=4)
    assert options.orchestrator_instances == instances
    assert [g.count for g in _parse(orchestrator_spec(_config(), options)).instance_group] == [instances]
    assert _parse(fold_spec(_config(), 0, options)).max_batch_size == 4 * instances
    if target == "gpu":  # the libtorch warm-up covers the merged batch of two requests
        assert [w.batch_size for w in _parse(fold_spec(_config(), 0, options)).model_warmup] == [1, 4, 8]


@pytest.mark.parametrize("runner", [FoldRunner.PYTHON, FoldRunner.LIBTORCH])
def test_fold_models_take_one_tile_batch_per_orchestrator_instance_when_concurrency_expected(runner):
    options = BuildOptions(target="gpu", fold_runner=runner, tile_batch_size=4, orchestrator_instances=3)
    message = _parse(fold_spec(_config(), 0, options))
    assert message.max_batch_size == options.fold_max_batch_size == 12
    assert message.dynamic_batching.max_queue_delay_microseconds == options.fold_queue_delay_us
    if runner is FoldRunner.LIBTORCH:  # warm-up covers the merged batches of concurrent requests too
        assert [w.batch_size for w in message.model_warmup] == [1, 4, 12]
    orchestrator = _parse(orchestrator_spec(_config(), options))
    assert [g.count for g in orchestrator.instance_group] == [3]


def test_python_fold_config_has_libtorch_io_and_runner_parameters_when_target_cpu() -> None:
    options = BuildOptions(tile_batch_size=5, fold_instances=2, torch_threads=3)
    python = _parse(python_fold_spec(_config(), 1, options))
    libtorch = _parse(libtorch_fold_spec(_config(), 1, options))
    header = (python.name, python.backend, python.platform, python.max_batch_size)
    assert header == ("fold_1", "python", "", 5)
    assert (_io(python.input), _io(python.output)) == (_io(libtorch.input), _io(libtorch.output))
    assert python.dynamic_batching == libtorch.dynamic_batching
    groups = [(g.count, model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)) for g in python.instance_group]
    assert groups == [(2, "KIND_CPU")]
    assert _params(python) == {
        "FORCE_CPU_ONLY_INPUT_TENSORS": "yes",
        "torch_num_threads": "3",
        "per_sample_forward": "true",
        "model_filename": "model.pt",
    }
    assert not python.model_warmup


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (BuildOptions(), FoldRunner.PYTHON),
        (BuildOptions(target="gpu"), FoldRunner.LIBTORCH),
        (BuildOptions(target="gpu", fold_runner="python"), FoldRunner.PYTHON),
    ],
)
def test_fold_spec_picks_runner_from_target_unless_given(options: BuildOptions, expected: FoldRunner) -> None:
    message = _parse(fold_spec(_config(), 0, options))
    assert (message.backend, message.platform) == (
        ("python", "") if expected is FoldRunner.PYTHON else ("", "pytorch_libtorch")
    )


@pytest.mark.parametrize(
    ("target", "kind", "force_cpu"), [("cpu", "KIND_CPU", "yes"), ("gpu", "KIND_GPU", "no")]
)
def test_python_pipeline_models_follow_target_when_built(target: str, kind: str, force_cpu: str) -> None:
    options = BuildOptions(
        target=target, preprocess_instances=2, orchestrator_instances=3, stitch_instances=4
    )
    config = _config()
    counts = {}
    for make in (preprocess_spec, orchestrator_spec, stitch_spec):
        spec = make(config, options)
        message = _parse(spec)
        assert (message.backend, message.max_batch_size) == ("python", 0)
        assert _params(message)["FORCE_CPU_ONLY_INPUT_TENSORS"] == force_cpu
        (group,) = message.instance_group
        assert model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) == kind
        counts[message.name] = group.count
    assert counts == {"preprocess_model": 2, "orchestrator_model": 3, "stitch_model": 4}


def test_pipeline_model_tensors_match_contract_when_two_channels_three_labels() -> None:
    config, options = _config(), BuildOptions()
    preprocess = _parse(preprocess_spec(config, options))
    orchestrator = _parse(orchestrator_spec(config, options))
    stitch = _parse(stitch_spec(config, options))
    assert _io(preprocess.input) == [
        ("IMAGE", "TYPE_FP32", [2, -1, -1, -1]), ("IMAGE_FP16", "TYPE_FP16", [2, -1, -1, -1]),
        ("IMAGE_INT16", "TYPE_INT16", [2, -1, -1, -1]), ("IMAGE_UINT16", "TYPE_UINT16", [2, -1, -1, -1]),
        ("IMAGE_UINT8", "TYPE_UINT8", [2, -1, -1, -1]), ("SPACING", "TYPE_FP64", [3]),
    ]
    assert [t.optional for t in preprocess.input] == [True] * 5 + [False]
    assert _io(preprocess.output) == [
        ("PREPROCESSED", "TYPE_FP32", [2, -1, -1, -1]),
        ("CASE_PROPERTIES", "TYPE_FP64", [-1]),
    ]
    assert _io(orchestrator.input) == [("PREPROCESSED", "TYPE_FP32", [2, -1, -1, -1])]
    assert _io(orchestrator.output) == [("LOGITS", "TYPE_FP16", [3, -1, -1, -1])]
    assert _io(stitch.input) == [
        ("LOGITS", "TYPE_FP16", [3, -1, -1, -1]),
        ("CASE_PROPERTIES", "TYPE_FP64", [-1]),
    ]
    assert _io(stitch.output) == [
        ("SEGMENTATION", "TYPE_UINT8", [-1, -1, -1]),
        ("PROBABILITIES", "TYPE_FP32", [3, -1, -1, -1]),
    ]


def test_orchestrator_parameters_list_fold_models_in_config_order() -> None:
    options = BuildOptions(tile_batch_size=8, max_inflight=6)
    message = _parse(orchestrator_spec(_config(folds=(3, 0, "all")), options))
    assert _params(message) == {
        "FORCE_CPU_ONLY_INPUT_TENSORS": "yes",
        "fold_models": "fold_3,fold_0,fold_all",
        "tile_batch_size": "8",
        "max_inflight": "6",
        "max_voxels": str(2**28),
        "max_request_bytes": str(8 * 2**30),
    }


@pytest.mark.parametrize("spec", [preprocess_spec, orchestrator_spec, stitch_spec])
def test_every_pipeline_step_carries_the_builders_request_limits(spec) -> None:
    params = _params(_parse(spec(_config(), BuildOptions(max_voxels=1000, max_request_bytes=4096))))
    assert (params["max_voxels"], params["max_request_bytes"]) == ("1000", "4096")


@pytest.mark.parametrize(("options", "expected", "budget"), [
    (BuildOptions(), str(2**28), str(8 * 2**30)),
    (BuildOptions(max_voxels=1000, max_request_bytes=4096), "1000", "4096"),
    (BuildOptions(max_voxels=0, max_request_bytes=0), "0", "0"),
])
def test_preprocess_parameters_carry_max_voxels_and_memory_budget_from_build_options(
        options: BuildOptions, expected: str, budget: str) -> None:
    message = _parse(preprocess_spec(_config(), options))
    assert _params(message) == {"FORCE_CPU_ONLY_INPUT_TENSORS": "yes", "max_voxels": expected,
                                "max_request_bytes": budget}
    assert PreprocessParameters.from_parameters(_params(message)).max_voxels == int(expected)
    assert PreprocessParameters.from_parameters(_params(message)).max_request_bytes == int(budget)


def test_segmentation_is_uint16_when_a_label_exceeds_255() -> None:
    labels = {"background": 0, **{f"l{i}": i for i in range(1, 300)}}
    config = _config(labels=labels)
    stitch, ensemble = _parse(stitch_spec(config, BuildOptions())), _parse(ensemble_spec(config))
    assert _io(stitch.output)[0] == ("SEGMENTATION", "TYPE_UINT16", [-1, -1, -1])
    assert _io(ensemble.output)[0] == ("SEGMENTATION", "TYPE_UINT16", [-1, -1, -1])


def test_ensemble_maps_each_step_to_the_next_when_built() -> None:
    message = _parse(ensemble_spec(_config()))
    assert (message.name, message.platform, message.max_batch_size) == ("nnunet", "ensemble", 0)
    steps = [(s.model_name, s.model_version, dict(s.input_map), dict(s.output_map))
             for s in message.ensemble_scheduling.step]
    assert steps == [
        ("preprocess_model", -1, {"IMAGE": "IMAGE", "SPACING": "SPACING"},
         {"PREPROCESSED": "PREPROCESSED", "CASE_PROPERTIES": "CASE_PROPERTIES"}),
        ("orchestrator_model", -1, {"PREPROCESSED": "PREPROCESSED"}, {"LOGITS": "LOGITS"}),
        ("stitch_model", -1, {"LOGITS": "LOGITS", "CASE_PROPERTIES": "CASE_PROPERTIES"},
         {"SEGMENTATION": "SEGMENTATION", "PROBABILITIES": "PROBABILITIES"}),
    ]


def test_ensemble_tensors_agree_in_type_and_shape_with_composing_models() -> None:
    """Every ensemble tensor has the same data type and dims wherever it is produced or consumed."""
    config, options = _config(), BuildOptions()
    models = {spec.name: _parse(spec) for spec in repository_specs(config, options)}
    endpoints = [name for name, model in models.items() if model.platform == "ensemble"]
    assert sorted(endpoints) == sorted(io_names.typed_endpoint(d) for d in io_names.IMAGE_DTYPES)
    for name in endpoints:
        ensemble = models[name]
        declared = {t.name: (t.data_type, list(t.dims)) for t in [*ensemble.input, *ensemble.output]}
        for step in ensemble.ensemble_scheduling.step:
            composing = models[step.model_name]
            for tensors, mapping in ((composing.input, step.input_map), (composing.output, step.output_map)):
                by_name = {t.name: (t.data_type, list(t.dims)) for t in tensors}
                required = {t.name for t in tensors if not getattr(t, "optional", False)}
                assert required <= set(mapping) <= set(by_name), step.model_name  # optional: one IMAGE
                for model_tensor, ensemble_tensor in mapping.items():
                    expected = by_name[model_tensor]
                    assert declared.setdefault(ensemble_tensor, expected) == expected


def test_repository_specs_lists_folds_then_pipeline_models() -> None:
    names = [spec.name for spec in repository_specs(_config(), BuildOptions())]
    assert names == ["fold_0", "fold_1", "preprocess_model", "orchestrator_model", "stitch_model", "nnunet",
                     "nnunet_fp16", "nnunet_int16", "nnunet_uint16", "nnunet_uint8"]
    folds_only = repository_specs(_config(), BuildOptions(), folds_only=True)
    assert [s.name for s in folds_only] == ["fold_0", "fold_1"]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "true"),
        ({"target": "gpu", "fold_runner": "python"}, "false"),
        ({"per_sample_forward": False}, "false"),
        ({"per_sample_forward": True, "target": "gpu", "fold_runner": "python"}, "true"),
    ],
)
def test_python_fold_runs_per_sample_by_default_only_on_cpu(kwargs: dict, expected: str) -> None:
    message = _parse(python_fold_spec(_config(), 0, BuildOptions(**kwargs)))
    assert _params(message)["per_sample_forward"] == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fold_precision": "fp16"}, "needs target 'gpu'"),
        ({"fold_precision": "bf16"}, "fold_precision must be"),
        ({"tile_batch_size": 0}, r"must be >= 1, got \{'tile_batch_size': 0\}"),
        ({"torch_threads": -1}, "must be >= 0"),
        ({"target": "tpu"}, "'tpu' is not a valid Target"),
        ({"max_voxels": -1}, r"max_voxels must be >= 0 \(0 = no limit\), got -1"),
        ({"fold_runner": "libtorch", "torch_threads": 2},
         r"torch_threads=2 is a Python fold runner setting; libtorch folds take their threads from"),
    ],
)
def test_build_options_raise_when_invalid(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BuildOptions(**kwargs)


def test_configuration_ensemble_prefixes_member_models_and_feeds_combine_model() -> None:
    configs, options = [_config(), _config(folds=(0,))], BuildOptions()
    specs = ensemble_repository_specs(configs, options)
    assert [s.name for s in specs] == [
        "member0_fold_0", "member0_fold_1", "member0_preprocess_model", "member0_orchestrator_model",
        "member0_stitch_model", "member1_fold_0", "member1_preprocess_model", "member1_orchestrator_model",
        "member1_stitch_model", "combine_model", "nnunet", "nnunet_fp16", "nnunet_int16", "nnunet_uint16",
        "nnunet_uint8",
    ]
    models = {spec.name: _parse(spec) for spec in specs}
    assert _params(models["member0_orchestrator_model"])["fold_models"] == "member0_fold_0,member0_fold_1"
    assert _params(models["member1_orchestrator_model"])["fold_models"] == "member1_fold_0"
    assert _params(models["member1_stitch_model"])["probabilities_output"] == "always"
    assert "probabilities_output" not in _params(_parse(stitch_spec(configs[0], options)))
    ensemble = models[io_names.ENDPOINT_MODEL]
    steps = [(s.model_name, dict(s.input_map), dict(s.output_map)) for s in ensemble.ensemble_scheduling.step]
    assert steps[2] == ("member0_stitch_model",
                        {"LOGITS": "member0_LOGITS", "CASE_PROPERTIES": "member0_CASE_PROPERTIES"},
                        {"PROBABILITIES": "PROBABILITIES_0"})
    assert steps[-1] == ("combine_model",
                         {"PROBABILITIES_0": "PROBABILITIES_0", "PROBABILITIES_1": "PROBABILITIES_1"},
                         {"SEGMENTATION": "SEGMENTATION", "PROBABILITIES": "PROBABILITIES"})
    declared = {t.name: (t.data_type, list(t.dims)) for t in [*ensemble.input, *ensemble.output]}
    for step in ensemble.ensemble_scheduling.step:
        composing = models[step.model_name]
        inputs = {t.name: (t.data_type, list(t.dims)) for t in composing.input}
        outputs = {t.name: (t.data_type, list(t.dims)) for t in composing.output}
        required = {t.name for t in composing.input if not t.optional}
        assert required <= set(step.input_map) <= set(inputs), step.model_name
        assert set(step.output_map) <= set(outputs), step.model_name
        for tensors, mapping in ((inputs, step.input_map), (outputs, step.output_map)):
            for model_tensor, ensemble_tensor in mapping.items():
                assert declared.setdefault(ensemble_tensor, tensors[model_tensor]) == tensors[model_tensor]


def test_python_pipeline_models_switch_metrics_off_only_when_asked() -> None:
    config = _config()
    for options, expected in ((BuildOptions(), None), (BuildOptions(metrics=False), "false")):
        for spec in (preprocess_spec(config, options), orchestrator_spec(config, options),
                     stitch_spec(config, options)):
            assert _params(_parse(spec)).get("metrics") == expected, spec.name


@pytest.mark.parametrize(("per_sample", "max_batch", "request_tiles", "label"),
                         [(None, 1, 1, "exact"), (False, 8, 4, "batched")])
def test_libtorch_folds_on_cpu_forward_one_tile_per_request_unless_batched_mode_asked(
        per_sample, max_batch, request_tiles, label):
    options = BuildOptions(fold_runner="libtorch", tile_batch_size=4, orchestrator_instances=2,
                           per_sample_forward=per_sample)
    fold = _parse(fold_spec(_config(), 0, options))
    orchestrator = _params(_parse(orchestrator_spec(_config(), options)))
    described = json.loads(_params(_parse(next(
        s for s in repository_specs(_config(), options) if s.name == io_names.ENDPOINT_MODEL)))[
        "nnunet_description"])

    assert (fold.max_batch_size, int(orchestrator["tile_batch_size"])) == (max_batch, request_tiles)
    assert [w.batch_size for w in fold.model_warmup] == sorted({1, request_tiles, max_batch})
    assert described["fold_forward"].split(":")[0] == label
    assert options.loading_torch is None  # the embedded server's backend is built against this torch
