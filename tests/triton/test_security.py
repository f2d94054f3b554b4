"""Attacks on the embedded server's own APIs, over loopback, as any client on the network would send them.

The server is the session's identity server (the default launcher: explicit model control, the watchdog,
the restricted APIs of ``server.model_control``). Each test is a reproduction that once succeeded: without the
launcher's token a client could register a Python stub's own shared-memory region (which let a later request
abort tritonserver), switch the server's logs off, turn tracing on and read every model's statistics.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import IDENTITY_MODEL

from nnunet_triton.server import health, preload
from nnunet_triton.server.model_control import CONTROL_HEADER

RESTRICTED = "This (API|protocol) is restricted"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _identity_answers(url: str) -> bool:
    import tritonclient.http as http

    client = http.InferenceServerClient(url)
    try:
        tensor = http.InferInput("INPUT_FP32", [1, 2, 3], "FP32")
        data = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
        tensor.set_data_from_numpy(data)
        int16 = http.InferInput("INPUT_INT16", [1, 1, 1], "INT16")
        int16.set_data_from_numpy(np.zeros((1, 1, 1), np.int16))
        result = client.infer(IDENTITY_MODEL, [tensor, int16])
        return bool(np.array_equal(result.as_numpy("OUTPUT_FP32"), data))
    finally:
        client.close()


def _http(url: str, path: str, *, body: dict | None = None, headers: dict[str, str] | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{url}{path}", data=data, headers=headers or {},
                                     method="GET" if body is None else "POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_registering_a_stubs_shared_memory_region_is_refused_without_the_token_and_the_server_keeps_answering(
        identity_server):
    import tritonclient.grpc as grpc
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    stubs = health.stub_processes(identity_server.pid)
    assert stubs, "the identity models' stubs are running"
    region = stubs[0].shm_region  # on the stub's argv and in /dev/shm: any local user can read the name
    for client in (http.InferenceServerClient(identity_server.http_url),
                   grpc.InferenceServerClient(identity_server.grpc_url)):
        try:
            with pytest.raises(InferenceServerException, match=RESTRICTED):
                client.register_system_shared_memory("stolen", f"/{region}", 4096)
            with pytest.raises(InferenceServerException, match=RESTRICTED):
                client.get_system_shared_memory_status()
            with pytest.raises(InferenceServerException, match=RESTRICTED):
                client.unregister_system_shared_memory()
        finally:
            client.close()
    assert identity_server.is_ready()
    assert _identity_answers(identity_server.http_url)


@pytest.mark.parametrize(("path", "body"), [
    ("/v2/logging", {"log_info": False, "log_verbose_level": 1}),
    ("/v2/logging", None),
    ("/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}),
    ("/v2/trace/setting", None),
    ("/v2/models/stats", None),
    (f"/v2/models/{IDENTITY_MODEL}/stats", None),
])
def test_logging_trace_and_statistics_over_http_need_the_token(identity_server, path, body):
    assert _http(identity_server.http_url, path, body=body) == 403
    if body is None:  # reading with the token works (changing settings is not repeated here)
        assert _http(identity_server.http_url, path, headers=identity_server.control_headers) == 200


def test_logging_trace_and_statistics_over_grpc_need_the_token(identity_server):
    import tritonclient.grpc as grpc
    from tritonclient.utils import InferenceServerException

    client = grpc.InferenceServerClient(identity_server.grpc_url)
    calls = {
        "log settings": lambda **kw: client.get_log_settings(**kw),
        "trace settings": lambda **kw: client.get_trace_settings(**kw),
        "statistics": lambda **kw: client.get_inference_statistics(IDENTITY_MODEL, **kw),
        "repository index": lambda **kw: client.get_model_repository_index(**kw),
    }
    try:
        with pytest.raises(InferenceServerException, match=RESTRICTED):
            client.update_log_settings({"log_info": False})
        for name, call in calls.items():
            with pytest.raises(InferenceServerException, match=RESTRICTED):
                call()
            assert call(headers=identity_server.control_headers) is not None, name
    finally:
        client.close()


def test_model_config_metadata_and_health_stay_open_for_clients(identity_server):
    url = identity_server.http_url
    model = f"/v2/models/{IDENTITY_MODEL}"
    for path in ("/v2/health/ready", "/v2", model, f"{model}/ready", f"{model}/config"):
        assert _http(url, path) == 200, path


def test_serve_prints_where_the_token_is_and_no_log_holds_it(identity_server):
    from nnunet_triton.cli.serve import _public_state

    token = identity_server.control_token
    printed = json.dumps(_public_state(identity_server))
    assert token not in printed
    assert json.loads(printed)["control_token_file"] == identity_server.state_file
    server_log = Path(identity_server.log_file)
    watchdog_log = server_log.with_name(server_log.stem + ".watchdog.log")
    for log in (server_log, watchdog_log):
        assert token.encode() not in log.read_bytes(), log


def _as_nobody(*command: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["runuser", "-u", "nobody", "--", *command], capture_output=True, timeout=60,
                          check=False)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                                reason="runs commands as user nobody (needs root and runuser)")

_LOAD_AS_NOBODY = """
import sys, urllib.error, urllib.request
request = urllib.request.Request(f"http://{sys.argv[1]}/v2/repository/models/identity/load", data=b"{}",
                                 method="POST", headers={sys.argv[2]: sys.argv[3]})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    print(opener.open(request, timeout=30).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


@needs_root
def test_another_local_user_cannot_read_the_token_nor_load_a_model(identity_server):
    pids = [identity_server.pid, identity_server.watchdog_pid,
            *(s.pid for s in health.stub_processes(identity_server.pid))]
    readable = b"".join(_as_nobody("cat", f"/proc/{pid}/{part}").stdout
                        for pid in pids for part in ("cmdline", "environ"))
    readable += _as_nobody("cat", str(identity_server.state_file)).stdout
    assert identity_server.control_token.encode() not in readable
    assert preload.PLACEHOLDER.encode() in readable  # what the command line shows instead is no token:
    load = _as_nobody("/usr/bin/python3", "-c", _LOAD_AS_NOBODY, identity_server.http_url, CONTROL_HEADER,
                      preload.PLACEHOLDER)
    assert load.stdout.decode().strip() == "403", load


@needs_root
def test_another_local_user_cannot_read_a_python_stubs_shared_memory_region(identity_server):
    regions = [s.shm_region for s in health.stub_processes(identity_server.pid)]
    assert regions
    for region in regions:
        path = Path("/dev/shm", region)
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))
        attempt = _as_nobody("head", "-c", "16", str(path))
        assert attempt.returncode != 0 and b"Permission denied" in attempt.stderr, attempt


