"""The embedded tritonserver: start on loopback, bit-exact tensor round trips, clean stop, CLI.

The round trips guard the numpy 2 route through the Python-backend stub: the models pass every tensor
by DLPack (``serving.tensors``), and these tests fail if any bit of a float32 or int16 tensor changes.
That no model uses the stub's NumPy C API (``as_numpy``, ``Tensor(name, ndarray)``; pytriton's stub builds
it with a pybind11 older than numpy 2) is checked on the source (``tests/unit/test_layering.py``), not by
asserting that the upstream bug still exists.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from nnunet_triton.builder import config_gen
from nnunet_triton.cli import serve as embedded_cli
from nnunet_triton.errors import ServerError
from nnunet_triton.server import embedded as embedded_server

FLOAT_SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).tiny / 4, -np.finfo(np.float32).max, 1e-45, -1e-45],
    dtype=np.float32,
)


def _fp32_payload(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    values = (rng.standard_normal(shape) * 1000).astype(np.float32)
    flat = values.reshape(-1)
    flat[: FLOAT_SPECIALS.size] = FLOAT_SPECIALS
    flat[FLOAT_SPECIALS.size] = np.frombuffer(np.uint32(0x7FC00123).tobytes(), dtype=np.float32)[
        0
    ]  # NaN payload
    return values


def _int16_payload(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    values = rng.integers(-32768, 32768, size=shape, dtype=np.int16)
    values.reshape(-1)[:4] = [-32768, 32767, -1, 0]
    return values


def _infer(module: object, url: str, arrays: dict[str, np.ndarray], model: str = "identity"
           ) -> dict[str, np.ndarray]:
    client = module.InferenceServerClient(url)  # type: ignore[attr-defined]
    try:
        inputs = []
        for name, array in arrays.items():
            tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))  # type: ignore[attr-defined]
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer(model, inputs)
        return {name: result.as_numpy(name) for name in ("OUTPUT_FP32", "OUTPUT_INT16", "STUB_ENV")}
    finally:
        client.close()  # an open keep-alive connection would hold the server's shutdown for exit_timeout_s


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_identity_round_trip_is_bit_exact_when_sent_over(identity_server, protocol: str) -> None:
    rng = np.random.default_rng(20240611)
    sent = {"INPUT_FP32": _fp32_payload(rng, (3, 5, 7)), "INPUT_INT16": _int16_payload(rng, (2, 9, 11))}
    module, url = (
        (httpclient, identity_server.http_url)
        if protocol == "http"
        else (grpcclient, identity_server.grpc_url)
    )

    received = _infer(module, url, sent)

    assert received["OUTPUT_FP32"].dtype == np.float32 and received["OUTPUT_FP32"].shape == (3, 5, 7)
    assert received["OUTPUT_INT16"].dtype == np.int16 and received["OUTPUT_INT16"].shape == (2, 9, 11)
    np.testing.assert_array_equal(received["OUTPUT_FP32"].view(np.uint32), sent["INPUT_FP32"].view(np.uint32))
    np.testing.assert_array_equal(received["OUTPUT_INT16"], sent["INPUT_INT16"])


def test_python_stub_runs_this_venv_and_its_numpy_2(identity_server) -> None:
    rng = np.random.default_rng(0)
    received = _infer(
        httpclient,
        identity_server.http_url,
        {"INPUT_FP32": _fp32_payload(rng, (1, 3, 3)), "INPUT_INT16": _int16_payload(rng, (1, 1, 5))},
    )

    stub_env = json.loads(received["STUB_ENV"].tobytes())
    assert stub_env == {"numpy": np.__version__, "prefix": sys.prefix}
    assert int(np.__version__.split(".")[0]) >= 2


def test_server_listens_only_on_loopback_ports_it_reports(identity_server) -> None:
    listening = [
        conn.laddr
        for conn in psutil.Process(identity_server.pid).net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]

    assert {addr.ip.removeprefix("::ffff:") for addr in listening} == {"127.0.0.1"}
    assert {addr.port for addr in listening} == {  # no metrics port unless asked for (test_security.py)
        identity_server.http_port,
        identity_server.grpc_port,
    }


def test_stop_terminates_server_and_stubs_and_removes_run_files(
    triton_server, identity_model_repository
) -> None:
    with triton_server(identity_model_repository) as handle:
        server = psutil.Process(handle.pid)
        stubs = server.children(recursive=True)
        assert [Path(p.cmdline()[0]).name for p in stubs] == ["triton_python_backend_stub"] * 2
        assert json.loads(Path(handle.state_file).read_text())["http_port"] == handle.http_port
        handle.stop()

        assert not handle.is_running()
        assert not psutil.pid_exists(handle.pid)
        assert [p.pid for p in stubs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
        assert not Path(handle.pid_file).exists() and not Path(handle.state_file).exists()


def test_start_raises_server_error_with_log_tail_when_a_model_fails_to_load(triton_server, tmp_path) -> None:
    spec = config_gen.ModelSpec(
        name="broken",
        backend="python",
        inputs=(config_gen.TensorSpec("X", "FP32", (1,)),),
        outputs=(config_gen.TensorSpec("Y", "FP32", (1,)),),
    )
    config_gen.write_config(spec, tmp_path / "broken")
    (tmp_path / "broken" / "1").mkdir()
    (tmp_path / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('boom-from-initialize')\n"
    )

    with pytest.raises(ServerError, match=r"(?s)exited \(code \d+\) before .*boom-from-initialize"):
        with triton_server(tmp_path):
            pass


def test_start_rejects_load_models_when_model_control_mode_is_none(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"load_models \['identity'\] needs model_control_mode='explicit'"):
        embedded_server.start(tmp_path, model_control_mode="none", load_models=("identity",))


def test_start_rejects_model_repository_when_it_does_not_exist(tmp_path) -> None:
    with pytest.raises(ValueError, match="model_repository must be an existing directory"):
        embedded_server.start(tmp_path / "missing")


def test_server_env_puts_bundled_libs_and_venv_bin_first() -> None:
    installation = embedded_server.prepare_home(Path(__file__).resolve().parents[2] / "build" / "triton-home")

    env = embedded_server.server_env(installation, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})

    libs = installation.lib_dirs[0]
    assert libs.name == "nvidia_pytriton.libs" and libs.is_dir()
    assert env["LD_LIBRARY_PATH"] == f"{libs}:/opt/x"
    assert env["PATH"] == f"{Path(sys.exec_prefix) / 'bin'}:/usr/bin"
    stub = installation.backend_dir / "python" / "triton_python_backend_stub"
    assert stub.is_file() and installation.server_bin.is_file()


def test_cli_start_status_stop_manage_a_detached_server(identity_model_repository, tmp_path, capsys) -> None:
    args = ["--home", str(tmp_path / "home")]
    try:
        assert (
            embedded_cli.main([*args, "start", "--model-repository", str(identity_model_repository)]) == 0
        )
        started = json.loads(capsys.readouterr().out)
        assert started["host"] == "127.0.0.1"

        assert embedded_cli.main([*args, "status"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert (status["pid"], status["running"], status["ready"]) == (started["pid"], True, True)
        assert (status["healthy"], status["problems"], status["watchdog_running"]) == (True, [], True)
        assert "control_token" not in status  # the model-control token stays in server.json (mode 0600)

        assert embedded_cli.main([*args, "stop"]) == 0
        # started by this process (detached), so it lingers as a zombie until Python reaps it
        for pid in (started["pid"], started["watchdog_pid"]):  # the server and its watchdog
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert embedded_cli.main([*args, "status"]) == 3
    finally:
        embedded_cli.main([*args, "stop"])


def test_importing_embedded_server_imports_neither_triton_nor_pytriton() -> None:
    code = (
        "import sys, nnunet_triton.server.embedded; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tritonclient', 'pytriton', 'torch')))"
    )
    src = Path(__file__).resolve().parents[2] / "src"

    result = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(src)}, capture_output=True, text=True
    )

    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\n", "")
