"""Files holding the control token or the server's launch: 0600 from the start, replaced atomically."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from nnunet_triton.server import embedded
from nnunet_triton.server.handle import ServerHandle
from nnunet_triton.server.restart import LaunchSpec
from nnunet_triton.server.server_config import TritonServerConfig
from nnunet_triton.server.watchdog import Watchdog
from nnunet_triton.util import durable


@pytest.fixture
def open_umask():
    """umask 0: a file created without an explicit mode would be world-readable."""
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.fixture
def renames(monkeypatch):
    """The real os.replace of util.durable, recording each rename's target and the source's mode then."""
    seen: list[tuple[str, int]] = []
    real_replace = os.replace

    def recording_replace(src, dst):
        seen.append((Path(dst).name, stat.S_IMODE(os.stat(src).st_mode)))
        real_replace(src, dst)

    monkeypatch.setattr(durable.os, "replace", recording_replace)
    return seen


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_durable_write_with_a_mode_is_private_before_its_first_byte(tmp_path, open_umask):
    target = tmp_path / "secret.json"
    target.write_text("old")
    target.chmod(0o644)
    with durable.durable_output(target, mode=0o600) as temp:
        assert _mode(temp) == 0o600 and temp.read_bytes() == b""  # created private, nothing written yet
        temp.write_text("new")
    assert (target.read_text(), _mode(target)) == ("new", 0o600)
    durable.write_json_atomic(tmp_path / "other.json", {"a": 1}, mode=0o600)
    assert _mode(tmp_path / "other.json") == 0o600


def test_a_durable_write_without_a_mode_keeps_the_umasks_default(tmp_path, open_umask):
    durable.write_text_atomic(tmp_path / "public.txt", "x")
    assert _mode(tmp_path / "public.txt") == 0o666


def _handle(tmp_path: Path) -> ServerHandle:
    return ServerHandle(pid=os.getpid(), host="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3,
                        model_repository=str(tmp_path), server_bin="tritonserver",
                        log_file=str(tmp_path / "log"),
                        state_file=str(tmp_path / "server.json"), control_token="secret-token")


def test_the_launchers_state_file_is_0600_and_replaced_atomically(tmp_path, open_umask, renames):
    state = tmp_path / "server.json"
    state.write_text("{}")
    state.chmod(0o644)  # left by an older launcher
    embedded._write_state(state, _handle(tmp_path))
    assert _mode(state) == 0o600 and json.loads(state.read_text())["control_token"] == "secret-token"
    assert renames == [("server.json", 0o600)]


def test_launch_json_is_0600_and_replaced_atomically(tmp_path, open_umask, renames):
    launch_file = tmp_path / "launch.json"
    launch_file.write_text("{}")
    launch_file.chmod(0o644)
    spec = LaunchSpec.for_server(TritonServerConfig(("/models",), 1, 2, 3, 15), {}, {},
                                 log_file=tmp_path / "log", pid_file=None, state_file=None)
    spec.write(launch_file)
    assert _mode(launch_file) == 0o600 and LaunchSpec.read(launch_file) == spec
    assert renames == [("launch.json", 0o600)]


def test_the_watchdogs_state_update_is_0600_and_replaced_atomically(tmp_path, open_umask, renames):
    embedded._write_state(tmp_path / "server.json", _handle(tmp_path))
    renames.clear()
    spec = LaunchSpec(TritonServerConfig(("/models",), 1, 2, 3, 15), {}, str(tmp_path / "log"),
                      str(tmp_path / "server.pid"), str(tmp_path / "server.json"))
    watchdog = Watchdog("127.0.0.1:1", 4242, [], "secret-token", launch=spec)
    watchdog.restarts = 1
    watchdog._record_restart()
    state = json.loads((tmp_path / "server.json").read_text())
    assert (state["pid"], state["restarts"], _mode(tmp_path / "server.json")) == (4242, 1, 0o600)
    # the restarted server's pid file too: private, not the open umask's 0666 a local user could rewrite
    assert renames == [("server.pid", 0o600), ("server.json", 0o600)]