def test_the_servers_own_proc_environ_no_longer_holds_the_token(identity_server):
    """The preload's constructor overwrites the token in the environment block /proc/<pid>/environ shows
    (read here by root, who can: unsetenv alone left it there for the server's own user)."""
    environ = Path(f"/proc/{identity_server.pid}/environ").read_bytes()
    assert identity_server.control_token.encode() not in environ
    wiped = f"{preload.TOKEN_ENV}=".encode() + b"*" * len(identity_server.control_token)
    assert wiped in environ.split(b"\0")


def _listening_ports(pid: int) -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
            for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_sagemaker_and_vertex_frontends_stay_closed_even_with_their_environment(
        triton_server, identity_model_repository, monkeypatch, tmp_path):
    """With AIP_MODE=PREDICTION in the launcher's environment Triton 2.51 opened its Vertex AI port on
    0.0.0.0, and its X-Vertex-Ai-Triton-Redirect header reached the restricted APIs without the token (with
    one model; with several it refused to start without --vertex-ai-default-model, now refused here)."""
    from nnunet_triton.cli import main

    repository = tmp_path / "one-model"
    shutil.copytree(identity_model_repository / IDENTITY_MODEL, repository / IDENTITY_MODEL)
    vertex_port = _free_port()
    for name, value in {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(vertex_port),
                        "AIP_HEALTH_ROUTE": "/health", "AIP_PREDICT_ROUTE": "/predict",
                        "AIP_STORAGE_URI": str(repository),
                        "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "identity"}.items():
        monkeypatch.setenv(name, value)
    with triton_server(repository) as server:
        assert _listening_ports(server.pid) == {("127.0.0.1", server.http_port),
                                                ("127.0.0.1", server.grpc_port)}
        environ = Path(f"/proc/{server.pid}/environ").read_bytes()
        assert b"AIP_" not in environ and b"SAGEMAKER_" not in environ
        request = urllib.request.Request(f"http://127.0.0.1:{vertex_port}/predict", data=b"{}",
                                         headers={"X-Vertex-Ai-Triton-Redirect": "v2/repository/index"})
        with pytest.raises(urllib.error.URLError, match="Connection refused"):
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10)
        assert _http(server.http_url, "/v2/repository/index", body={}) == 403  # the token still guards it
    for arg in ("--vertex-ai-default-model=nnunet", "--allow-vertex-ai=true", "--allow-sagemaker=true",
                "--sagemaker-port=8080"):
        assert main(["serve", "--model-repository", str(repository), "--home", str(tmp_path / "home"),
                     f"--server-arg={arg}"]) == 2
        assert not (tmp_path / "home" / "run" / "server.json").exists()


