"""The nginx configuration of the TLS proxy (``server.proxy`` runs it) and the refusal to expose a server
without TLS: what is let through to Triton, how bodies are forwarded, who must authenticate.

Pure text and checks: nothing is started here, so the rules are unit-tested without nginx.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.errors import NnunetTritonError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "ExposureError",
    "ProxyConfig",
    "ProxyError",
    "TlsSettings",
    "check_exposure",
    "is_loopback",
    "public_model_pattern",
    "render_config",
]

# A 512x512x1000 float32 CT is 1000 MiB; JSON headers and a probability request's margin fit in 100 MiB more.
DEFAULT_MAX_BODY_BYTES = 1100 * 2**20
_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]{16,256}$")


class ExposureError(NnunetTritonError, ValueError):
    """A server would be reachable beyond loopback without TLS and client authentication."""

    triton_code = "UNAVAILABLE"


class ProxyError(NnunetTritonError):
    """The TLS proxy cannot be configured or started (nginx missing, a certificate file unreadable, ...)."""

    triton_code = "INTERNAL"


def is_loopback(host: str) -> bool:
    """True for loopback addresses (``127.0.0.0/8``, ``::1``) and ``localhost``; False for ``0.0.0.0``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsSettings:
    """What authenticates the public endpoints: server certificate and key, and client authentication by
    certificates signed by ``client_ca`` and/or a bearer token kept in ``token_file``."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    token_file: Path | None = None

    def validate(self) -> TlsSettings:
        """``self`` when every file is readable and clients must authenticate; ExposureError otherwise."""
        if self.client_ca is None and self.token_file is None:
            raise ExposureError("TLS without client authentication: give --tls-ca (client certificates) "
                                "and/or --tls-token-file (bearer token).")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.client_ca),
                           ("--tls-token-file", self.token_file)):
            if path is not None and not Path(path).is_file():
                raise ExposureError(f"{flag}: no such file {str(path)!r}.")
        if self.token_file is not None:
            token = self.token()
            if not _SAFE_TOKEN.match(token or ""):
                raise ExposureError(f"--tls-token-file {str(self.token_file)!r}: the token must be 16 to 256 "
                                    f"characters of A-Z a-z 0-9 . _ ~ + / = - (got {len(token or '')} "
                                    f"characters).")
        return self

    def token(self) -> str | None:
        return Path(self.token_file).read_text().strip() if self.token_file is not None else None


def check_exposure(host: str, tls: TlsSettings | None, *, what: str = "the server") -> None:
    """Refuse (ExposureError) to bind ``host`` beyond loopback without TLS and client authentication."""
    if tls is not None:
        tls.validate()
        return
    if not is_loopback(host):
        raise ExposureError(
            f"{what} would listen on {host!r} (beyond loopback) without TLS: give --tls-cert, --tls-key and "
            f"--tls-ca (client certificates) and/or --tls-token-file, or bind 127.0.0.1. Triton 2.51 has no "
            f"authentication of its own and published critical CVEs (docs/security.md).")


def public_model_pattern(endpoints: Sequence[str] = (), models: Sequence[str] = ()) -> str:
    """A regex (nginx PCRE) of the model names the proxy serves: each endpoint, its typed copies and its
    pinned versions (``liver``, ``liver_int16``, ``liver__v3``, ``liver__v3_int16``), plus ``models``
    verbatim (a repository without a registry)."""
    from nnunet_triton.io_names import IMAGE_DTYPES

    typed = "|".join(dtype.lower() for dtype in IMAGE_DTYPES if dtype != "FP32")
    names = [f"{re.escape(name)}(__v[1-9][0-9]*)?(_({typed}))?" for name in endpoints]
    names += [re.escape(model) for model in models]
    if not names:
        raise ProxyError("the proxy has no public model to serve (no endpoint in the repository).")
    return "(" + "|".join(names) + ")"


@dataclass(frozen=True)
class ProxyConfig:
    """One proxy: where it listens, the loopback Triton HTTP port it forwards to and what it lets through."""

    listen_host: str
    listen_port: int
    upstream_port: int
    tls: TlsSettings
    model_pattern: str
    run_dir: Path
    allow_statistics: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @property
    def config_file(self) -> Path:
        return self.run_dir / "nginx.conf"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.listen_host in ("0.0.0.0", "") else self.listen_host
        return f"{host}:{self.listen_port}"


def _listen(host: str, port: int) -> str:
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _auth_lines(tls: TlsSettings) -> list[str]:
    lines = []
    if tls.client_ca is not None:
        lines += [f"ssl_client_certificate {Path(tls.client_ca).absolute()};", "ssl_verify_client on;",
                  "ssl_verify_depth 2;"]
    token = tls.token()
    if token is not None:
        # inside `server`: every location below inherits the check before anything is forwarded
        lines += [f'if ($http_authorization != "Bearer {token}") {{ return 401; }}']
    return lines


def render_config(config: ProxyConfig, *, worker_user: str | None = None,
                  temp_dir: Path | None = None) -> str:
    """The nginx.conf text for ``config``: files in ``config.run_dir``, request bodies in ``temp_dir``
    (default: the run folder), workers as ``worker_user`` (nginx's ``user``, when started as root)."""
    run = config.run_dir.absolute()
    temp = (temp_dir or run).absolute()
    upstream = f"http://127.0.0.1:{config.upstream_port}"
    versioned = f"{config.model_pattern}(/versions/[1-9][0-9]*)?"
    model = f"/v2/models/{versioned}"
    forward = [f"proxy_pass {upstream}$uri;"]
    locations = [
        # server liveness/readiness and metadata
        ('"^/v2/health/(live|ready)$"', "GET"),
        ('"^/v2$"', "GET"),
        # a public endpoint's readiness, metadata and config (config: clients read the input dtypes)
        (f'"^{model}(/ready|/config)?$"', "GET"),
        (f'"^{model}/infer$"', "POST"),
    ]
    if config.allow_statistics:
        locations.append((f'"^/v2/models(/{versioned})?/stats$"', "GET"))
    body = []
    for pattern, method in locations:
        body += [f"location ~ {pattern} {{", f"    limit_except {method} {{ deny all; }}",
                 *(f"    {line}" for line in forward), "}"]
    body += ["location / { return 403; }"]
    server = [
        f"listen {_listen(config.listen_host, config.listen_port)} ssl;",
        f"ssl_certificate {Path(config.tls.cert).absolute()};",
        f"ssl_certificate_key {Path(config.tls.key).absolute()};",
        "ssl_protocols TLSv1.2 TLSv1.3;",
        "ssl_prefer_server_ciphers on;",
        *_auth_lines(config.tls),
        *body,
    ]
    http = [
        "server_tokens off;",
        f"access_log {run}/nginx-access.log;",
        f"client_body_temp_path {temp}/nginx-body;",
        f"proxy_temp_path {temp}/nginx-proxy;",
        f"fastcgi_temp_path {temp}/nginx-fastcgi;",
        f"uwsgi_temp_path {temp}/nginx-uwsgi;",
        f"scgi_temp_path {temp}/nginx-scgi;",
        # bodies are buffered whole (to disk beyond 1 MiB) and sent de-chunked with a Content-Length
        f"client_max_body_size {config.max_body_bytes};",
        "client_body_buffer_size 1m;",
        "client_body_timeout 300s;",
        "proxy_request_buffering on;",
        "proxy_http_version 1.0;",
        "proxy_set_header Transfer-Encoding \"\";",
        "proxy_set_header Host $host;",
        # answers (segmentations, probabilities) stream back instead of filling a temp file
        "proxy_buffering off;",
        "proxy_read_timeout 3600s;",
        "proxy_send_timeout 3600s;",
        "server {", *(f"    {line}" for line in server), "}",
    ]
    main = [
        "daemon off;",
        "worker_processes 1;",
        f"pid {run}/nginx.pid;",
        f"error_log {run}/nginx-error.log warn;",
        *([f"user {worker_user};"] if worker_user else []),
        "events { worker_connections 512; }",
        "http {", *(f"    {line}" for line in http), "}",
    ]
    return "\n".join(main) + "\n"
