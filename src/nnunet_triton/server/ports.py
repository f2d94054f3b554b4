"""Which ports a server opens: the ones given, else Triton's usual ones or free ones.

``nnunet-triton serve`` asks for Triton's usual ports (``parameters.DEFAULT_*``: HTTP 8000, gRPC 8001 and,
with metrics, 8002), as ``make serve``, the containers and the clients' defaults do. A usual port already
taken on its address is replaced by a free one, and one warning names the taken ports and the ports chosen
instead. The library's default (``embedded.start`` without ``usual_ports``: tests, tools) is free ports.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

from nnunet_triton.parameters import DEFAULT_PORTS

__all__ = ["ENDPOINTS", "choose_ports", "free_port", "port_taken"]

LOGGER = logging.getLogger(__name__)

ENDPOINTS = ("http", "grpc", "metrics")
_LABELS = {"http": "HTTP", "grpc": "gRPC", "metrics": "metrics"}
_FLAGS = {"http": "--http-port", "grpc": "--grpc-port", "metrics": "--metrics-port"}


def _bind_address(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def free_port(host: str) -> int:
    """A port the kernel says is free on ``host`` now (loopback for the wildcard address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_bind_address(host), 0))
        return int(sock.getsockname()[1])


def port_taken(host: str, port: int) -> bool:
    """Whether another socket holds ``port`` on ``host`` (``""``/``0.0.0.0``: any address). A port whose last
    connections are only in TIME_WAIT counts as free, as it does for tritonserver."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0" if host == "" else host, port))
        except OSError:
            return True
    return False


def choose_ports(given: Mapping[str, int | None], addresses: Mapping[str, str], *, metrics: bool,
                 usual: bool, usual_ports: Mapping[str, int] = DEFAULT_PORTS) -> dict[str, int | None]:
    """The ports of one start: ``{"http", "grpc", "metrics"}`` (metrics None when closed).

    Args:
        given: the ports asked for (None: not given); a given port is kept as it is.
        addresses: each endpoint's bind address (where a usual port is checked).
        metrics: the metrics endpoint opens (a given metrics port opens it too).
        usual: a port not given is Triton's usual one (8000, 8001, 8002) unless that is taken, then a free
            one, with a warning naming the taken ports and the chosen ones; False: a free one.
        usual_ports: Triton's usual ports (``parameters.DEFAULT_PORTS``).
    """
    wanted = [name for name in ENDPOINTS if name != "metrics" or metrics or given.get("metrics") is not None]
    chosen: dict[str, int | None] = {name: given.get(name) or None for name in ENDPOINTS}
    taken: list[str] = []
    for name in wanted:
        if chosen[name] is not None:
            continue
        port = usual_ports[name]
        if usual and port not in chosen.values() and not port_taken(addresses[name], port):
            chosen[name] = port
            continue
        if usual:
            taken.append(f"{_LABELS[name]} {port} on {_bind_address(addresses[name])}")
        chosen[name] = free_port(addresses[name])
    if taken:
        now = ", ".join(f"{_LABELS[name]} {chosen[name]}" for name in wanted)
        flags = "/".join(_FLAGS[name] for name in wanted)
        LOGGER.warning("Triton's usual port(s) taken: %s; serving on free ports instead: %s (clients find it "
                       "through <home>/run/server.json; choose ports with %s)", ", ".join(taken), now, flags)
    return chosen
