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
* The path forwarded is nginx's normalized ``$uri`` that matched the allow-list (no query string, each pattern
  closed with ``\\z``); a request line holding ``..``, an encoded dot, slash or backslash, a backslash or a
  control byte is refused (400) first.
* A body with a ``Content-Encoding`` is refused (415: Triton 2.51 inflates gzip and deflate bodies without a
  limit), and the header is never forwarded; a ``Transfer-Encoding`` other than ``chunked`` is refused.
* Each client (its certificate, else its address) gets a request rate and a number of requests in progress;
  beyond them nginx answers 429.
* As root, the workers (which face the network and hold the bearer token, the TLS key and the bodies in
  transit) run as a system user of their own, ``nnunet-proxy`` (created when missing): another local user's
  processes cannot read their memory. nginx is started with a minimal environment (no token, nothing secret),
  at first start and at every restart.

``server.proxy_config`` renders that configuration (and refuses exposure without TLS); this module writes it,
starts nginx, finds and stops it; ``server.proxy_keeper`` starts it again for the watchdog.
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.server.proxy_config import (
    DEFAULT_MAX_BODY_BYTES,
    ClientLimits,
    ExposureError,
    ProxyConfig,
    ProxyError,
    TlsSettings,
    check_exposure,
    is_loopback,
    public_model_pattern,
    render_config,
)
from nnunet_triton.util.durable import write_text_atomic
from nnunet_triton.util.process import kill, terminate

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "PROXY_USER",
    "ClientLimits",
    "ExposureError",
    "ProxyConfig",
    "ProxyError",
    "ProxyProcess",
    "TlsSettings",
    "check_exposure",
    "find_nginx",
    "is_loopback",
    "kill_orphaned_workers",
    "nginx_environment",
    "proxy_alive",
    "running_pid",
    "public_model_pattern",
    "render_config",
    "start_proxy",
    "stop_proxy",
    "worker_account",
]

LOGGER = logging.getLogger(__name__)

NGINX_INSTALL_HINT = "apt-get install nginx-light"
_PR_SET_PDEATHSIG = 1
# The workers' own system user (when started as root): nginx makes its workers dumpable after switching user,
# so any process of the same user could read their memory; no other process runs as this one.
PROXY_USER = "nnunet-proxy"
# All nginx gets from its starter's environment: nginx needs none, and its workers' /proc/<pid>/environ (and
# memory) keep what the master was started with, even after nginx clears its own `environ`.
_NGINX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def nginx_environment() -> dict[str, str]:
    """The environment nginx is started with, at first start and by the watchdog: PATH only."""
    return {"PATH": _NGINX_PATH}


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
        kill(master_pid, group=True)


def stop_proxy(pid: int, config_file: str, *, timeout_s: float = 10.0,
               process: subprocess.Popen[bytes] | None = None) -> None:
    """SIGQUIT (graceful), then SIGKILL the group; only a process started with ``config_file``."""
    alive = (lambda: process.poll() is None) if process is not None else (
        lambda: proxy_alive(pid, config_file))
    if alive():
        terminate(pid, timeout_s, sig=signal.SIGQUIT, group=True, alive=alive)
        if process is not None:
            process.wait()
    kill_orphaned_workers(pid)
    _remove_temp_dir(config_file)


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_TEMP_RECORD = "nginx-temp-dir"  # in the run folder: the request-body folder to remove at stop


def worker_account(name: str = PROXY_USER) -> pwd.struct_passwd:
    """The workers' system user ``name``, created (``useradd --system``, no home, no login shell, a group of
    its own) when it does not exist; ProxyError when it cannot be."""
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    useradd = shutil.which("useradd") or next(
        (p for p in ("/usr/sbin/useradd", "/sbin/useradd") if Path(p).is_file()), None)
    hint = (f"create it (useradd --system --no-create-home --shell /usr/sbin/nologin --user-group {name}) "
            f"or start the server as a user other than root")
    if useradd is None:
        raise ProxyError(f"the TLS proxy's workers run as the system user {name!r}, which does not exist, "
                         f"and useradd is not installed: {hint}.")
    result = subprocess.run([useradd, "--system", "--no-create-home", "--home-dir", "/nonexistent",
                             "--shell", "/usr/sbin/nologin", "--user-group", name],
                            capture_output=True, text=True, check=False, env=nginx_environment())
    try:
        return pwd.getpwnam(name)  # also when a concurrent start created it first (useradd exit code 9)
    except KeyError:
        raise ProxyError(f"the TLS proxy's workers run as the system user {name!r}, which could not be "
                         f"created (useradd exit code {result.returncode}: {result.stderr.strip()}): "
                         f"{hint}.") from None


def _prepare_run_dir(config: ProxyConfig) -> tuple[str | None, Path]:
    """(worker user, temp folder). As root the workers (which face the network) run as ``PROXY_USER``;
    their request-body folder is then a fresh 0700 folder of that user under the system temp folder, since
    the run folder's parents need not be searchable by it."""
    config.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.geteuid() != 0:
        worker, temp = None, config.run_dir
    else:
        entry = worker_account()
        worker = f"{entry.pw_name} {grp.getgrgid(entry.pw_gid).gr_name}"
        temp = Path(tempfile.mkdtemp(prefix="nnunet-proxy-"))
        os.chown(temp, entry.pw_uid, entry.pw_gid)
        write_text_atomic(config.run_dir / _TEMP_RECORD, f"{temp}\n")
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
    """Start nginx in its own process group (stopped as a group) with ``nginx_environment()`` only (the
    watchdog's environment holds the control token); without ``detach`` it gets SIGTERM when the starting
    thread's process exits."""
    return subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=nginx_environment(),
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
    text = render_config(config, worker_user=worker, temp_dir=temp)
    write_text_atomic(config.config_file, text, mode=0o600)
    command = nginx_command(config.config_file, nginx)
    check = subprocess.run([*command, "-t"], capture_output=True, text=True, check=False,
                           env=nginx_environment())
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
