"""Which ports ``serve`` opens (``server.ports.choose_ports``) and where the client commands find its server
(``server.discovery``, ``cli.common.url``): real sockets, real state files, real processes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nnunet_triton.cli.common import URL_ENV, url
from nnunet_triton.parameters import DEFAULT_PORTS
from nnunet_triton.server.discovery import recorded_url, server_url
from nnunet_triton.server.ports import choose_ports, free_port, port_taken

LOOPBACK = {"http": "127.0.0.1", "grpc": "127.0.0.1", "metrics": "127.0.0.1"}
NONE_GIVEN = {"http": None, "grpc": None, "metrics": None}


@pytest.fixture
def held_port():
    """A port a listening socket of this test holds on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _usual(**ports: int) -> dict[str, int]:
    """Stand-ins for Triton's usual ports: free ones (8000... may be taken on a shared machine)."""
    return {name: ports.get(name) or free_port("127.0.0.1") for name in ("http", "grpc", "metrics")}


def test_a_port_held_by_a_listening_socket_is_taken_and_a_free_one_is_not(held_port: int) -> None:
    assert port_taken("127.0.0.1", held_port)
    assert not port_taken("127.0.0.1", free_port("127.0.0.1"))


def test_serve_takes_the_usual_ports_when_they_are_free_and_keeps_metrics_closed(caplog) -> None:
    usual = _usual()
    with caplog.at_level(logging.WARNING, logger="nnunet_triton.server.ports"):
        chosen = choose_ports(NONE_GIVEN, LOOPBACK, metrics=False, usual=True, usual_ports=usual)
    assert chosen == {"http": usual["http"], "grpc": usual["grpc"], "metrics": None}
    assert not caplog.records
    opened = choose_ports(NONE_GIVEN, LOOPBACK, metrics=True, usual=True, usual_ports=usual)
    assert opened["metrics"] == usual["metrics"]


def test_a_taken_usual_port_falls_back_to_a_free_one_with_a_warning_naming_both(held_port: int,
                                                                                caplog) -> None:
    usual = _usual(http=held_port)
    with caplog.at_level(logging.WARNING, logger="nnunet_triton.server.ports"):
        chosen = choose_ports(NONE_GIVEN, LOOPBACK, metrics=False, usual=True, usual_ports=usual)
    assert chosen["http"] not in (None, held_port) and chosen["grpc"] == usual["grpc"]
    (record,) = caplog.records
    message = record.getMessage()
    assert f"HTTP {held_port} on 127.0.0.1" in message  # the taken port
    assert f"HTTP {chosen['http']}, gRPC {usual['grpc']}" in message  # the ports chosen instead
    assert "--http-port" in message


def test_given_ports_are_kept_even_when_taken_and_the_library_default_is_free_ports(held_port: int,
                                                                                    caplog) -> None:
    given = {"http": held_port, "grpc": None, "metrics": None}
    chosen = choose_ports(given, LOOPBACK, metrics=False, usual=True, usual_ports=_usual())
    assert chosen["http"] == held_port  # `make serve`'s explicit ports: tritonserver reports the clash
    with caplog.at_level(logging.WARNING, logger="nnunet_triton.server.ports"):
        free = choose_ports(NONE_GIVEN, LOOPBACK, metrics=False, usual=False,
                            usual_ports=_usual(http=held_port))
    assert free["http"] != held_port and not caplog.records  # embedded.start's default: no usual port tried


def _state(home: Path, **fields: object) -> Path:
    state_file = home / "run" / "server.json"
    state_file.parent.mkdir(parents=True, exist_ok=True)
    # this process stands for the tritonserver: its pid, the binary /proc says it runs
    this_bin = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode()
    state = {"pid": os.getpid(), "server_bin": this_bin, "host": "127.0.0.1", "http_port": 8123,
             "grpc_host": None, "grpc_port": 8124, "metrics_port": None, "proxy_url": None,
             "control_token": "SECRET-TOKEN", **fields}
    state_file.write_text(json.dumps(state))
    state_file.chmod(0o600)
    return state_file


def test_discovery_finds_the_running_server_recorded_in_the_state_file(tmp_path: Path, caplog) -> None:
    state_file = _state(tmp_path)
    with caplog.at_level(logging.DEBUG):
        found = server_url("http", home=tmp_path, env={})
        grpc = server_url("grpc", home=tmp_path, env={})
    assert found.url == "127.0.0.1:8123" and str(state_file) in found.source
    assert grpc.url == "127.0.0.1:8124"
    assert "SECRET-TOKEN" not in repr(found) + caplog.text  # the token is neither kept nor logged


def test_discovery_without_a_state_file_falls_back_to_the_default(tmp_path: Path) -> None:
    chosen = server_url("http", home=tmp_path, env={})
    assert chosen.url == f"127.0.0.1:{DEFAULT_PORTS['http']}" and "default" in chosen.source
    assert server_url("grpc", home=tmp_path, env={}).url == f"127.0.0.1:{DEFAULT_PORTS['grpc']}"


def test_discovery_ignores_a_state_file_whose_server_is_gone_or_another_program(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid is free
    _state(tmp_path, pid=gone.pid)
    assert recorded_url("http", tmp_path) is None
    assert server_url("http", home=tmp_path, env={}).url == f"127.0.0.1:{DEFAULT_PORTS['http']}"
    _state(tmp_path, server_bin="/nonexistent/tritonserver")  # a live pid that runs something else
    assert recorded_url("http", tmp_path) is None
    (tmp_path / "run" / "server.json").write_text("{not json")
    assert recorded_url("http", tmp_path) is None


def test_discovery_of_a_tls_server_gives_the_proxys_url_for_http(tmp_path: Path) -> None:
    _state(tmp_path, host="127.0.0.1", proxy_url="10.1.2.3:8443", grpc_host="10.1.2.3")
    assert server_url("http", home=tmp_path, env={}).url == "10.1.2.3:8443"
    assert server_url("grpc", home=tmp_path, env={}).url == "10.1.2.3:8124"


def test_url_and_environment_come_before_the_state_file(tmp_path: Path, monkeypatch) -> None:
    _state(tmp_path)
    assert server_url("http", given="10.0.0.1:9000", home=tmp_path, env={}).url == "10.0.0.1:9000"
    env_first = server_url("http", home=tmp_path, env={URL_ENV: "10.0.0.2:9000"}, env_var=URL_ENV)
    assert (env_first.url, env_first.source) == ("10.0.0.2:9000", f"${URL_ENV}")
    monkeypatch.delenv(URL_ENV, raising=False)
    args = argparse.Namespace(url=None, protocol="http", home=str(tmp_path))
    assert url(args) == "127.0.0.1:8123"  # the CLI's default: the running server of --home
    monkeypatch.setenv(URL_ENV, "10.0.0.3:9000")
    assert url(argparse.Namespace(url=None, protocol="http", home=str(tmp_path))) == "10.0.0.3:9000"