def test_the_metrics_port_is_closed_unless_asked_for(identity_server):
    """Triton's metrics endpoint has no authentication: it showed any local user the per-model counters the
    restricted statistics API hides. The default server has none (test_metrics.py asks for one)."""
    from nnunet_triton.errors import ServerError

    assert identity_server.metrics_port is None
    assert {port for _, port in _listening_ports(identity_server.pid)} == {identity_server.http_port,
                                                                          identity_server.grpc_port}
    with pytest.raises(ServerError, match="no metrics endpoint: start it with metrics=True"):
        identity_server.metrics_url  # noqa: B018


def _path_without_cc(tmp_path: Path) -> str:
    """A PATH with every program of this one but ``cc``: the preload library cannot be built."""
    bin_dir = tmp_path / "bin-without-cc"
    bin_dir.mkdir()
    for folder in reversed(os.environ["PATH"].split(os.pathsep)):
        if not Path(folder).is_dir():
            continue
        for program in Path(folder).iterdir():
            if program.name != "cc" and os.access(program, os.X_OK):
                (bin_dir / program.name).unlink(missing_ok=True)
                (bin_dir / program.name).symlink_to(program.absolute())
    assert shutil.which("cc", path=str(bin_dir)) is None
    return str(bin_dir)


def test_serve_refuses_to_start_without_the_preload_unless_told_the_consequence(
        identity_model_repository, tmp_path):
    """Without a C compiler `serve` once exited 0 with one warning: the token on argv, 0644 regions."""
    from nnunet_triton.server.triton_install import prepare_home, resolve_home

    shared = resolve_home(os.environ.get("NNUNET_TRITON_HOME", REPO_ROOT / "build" / "triton-home"))
    prepare_home(shared)
    home = tmp_path / "home"  # a fresh preload cache; the prepared server tree is the shared one
    home.mkdir()
    (home / "server").symlink_to(shared / "server")
    env = {**os.environ, "PATH": _path_without_cc(tmp_path)}
    serve = [sys.executable, "-m", "nnunet_triton.cli", "serve", "--model-repository",
             str(identity_model_repository), "--home", str(home), "--exit-timeout", "5"]

    def run(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)

    try:  # a launcher that does start (the old one did) is stopped in the end
        refused = run(*serve)
        assert refused.returncode == 2, refused
        for words in ("refusing to start tritonserver without the preload library", "no C compiler (`cc`)",
                      "/proc/<pid>/cmdline, readable by every local user", "/dev/shm regions 0644",
                      "--allow-token-in-proc-and-readable-shm"):
            assert words in refused.stderr, (words, refused.stderr)
        assert not (home / "run" / "server.json").exists()
        started = run(*serve, "--allow-token-in-proc-and-readable-shm")
        assert started.returncode == 0, started
        assert "starting DEGRADED" in started.stderr
        status = run(sys.executable, "-m", "nnunet_triton.cli", "status", "--home", str(home))
        state = json.loads(status.stdout)
        assert status.returncode == 0 and state["healthy"], status
        assert any("/proc/<pid>/cmdline" in line for line in state["degraded"]), state
        assert "runs DEGRADED" in status.stderr
        recorded = json.loads((home / "run" / "server.json").read_text())
        assert recorded["degraded"] == state["degraded"]
    finally:
        run(sys.executable, "-m", "nnunet_triton.cli", "stop", "--home", str(home))
