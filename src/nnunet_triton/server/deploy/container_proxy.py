"""The TLS proxy inside the serving container (``deploy --target docker --tls-cert/--tls-key/--tls-ca``).

The image carries nginx (docker/Dockerfile) and a user of its own for nginx's workers (:data:`PROXY_USER`).
With TLS the container runs, from the same configuration renderer as the embedded launcher's proxy
(``server.proxy_config.render_config``: the repository's public endpoints as the allow-list, client
certificates and/or a bearer token, buffered de-chunked bodies):

* tritonserver with HTTP, gRPC and metrics bound to 127.0.0.1 inside the container (unreachable from outside
  it, published or not);
* nginx on :data:`PROXY_PORT`, the only port ``docker run`` publishes (on ``--host``); its master reads the
  certificate, key and client CA (and the token file) from :data:`TLS_DIR`, each host file bind-mounted
  read-only; its workers run as :data:`PROXY_USER`;
* the container's watchdog (``thread_budget exec --watchdog --proxy-config``) starts nginx and starts it
  again when it died (``server.proxy_keeper``).

Host side (pure, for ``server.deploy.docker``): :func:`volumes` and :func:`entrypoint_args`. Container side
(``server.deploy.entrypoint``, before tritonserver starts): :func:`prepare` writes nginx.conf and checks it
with ``nginx -t``.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from collections.abc import Sequence
from pathlib import Path

from nnunet_triton.server.proxy_config import (
    ProxyConfig,
    ProxyError,
    TlsSettings,
    public_model_pattern,
    render_config,
)

__all__ = ["PROXY_PORT", "PROXY_USER", "RUN_DIR", "TLS_DIR", "TLS_FILES", "container_tls", "entrypoint_args",
           "prepare", "proxy_config", "volumes"]

PROXY_PORT = 8443  # inside the container (the k8s sidecar's port too)
PROXY_USER = "nnunet-proxy"  # made by docker/Dockerfile; nothing else runs as it
# paths inside the container
TLS_DIR = Path("/etc/nnunet-triton/tls")
RUN_DIR = Path("/run/nnunet-triton/proxy")  # root 0700: nginx.conf (0600, may hold the token), pid, logs
TEMP_DIR = Path("/run/nnunet-triton/proxy-temp")  # request bodies: the workers' own 0700 folder
# TlsSettings field -> the file's name under TLS_DIR, and the entry point's flag for it
TLS_FILES = {"cert": ("tls.crt", "--tls-cert"), "key": ("tls.key", "--tls-key"),
             "client_ca": ("ca.crt", "--tls-ca"), "token_file": ("token", "--tls-token-file")}


def _given(tls: TlsSettings) -> list[tuple[str, Path]]:
    return [(field, Path(getattr(tls, field))) for field in TLS_FILES if getattr(tls, field) is not None]


def container_tls(tls: TlsSettings) -> TlsSettings:
    """``tls`` (host files) as the container sees them: each file under :data:`TLS_DIR`."""
    return TlsSettings(**{field: TLS_DIR / TLS_FILES[field][0] for field, _ in _given(tls)})


def volumes(tls: TlsSettings) -> tuple[str, ...]:
    """``--volume HOST:CONTAINER:ro`` for each TLS file (absolute host paths, read-only in the container)."""
    return tuple(part for field, path in _given(tls)
                 for part in ("--volume", f"{path.absolute()}:{TLS_DIR / TLS_FILES[field][0]}:ro"))


def entrypoint_args(tls: TlsSettings, *, allow_statistics: bool = False) -> tuple[str, ...]:
    """The entry point's TLS flags for the mounted files (``server.deploy.entrypoint``)."""
    inside = container_tls(tls)
    flags = tuple(part for field, path in _given(inside) for part in (TLS_FILES[field][1], str(path)))
    return (*flags, *(("--proxy-allow-statistics",) if allow_statistics else ()))


def proxy_config(endpoints: Sequence[str], tls: TlsSettings, *, upstream_port: int,
                 allow_statistics: bool = False, models: Sequence[str] = ()) -> ProxyConfig:
    """The container's proxy: every address of the container on :data:`PROXY_PORT`, forwarding the public
    endpoints (``models`` verbatim for a repository without a registry) to Triton's loopback HTTP port."""
    return ProxyConfig(listen_host="0.0.0.0", listen_port=PROXY_PORT, upstream_port=upstream_port, tls=tls,
                       model_pattern=public_model_pattern(endpoints, models), run_dir=RUN_DIR,
                       allow_statistics=allow_statistics)


def _worker(user: str) -> tuple[int, int, str]:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ProxyError(f"the user {user!r} the proxy's workers run as does not exist in this image "
                         "(docker/Dockerfile makes it): rebuild the image.") from None
    return entry.pw_uid, entry.pw_gid, f"{user} {grp.getgrgid(entry.pw_gid).gr_name}"


def prepare(config: ProxyConfig, *, nginx: str | None = None, temp_dir: Path = TEMP_DIR,
            user: str = PROXY_USER) -> Path:
    """Write ``config``'s nginx.conf (0600; workers as ``user``, request bodies in their own 0700
    ``temp_dir``) and check it with ``nginx -t`` (certificate and key readable, client CA parsed); the
    config file. ProxyError naming what is wrong otherwise (ExposureError for missing TLS files or no client
    authentication)."""
    from nnunet_triton.server.proxy import find_nginx, nginx_command
    from nnunet_triton.util.durable import write_text_atomic

    config.tls.validate()  # every file there, client authentication asked for, a well-formed token
    uid, gid, worker = _worker(user)
    config.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(config.run_dir, 0o700)
    temp_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(temp_dir, uid, gid)
    os.chmod(temp_dir, 0o700)
    write_text_atomic(config.config_file, render_config(config, worker_user=worker, temp_dir=temp_dir),
                      mode=0o600)
    command = nginx_command(config.config_file, nginx or find_nginx())
    check = subprocess.run([*command, "-t"], capture_output=True, text=True, check=False, timeout=60)
    if check.returncode != 0:
        raise ProxyError(f"nginx rejected {config.config_file}: {check.stderr.strip()}")
    return config.config_file
