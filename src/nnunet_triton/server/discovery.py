"""Where the clients' commands find the server: ``--url``, ``$NNUNET_TRITON_URL``, the server ``nnunet-triton
serve`` started on this machine, else Triton's usual port on loopback.

``serve`` records its server in ``<home>/run/server.json`` (``server.handle``; mode 0600, so only its user
finds it). Only the public fields are taken from it: the pid and binary (is it still that tritonserver?),
the bind addresses and ports, and the TLS proxy's address (with TLS the HTTP clients go through the proxy).
The control token stored there is dropped on reading, never kept, logged nor sent.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.parameters import DEFAULT_PORTS
from nnunet_triton.server.triton_install import resolve_home
from nnunet_triton.util.process import pid_alive

__all__ = ["STATE_FILE", "ServerUrl", "recorded_url", "server_url"]

LOGGER = logging.getLogger(__name__)

STATE_FILE = Path("run") / "server.json"  # under the server home (embedded.start writes it)
_PUBLIC = ("pid", "server_bin", "host", "http_port", "grpc_host", "grpc_port", "proxy_url")


@dataclass(frozen=True)
class ServerUrl:
    """A server's ``host:port`` and where it came from (``--url``, ``$NNUNET_TRITON_URL``, the state file,
    or the default)."""

    url: str
    source: str


def _loopback(host: str | None) -> str:
    return "127.0.0.1" if host in (None, "", "0.0.0.0") else str(host)


def _public_fields(state_file: Path) -> dict[str, object] | None:
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as exc:
        LOGGER.info("ignoring %s: %s", state_file, exc)
        return None
    if not isinstance(state, dict):
        return None
    return {key: state.get(key) for key in _PUBLIC}  # the control token stays behind


def _runs(pid: object, server_bin: object) -> bool:
    """The recorded pid is alive and is still that tritonserver (not a reused pid)."""
    if not isinstance(pid, int) or not pid_alive(pid):
        return False
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() == server_bin
    except OSError:
        return False


def recorded_url(protocol: str, home: str | Path | None = None) -> ServerUrl | None:
    """The ``protocol`` URL of the server recorded in ``<home>/run/server.json`` when it runs; None when there
    is no state file, it cannot be read, or its server is gone (a stale pid)."""
    state_file = resolve_home(home) / STATE_FILE
    try:
        if not state_file.is_file():
            return None
    except OSError:  # a home another user keeps private
        return None
    state = _public_fields(state_file)
    if state is None:
        return None
    if not _runs(state["pid"], state["server_bin"]):
        LOGGER.info("ignoring %s: its server (pid %s) is not running", state_file, state["pid"])
        return None
    if protocol == "http" and state["proxy_url"]:
        url = str(state["proxy_url"])  # TLS: Triton's HTTP is loopback-only behind the proxy
    elif protocol == "grpc":
        url = f"{_loopback(state['grpc_host'] or state['host'])}:{state['grpc_port']}"  # type: ignore[str-bytes-safe]
    else:
        url = f"{_loopback(state['host'])}:{state['http_port']}"  # type: ignore[str-bytes-safe]
    return ServerUrl(url, f"{state_file} (pid {state['pid']})")


def server_url(protocol: str, *, given: str | None = None, env: Mapping[str, str] | None = None,
               home: str | Path | None = None, env_var: str = "NNUNET_TRITON_URL") -> ServerUrl:
    """The URL a client command uses: ``given`` (``--url``), else ``$NNUNET_TRITON_URL``, else the server
    ``serve`` recorded in ``home`` (default ``$NNUNET_TRITON_HOME`` or ``build/triton-home``) when it runs,
    else ``127.0.0.1`` on Triton's usual port of ``protocol`` (8000 HTTP, 8001 gRPC)."""
    if given:
        return ServerUrl(given, "--url")
    env = os.environ if env is None else env
    if env.get(env_var):
        return ServerUrl(env[env_var], f"${env_var}")
    recorded = recorded_url(protocol, home)
    if recorded is not None:
        return recorded
    return ServerUrl(f"127.0.0.1:{DEFAULT_PORTS[protocol]}", "the default (no running server recorded in "
                     f"{resolve_home(home) / STATE_FILE})")
