"""The authenticating TLS proxy (Debian's nginx) in front of a loopback-only Triton HTTP endpoint.

Triton 2.51 has no TLS on HTTP, serves every model and API to whoever reaches its port, and crashes on
crafted chunked bodies (CVE-2025-23310/23311). Beyond loopback the embedded launcher therefore binds
Triton's HTTP and metrics endpoints to 127.0.0.1 and puts nginx, run unprivileged from a config generated
into the run folder, on the public address:

* TLS 1.2/1.3 with the given certificate; clients authenticate with a certificate signed by ``client_ca``
  (mutual TLS) and/or a bearer token (``Authorization: Bearer ...``, the token read from a 0600 file).
* An allow-list of paths: server health and metadata, and health, metadata, config and infer of the public
  endpoints only. Internal models (``stitch_model``, ``fold_k``, ...), shared memory, logging, trace, the
  model repository and (unless ``allow_statistics``) statistics answer 403 from nginx; Triton never sees them.
* Request bodies are buffered whole (``proxy_request_buffering on``, at most ``max_body_bytes``) and
  forwarded with a Content-Length over HTTP/1.0, so Triton never receives chunked transfer encoding.
* The path forwarded is nginx's normalized ``$uri`` that matched the allow-list (no query string), so
  ``..``, ``%2F`` or doubled slashes cannot reach another path in Triton.
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import ipaddress
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.errors import NnunetTritonError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "ExposureError",
    "ProxyConfig",
    "ProxyError",
    "ProxyProcess",
    "TlsSettings",
    "check_exposure",
    "find_nginx",
    "is_loopback",
    "kill_orphaned_workers",
    "proxy_alive",
    "running_pid",
    "public_model_pattern",
    "render_config",
    "start_proxy",
    "stop_proxy",
]

LOGGER = logging.getLogger(__name__)

# A 512x512x1000 float32 CT is 1000 MiB; JSON headers and a probability request's margin fit in 100 MiB more.
DEFAULT_MAX_BODY_BYTES = 1100 * 2**20
NGINX_INSTALL_HINT = "apt-get install nginx-light"
_PR_SET_PDEATHSIG = 1
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


def find_nginx() -> str:
    """The nginx binary; ProxyError naming the package when it is missing."""
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).is_file()), None)
    if found is None:
        raise ProxyError(f"nginx is not installed: the TLS proxy needs it ({NGINX_INSTALL_HINT}).")
    return found


@dataclass
class ProxyProcess:
    """A started nginx master (its own process group) and what it serves."""

    pid: int
    url: str
    config_file: str
    _process: subprocess.Popen[bytes] | None = None

    def is_running(self) -> bool:
        if self._process is not None:
            return self._process.poll() is None
        return proxy_alive(self.pid, self.config_file)

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_proxy(self.pid, self.config_file, timeout_s=timeout_s, process=self._process)


def proxy_alive(pid: int, config_file: str) -> bool:
    """Whether ``pid`` is an nginx master started on ``config_file`` (guards against pid reuse)."""
    try:
        return config_file.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _group_members(pgid: int, name: str = "nginx") -> list[int]:
    """Pids of the processes named ``name`` in process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if comm == name and int(rest[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def kill_orphaned_workers(master_pid: int) -> None:
    """SIGKILL what is left of a dead nginx master's process group: its workers outlive a master killed by
    SIGKILL and keep serving (and holding the port)."""
    if _group_members(master_pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(master_pid, signal.SIGKILL)


def stop_proxy(pid: int, config_file: str, *, timeout_s: float = 10.0,
               process: subprocess.Popen[bytes] | None = None) -> None:
    """SIGQUIT (graceful), then SIGKILL the group; only a process started with ``config_file``."""
    alive = (lambda: process.poll() is None) if process is not None else (
        lambda: proxy_alive(pid, config_file))
    if alive():
        os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + timeout_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive():
            os.killpg(pid, signal.SIGKILL)
        if process is not None:
            process.wait()
    kill_orphaned_workers(pid)
    _remove_temp_dir(config_file)


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_TEMP_RECORD = "nginx-temp-dir"  # in the run folder: the request-body folder to remove at stop


def _prepare_run_dir(config: ProxyConfig) -> tuple[str | None, Path]:
    """(worker user, temp folder). As root the workers (which face the network) run as ``nobody``; their
    request-body folder is then a fresh 0700 folder of ``nobody`` under the system temp folder, since the
    run folder's parents need not be searchable by ``nobody``."""
    config.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.geteuid() != 0:
        worker, temp = None, config.run_dir
    else:
        entry = pwd.getpwnam("nobody")
        worker = f"nobody {grp.getgrgid(entry.pw_gid).gr_name}"  # nginx's default group is the user's name
        temp = Path(tempfile.mkdtemp(prefix="nnunet-proxy-"))
        os.chown(temp, entry.pw_uid, entry.pw_gid)
        (config.run_dir / _TEMP_RECORD).write_text(f"{temp}\n")
    for name in ("nginx-body", "nginx-proxy", "nginx-fastcgi", "nginx-uwsgi", "nginx-scgi"):
        path = temp / name
        path.mkdir(mode=0o700, exist_ok=True)
        if worker is not None:
            os.chown(path, entry.pw_uid, entry.pw_gid)
    return worker, temp


def _remove_temp_dir(config_file: str) -> None:
    record = Path(config_file).parent / _TEMP_RECORD
    if record.is_file():
        temp = Path(record.read_text().strip())
        if temp.name.startswith("nnunet-proxy-") and temp.parent == Path(tempfile.gettempdir()):
            shutil.rmtree(temp, ignore_errors=True)
        record.unlink(missing_ok=True)


def _wait_listening(process: subprocess.Popen[bytes], config: ProxyConfig, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    host = config.url.rsplit(":", 1)[0].strip("[]")
    while True:
        if process.poll() is not None:
            log = config.run_dir / "nginx-error.log"
            tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
            raise ProxyError(f"nginx exited (code {process.returncode}) before listening on {config.url}; "
                             f"{log}:\n{tail}")
        try:
            with socket.create_connection((host, config.listen_port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                stop_proxy(process.pid, str(config.config_file), process=process)
                raise ProxyError(f"nginx did not listen on {config.url} within {timeout_s:.0f} s.") from None
            time.sleep(0.05)


def nginx_command(config_file: Path, nginx: str | None = None) -> list[str]:
    """nginx on ``config_file`` with its prefix and error log in that file's folder (the run folder)."""
    run_dir = Path(config_file).absolute().parent
    return [nginx or find_nginx(), "-p", str(run_dir), "-c", str(Path(config_file).absolute()),
            "-e", str(run_dir / "nginx-error.log")]


def launch(command: Sequence[str], *, detach: bool) -> subprocess.Popen[bytes]:
    """Start nginx in its own process group (stopped as a group); without ``detach`` it gets SIGTERM
    when the starting thread's process exits."""
    return subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=None if detach else _die_with_parent)


def running_pid(config_file: str | Path) -> int | None:
    """The pid of the nginx master running on ``config_file`` (from its pid file), None when none runs."""
    try:
        pid = int((Path(config_file).parent / "nginx.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if proxy_alive(pid, str(Path(config_file).absolute())) else None


def start_proxy(config: ProxyConfig, *, detach: bool = False, timeout_s: float = 30.0) -> ProxyProcess:
    """Write ``config``'s nginx.conf (0600: it may hold the bearer token) and start nginx on it."""
    nginx = find_nginx()
    worker, temp = _prepare_run_dir(config)
    fd = os.open(config.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(render_config(config, worker_user=worker, temp_dir=temp))
    command = nginx_command(config.config_file, nginx)
    check = subprocess.run([*command, "-t"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise ProxyError(f"nginx rejected {config.config_file}: {check.stderr.strip()}")
    process = launch(command, detach=detach)
    _wait_listening(process, config, timeout_s)
    LOGGER.info("TLS proxy (nginx pid %d) on %s -> Triton HTTP 127.0.0.1:%d (client %s)", process.pid,
                config.url, config.upstream_port,
                " + ".join(x for x, v in (("certificate", config.tls.client_ca),
                                          ("bearer token", config.tls.token_file)) if v is not None))
    return ProxyProcess(pid=process.pid, url=config.url, config_file=str(config.config_file.absolute()),
                        _process=process)
