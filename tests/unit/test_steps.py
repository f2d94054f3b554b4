"""The serving steps (``nnunet_triton.serving.steps``) driven without a server, with the fake stub.

Each step's ``run`` is the library call it exists for (compared with the library itself on the SynthCT
fixture); the base answers every request on its own with the error mapped to its Triton code, and a
failed ``initialize`` names the model. The thin ``model.py`` files of the source tree are what the builder
writes.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from fake_pb import FakeError, FakeLogger, FakeRequest, FakeTensor, install

from nnunet_triton import io_names
from nnunet_triton.builder.build_inputs import ADAPTERS, COMBINE_ADAPTER, FOLD_RUNNER_ADAPTER, adapter_source
from nnunet_triton.numerics.model_folder import read_model_folder
from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation
from nnunet_triton.numerics.preprocess import CaseProperties, preprocess_case
from nnunet_triton.options import RequestOptions
from nnunet_triton.serving.metrics import RequestRecord
from nnunet_triton.serving.steps.preprocess import PreprocessStep
from nnunet_triton.serving.steps.stitch import StitchStep
from tests.fixture_paths import SYNTH_CT, require_fixture

SYNTHCT_MODEL = SYNTH_CT.model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
# the steps' model.py files in the source tree (the builder writes the same text into repositories)
SOURCE_ADAPTERS = {
    "preprocess": "preprocess_model/model.py",
    "orchestrator": "repository/orchestrator/model.py",
    "fold_runner": "network_models/python_runner/model.py",
    "stitch": "stitch_model/model.py",
    "combine": "repository/ensemble_combine/model.py",
}


@pytest.fixture(autouse=True)
def _committed_fixture() -> None:
    require_fixture(SYNTHCT_MODEL / "plans.json")


@pytest.fixture(autouse=True)
def pb(monkeypatch: pytest.MonkeyPatch):
    return install(monkeypatch)


@pytest.fixture(scope="module")
def config():
    return read_model_folder(SYNTHCT_MODEL, folds=(0, 1))


def _args(tmp_path: Path, name: str, config, model_config: dict | None = None) -> dict[str, str]:
    folder = tmp_path / name
    (folder / "1").mkdir(parents=True)
    config.save(folder / "1")
    return {"model_name": name, "model_repository": str(folder), "model_version": "1",
            "model_config": json.dumps(model_config or {}), "model_instance_kind": "CPU",
            "model_instance_device_id": "0"}


def _case(config) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    image = (rng.normal(size=(1, 20, 30, 28)) * 200).astype(np.float32)
    return image, np.asarray([2.0, 1.0, 1.0], np.float64)


def _request(image: np.ndarray, spacing: np.ndarray, **parameters) -> FakeRequest:
    inputs = [FakeTensor.of(io_names.IMAGE, image), FakeTensor.of(io_names.SPACING, spacing)]
    return FakeRequest(inputs=inputs, parameters=json.dumps(parameters))


def test_the_preprocess_steps_run_is_preprocess_case(tmp_path: Path, config) -> None:
    step = PreprocessStep(_args(tmp_path, io_names.PREPROCESS_MODEL, config))
    image, spacing = _case(config)
    arrays = {io_names.IMAGE: image, io_names.SPACING: spacing, io_names.PREVIOUS_SEGMENTATION: None}
    result = step.run(arrays, RequestOptions.from_parameters({}, config), RequestRecord())
    data, props = preprocess_case(image, spacing, config, max_voxels=step.limits["max_voxels"],
                                  max_request_bytes=step.limits["max_request_bytes"])
    np.testing.assert_array_equal(result[io_names.PREPROCESSED], data)
    np.testing.assert_array_equal(result[io_names.CASE_PROPERTIES], props.to_array())


def test_each_request_of_a_batch_is_answered_on_its_own_with_its_triton_code(tmp_path: Path, config) -> None:
    step = PreprocessStep(_args(tmp_path, io_names.PREPROCESS_MODEL, config))
    image, spacing = _case(config)
    good = _request(image, spacing, mirroring=False)
    typo = _request(image, spacing, mirorring=False)
    no_spacing = FakeRequest(inputs=[FakeTensor.of(io_names.IMAGE, image)], parameters="{}")
    answers = step.execute([typo, good, no_spacing])
    assert [a.has_error() for a in answers] == [True, False, True]
    assert answers[0].error().code() == FakeError.INVALID_ARG and "mirorring" in answers[0].error().message()
    assert "request has no input tensor 'SPACING'" in answers[2].error().message()
    outputs = {t.name(): t.data() for t in answers[1].output_tensors()}
    assert set(outputs) == {io_names.PREPROCESSED, io_names.CASE_PROPERTIES}


def test_an_unexpected_error_is_internal_and_logged_with_its_traceback(
        tmp_path: Path, config, monkeypatch: pytest.MonkeyPatch) -> None:
    step = PreprocessStep(_args(tmp_path, io_names.PREPROCESS_MODEL, config))

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(step, "run", broken)
    (answer,) = step.execute([_request(*_case(config))])
    error = answer.error()
    assert (error.code(), error.message()) == (FakeError.INTERNAL, "ZeroDivisionError: boom")
    assert any(level == "error" and "Traceback" in text for level, text in FakeLogger.lines)


def test_a_failed_initialize_names_the_model_and_the_reason(tmp_path: Path) -> None:
    from nnunet_triton.serving.steps.preprocess import TritonPythonModel

    args = {"model_name": "preprocess_model", "model_repository": str(tmp_path / "none"),
            "model_version": "1", "model_config": "{}"}
    with pytest.raises(RuntimeError, match=r"(?s)preprocess_model initialize failed: .*inference_config"):
        TritonPythonModel().initialize(args)


def test_the_stitch_steps_run_is_nnunets_export_of_the_logits(tmp_path: Path, config) -> None:
    model_config = {"output": [{"name": io_names.SEGMENTATION, "data_type": "TYPE_UINT8",
                                "dims": [-1, -1, -1]}]}
    step = StitchStep(_args(tmp_path, io_names.STITCH_MODEL, config, model_config))
    image, spacing = _case(config)
    data, props = preprocess_case(image, spacing, config)
    logits = np.random.default_rng(4).normal(
        size=(config.labels.num_segmentation_heads, *data.shape[1:])).astype(np.float16)
    options = RequestOptions.from_parameters({"probabilities": True}, config)
    arrays = {io_names.LOGITS: logits, io_names.CASE_PROPERTIES: CaseProperties.from_array(props.to_array())}
    result = step.outputs(step.run(arrays, options, RequestRecord()))
    segmentation, probabilities = convert_logits_to_segmentation(logits, props, config,
                                                                 return_probabilities=True)
    np.testing.assert_array_equal(result[io_names.SEGMENTATION], segmentation.astype(np.uint8))
    np.testing.assert_array_equal(result[io_names.PROBABILITIES], probabilities)
    without = step.run(arrays, RequestOptions.from_parameters({}, config), RequestRecord())
    assert io_names.PROBABILITIES not in without


def test_the_stitch_step_exports_by_rows_with_its_export_threads_and_the_same_bits(
        tmp_path: Path, config, monkeypatch: pytest.MonkeyPatch) -> None:
    from nnunet_triton.errors import ThreadBudgetError
    from nnunet_triton.numerics import slab_export
    from nnunet_triton.pipeline import threads
    from nnunet_triton.pipeline.threads import EXPORT_THREADS_ENV, CpuQuota
    from nnunet_triton.serving.steps import stitch

    monkeypatch.setenv(EXPORT_THREADS_ENV, "2")
    monkeypatch.setattr(threads, "available_cpus", lambda: CpuQuota(2, 2, None, "two CPUs (test)"))
    model_config = {"output": [{"name": io_names.SEGMENTATION, "data_type": "TYPE_UINT8",
                                "dims": [-1, -1, -1]}]}
    step = StitchStep(_args(tmp_path, io_names.STITCH_MODEL, config, model_config))
    assert step.export_threads == 2
    calls: list[dict] = []
    real = slab_export.export_logits

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **{**kwargs, "step_bytes": 1})  # one output row per step: many ranges
    monkeypatch.setattr(stitch, "export_logits", recording)
    image, spacing = _case(config)
    data, props = preprocess_case(image, spacing, config)
    logits = np.random.default_rng(5).normal(
        size=(config.labels.num_segmentation_heads, *data.shape[1:])).astype(np.float16)
    arrays = {io_names.LOGITS: logits, io_names.CASE_PROPERTIES: CaseProperties.from_array(props.to_array())}
    options = RequestOptions.from_parameters({"probabilities": True}, config)
    result = step.run(arrays, options, RequestRecord())
    segmentation, probabilities = convert_logits_to_segmentation(logits, props, config,
                                                                 return_probabilities=True)
    assert [c["workers"] for c in calls] == [2]
    assert result[io_names.SEGMENTATION].tobytes() == segmentation.astype(np.uint8).tobytes()
    assert result[io_names.PROBABILITIES].tobytes() == probabilities.tobytes()
    monkeypatch.setenv(EXPORT_THREADS_ENV, "0")
    with pytest.raises(ThreadBudgetError, match=f"{EXPORT_THREADS_ENV}.*positive integer"):
        StitchStep(_args(tmp_path / "again", io_names.STITCH_MODEL, config, model_config))


def test_a_cpu_server_refuses_probabilities_over_the_budget_but_not_the_labels_of_the_same_case(
        tmp_path: Path, config) -> None:
    from nnunet_triton.errors import InputValidationError

    image, spacing = _case(config)
    data, props = preprocess_case(image, spacing, config)
    heads = config.labels.num_segmentation_heads
    logits_bytes = heads * int(np.prod(data.shape[1:])) * 4
    probabilities_bytes = heads * int(np.prod(image.shape[1:])) * 4
    assert probabilities_bytes > logits_bytes
    budget = {"max_request_bytes": {"string_value": str(logits_bytes)}}
    pre = PreprocessStep(_args(tmp_path, io_names.PREPROCESS_MODEL, config, {"parameters": budget}))
    arrays = {io_names.IMAGE: image, io_names.SPACING: spacing, io_names.PREVIOUS_SEGMENTATION: None}
    labels_only, with_probabilities = (RequestOptions.from_parameters(p, config)
                                       for p in ({}, {"probabilities": True}))
    assert io_names.PREPROCESSED in pre.run(arrays, labels_only, RequestRecord())
    with pytest.raises(InputValidationError, match=f"for its probabilities .* budget .*{logits_bytes} bytes"):
        pre.run(arrays, with_probabilities, RequestRecord())
    output = {"name": io_names.SEGMENTATION, "data_type": "TYPE_UINT8", "dims": [-1, -1, -1]}
    model_config = {"parameters": budget, "output": [output]}
    stitch = StitchStep(_args(tmp_path / "stitch", io_names.STITCH_MODEL, config, model_config))
    logits = np.random.default_rng(6).normal(size=(heads, *data.shape[1:])).astype(np.float16)
    request = FakeRequest(inputs=[FakeTensor.of(io_names.LOGITS, logits),
                                  FakeTensor.of(io_names.CASE_PROPERTIES, props.to_array())], parameters="{}")
    checked = stitch.inputs(request, RequestRecord())  # the labels' bounds only
    expected = convert_logits_to_segmentation(logits, props, config).astype(np.uint8)
    assert stitch.run(checked, labels_only, RequestRecord())[io_names.SEGMENTATION].tobytes() == \
        expected.tobytes()
    with pytest.raises(InputValidationError, match="without probabilities the labels need no such array"):
        stitch.run(checked, with_probabilities, RequestRecord())


@pytest.mark.parametrize("step", sorted(SOURCE_ADAPTERS))
def test_the_source_trees_model_py_is_what_the_builder_writes_and_imports_its_step(step: str) -> None:
    assert (REPO_ROOT / SOURCE_ADAPTERS[step]).read_text() == adapter_source(step)
    assert callable(importlib.import_module(f"nnunet_triton.serving.steps.{step}").TritonPythonModel)


def test_every_adapter_the_builder_writes_has_a_step() -> None:
    assert {*ADAPTERS.values(), FOLD_RUNNER_ADAPTER, COMBINE_ADAPTER} <= set(SOURCE_ADAPTERS)


def _orchestrator(tmp_path: Path, config, instance_group: list[dict]):
    from nnunet_triton.parameters import OrchestratorParameters
    from nnunet_triton.serving.steps.orchestrator import OrchestratorStep

    parameters = OrchestratorParameters(fold_models=("fold_0", "fold_1")).to_config()
    model_config = {"parameters": {key: {"string_value": value} for key, value in parameters.items()},
                    "instance_group": instance_group}
    return OrchestratorStep(_args(tmp_path, io_names.ORCHESTRATOR_MODEL, config, model_config))


def test_the_orchestrator_refuses_a_request_whose_fold_accumulators_do_not_fit_its_memory_share(
        tmp_path: Path, config) -> None:
    import asyncio

    # the host's real available memory shared by 10**12 instances leaves each less than one fold needs
    step = _orchestrator(tmp_path, config, [{"count": 10**12, "kind": "KIND_CPU"}])
    data = np.zeros((1, 20, 30, 28), np.float32)
    (answer,) = asyncio.run(step.execute([FakeRequest([FakeTensor.of(io_names.PREPROCESSED, data)])]))
    error = answer.error()
    assert error.code() == FakeError.UNAVAILABLE
    assert "fold-accumulator memory limit: 2 folds x" in error.message()
    assert "available host memory" in error.message() and "/ 1000000000000 instances" in error.message()


def test_the_orchestrator_shares_memory_with_the_instances_on_its_device(tmp_path: Path, config) -> None:
    from nnunet_triton.serving.devices import InstanceDevice

    groups = {"instance_group": [{"count": 2, "kind": "KIND_GPU"},
                                 {"count": 3, "kind": "KIND_GPU", "gpus": [1]},
                                 {"count": 4, "kind": "KIND_CPU"}]}
    gpu0, gpu1, host = InstanceDevice(gpu=True, index=0), InstanceDevice(gpu=True, index=1), InstanceDevice()
    assert [gpu0.instances(groups), gpu1.instances(groups), host.instances(groups), host.instances({})] == [
        2, 5, 9, 1]
