"""config_gen: ModelSpec -> config.pbtxt, golden-tested and parsed back with Triton's own protobuf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from nnunet_triton.builder.config_gen import (
    DynamicBatching,
    EnsembleStep,
    InstanceGroup,
    ModelSpec,
    ModelWarmup,
    TensorSpec,
    WarmupInput,
    model_config_dict,
    model_config_proto,
    render_config,
    write_config,
)
from nnunet_triton.dtypes import triton_dtype

ASSETS = Path(__file__).parent / "assets"

PYTHON_SPEC = ModelSpec(
    name="python_model",
    backend="python",
    max_batch_size=0,
    inputs=(
        TensorSpec("IMAGE", "FP32", (-1, -1, -1, -1)),
        TensorSpec("SPACING", np.float64, (3,)),
        TensorSpec("OPTIONS", "BYTES", (1,), optional=True),
    ),
    outputs=(TensorSpec("SEGMENTATION", np.uint8, (-1, -1, -1)),),
    instance_groups=(InstanceGroup(count=2, kind="cpu"),),
    parameters={"FORCE_CPU_ONLY_INPUT_TENSORS": "no", "SHM_NOTE": 16},
)

LIBTORCH_SPEC = ModelSpec(
    name="fold_0",
    platform="pytorch_libtorch",
    max_batch_size=8,
    inputs=(TensorSpec("volume__0", "TYPE_FP16", (1, 128, 128, 128)),),
    outputs=(TensorSpec("logits__0", "FP16", (3, 128, 128, 128)),),
    instance_groups=(InstanceGroup(count=1, kind="gpu", gpus=(0,)),),
    dynamic_batching=DynamicBatching(max_queue_delay_us=2000, preferred_batch_sizes=(4, 8)),
    parameters={"INFERENCE_MODE": "true", "DISABLE_OPTIMIZED_EXECUTION": "true"},
    model_warmup=(
        ModelWarmup("zeros_b1", 1, {"volume__0": WarmupInput("FP16", (1, 128, 128, 128))}),
        ModelWarmup(
            "random_b8", 8, {"volume__0": WarmupInput("FP16", (1, 128, 128, 128), "random")}, count=2
        ),
    ),
    default_model_filename="model.pt",
)

ENSEMBLE_SPEC = ModelSpec(
    name="pipeline",
    platform="ensemble",
    inputs=(TensorSpec("IMAGE", "FP32", (-1, -1, -1)),),
    outputs=(TensorSpec("SEGMENTATION", "UINT8", (-1, -1, -1)),),
    ensemble_steps=(
        EnsembleStep("pre", {"IMAGE": "IMAGE"}, {"PREPROCESSED": "volume"}),
        EnsembleStep("post", {"PREPROCESSED": "volume"}, {"SEGMENTATION": "SEGMENTATION"}, model_version=1),
    ),
)


@pytest.mark.parametrize(
    ("spec", "golden"),
    [(PYTHON_SPEC, "config_gen_python.pbtxt"), (LIBTORCH_SPEC, "config_gen_libtorch.pbtxt")],
    ids=["python", "libtorch"],
)
def test_render_config_matches_golden_text_when_spec_is(spec: ModelSpec, golden: str) -> None:
    assert render_config(spec) == (ASSETS / golden).read_text()


@pytest.mark.parametrize(
    "spec", [PYTHON_SPEC, LIBTORCH_SPEC, ENSEMBLE_SPEC], ids=["python", "libtorch", "ensemble"]
)
def test_rendered_config_parses_back_to_the_same_message(spec: ModelSpec) -> None:
    parsed = text_format.Parse(render_config(spec), model_config_pb2.ModelConfig())

    assert parsed == model_config_proto(spec)
    assert parsed.name == spec.name


def test_model_config_dict_has_ensemble_scheduling_when_spec_is_an_ensemble() -> None:
    assert model_config_dict(ENSEMBLE_SPEC) == {
        "name": "pipeline",
        "max_batch_size": 0,
        "platform": "ensemble",
        "input": [{"name": "IMAGE", "data_type": "TYPE_FP32", "dims": [-1, -1, -1]}],
        "output": [{"name": "SEGMENTATION", "data_type": "TYPE_UINT8", "dims": [-1, -1, -1]}],
        "ensemble_scheduling": {
            "step": [
                {
                    "model_name": "pre",
                    "model_version": -1,
                    "input_map": {"IMAGE": "IMAGE"},
                    "output_map": {"PREPROCESSED": "volume"},
                },
                {
                    "model_name": "post",
                    "model_version": 1,
                    "input_map": {"PREPROCESSED": "volume"},
                    "output_map": {"SEGMENTATION": "SEGMENTATION"},
                },
            ]
        },
    }


def test_model_config_dict_sets_policy_ragged_inputs_and_lowercase_bools_when_requested() -> None:
    spec = ModelSpec(
        name="m",
        backend="python",
        max_batch_size=4,
        inputs=(TensorSpec("X", "FP32", (-1,), allow_ragged_batch=True),),
        outputs=(TensorSpec("Y", "FP32", (-1,), reshape=(-1, 1)),),
        dynamic_batching=DynamicBatching(preserve_ordering=True),
        parameters={"ENABLE_CACHE_CLEANING": True, "INTRA_OP_THREAD_COUNT": 2},
        decoupled=True,
    )

    assert model_config_dict(spec) == {
        "name": "m",
        "max_batch_size": 4,
        "backend": "python",
        "model_transaction_policy": {"decoupled": True},
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1], "allow_ragged_batch": True}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1], "reshape": {"shape": [-1, 1]}}],
        "dynamic_batching": {"preserve_ordering": True},
        "parameters": {
            "ENABLE_CACHE_CLEANING": {"string_value": "true"},
            "INTRA_OP_THREAD_COUNT": {"string_value": "2"},
        },
    }


def test_write_config_creates_the_model_dir_and_writes_the_rendered_text(tmp_path: Path) -> None:
    path = write_config(PYTHON_SPEC, tmp_path / "python_model")

    assert path == tmp_path / "python_model" / "config.pbtxt"
    assert path.read_text() == render_config(PYTHON_SPEC)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("FP32", "TYPE_FP32"),
        ("type_int16", "TYPE_INT16"),
        ("BYTES", "TYPE_STRING"),
        (np.float16, "TYPE_FP16"),
        (np.dtype("int64"), "TYPE_INT64"),
        (np.uint8, "TYPE_UINT8"),
        (np.bool_, "TYPE_BOOL"),
        (np.object_, "TYPE_STRING"),
    ],
)
def test_triton_dtype_maps_names_and_numpy_dtypes(dtype: object, expected: str) -> None:
    assert triton_dtype(dtype) == expected


@pytest.mark.parametrize(
    ("make_spec", "message"),
    [
        (
            lambda: ModelSpec(
                "m", backend="python", inputs=(TensorSpec("X", "FP32", (1,)), TensorSpec("X", "INT16", (1,)))
            ),
            r"model 'm': duplicate input tensor names \['X'\]",
        ),
        (lambda: TensorSpec("X", "FLOAT99", (1,)), r"dtype must be one of .* got 'FLOAT99'"),
        (lambda: TensorSpec("X", np.complex64, (1,)), r"numpy dtype complex64 has no Triton equivalent"),
        (lambda: ModelSpec("m", backend="python", max_batch_size=-1), r"max_batch_size must be >= 0, got -1"),
        (lambda: TensorSpec("X", "FP32", (4, 0)), r"tensor 'X': every dim must be -1 \(variable\) or >= 1"),
        (lambda: TensorSpec("X", "FP32", ()), r"tensor 'X': dims must not be empty"),
        (lambda: ModelSpec("m"), r"model 'm': set backend \(e.g. 'python'\) or platform, got neither"),
        (lambda: InstanceGroup(kind="tpu"), r"instance_group kind must be one of .* got 'tpu'"),
        (lambda: InstanceGroup(count=0), r"instance_group count must be >= 1, got 0"),
        (
            lambda: ModelSpec(
                "m",
                backend="python",
                max_batch_size=4,
                dynamic_batching=DynamicBatching(preferred_batch_sizes=(8,)),
            ),
            r"preferred batch sizes must be in \[1, 4\], got \[8\]",
        ),
        (
            lambda: ModelSpec("e", platform="ensemble"),
            r"platform 'ensemble' and non-empty ensemble_steps go together",
        ),
        (
            lambda: ModelSpec("m", backend="python", outputs=(TensorSpec("Y", "FP32", (1,), optional=True),)),
            r"optional/allow_ragged_batch apply to inputs only, got \['Y'\]",
        ),
        (
            lambda: ModelSpec(
                "m", backend="python", model_warmup=(ModelWarmup("w", 2, {"X": WarmupInput("FP32", (1,))}),)
            ),
            r"warmup 'w' batch_size 2 exceeds max_batch_size 0",
        ),
    ],
    ids=[
        "duplicate-names",
        "unknown-dtype",
        "numpy-dtype-without-triton-type",
        "negative-batch",
        "zero-dim",
        "empty-dims",
        "no-backend",
        "bad-kind",
        "zero-instances",
        "preferred-over-max",
        "ensemble-without-steps",
        "optional-output",
        "warmup-over-max",
    ],
)
def test_spec_raises_value_error_naming_the_rule_when_invalid(make_spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_spec()


def test_importing_config_gen_does_not_import_tritonclient() -> None:
    code = "import sys, nnunet_triton.builder.config_gen; sys.exit('tritonclient' in sys.modules)"
    src = Path(__file__).resolve().parents[2] / "src"

    result = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(src)}, check=False)

    assert result.returncode == 0
