"""The internal models of the pipeline answer any client that reaches the port: each bounds what it accepts
and what it makes (``numerics.limits``), with the repository's ``max_voxels``/``max_request_bytes``.

Requests go straight to ``stitch_model``, ``orchestrator_model`` and ``fold_0`` of the shared SynthCT server
(test repository: ``TEST_MAX_VOXELS``), as an attacker would send them. Once, a 421-byte request to
``stitch_model`` declaring a 700^3 volume got a 343 MB answer and left the stub's shared-memory region grown
from 16 to 400 MiB. Each refused request is INVALID_ARG naming the limit and the numbers; the server keeps
answering the probe case correctly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import (
    REPO_ROOT,
    SYNTHCT,
    TEST_MAX_REQUEST_BYTES,
    TEST_MAX_VOXELS,
    build,
    probe_case,
    reference,
    shared_server,
)

from nnunet_triton import io_names
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.server import health, shm_reclaim

SHM = "/dev/shm"


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


@pytest.fixture()
def client(server):
    import tritonclient.http as http

    client = http.InferenceServerClient(server.http_url, network_timeout=300)
    yield client
    client.close()


def _tensor(name: str, array: np.ndarray, dtype: str):
    import tritonclient.http as http

    tensor = http.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def _region_bytes(server, model: str) -> int:
    (stub,) = [s for s in health.stub_processes(server.pid) if s.model == model]
    with open(f"{SHM}/{stub.shm_region}", "rb") as region:
        return region.seek(0, 2)


def _refused(client, model: str, inputs: list, outputs: list[str], match: str) -> None:
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=match) as info:
        client.infer(model, inputs, outputs=[http.InferRequestedOutput(o, binary_data=True) for o in outputs])
    assert info.value.status() == "400", (info.value.status(), str(info.value))


def _still_segments(server) -> None:
    case = probe_case(SYNTHCT)
    with NnunetClient(server.http_url) as nnunet:
        result = nnunet.segment(case.image, case.spacing, mirroring=False)
    np.testing.assert_array_equal(result.segmentation, reference(SYNTHCT, case.name, False).segmentation)


def test_stitch_request_declaring_a_700_cubed_volume_is_refused_and_its_shm_region_does_not_grow(server,
                                                                                                client):
    heads = int(client.get_model_config(io_names.STITCH_MODEL)["input"][0]["dims"][0])
    logits = np.zeros((heads, 1, 1, 1), np.float16)
    properties = np.array([1.0, 1.0, 1.0, 700, 700, 700, 0, 1, 0, 1, 0, 1, 1, 1, 1], np.float64)
    before = _region_bytes(server, io_names.STITCH_MODEL)
    inputs = [_tensor(io_names.LOGITS, logits, "FP16"), _tensor(io_names.CASE_PROPERTIES, properties, "FP64")]
    _refused(client, io_names.STITCH_MODEL, inputs,
             [io_names.SEGMENTATION], r"shape before cropping\) has 343000000 voxels .* limit of "
             rf"{TEST_MAX_VOXELS} voxels \(model parameter 'max_voxels'\)")
    assert _region_bytes(server, io_names.STITCH_MODEL) == before
    _still_segments(server)


def test_orchestrator_request_over_the_voxel_limit_is_refused_before_any_tile_runs(server, client):
    side = round(TEST_MAX_VOXELS ** (1 / 3)) + 2  # one channel (SynthCT): just over the limit
    volume = np.zeros((1, side, side, side), np.float32)
    _refused(client, io_names.ORCHESTRATOR_MODEL, [_tensor(io_names.PREPROCESSED, volume, "FP32")],
             [io_names.LOGITS], rf"input 'PREPROCESSED' has {side ** 3} voxels .* limit of {TEST_MAX_VOXELS}")
    _still_segments(server)


def test_fold_model_refuses_tiles_of_another_shape_than_its_patch(server, client):
    config = client.get_model_config(io_names.fold_model_name(0))
    channels, *patch = (int(d) for d in config["input"][0]["dims"])
    tiles = np.zeros((1, channels, patch[0] * 2, *patch[1:]), np.float32)
    _refused(client, io_names.fold_model_name(0), [_tensor(io_names.FOLD_INPUT, tiles, "FP32")],
             [io_names.FOLD_OUTPUT], r"unexpected shape for input")
    _still_segments(server)


# --- grown regions given back (server.shm_reclaim) ---------------------------------------------------------

RECLAIM_MIB = 32  # python_backend grows a region in 64 MiB steps: any growth is more than this
RECLAIM_IDLE_S = 1.0
RECLAIM_LIMIT_S = 90.0  # idle time + loading the model again, on a loaded 2-core machine
OVERSIZE_SIDE = 300  # a 1 x 300^3 float32 IMAGE: 103 MiB, 13x the test repository's voxel limit


@pytest.fixture(scope="module")
def reclaiming(triton_server):
    """A SynthCT server of its own whose watchdog gives a region grown by more than RECLAIM_MIB back after
    RECLAIM_IDLE_S idle (the watchdog reads its policy from the environment it starts with)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(shm_reclaim.ABOVE_ENV, str(RECLAIM_MIB))
        env.setenv(shm_reclaim.IDLE_ENV, str(RECLAIM_IDLE_S))
        with triton_server(build(SYNTHCT)) as handle:
            yield handle


