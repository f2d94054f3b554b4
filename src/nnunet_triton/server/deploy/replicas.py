"""Replicas behind a load balancer: ``nnunet-triton deploy --target docker --replicas N``.

N containers of the serving image, each publishing Triton's HTTP, gRPC and metrics ports on 127.0.0.1 only
(host ports of their own), and one more container of the same image running nginx on the host's network
(``--network host``) from the project's one proxy configuration (``server.proxy_config.render_config`` with
a :class:`~nnunet_triton.server.proxy_config.Balancer`): the balancer listens on ``--host``:``--http-port``
(with ``--tls-*``, HTTPS on ``--proxy-port`` with client authentication, the files mounted read-only at
their host paths; without TLS on loopback only), lets
through the public endpoints only (the same allow-list, body and path guards and client limits as the TLS
proxy) and spreads the requests round-robin over the replicas' loopback ports.

Health checks are passive (nginx open source has no active ones): a replica that refuses or drops a
connection, or answers 502/503, is skipped for ``fail_timeout`` seconds and the request goes on to the next
replica (``proxy_next_upstream ... non_idempotent``; an inference POST is idempotent). Each replica keeps its
own health command and restart policy (``docker.docker_run_command``), so a crashed or OOM-killed server comes
back and is used again after ``fail_timeout`` (one stopped through the engine stays down until started).

State: :func:`write_state` records the replicas (names and ports) and the balancer in
``<run>/<name>-replicas/replicas.json`` next to the balancer's nginx.conf and logs (access log: which
replica answered each request); ``undeploy`` reads it and removes them all.

Everything here is a pure function of its arguments except :func:`write_state`, :func:`read_state` and
:func:`free_loopback_ports`.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.parameters import DEFAULT_HTTP_PORT
from nnunet_triton.server.deploy import docker
from nnunet_triton.server.proxy_config import Balancer, ProxyConfig, TlsSettings, public_model_pattern
from nnunet_triton.util.durable import write_text_atomic

__all__ = ["BALANCER_RUN_DIR", "STATE_FILE", "ReplicaSet", "balancer_config", "balancer_run_command",
           "free_loopback_ports", "read_state", "replica_specs", "state_dir", "write_state"]

BALANCER_RUN_DIR = Path("/run/nnunet-triton/balancer")  # inside the balancer container (the host folder)
BALANCER_TEMP_DIR = Path("/tmp")  # inside it: request bodies, the workers' (nginx makes its folders there)
STATE_FILE = "replicas.json"


@dataclass(frozen=True)
class ReplicaSet:
    """N replicas of one deployment and their balancer.

    Attributes:
        name: the deployment's ``--container-name``; replicas are ``<name>-<i>``, the balancer
            ``<name>-balancer``.
        ports: per replica, its loopback host ports (http, grpc, metrics).
        listen_host, listen_port: where the balancer listens (``--host``; ``--http-port``, or
            ``--proxy-port`` with TLS).
        tls: the balancer's TLS (host files, mounted read-only); None: plain HTTP on loopback.
    """

    name: str
    ports: tuple[tuple[int, int, int], ...]
    listen_host: str = "127.0.0.1"
    listen_port: int = DEFAULT_HTTP_PORT
    tls: TlsSettings | None = None

    def __post_init__(self) -> None:
        if len(self.ports) < 1:
            raise ValueError(f"a replica set needs at least one replica, got {len(self.ports)}.")
        flat = [port for ports in self.ports for port in ports]
        if len(set(flat)) != len(flat) or self.listen_port in flat:
            raise ValueError(f"every replica port and the balancer's port must differ, got replicas "
                             f"{[list(p) for p in self.ports]} and balancer {self.listen_port}.")

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(f"{self.name}-{index}" for index in range(len(self.ports)))

    @property
    def balancer(self) -> str:
        return f"{self.name}-balancer"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.listen_host in ("0.0.0.0", "::") else self.listen_host
        return f"{host}:{self.listen_port}"


def replica_specs(spec: docker.DeploySpec, replicas: ReplicaSet) -> tuple[docker.DeploySpec, ...]:
    """One container spec per replica: ``spec`` (the image, repository and memory plan) with its own name
    and loopback ports, without TLS (the balancer holds it); GPUs round-robin over ``spec.gpus``."""
    return tuple(
        docker.replace_spec(spec, container_name=name, http_port=http, grpc_port=grpc, metrics_port=metrics,
                            publish_host="127.0.0.1", tls=None,
                            gpus=(spec.gpus[index % len(spec.gpus)],) if spec.gpus else ())
        for index, (name, (http, grpc, metrics)) in enumerate(zip(replicas.replicas, replicas.ports,
                                                                  strict=True)))


def _absolute_tls(tls: TlsSettings) -> TlsSettings:
    return TlsSettings(**{field: Path(path).absolute() if path is not None else None
                          for field, path in vars(tls).items()})


def balancer_config(replicas: ReplicaSet, endpoints: tuple[str, ...], *, models: tuple[str, ...] = (),
                    allow_statistics: bool = False) -> ProxyConfig:
    """The balancer's proxy as the container sees it: run folder :data:`BALANCER_RUN_DIR`, one upstream
    server per replica's loopback HTTP port, TLS files at their absolute host paths (mounted there read-only;
    the bearer token is read here, into the 0600 config, as for the embedded proxy)."""
    tls = _absolute_tls(replicas.tls) if replicas.tls is not None else None
    return ProxyConfig(listen_host=replicas.listen_host, listen_port=replicas.listen_port,
                       upstream_port=replicas.ports[0][0], tls=tls,
                       model_pattern=public_model_pattern(endpoints, models), run_dir=BALANCER_RUN_DIR,
                       allow_statistics=allow_statistics,
                       balancer=Balancer(ports=tuple(ports[0] for ports in replicas.ports)))


def balancer_run_command(replicas: ReplicaSet, *, image: str, run_dir: Path, engine: str,
                         check_only: bool = False) -> tuple[str, ...]:
    """``run`` of nginx in ``image`` on the host's network (the replicas' ports are on the host's loopback),
    the host folder ``run_dir`` (nginx.conf, pid, logs) at :data:`BALANCER_RUN_DIR`, TLS files read-only.
    ``check_only``: ``nginx -t`` in a throwaway container instead."""
    config = str(BALANCER_RUN_DIR / "nginx.conf")
    files = [path for path in vars(_absolute_tls(replicas.tls)).values() if path is not None] if (
        replicas.tls is not None) else []
    tls = tuple(part for path in files for part in ("--volume", f"{path}:{path}:ro"))
    how = ("--rm",) if check_only else ("--detach", "--name", replicas.balancer, "--restart",
                                         docker.RESTART_POLICY)
    return (engine, "run", *how, "--network", "host",
            "--volume", f"{Path(run_dir).absolute()}:{BALANCER_RUN_DIR}", *tls,
            image, "nginx", "-c", config, *(("-t",) if check_only else ()))


def state_dir(run: Path, name: str) -> Path:
    """The host folder of one replica set: nginx.conf, logs and :data:`STATE_FILE`."""
    return Path(run) / f"{name}-replicas"


def write_state(folder: Path, replicas: ReplicaSet, engine: str) -> Path:
    """Record what runs (the file ``undeploy`` reads); the file written."""
    path = Path(folder) / STATE_FILE
    state = {"engine": engine, "balancer": replicas.balancer, "url": replicas.url,
             "tls": replicas.tls is not None,
             "replicas": [{"name": name, "http_port": http, "grpc_port": grpc, "metrics_port": metrics}
                          for name, (http, grpc, metrics) in zip(replicas.replicas, replicas.ports,
                                                                 strict=True)]}
    write_text_atomic(path, json.dumps(state, indent=2) + "\n", mode=0o600)
    return path


def read_state(folder: Path) -> dict | None:
    """What :func:`write_state` recorded, or None."""
    path = Path(folder) / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (the kernel's choice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
