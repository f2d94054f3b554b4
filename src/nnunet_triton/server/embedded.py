"""Start, stop and query the embedded ``tritonserver`` (pytriton's 2.51.0 binary) as a plain subprocess.

``triton_install.prepare_home`` makes the binary runnable outside pytriton; this module launches it
bound to loopback on free (or given) ports, records pid/ports in ``<home>/run/server.json`` for
``make stop`` and clients, waits for ``/v2/health/ready`` and stops it with SIGTERM, then SIGKILL.
Nothing from Triton or PyTriton is imported here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from nnunet_triton.errors import ServerError
from nnunet_triton.server import watchdog
from nnunet_triton.server.health import (
    HealthReport,
    check_health,
    pid_alive,
    remove_shm_regions,
    repository_models,
    stub_processes,
)
from nnunet_triton.server.thread_budget import ThreadBudget, plan_budget, repository_folds
from nnunet_triton.server.triton_install import (
    DEFAULT_HOME,
    HOME_ENV,
    TritonInstallation,
    prepare_home,
    resolve_home,
    server_env,
)

__all__ = ["DEFAULT_BACKEND_CONFIG", "DEFAULT_HOME", "ServerHandle", "prepare_home", "start", "main"]

LOGGER = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
EXIT_TIMEOUT_S = 15
# Python backend shared memory (one /dev/shm region per model instance, never shrunk; tmpfs pages are
# only used once touched). 16 MiB holds a batch of fp16 128^3 tiles; the region then grows in 64 MiB
# steps, rounded up to fit, so a whole CT volume (512x512x300 int16 = 150 MiB) costs one or two
# growths instead of 150 one-MiB growths with Triton's defaults. /dev/shm must hold
# (Python instances x largest CPU tensor in flight): give containers --shm-size of several GiB.
# stub-timeout-seconds: the stub's start handshake; 30 s (default) is too short on a busy 2-core
# machine once a stub imports torch.
DEFAULT_BACKEND_CONFIG: Mapping[str, Mapping[str, str]] = {
    "python": {
        "shm-default-byte-size": str(16 * 2**20),
        "shm-growth-byte-size": str(64 * 2**20),
        "stub-timeout-seconds": "120",
    }
}
_PR_SET_PDEATHSIG = 1


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
    metrics_port: int
    model_repository: str
    server_bin: str
    log_file: str
    pid_file: str | None = None
    state_file: str | None = None
    exit_timeout_s: int = EXIT_TIMEOUT_S
    thread_budget: dict[str, object] | None = None  # thread_budget: what was chosen and why
    watchdog_pid: int | None = None  # nnunet_triton.server.watchdog: reloads models whose process died
    events_file: str | None = None  # the watchdog's recoveries (JSON lines)
    control_token: str | None = None  # the model-repository API needs it (watchdog.CONTROL_HEADER)
    _watchdog: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        """``host:port`` for ``tritonclient.http`` and ``perf_analyzer -u``."""
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    def is_running(self) -> bool:
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
        return check_health(self.http_url, repository_models(self.model_repository),
                            server_pid=self.pid if self.is_running() else None, timeout_s=timeout_s)

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
        self._stop_watchdog()  # first: a stopping server's models must not be "recovered"
        ours = self.is_running()
        regions = [s.shm_region for s in stub_processes(self.pid)] if ours else []
        if ours:
            LOGGER.info("stopping tritonserver pid %d", self.pid)
            os.kill(self.pid, signal.SIGTERM)
            if not self._wait_exit(timeout_s):
                LOGGER.warning(
                    "tritonserver pid %d ignored SIGTERM for %.0f s; sending SIGKILL", self.pid, timeout_s
                )
                os.killpg(self.pid, signal.SIGKILL)
                self._wait_exit(10.0)
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
        os.kill(self.watchdog_pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while self.watchdog_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.watchdog_running():
            os.kill(self.watchdog_pid, signal.SIGKILL)

    def _wait_exit(self, timeout_s: float) -> bool:
        if self._process is not None:
            try:
                self._process.wait(timeout=timeout_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout_s
        while pid_alive(self.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def _reap_group(self) -> None:
        # The server runs in its own session (pgid == pid); stubs left behind exit on their own when
        # they notice the server is gone, but never wait on that.
        deadline = time.monotonic() + 5.0
        while _group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(self.pid):
            os.killpg(self.pid, signal.SIGKILL)

    def _remove_run_files(self) -> None:
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


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _backend_args(backend_config: Mapping[str, Mapping[str, object]] | None) -> list[str]:
    merged = {name: dict(values) for name, values in DEFAULT_BACKEND_CONFIG.items()}
    for name, values in (backend_config or {}).items():
        merged.setdefault(name, {}).update(values)
    return [
        f"--backend-config={name},{key}={value}"
        for name, values in merged.items()
        for key, value in values.items()
    ]


@dataclass(frozen=True)
class _Launch:
    """Everything one tritonserver start needs (built once per attempt in ``start``)."""

    installation: TritonInstallation
    model_repository: Path
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    log_file: Path
    pid_file: Path
    state_file: Path
    model_control_mode: str
    load_models: tuple[str, ...]
    backend_args: tuple[str, ...]
    extra_args: tuple[str, ...]
    exit_timeout_s: int
    detach: bool
    thread_budget: ThreadBudget
    control_token: str | None  # None: no model-control API restriction (model control mode "none")

    def command(self) -> list[str]:
        return [
            str(self.installation.server_bin),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.installation.backend_dir}",
            f"--cache-directory={self.installation.cache_dir}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--model-control-mode={self.model_control_mode}",
            *(f"--load-model={name}" for name in self.load_models),
            f"--exit-timeout-secs={self.exit_timeout_s}",
            # Our configs are generated complete (config_gen); auto-complete only adds a stub round trip.
            "--disable-auto-complete-config",
            *self.backend_args,
            *self.thread_budget.server_args(),
            *(watchdog.restricted_api_args(self.control_token) if self.control_token else ()),
            *self.extra_args,
        ]


def _die_with_parent() -> None:
    # Like pytriton: the server dies with the Python process that started it (not used when detached).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(launch: _Launch) -> ServerHandle:
    for path in (launch.log_file, launch.pid_file, launch.state_file):
        path.parent.mkdir(parents=True, exist_ok=True)
    command = launch.command()
    LOGGER.info("starting %s", " ".join(c if launch.control_token is None else
                                        c.replace(launch.control_token, "***") for c in command))
    LOGGER.info("thread budget: %s", launch.thread_budget.reason)
    with open(launch.log_file, "wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**server_env(launch.installation), **launch.thread_budget.environment()},
            start_new_session=True,  # own process group: stop() can kill the server and its stubs together
            preexec_fn=None if launch.detach else _die_with_parent,
        )
    try:
        handle = ServerHandle(
            pid=process.pid,
            host=launch.host,
            http_port=launch.http_port,
            grpc_port=launch.grpc_port,
            metrics_port=launch.metrics_port,
            model_repository=str(launch.model_repository),
            server_bin=command[0],
            log_file=str(launch.log_file),
            pid_file=str(launch.pid_file),
            state_file=str(launch.state_file),
            exit_timeout_s=launch.exit_timeout_s,
            thread_budget=launch.thread_budget.to_dict(),
            control_token=launch.control_token,
            _process=process,
        )
        launch.pid_file.write_text(f"{process.pid}\n")
        _write_state(launch.state_file, handle)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)  # never leave an unrecorded server (or its stubs) behind
        process.wait()
        raise
    return handle


def _write_state(path: Path, handle: ServerHandle) -> None:
    # holds the model-control token: readable by the owner only
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as state:
        state.write(handle.to_json() + "\n")


def _start_watchdog(handle: ServerHandle, launch: _Launch) -> None:
    """Run ``python -m nnunet_triton.server.watchdog`` for ``handle`` and record its pid in the state file."""
    assert handle.control_token is not None
    events = launch.state_file.with_name("recoveries.jsonl")
    log_path = launch.log_file.with_name(launch.log_file.stem + ".watchdog.log")
    command = [sys.executable, "-m", "nnunet_triton.server.watchdog", "--url", handle.http_url,
               "--server-pid", str(handle.pid), "--model-repository", str(launch.model_repository),
               "--events-file", str(events)]
    with open(log_path, "ab") as log:
        offset = log.tell()  # the log is appended to across restarts: only this watchdog's lines count
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, watchdog.TOKEN_ENV: handle.control_token},
            start_new_session=True, preexec_fn=None if launch.detach else _die_with_parent,
        )
    handle.watchdog_pid, handle.events_file, handle._watchdog = process.pid, str(events), process
    _write_state(launch.state_file, handle)
    deadline = time.monotonic() + 60.0
    announced = f" {watchdog.WATCHING} tritonserver pid ".encode()
    while announced not in log_path.read_bytes()[offset:]:
        if process.poll() is not None or time.monotonic() > deadline:
            handle.stop()
            raise ServerError(f"the watchdog did not start; last lines of {log_path}:\n{_tail(log_path)}")
        time.sleep(0.05)
    LOGGER.info("watchdog pid %d reloads models whose process dies (log %s)", process.pid, log_path)


def _model_control(mode: str, load_models: tuple[str, ...], recovery: bool) -> tuple[tuple[str, ...], bool]:
    """(models to load, whether the watchdog runs) for a model control mode; ValueError when they clash."""
    if mode not in ("none", "explicit"):
        raise ValueError(f"model_control_mode must be 'none' or 'explicit', got {mode!r}.")
    if load_models and mode != "explicit":
        raise ValueError(f"load_models {list(load_models)} needs model_control_mode='explicit'.")
    if mode == "none":
        if recovery:
            LOGGER.warning("model_control_mode 'none': no watchdog, a model whose process dies stays broken")
        return (), False
    return load_models or ("*",), recovery


def start(
    model_repository: str | Path,
    *,
    host: str = DEFAULT_HOST,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    home: str | Path | None = None,
    log_file: str | Path | None = None,
    pid_file: str | Path | None = None,
    state_file: str | Path | None = None,
    model_control_mode: str = "explicit",
    load_models: Sequence[str] = (),
    recovery: bool = True,
    backend_config: Mapping[str, Mapping[str, object]] | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 120.0,
    exit_timeout_s: int = EXIT_TIMEOUT_S,
    detach: bool = False,
) -> ServerHandle:
    """Start tritonserver on ``host`` and wait until ``GET /v2/health/ready`` answers 200.

    Args:
        model_repository: directory with one sub-directory per model.
        host: address all three endpoints bind to (loopback by default).
        http_port, grpc_port, metrics_port: fixed ports; free ones are picked when None.
        home: server home (default ``$NNUNET_TRITON_HOME`` or ``build/triton-home``); run files default
            to ``<home>/run/{tritonserver.log,tritonserver.pid,server.json}``.
        model_control_mode: ``"explicit"`` (default: load ``load_models``, all models when empty) or
            ``"none"`` (load everything; no model-control API, so no recovery).
        recovery: run the watchdog (``server.watchdog``) that reloads a model whose process died;
            needs explicit model control. The model-repository API then needs ``handle.control_headers``.
        backend_config: ``{backend: {key: value}}`` merged over ``DEFAULT_BACKEND_CONFIG``.
        extra_args: further tritonserver flags, e.g. ``("--log-verbose=1",)``.
        ready_timeout_s: how long to wait for readiness (model loading included).
        exit_timeout_s: ``--exit-timeout-secs``, how long a stop drains requests and connections.
        detach: keep running after this Python process exits (CLI ``start``); otherwise the server
            gets SIGTERM when the starting thread exits.

    The server's environment carries the thread budget (``nnunet_triton.server.thread_budget``: fold threads
    from the CPUs really available and the repository's fold instances, ``OMP_WAIT_POLICY=PASSIVE``),
    with the user's ``NNUNET_TRITON_THREAD_POLICY``/``NNUNET_TRITON_FOLD_THREADS``/``OMP_WAIT_POLICY``
    as overrides; the handle's ``thread_budget`` records the choice and the reason.

    Raises:
        ServerError: the process died or was not ready in time; the message holds the log's last lines.
        ThreadBudgetError: a thread override that cannot be honoured (names the setting and value).
        ValueError: bad ``model_repository``/``model_control_mode``/``load_models``.
    """
    repo = Path(model_repository).absolute()
    if not repo.is_dir():
        raise ValueError(f"model_repository must be an existing directory, got {str(model_repository)!r}.")
    if any(c.isspace() for c in str(repo)):
        # the Python backend starts each stub with a command line split at spaces: the stubs die with
        # "terminate called after throwing an instance of 'std::invalid_argument' what(): stol"
        raise ValueError(f"model_repository must not contain whitespace (Triton 2.51's Python backend cannot "
                         f"start its stubs there), got {str(repo)!r}; build or copy it to another path.")
    load_models, recovery = _model_control(model_control_mode, tuple(load_models), recovery)
    run_dir = resolve_home(home) / "run"
    launch_args = {
        "installation": prepare_home(home),
        "model_repository": repo,
        "host": host,
        "log_file": Path(log_file) if log_file else run_dir / "tritonserver.log",
        "pid_file": Path(pid_file) if pid_file else run_dir / "tritonserver.pid",
        "state_file": Path(state_file) if state_file else run_dir / "server.json",
        "model_control_mode": model_control_mode,
        "load_models": tuple(load_models),
        "backend_args": tuple(_backend_args(backend_config)),
        "extra_args": tuple(extra_args),
        "exit_timeout_s": exit_timeout_s,
        "detach": detach,
        "thread_budget": plan_budget(repository_folds(repo)),
        "control_token": watchdog.new_token() if model_control_mode == "explicit" else None,
    }
    auto_ports = (http_port, grpc_port, metrics_port) == (None, None, None)  # only then is a retry useful
    for attempt in range(3 if auto_ports else 1):
        ports = {
            "http_port": http_port or _free_port(host),
            "grpc_port": grpc_port or _free_port(host),
            "metrics_port": metrics_port or _free_port(host),
        }
        if len(set(ports.values())) < 3:
            continue
        launch = _Launch(**launch_args, **ports)
        handle = _spawn(launch)
        try:
            _wait_ready(handle, ready_timeout_s)
            if recovery:
                _start_watchdog(handle, launch)
            return handle
        except ServerError as exc:
            if not (auto_ports and "already in use" in str(exc) and attempt < 2):
                raise
            LOGGER.warning("port race on %s; retrying with new ports", ports)
        except BaseException:  # e.g. Ctrl-C while waiting: do not leave a half-started server behind
            handle.stop()
            raise
    raise ServerError(f"could not find three distinct free ports on {host}.")


def _wait_ready(handle: ServerHandle, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    url = f"http://{handle.http_url}/v2/health/ready"
    while not _http_ok(url):
        if not handle.is_running():
            code = handle._process.returncode if handle._process is not None else None
            handle.stop()
            raise ServerError(
                f"tritonserver exited (code {code}) before {url} was ready; "
                f"last lines of {handle.log_file}:\n{_tail(Path(handle.log_file))}"
            )
        if time.monotonic() > deadline:
            handle.stop()
            raise ServerError(
                f"tritonserver was not ready at {url} after {timeout_s:.0f} s; "
                f"last lines of {handle.log_file}:\n{_tail(Path(handle.log_file))}"
            )
        time.sleep(0.2)
    LOGGER.info(
        "tritonserver ready: http %s grpc %s metrics %s", handle.http_url, handle.grpc_url, handle.metrics_url
    )


# --- command line ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nnunet-triton-server", description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=None, help=f"server home (default ${HOME_ENV} or {DEFAULT_HOME})")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)
    start_cmd = commands.add_parser("start", help="start tritonserver and wait until it is ready")
    start_cmd.add_argument("--model-repository", required=True, type=Path)
    start_cmd.add_argument("--host", default=DEFAULT_HOST, help="bind address for all endpoints")
    start_cmd.add_argument("--http-port", type=int, default=None, help="default: a free port")
    start_cmd.add_argument("--grpc-port", type=int, default=None, help="default: a free port")
    start_cmd.add_argument("--metrics-port", type=int, default=None, help="default: a free port")
    start_cmd.add_argument("--model-control-mode", choices=("none", "explicit"), default="explicit",
                           help="explicit (default): the watchdog can reload a model whose process died")
    start_cmd.add_argument("--load-model", action="append", default=[],
                           help="repeatable; explicit mode only (default: every model)")
    start_cmd.add_argument("--no-recovery", action="store_true",
                           help="no watchdog: a model whose process dies stays broken until a restart")
    start_cmd.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra tritonserver flag, e.g. --server-arg=--log-verbose=1",
    )
    start_cmd.add_argument("--ready-timeout", type=float, default=300.0, help="seconds (default 300)")
    start_cmd.add_argument(
        "--exit-timeout",
        type=int,
        default=EXIT_TIMEOUT_S,
        help=f"--exit-timeout-secs (default {EXIT_TIMEOUT_S})",
    )
    start_cmd.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the server")
    stop_cmd = commands.add_parser("stop", help="stop the server recorded in <home>/run/server.json")
    stop_cmd.add_argument(
        "--timeout", type=float, default=None, help="seconds before SIGKILL (default: exit timeout + 10)"
    )
    commands.add_parser("status", help="print the recorded server state and its health; exit 0 when healthy "
                        "(1: running but not healthy, 3: not running)")
    return parser


def _recorded_handle(home: str | None) -> ServerHandle | None:
    state_file = resolve_home(home) / "run" / "server.json"
    if not state_file.is_file():
        return None
    try:
        return ServerHandle.from_state_file(state_file)
    except (ValueError, TypeError, KeyError) as exc:
        LOGGER.warning("ignoring unreadable state file %s: %s", state_file, exc)
        return None


def _cmd_start(args: argparse.Namespace) -> int:
    running = _recorded_handle(args.home)
    if running is not None and running.is_running():
        LOGGER.error(
            "a server is already running (pid %d, http %s); run `stop` first", running.pid, running.http_url
        )
        return 1
    handle = start(
        args.model_repository,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        home=args.home,
        model_control_mode=args.model_control_mode,
        load_models=tuple(args.load_model),
        recovery=not args.no_recovery,
        extra_args=tuple(args.server_arg),
        ready_timeout_s=args.ready_timeout,
        exit_timeout_s=args.exit_timeout,
        detach=not args.foreground,
    )
    sys.stdout.write(handle.to_json() + "\n")
    sys.stdout.flush()
    if not args.foreground:
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM -> KeyboardInterrupt -> clean stop
    try:
        return handle._process.wait() if handle._process is not None else 0
    except KeyboardInterrupt:
        return 0
    finally:
        handle.stop()


def _cmd_stop(args: argparse.Namespace) -> int:
    handle = _recorded_handle(args.home)
    if handle is None:
        LOGGER.info("no server recorded under %s", resolve_home(args.home) / "run")
        return 0
    handle.stop(timeout_s=args.timeout)
    LOGGER.info("stopped (pid %d)", handle.pid)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    handle = _recorded_handle(args.home)
    if handle is None:
        sys.stdout.write(json.dumps({"running": False, "ready": False}) + "\n")
        return 3
    state = json.loads(handle.to_json())
    state.pop("control_token", None)
    running = handle.is_running()
    health = handle.health() if running else None
    state |= {"running": running, "ready": handle.is_ready(), "watchdog_running": handle.watchdog_running(),
              "healthy": bool(health and health.healthy),
              "problems": health.problems() if health else ["tritonserver is not running"]}
    if handle.events_file and Path(handle.events_file).is_file():
        lines = Path(handle.events_file).read_text().splitlines()
        state["recoveries"] = [json.loads(line) for line in lines[-10:]]  # the last ten
    sys.stdout.write(json.dumps(state, indent=2) + "\n")
    return 0 if state["healthy"] else (1 if running else 3)


def main(argv: list[str] | None = None) -> int:
    """``nnunet-triton-server start|stop|status``; exit code 0 on success."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s"
    )
    commands = {"start": _cmd_start, "stop": _cmd_stop, "status": _cmd_status}
    try:
        return commands[args.command](args)
    except (ServerError, ValueError) as exc:
        LOGGER.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
