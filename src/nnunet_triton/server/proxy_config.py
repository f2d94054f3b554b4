"""The nginx configuration of the TLS proxy (``server.proxy`` runs it) and the refusal to expose a server
without TLS: what is let through to Triton, how bodies are forwarded, who must authenticate.

The same configuration balances replicas (``deploy --target docker --replicas N``,
``server.deploy.replicas``): with a :class:`Balancer` the requests go to an ``upstream`` of N loopback
Triton HTTP ports instead of one, with passive health checks (``max_fails``/``fail_timeout``) and retries on
the next replica (``proxy_next_upstream ... non_idempotent``: an inference POST is idempotent, it holds no
server-side state). Without TLS (``tls=None``) it listens on loopback only.

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
    "BALANCER_FAIL_TIMEOUT_S",
    "Balancer",
    "ClientLimits",
    "DEFAULT_CONCURRENT_REQUESTS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_REQUESTS_PER_MINUTE",
    "DEFAULT_REQUEST_BURST",
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
# Per client (its certificate, else its address): one segmentation takes seconds and a client polls health
# and metadata between requests; 600 a minute (10/s) with a burst of 60 and 16 requests at once are far above
# what the client library and the DICOM node send. perf_analyzer through the proxy at high rates needs more
# (--proxy-requests-per-minute, --proxy-burst, --proxy-concurrent-requests).
DEFAULT_REQUESTS_PER_MINUTE = 600
DEFAULT_REQUEST_BURST = 60
DEFAULT_CONCURRENT_REQUESTS = 16
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
class ClientLimits:
    """What one client may have the proxy forward: ``requests_per_minute`` on average, ``burst`` more at
    once, and ``concurrent`` requests in progress; beyond either nginx answers 429. A client is its TLS
    certificate where client certificates authenticate (two processes of one host with different
    certificates are two clients), else its address (with a bearer token alone, every process of a host
    shares that host's allowance)."""

    requests_per_minute: int = DEFAULT_REQUESTS_PER_MINUTE
    burst: int = DEFAULT_REQUEST_BURST
    concurrent: int = DEFAULT_CONCURRENT_REQUESTS

    def __post_init__(self) -> None:
        for name, flag, minimum in (("requests_per_minute", "--proxy-requests-per-minute", 1),
                                    ("burst", "--proxy-burst", 0),
                                    ("concurrent", "--proxy-concurrent-requests", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ProxyError(f"the proxy's {name} per client ({flag}) must be an integer >= {minimum} "
                                 f"(got {value!r}).")


BALANCER_FAIL_TIMEOUT_S = 10  # a replica that failed gets no request for this long, then one tries it again


@dataclass(frozen=True)
class Balancer:
    """The replicas one proxy balances: their loopback Triton HTTP ports, and the passive health check.

    nginx open source has no active health check (``health_check`` is NGINX Plus): a replica is marked
    down by the requests themselves. After ``max_fails`` failed attempts (connection refused or reset, no
    answer within ``connect_timeout_s``, a 502 or 503) within ``fail_timeout_s`` it gets no request for
    ``fail_timeout_s``; then one request tries it again. A request that failed on one replica goes on to the
    next (each replica at most once): the client sees no failure while one replica lives, unless the
    replica died after its answer's header was sent.
    """

    ports: tuple[int, ...]
    max_fails: int = 1
    fail_timeout_s: int = BALANCER_FAIL_TIMEOUT_S
    connect_timeout_s: int = 5

    def __post_init__(self) -> None:
        if not self.ports or len(set(self.ports)) != len(self.ports) or not all(
                isinstance(p, int) and 0 < p < 65536 for p in self.ports):
            raise ProxyError(f"the balancer needs one or more distinct replica ports (1-65535), got "
                             f"{list(self.ports)}.")
        for name in ("max_fails", "fail_timeout_s", "connect_timeout_s"):
            if getattr(self, name) < 1:
                raise ProxyError(f"the balancer's {name} must be at least 1, got {getattr(self, name)}.")

    def upstream_lines(self) -> list[str]:
        """The ``upstream`` block (http context): one loopback server per replica."""
        check = f"max_fails={self.max_fails} fail_timeout={self.fail_timeout_s}s"
        servers = [f"    server 127.0.0.1:{port} {check};" for port in self.ports]
        return [f"upstream {BALANCER_UPSTREAM} {{", *servers, "}"]

    def retry_lines(self) -> list[str]:
        """The retries (http context): a request that failed on one replica goes on to the next; inference
        is idempotent (no sequence batching, no state kept between requests), so POSTs are retried too."""
        return [
            "proxy_next_upstream error timeout http_502 http_503 non_idempotent;",
            f"proxy_next_upstream_tries {len(self.ports)};",
            f"proxy_connect_timeout {self.connect_timeout_s}s;",
            # one line per request: which replica(s) it went to and what each answered
            "log_format nnunet_balancer '$msec $status $upstream_addr $upstream_status $request_time "
            "\"$request\"';",
        ]


BALANCER_UPSTREAM = "nnunet_replicas"


@dataclass(frozen=True)
class ProxyConfig:
    """One proxy: where it listens, the loopback Triton HTTP port it forwards to and what it lets through.

    ``balancer``: forward to its replicas instead of ``upstream_port``. ``tls`` None: plain HTTP, on a
    loopback ``listen_host`` only (ExposureError otherwise)."""

    listen_host: str
    listen_port: int
    upstream_port: int
    tls: TlsSettings | None
    model_pattern: str
    run_dir: Path
    allow_statistics: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limits: ClientLimits = ClientLimits()
    balancer: Balancer | None = None

    def __post_init__(self) -> None:
        if self.tls is None:
            check_exposure(self.listen_host, None, what="the proxy")

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


# What the proxy answers before anything reaches Triton (nginx ``return``; the body is read and discarded).
# Triton 2.51 inflates `Content-Encoding: gzip|deflate` bodies without a limit (a 1 MiB gzip grows it by
# 1 GiB for good): no encoded body is forwarded, and the header itself never is (``proxy_set_header``).
_ENCODED_BODY = ("415", "a request body with a Content-Encoding is refused: send it uncompressed "
                        "(docs/security.md, TLS proxy)")
# nginx itself answers 501 for any Transfer-Encoding but exactly "chunked" and 400 for two of them; this
# check keeps that true for an nginx that would not (``\z``: PCRE's ``$`` also matches before a final
# newline).
_TRANSFER_ENCODING = ("501", "a Transfer-Encoding other than chunked is refused")
_BAD_TRANSFER_ENCODING = "^(chunked)?\\z"
# The raw request line: no parent segment, no encoded dot, slash, backslash or control byte, no backslash
# and no control byte at all; a model name never needs them and nginx would decode them into $uri.
_BAD_PATH = ("400", "the path holds a traversal or control character (.., %2e, %2f, %5c, backslash, %00-%1f, "
                    "%7f): refused")
_BAD_PATH_PATTERN = "(\\.\\.|%2e|%2f|%5c|%[01][0-9a-f]|%7f|\\x5c|[\\x00-\\x20\\x7f])"


def _refusal(status_message: tuple[str, str]) -> str:
    status, message = status_message
    return f'return {status} "{message}\\n";'


def _guards() -> list[str]:
    """Server-level refusals, after authentication (an unauthenticated client learns nothing more)."""
    return [
        f'if ($request_uri ~* "{_BAD_PATH_PATTERN}") {{ {_refusal(_BAD_PATH)} }}',
        f'if ($http_transfer_encoding !~* "{_BAD_TRANSFER_ENCODING}") {{ {_refusal(_TRANSFER_ENCODING)} }}',
        f'if ($http_content_encoding != "") {{ {_refusal(_ENCODED_BODY)} }}',
    ]


def _limits(limits: ClientLimits) -> tuple[list[str], list[str]]:
    """(http lines, server lines) of ``limits``: the client is keyed on its certificate's SHA-1 fingerprint
    (empty without client certificates), else on its address. Refused requests (401, 403, 400, 415) never
    count: nginx answers them before the limits' phase."""
    http = [
        "map $ssl_client_fingerprint $nnunet_client {",
        '    "" $binary_remote_addr;',
        "    default $ssl_client_fingerprint;",
        "}",
        f"limit_req_zone $nnunet_client zone=nnunet_rate:2m rate={limits.requests_per_minute}r/m;",
        "limit_conn_zone $nnunet_client zone=nnunet_busy:2m;",
        "limit_req_status 429;",
        "limit_conn_status 429;",
        "limit_req_log_level warn;",
        "limit_conn_log_level warn;",
    ]
    server = [f"limit_req zone=nnunet_rate burst={limits.burst} nodelay;",
              f"limit_conn nnunet_busy {limits.concurrent};"]
    return http, server


def render_config(config: ProxyConfig, *, worker_user: str | None = None,
                  temp_dir: Path | None = None) -> str:
    """The nginx.conf text for ``config``: files in ``config.run_dir``, request bodies in ``temp_dir``
    (default: the run folder), workers as ``worker_user`` (nginx's ``user``, when started as root)."""
    run = config.run_dir.absolute()
    temp = (temp_dir or run).absolute()
    balancer = config.balancer
    upstream = (f"http://{BALANCER_UPSTREAM}" if balancer is not None
                else f"http://127.0.0.1:{config.upstream_port}")
    versioned = f"{config.model_pattern}(/versions/[1-9][0-9]*)?"
    model = f"/v2/models/{versioned}"
    forward = [f"proxy_pass {upstream}$uri;"]
    # each pattern ends in \z: with `$` a path ending in %0a (decoded into $uri) matched and reached Triton
    # as a raw line feed
    locations = [
        # server liveness/readiness and metadata
        ('"^/v2/health/(live|ready)\\z"', "GET"),
        ('"^/v2\\z"', "GET"),
        # a public endpoint's readiness, metadata and config (config: clients read the input dtypes)
        (f'"^{model}(/ready|/config)?\\z"', "GET"),
        (f'"^{model}/infer\\z"', "POST"),
    ]
    if config.allow_statistics:
        locations.append((f'"^/v2/models(/{versioned})?/stats\\z"', "GET"))
    body = []
    for pattern, method in locations:
        body += [f"location ~ {pattern} {{", f"    limit_except {method} {{ deny all; }}",
                 *(f"    {line}" for line in forward), "}"]
    body += ["location / { return 403; }"]
    limits_http, limits_server = _limits(config.limits)
    listen = _listen(config.listen_host, config.listen_port)
    tls = [] if config.tls is None else [
        f"ssl_certificate {Path(config.tls.cert).absolute()};",
        f"ssl_certificate_key {Path(config.tls.key).absolute()};",
        "ssl_protocols TLSv1.2 TLSv1.3;",
        "ssl_prefer_server_ciphers on;",
        *_auth_lines(config.tls),
    ]
    server = [
        f"listen {listen}{'' if config.tls is None else ' ssl'};",
        *tls,
        *_guards(),
        *limits_server,
        *body,
    ]
    http = [
        "server_tokens off;",
        *(balancer.retry_lines() if balancer is not None else []),
        f"access_log {run}/nginx-access.log{' nnunet_balancer' if balancer is not None else ''};",
        f"client_body_temp_path {temp}/nginx-body;",
        f"proxy_temp_path {temp}/nginx-proxy;",
        f"fastcgi_temp_path {temp}/nginx-fastcgi;",
        f"uwsgi_temp_path {temp}/nginx-uwsgi;",
        f"scgi_temp_path {temp}/nginx-scgi;",
        *limits_http,
        # bodies are buffered whole (to disk beyond 1 MiB) and sent de-chunked with a Content-Length
        f"client_max_body_size {config.max_body_bytes};",
        "client_body_buffer_size 1m;",
        "client_body_timeout 300s;",
        "proxy_request_buffering on;",
        "proxy_http_version 1.0;",
        "proxy_set_header Transfer-Encoding \"\";",
        # never forwarded, whatever the refusal above saw (nginx 1.22's $http_ variable reads the first of
        # several headers only): Triton inflates gzip and deflate bodies without a limit
        "proxy_set_header Content-Encoding \"\";",
        "proxy_set_header Host $host;",
        # answers (segmentations, probabilities) stream back instead of filling a temp file
        "proxy_buffering off;",
        "proxy_read_timeout 3600s;",
        "proxy_send_timeout 3600s;",
        *(balancer.upstream_lines() if balancer is not None else []),
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