def _regions(server, model: str) -> dict[int, int]:
    """``{stub pid: region bytes}`` of ``model``'s live stubs."""
    found = {}
    for stub in health.stub_processes(server.pid):
        size = shm_reclaim.region_bytes(stub) if stub.model == model else None
        if size is not None:
            found[stub.pid] = size
    return found


def _default_bytes(server) -> int:
    (default,) = {s.shm_default_bytes for s in health.stub_processes(server.pid)}
    return default


def _tree_pss_mib(server) -> float:
    """Proportional set size of tritonserver and its stubs (shared pages, the shm regions included, counted
    once across the tree)."""
    total_kib = 0
    for pid in (server.pid, *(s.pid for s in health.stub_processes(server.pid))):
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            total_kib += sum(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
    return total_kib / 1024


def _wait_back_to_default(server, models: tuple[str, ...]) -> float:
    """Seconds until every stub of ``models`` is one stub with a default-size region again and the regions
    of their earlier stubs are gone (Triton removes one when it destroys the old instance, a moment after
    its stub left)."""
    default, start, seen = _default_bytes(server), time.monotonic(), set()
    while True:
        stubs = [s for s in health.stub_processes(server.pid) if s.model in models]
        seen |= {s.shm_region for s in stubs}
        regions = {m: _regions(server, m) for m in models}
        left = {r: size for r in seen if (size := _file_bytes(SHM, r)) not in (None, default)}
        if all(len(r) == 1 and set(r.values()) == {default} for r in regions.values()) and not left:
            return time.monotonic() - start
        if time.monotonic() - start > RECLAIM_LIMIT_S:
            raise AssertionError(f"shm regions not back to {default} bytes after {RECLAIM_LIMIT_S:.0f} s: "
                                 f"{regions}, grown regions left: {left}")
        time.sleep(0.2)


def _file_bytes(folder: str, name: str) -> int | None:
    try:
        return Path(folder, name).stat().st_size
    except OSError:
        return None


def _reclaims(server) -> list[dict]:
    path = Path(server.events_file)
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [e for e in events if e.get("event") == "shm_reclaim"]


def _heads(client) -> int:
    return int(client.get_model_config(io_names.STITCH_MODEL)["input"][0]["dims"][0])


def _stitch_inputs(client, side: int) -> list:
    heads = _heads(client)
    logits = np.zeros((heads, 1, 1, 1), np.float16)
    logits[-1] = 1.0  # the last class everywhere
    properties = np.array([1.0, 1.0, 1.0, side, side, side, 0, 1, 0, 1, 0, 1, 1, 1, 1], np.float64)
    return [_tensor(io_names.LOGITS, logits, "FP16"), _tensor(io_names.CASE_PROPERTIES, properties, "FP64")]


def _stitch(client, side: int) -> dict[str, np.ndarray]:
    import tritonclient.http as http

    outputs = [io_names.SEGMENTATION, io_names.PROBABILITIES]
    result = client.infer(io_names.STITCH_MODEL, _stitch_inputs(client, side),
                          outputs=[http.InferRequestedOutput(o, binary_data=True) for o in outputs],
                          parameters={"probabilities": True})
    return {o: result.as_numpy(o) for o in outputs}


def _refuse_oversize_image(client) -> None:
    image = np.zeros((1, OVERSIZE_SIDE, OVERSIZE_SIDE, OVERSIZE_SIDE), np.float32)
    spacing = np.asarray(probe_case(SYNTHCT).spacing, np.float64)
    _refused(client, io_names.PREPROCESS_MODEL,
             [_tensor(io_names.IMAGE, image, "FP32"), _tensor(io_names.SPACING, spacing, "FP64")],
             [io_names.PREPROCESSED], rf"IMAGE has {OVERSIZE_SIDE ** 3} voxels .* limit of {TEST_MAX_VOXELS}")


def test_a_grown_stub_region_shrinks_back_after_a_large_request(reclaiming):
    import tritonclient.http as http

    default = _default_bytes(reclaiming)
    with http.InferenceServerClient(reclaiming.http_url, network_timeout=300) as client:
        # the largest volume within the request's budget: its float32 probabilities fill max_request_bytes
        side = int((TEST_MAX_REQUEST_BYTES / (4 * _heads(client))) ** (1 / 3))
        answer = _stitch(client, side)  # 421 bytes in, 17 MiB out (SynthCT: 3 classes, 110^3)
        assert answer[io_names.SEGMENTATION].shape == (side,) * 3
        (grown,) = _regions(reclaiming, io_names.STITCH_MODEL).values()
        assert grown > default + RECLAIM_MIB * 2**20, (grown, default)
        _wait_back_to_default(reclaiming, (io_names.STITCH_MODEL,))
        again = _stitch(client, side)  # the fresh instance answers exactly as the grown one did
    for name, array in answer.items():
        np.testing.assert_array_equal(again[name], array)
    assert any(e["model"] == io_names.STITCH_MODEL and e["ok"] for e in _reclaims(reclaiming))
    _still_segments(reclaiming)


def test_a_refused_oversize_request_leaves_no_grown_region_behind(reclaiming):
    import tritonclient.http as http

    models = (io_names.PREPROCESS_MODEL, io_names.ORCHESTRATOR_MODEL)
    _wait_back_to_default(reclaiming, models)
    default = _default_bytes(reclaiming)
    pss_before = _tree_pss_mib(reclaiming)
    with http.InferenceServerClient(reclaiming.http_url, network_timeout=300) as client:
        _refuse_oversize_image(client)  # 103 MiB copied into the preprocess stub's region, then refused
        _refuse_oversize_preprocessed(client)  # 18 MiB into the orchestrator's
    grown = {m: max(_regions(reclaiming, m).values()) for m in models}
    assert grown[io_names.PREPROCESS_MODEL] >= OVERSIZE_SIDE ** 3 * 4, grown
    assert grown[io_names.ORCHESTRATOR_MODEL] > default + RECLAIM_MIB * 2**20, grown
    pss_grown = _tree_pss_mib(reclaiming)
    _wait_back_to_default(reclaiming, models)
    pss_after = _tree_pss_mib(reclaiming)
    # the 103 MiB IMAGE's pages are gone from the server's tree (allocator noise aside)
    assert pss_after < pss_grown - 64, (pss_before, pss_grown, pss_after)
    assert pss_after < pss_before + 64, (pss_before, pss_grown, pss_after)
    reclaimed = {e["model"] for e in _reclaims(reclaiming) if e["ok"]}
    assert set(models) <= reclaimed, reclaimed
    _still_segments(reclaiming)


def _refuse_oversize_preprocessed(client) -> None:
    side = round(TEST_MAX_VOXELS ** (1 / 3)) + 40  # 168^3 PREPROCESSED: 18 MiB, over the voxel limit
    _refused(client, io_names.ORCHESTRATOR_MODEL,
             [_tensor(io_names.PREPROCESSED, np.zeros((1, side, side, side), np.float32), "FP32")],
             [io_names.LOGITS], rf"input 'PREPROCESSED' has {side ** 3} voxels")


def test_requests_in_flight_during_a_reclaim_are_answered(reclaiming):
    """The preprocess and the orchestrator regions are grown; as soon as the watchdog starts loading one of
    them again (its second stub appears), clients over HTTP and gRPC segment the probe case back to back
    until that reload is done and two more requests each were answered: every answer exact, none failed,
    and requests were sent while the new instance was loading."""
    import tritonclient.http as http

    models = (io_names.PREPROCESS_MODEL, io_names.ORCHESTRATOR_MODEL)
    _wait_back_to_default(reclaiming, models)
    known = len(_reclaims(reclaiming))
    case = probe_case(SYNTHCT)
    expected = reference(SYNTHCT, case.name, False).segmentation
    with http.InferenceServerClient(reclaiming.http_url, network_timeout=300) as client:
        _refuse_oversize_image(client)
        _refuse_oversize_preprocessed(client)
    sent: list[tuple[float, float]] = []  # (start, end) of every exact answer
    failures: list[BaseException] = []
    deadline = time.monotonic() + RECLAIM_LIMIT_S + 60

    def reclaimed() -> dict[str, dict]:
        return {e["model"]: e for e in _reclaims(reclaiming)[known:] if e["ok"]}

    def segment(protocol: str, model: str) -> None:
        url = reclaiming.http_url if protocol == "http" else reclaiming.grpc_url
        with NnunetClient(url, protocol=protocol) as nnunet:
            after = 0  # requests sent once the reload was done: the fresh instances serve too
            while after < 2 and time.monotonic() < deadline:
                after += model in reclaimed()
                start = time.time()
                try:
                    result = nnunet.segment(case.image, case.spacing, mirroring=False)
                    np.testing.assert_array_equal(result.segmentation, expected)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)
                    return
                sent.append((start, time.time()))

    for _ in models:  # one reload after the other: traffic keeps the other model busy, so not idle
        while time.monotonic() < deadline:
            loading = [m for m in models if m not in reclaimed() and len(_regions(reclaiming, m)) > 1]
            if loading:
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"no reload began within {RECLAIM_LIMIT_S + 60:.0f} s: {reclaimed()}")
        threads = [threading.Thread(target=segment, args=(p, loading[0])) for p in ("http", "grpc")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures
        event = reclaimed()[loading[0]]
        during = [s for s, _ in sent if event["at"] <= s <= event["at"] + event["seconds"]]
        assert during, (event, sent)  # requests came while the new instance was loading
    assert set(models) <= set(reclaimed()), reclaimed()
    _wait_back_to_default(reclaiming, models)


def test_status_counts_the_shm_reclaims_of_a_detached_server(identity_model_repository, tmp_path, capsys,
                                                            monkeypatch):
    """``nnunet-triton-server start`` (detached, any Python model: here the identity echo): a 64 MiB echo
    grows the stub's region, the watchdog gives it back, ``status`` counts it and the model still echoes."""
    import tritonclient.http as http

    from nnunet_triton.cli import serve as embedded_cli

    monkeypatch.setenv(shm_reclaim.ABOVE_ENV, str(RECLAIM_MIB))
    monkeypatch.setenv(shm_reclaim.IDLE_ENV, str(RECLAIM_IDLE_S))
    args = ["--home", str(tmp_path / "home")]

    def status() -> dict:
        embedded_cli.main([*args, "status"])
        return json.loads(capsys.readouterr().out)

    assert embedded_cli.main([*args, "start", "--model-repository", str(identity_model_repository)]) == 0
    started = json.loads(capsys.readouterr().out)
    try:
        data = np.arange(2**24, dtype=np.float32).reshape(1, 1, -1)  # 64 MiB in, 64 MiB out
        small = np.ones((1, 1, 1), np.int16)
        with http.InferenceServerClient(f"127.0.0.1:{started['http_port']}", network_timeout=300) as client:
            inputs = [_tensor("INPUT_FP32", data, "FP32"), _tensor("INPUT_INT16", small, "INT16")]
            np.testing.assert_array_equal(client.infer("identity", inputs).as_numpy("OUTPUT_FP32"), data)
            server = type("Started", (), {"pid": started["pid"]})
            assert max(_regions(server, "identity").values()) > 128 * 2**20
            _wait_back_to_default(server, ("identity",))
            deadline = time.monotonic() + 30
            while status().get("shm_reclaims") != 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert status()["shm_reclaims"] == 1
            np.testing.assert_array_equal(client.infer("identity", inputs).as_numpy("OUTPUT_FP32"), data)
    finally:
        assert embedded_cli.main([*args, "stop"]) == 0


def test_the_container_entry_points_watchdog_gives_a_grown_region_back(identity_model_repository, tmp_path):
    """What the Docker image and the Kubernetes pod run, minus Docker (``thread_budget exec --watchdog --
    tritonserver ...``, as tests/triton/test_recovery.py starts it): the forked watchdog reads the same
    environment and gives the identity stub's grown region back."""
    import socket
    import subprocess
    import sys

    import tritonclient.http as http

    from nnunet_triton.server import preload
    from nnunet_triton.server.triton_install import prepare_home, server_env

    installation = prepare_home(os.environ.get("NNUNET_TRITON_HOME", REPO_ROOT / "build" / "triton-home"))
    repo = identity_model_repository
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for s in (a, b, c):
            s.bind(("127.0.0.1", 0))
        http_port, grpc_port, metrics_port = (s.getsockname()[1] for s in (a, b, c))
    command = [
        sys.executable, "-m", "nnunet_triton.server.thread_budget", "exec", "--watchdog",
        "--preload", str(preload.library(tmp_path / "preload")),  # as the image's entry point has it
        "--model-repository", str(repo), "--", str(installation.server_bin), f"--model-repository={repo}",
        f"--backend-directory={installation.backend_dir}", f"--cache-directory={installation.cache_dir}",
        "--http-address=127.0.0.1", f"--http-port={http_port}", "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}", "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
        "--model-control-mode=explicit", "--load-model=*", "--disable-auto-complete-config",
        "--exit-timeout-secs=5",
    ]
    env = {**server_env(installation), shm_reclaim.ABOVE_ENV: str(RECLAIM_MIB),
           shm_reclaim.IDLE_ENV: str(RECLAIM_IDLE_S)}
    with open(tmp_path / "container.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    server = type("Container", (), {"pid": process.pid})
    try:
        deadline = time.monotonic() + 120
        while len({s.model for s in health.stub_processes(process.pid)}) < 2 or not health.check_health(
                f"127.0.0.1:{http_port}", ["identity"], server_pid=process.pid).healthy:
            assert process.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "container.log").read_text()[-3000:]
            time.sleep(0.2)
        data = np.arange(2**24, dtype=np.float32).reshape(1, 1, -1)  # 64 MiB in, 64 MiB out
        small = np.ones((1, 1, 1), np.int16)
        inputs = [_tensor("INPUT_FP32", data, "FP32"), _tensor("INPUT_INT16", small, "INT16")]
        with http.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=300) as client:
            np.testing.assert_array_equal(client.infer("identity", inputs).as_numpy("OUTPUT_FP32"), data)
            assert max(_regions(server, "identity").values()) > 128 * 2**20
            _wait_back_to_default(server, ("identity",))
            np.testing.assert_array_equal(client.infer("identity", inputs).as_numpy("OUTPUT_FP32"), data)
        assert b"model 'identity' loaded again" in (tmp_path / "container.log").read_bytes()
    finally:
        process.terminate()  # docker stop: SIGTERM to PID 1
        process.wait(60)
