"""``ServerHandle``: a running embedded ``tritonserver`` (pid, ports, files; ``<home>/run/server.json``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path

from nnunet_triton.errors import ServerError
from nnunet_triton.server import watchdog
from nnunet_triton.server.health import (
    HealthReport,
    check_health,
    remove_shm_regions,
    repository_expectations,
    stub_processes,
)
from nnunet_triton.server.proxy import running_pid, stop_proxy
from nnunet_triton.server.server_config import EMBEDDED
from nnunet_triton.util.process import pid_alive, terminate

__all__ = [
    "ServerHandle",
    "recorded_server",
]

LOGGER = logging.getLogger(__name__)


EXIT_TIMEOUT_S = EMBEDDED.exit_timeout_s


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log file {path})"


def _http_ok(url: str, timeout_s: float = 1.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes via a proxy
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class ServerHandle:
    """A running (or stopped) tritonserver process and its endpoints; a context manager that stops it."""

    pid: int
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int | None  # None: no metrics endpoint (embedded.start without metrics)
    model_repository: str
    server_bin: str
    log_file: str
    pid_file: str | None = None
    state_file: str | None = None
    exit_timeout_s: int = EXIT_TIMEOUT_S
    thread_budget: dict[str, object] | None = None  # thread_budget: what was chosen and why
    memory_plan: dict[str, object] | None = None  # a GPU repository's CUDA/pinned pools
    watchdog_pid: int | None = None  # nnunet_triton.server.watchdog: reloads models whose process died
    events_file: str | None = None  # the watchdog's recoveries (JSON lines)
    control_token: str | None = None  # the restricted APIs need it (model_control.CONTROL_HEADER)
    restarts: int = 0  # times the watchdog started the server again after it died (server.restart)
    grpc_host: str | None = None  # gRPC's bind address when not ``host`` (TLS: gRPC public, HTTP loopback)
    proxy_pid: int | None = None  # server.proxy: the TLS proxy (nginx) in front of the HTTP endpoint
    proxy_url: str | None = None  # host:port clients use over HTTPS
    proxy_config: str | None = None  # its nginx.conf (identifies the process as ours)
    # what runs unprotected: started without server.preload's library (embedded.ALLOW_DEGRADED_FLAG)
    degraded: list[str] = field(default_factory=list)
    _watchdog: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    _proxy: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        """``host:port`` for ``tritonclient.http`` and ``perf_analyzer -u``."""
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        host = self.grpc_host or self.host
        return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics``; ServerError when the server was started without metrics."""
        if self.metrics_port is None:
            raise ServerError("this server has no metrics endpoint: start it with metrics=True or a "
                              "metrics_port (`serve --metrics` / `--metrics-port`)")
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    def follow_restart(self) -> None:
        """Take the pid the watchdog recorded in the state file after restarting the server."""
        if not self.state_file:
            return
        try:
            state = json.loads(Path(self.state_file).read_text())
        except (OSError, ValueError):
            return
        pid = state.get("pid")
        if isinstance(pid, int) and pid != self.pid:
            if self._process is not None:
                self._process.poll()  # reap the dead server
            self.pid, self.restarts, self._process = pid, int(state.get("restarts", self.restarts)), None

    def is_running(self) -> bool:
        self.follow_restart()
        if self._process is not None:
            return self._process.poll() is None
        if not pid_alive(self.pid):
            return False
        try:  # guard against pid reuse: only ever signal our own tritonserver
            return Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")[0].decode() == self.server_bin
        except OSError:
            return False

    def is_ready(self) -> bool:
        """Triton's own readiness (``/v2/health/ready``); ``health()`` says whether requests can succeed."""
        return self.is_running() and _http_ok(f"http://{self.http_url}/v2/health/ready")

    @property
    def control_headers(self) -> dict[str, str]:
        """Headers for Triton's model-repository API (index, load, unload), restricted to this token."""
        return {watchdog.CONTROL_HEADER: self.control_token} if self.control_token else {}

    def health(self, timeout_s: float = 2.0) -> HealthReport:
        """Whether the endpoint can answer now: server ready, every model ready with all its processes."""
        required, optional = repository_expectations(self.model_repository)
        return check_health(self.http_url, required, server_pid=self.pid if self.is_running() else None,
                            timeout_s=timeout_s, optional=optional)

    def watchdog_running(self) -> bool:
        if self._watchdog is not None:
            return self._watchdog.poll() is None
        pid = self.watchdog_pid
        return pid is not None and pid_alive(pid) and _is_watchdog(pid)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM, wait ``timeout_s`` (default: exit timeout + 10 s), then SIGKILL server and stubs.

        tritonserver drains for up to ``exit_timeout_s``, and it also waits that long for idle HTTP
        keep-alive connections: close clients before stopping to shut down in well under a second.
        """
        timeout_s = self.exit_timeout_s + 10.0 if timeout_s is None else timeout_s
        self._stop_watchdog()  # first: a stopping server's models must not be "recovered" nor restarted
        self.follow_restart()
        if self.proxy_pid is not None and self.proxy_config is not None:  # then: no new requests
            # the watchdog may have started the proxy again (server.proxy_keeper): its pid file says which
            pid = running_pid(self.proxy_config) or self.proxy_pid
            stop_proxy(pid, self.proxy_config, process=self._proxy if pid == self.proxy_pid else None)
        ours = self.is_running()
        regions = [s.shm_region for s in stub_processes(self.pid)] if ours else []
        if ours:
            LOGGER.info("stopping tritonserver pid %d", self.pid)
            if not terminate(self.pid, timeout_s, group=True, alive=self._server_alive, kill_wait_s=10.0):
                LOGGER.warning("tritonserver pid %d ignored SIGTERM for %.0f s; sent SIGKILL", self.pid,
                               timeout_s)
        if ours or self._process is not None:  # never signal a group we cannot prove is ours
            self._reap_group()
        # Triton 2.51 leaves the regions of some reloaded instances behind even on a clean exit
        leftover = remove_shm_regions(regions)
        if leftover:
            LOGGER.info("removed %d shm region(s) tritonserver left in /dev/shm", len(leftover))
        self._remove_run_files()

    def _stop_watchdog(self) -> None:
        if not self.watchdog_running():
            return
        assert self.watchdog_pid is not None
        terminate(self.watchdog_pid, 5.0, alive=self.watchdog_running)

    def _server_alive(self) -> bool:
        # a child of this process is reaped by poll(); another's is gone when it is a zombie or gone
        return self._process.poll() is None if self._process is not None else pid_alive(self.pid)

    def _reap_group(self) -> None:
        # The server runs in its own session (pgid == pid); stubs left behind exit on their own when
        # they notice the server is gone, but never wait on that.
        terminate(self.pid, 5.0, sig=None, group=True, alive=lambda: _group_alive(self.pid), poll_s=0.1)

    def _remove_run_files(self) -> None:
        if self.state_file:  # the watchdog's restart spec (embedded._start_watchdog)
            Path(self.state_file).with_name("launch.json").unlink(missing_ok=True)
        for name in (self.pid_file, self.state_file):
            path = Path(name) if name else None
            if path is not None and path.is_file() and _state_pid(path) == self.pid:
                path.unlink()

    def to_json(self) -> str:
        state = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        return json.dumps(state, indent=2)

    @classmethod
    def from_state_file(cls, state_file: str | Path) -> ServerHandle:
        state = json.loads(Path(state_file).read_text())
        return cls(**state)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def recorded_server(home: str | Path | None = None) -> ServerHandle | None:
    """The server ``nnunet-triton serve`` recorded in ``<home>/run/server.json`` (running or not); None when
    there is none, or its state file cannot be read (logged)."""
    from nnunet_triton.server.triton_install import resolve_home

    state_file = resolve_home(home) / "run" / "server.json"
    if not state_file.is_file():
        return None
    try:
        return ServerHandle.from_state_file(state_file)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        LOGGER.warning("ignoring unreadable state file %s: %s", state_file, exc)
        return None


def _is_watchdog(pid: int) -> bool:
    try:
        return b"nnunet_triton.server.watchdog" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _state_pid(path: Path) -> int | None:
    text = path.read_text().strip()
    try:
        return int(json.loads(text)["pid"]) if text.startswith("{") else int(text)
    except (ValueError, KeyError):
        return None
