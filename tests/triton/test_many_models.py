"""Several nnU-Net models behind one server, and versioned rollouts that drop no request.

One repository, one embedded server:

* ``nnunet`` version 1: the CT fixture (``Dataset901_SynthCT``), folds 0 and 1 (promoted);
* ``nnunet`` version 2: the same model with fold 0 only (another answer: the fold average differs);
* ``multi`` version 1: the two-channel fixture (``Dataset903_SynthMulti`` 3d, regions).

Each endpoint answers exactly what nnU-Net's own ``nnUNetPredictor`` answers for its model; a promotion and
a rollback under four clients fail no request and never mix the versions; a version built while the server
runs is loaded, validated against the answers recorded from version 1 and removed, without a restart.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import (
    BUILD_ROOT,
    MAX_INFLIGHT,
    SYNTHCT,
    TEST_MAX_REQUEST_BYTES,
    TEST_MAX_VOXELS,
    TILE_BATCH_SIZE,
    cases,
    model_dir,
    reference,
)

from nnunet_triton import cli
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.builder.repository import VersionChoice, build_repository
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.errors import ClientError
from nnunet_triton.registry import read_registry
from nnunet_triton.server import rollout
from nnunet_triton.server.health import stub_processes
from nnunet_triton.server.watchdog import TOKEN_ENV

MULTI = "Dataset903_SynthMulti/nnUNetTrainer__nnUNetPlans__3d_tiny"
REPOSITORY = BUILD_ROOT / "many-models"
TIMEOUT_S = 600.0
OPTIONS = BuildOptions(tile_batch_size=TILE_BATCH_SIZE, per_sample_forward=True, max_inflight=MAX_INFLIGHT,
                       max_voxels=TEST_MAX_VOXELS, max_request_bytes=TEST_MAX_REQUEST_BYTES)


def _build(dataset: str, *, folds: tuple[int, ...] | None = None, **choice: object) -> object:
    return build_repository(model_dir(dataset), REPOSITORY, options=OPTIONS, folds=folds,
                            endpoint=VersionChoice(**choice))


@pytest.fixture(scope="module")
def server(triton_server):
    if (REPOSITORY / "repository_metadata.json").is_file():  # an earlier run may have stopped mid-rollout
        registry = read_registry(REPOSITORY)
        if "nnunet" in registry.endpoints and 3 in registry.endpoint("nnunet").versions:
            rollout.remove(REPOSITORY, "nnunet", 3)
        if "nnunet" in registry.endpoints and registry.endpoint("nnunet").promoted != 1:
            rollout.promote(REPOSITORY, "nnunet", 1)
    first = _build(SYNTHCT, folds=(0, 1))
    second = _build(SYNTHCT, folds=(0,), new_version=True)
    multi = _build(MULTI, name="multi")
    built = [(r.name, r.version) for r in (first, second, multi)]
    assert built == [("nnunet", 1), ("nnunet", 2), ("multi", 1)]
    with triton_server(REPOSITORY) as handle:
        yield handle


def _segment(handle, image, spacing, model="nnunet", version=None):
    with NnunetClient(handle.grpc_url, "grpc", timeout_s=TIMEOUT_S, endpoint=model,
                      version=version) as client:
        return client.segment(image, spacing, mirroring=False).segmentation


def _stubs(handle) -> dict[str, int]:
    """Model instance -> pid of its Python-backend process."""
    return {stub.instance: stub.pid for stub in stub_processes(handle.pid)}


def test_two_models_on_one_server_each_answer_their_own_nnunet_result(server) -> None:
    ct = cases(SYNTHCT)[0]
    multi = cases(MULTI)[0]
    assert (ct.image.shape[0], multi.image.shape[0]) == (1, 2)
    np.testing.assert_array_equal(_segment(server, ct.image, ct.spacing),
                                  reference(SYNTHCT, ct.name, False, (0, 1)).segmentation)
    np.testing.assert_array_equal(_segment(server, multi.image, multi.spacing, model="multi"),
                                  reference(MULTI, multi.name, False).segmentation)
    np.testing.assert_array_equal(_segment(server, ct.image, ct.spacing, version=2),
                                  reference(SYNTHCT, ct.name, False, (0,)).segmentation)
    with pytest.raises(ClientError, match=r"'multi'.*Expected \[2,-1,-1,-1\], got \[1,"):
        _segment(server, ct.image, ct.spacing, model="multi")  # the CT case has one channel


def test_info_lists_every_endpoint_with_its_versions_and_the_split_of_memory(server, capsys) -> None:
    code = cli.main(["info", "--url", server.http_url, "--model-repository", str(REPOSITORY), "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0
    endpoints = {e["model_name"]: e for e in shown["endpoints"]}
    assert sorted(endpoints) == ["multi", "nnunet"]
    assert (endpoints["multi"]["num_channels"], endpoints["nnunet"]["num_channels"]) == (2, 1)
    assert endpoints["multi"]["published"]["dataset_name"] == "Dataset903_SynthMulti"
    assert [(v["version"], v["promoted"], v["loaded"]) for v in endpoints["nnunet"]["versions"]] == [
        (1, True, True), (2, False, True)]
    shares = shown["memory"]["per_endpoint_version"]
    assert sorted(shares) == ["multi v1", "nnunet v1", "nnunet v2"]
    assert shown["memory"]["fold_models"] == {"multi v1": 1, "nnunet v1": 2, "nnunet v2": 1}
    assert shown["memory"]["shm_mib"] > max(s["shm_mib"] for s in shares.values())


def test_promotion_and_rollback_under_load_fail_no_request_and_never_mix_versions(server) -> None:
    case = cases(SYNTHCT)[0]
    version_answer = {v: _segment(server, case.image, case.spacing, version=v) for v in (1, 2)}
    assert not np.array_equal(version_answer[1], version_answer[2])  # the versions can be told apart
    control = rollout.ModelControl(server.http_url, server.control_token)
    answers: list[tuple[float, float, int]] = []  # (sent, answered, version whose answer it is; 0: neither)
    errors: list[str] = []
    stop = threading.Event()

    def client_loop() -> None:
        with NnunetClient(server.grpc_url, "grpc", timeout_s=TIMEOUT_S) as client:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    answer = client.segment(case.image, case.spacing, mirroring=False).segmentation
                except ClientError as exc:
                    errors.append(str(exc))
                    continue
                which = next((v for v, a in version_answer.items() if np.array_equal(answer, a)), 0)
                answers.append((sent, time.monotonic(), which))

    def wait_for(count: int, since: float) -> None:
        deadline = time.monotonic() + 300
        while sum(1 for sent, _, _ in answers if sent > since) < count and time.monotonic() < deadline:
            time.sleep(0.2)

    stubs_before = _stubs(server)
    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_for(4, 0.0)
        started = time.monotonic()
        rollout.promote(REPOSITORY, "nnunet", 2, control)
        promoted = time.monotonic()
        wait_for(8, promoted)
        rolling_back = time.monotonic()
        rollout.rollback(REPOSITORY, "nnunet", control)
        rolled_back = time.monotonic()
        wait_for(8, rolled_back)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    assert all(which in (1, 2) for _, _, which in answers), "an answer equal to neither version (a mix)"
    # requests were in flight while each switch happened
    assert any(sent < promoted and answered > started for sent, answered, _ in answers)
    assert any(sent < rolled_back and answered > rolling_back for sent, answered, _ in answers)
    # the switches reloaded only the public endpoints: every model process is the one that served before
    assert _stubs(server) == stubs_before
    # once a switch returned, every new request ran on the version it switched to
    assert {w for sent, done, w in answers if promoted < sent and done < rolling_back} == {2}
    assert {w for sent, _, w in answers if sent > rolled_back} == {1}
    entry = read_registry(REPOSITORY).endpoint("nnunet")
    assert (entry.promoted, entry.previous) == (1, 2)


def test_a_version_built_while_serving_is_loaded_validated_against_v1_and_removed_without_a_restart(
        server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv(TOKEN_ENV, server.control_token)
    cases_dir = model_dir(SYNTHCT).parent / "imagesTs"
    common = ["--url", server.http_url, "-i", str(cases_dir), "--no-mirroring",
              "--report", str(tmp_path / "r")]
    record = tmp_path / "v1-answers"
    assert cli.main(["validate", "--model-dir", str(model_dir(SYNTHCT)), "--folds", "0", "1",
                     "--record", str(record), "--endpoint", "nnunet", "--endpoint-version", "1", "--exact",
                     *common]) == 0
    third = _build(SYNTHCT, folds=(1,), new_version=True)
    assert (third.version, third.promoted) == (3, False)
    control = rollout.ModelControl(server.http_url, server.control_token)
    assert not control.ready("nnunet__v3")  # built, not loaded
    assert cli.main(["load", "--endpoint", "nnunet", "--endpoint-version", "3", "--url", server.http_url,
                     "--model-repository", str(REPOSITORY)]) == 0
    case = cases(SYNTHCT)[0]
    np.testing.assert_array_equal(_segment(server, case.image, case.spacing, version=3),
                                  reference(SYNTHCT, case.name, False, (1,)).segmentation)
    against = ["validate", "--against", str(record), "--endpoint", "nnunet", "--endpoint-version", "3",
               *common]
    assert cli.main(against) == 2  # another training (its folds differ): refused unless allowed
    assert "--allow-model-change" in capsys.readouterr().err
    assert cli.main([*against, "--allow-model-change", "--min-dice", "0.8"]) == 0
    report = json.loads((tmp_path / "r" / "validation.json").read_text())
    assert report["deployment"]["endpoint"] == "nnunet__v3"
    assert report["deployment"]["model_changes"] == ["folds: recorded ['0', '1'], now ['1']"]
    assert cli.main(["remove", "--endpoint", "nnunet", "--endpoint-version", "3", "--url", server.http_url,
                     "--model-repository", str(REPOSITORY)]) == 0
    assert not control.ready("nnunet__v3__fold_1") and not (REPOSITORY / "nnunet__v3__fold_1").exists()
    assert sorted(read_registry(REPOSITORY).endpoint("nnunet").versions) == [1, 2]
    np.testing.assert_array_equal(_segment(server, case.image, case.spacing),  # the public endpoint as it was
                                  reference(SYNTHCT, case.name, False, (0, 1)).segmentation)
    assert server.health().healthy, server.health().problems()
