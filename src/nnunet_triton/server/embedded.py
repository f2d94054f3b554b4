"""Start, stop and query the embedded ``tritonserver`` (pytriton's 2.51.0 binary) as a plain subprocess.

``triton_install.prepare_home`` makes the binary runnable outside pytriton; this module launches it
bound to loopback on free (or given) ports, records pid/ports in ``<home>/run/server.json`` for
``make stop`` and clients, waits for ``/v2/health/ready`` and stops it with SIGTERM, then SIGKILL.
Nothing from Triton or PyTriton is imported here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, BinaryIO

from nnunet_triton.errors import DeployError, PreloadUnavailableError, RepositoryError, ServerError
from nnunet_triton.repository import ModelRepository
from nnunet_triton.server import backends, cves, preload, proxy, readiness, watchdog
from nnunet_triton.server.deploy.repository_info import RepositoryInfo
from nnunet_triton.server.deploy.sizing import VolumeSpec, plan_memory
from nnunet_triton.server.handle import EXIT_TIMEOUT_S, ServerHandle, _tail
from nnunet_triton.server.model_control import CONTROL_HEADER, RESTRICTED_APIS
from nnunet_triton.server.ports import choose_ports
from nnunet_triton.server.ports import free_port as _free_port
from nnunet_triton.server.restart import LaunchSpec
from nnunet_triton.server.server_config import (
    EMBEDDED,
    GrpcTls,
    MemoryPools,
    TritonServerConfig,
    check_extra_args,
    server_config,
    without_frontend_environment,
)
from nnunet_triton.server.thread_budget import ThreadBudget, decide_budget, repository_folds
from nnunet_triton.server.triton_install import (
    DEFAULT_HOME,
    TritonInstallation,
    prepare_home,
    resolve_home,
    server_env,
)
from nnunet_triton.util.durable import write_text_atomic
from nnunet_triton.util.process import kill

__all__ = [
    "ALLOW_DEGRADED_FLAG",
    "DEFAULT_HOME",
    "LaunchOptions",
    "prepare_home",
    "start",
]

LOGGER = logging.getLogger(__name__)

DEFAULT_HOST = EMBEDDED.host  # the Python backend's shm sizes and the exit timeout: server_config.EMBEDDED
_PR_SET_PDEATHSIG = 1
# tritonserver, its stubs (they inherit it) and the watchdog create files and /dev/shm regions holding
# images and logs: readable by the server's user only
PRIVATE_UMASK = 0o077
# the command-line flag (serve, deploy) that starts a server without server.preload's library anyway
ALLOW_DEGRADED_FLAG = "--allow-token-in-proc-and-readable-shm"


# flags TritonServerConfig owns as fields: refused in extra_args, which would render them a second time
_OWNED_FLAGS = {"--model-repository": ("extra_repositories", "serve one repository per server"),
                "--backend-directory": ("backend_dirs", "serve/deploy --backend-directory DIR")}


@dataclass(frozen=True)
class LaunchOptions:
    """How :func:`start` launches one server: every choice but the repository (see ``start`` for each).

    ``extra_repositories`` are served by the same server next to the first (``TritonServerConfig``'s
    ``model_repositories``); ``extra_args`` are further tritonserver flags, none that ``server_config`` owns
    as a field (``--model-repository=``, ``--backend-directory=``: ValueError naming the option to use).
    """

    host: str = DEFAULT_HOST
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    metrics: bool = False
    extra_repositories: tuple[Path, ...] = ()
    home: str | Path | None = None
    log_file: str | Path | None = None
    pid_file: str | Path | None = None
    state_file: str | Path | None = None
    model_control_mode: str = "explicit"
    load_models: tuple[str, ...] = ()
    recovery: bool = True
    backend_config: Mapping[str, Mapping[str, object]] | None = field(default=None, hash=False)
    extra_args: tuple[str, ...] = ()
    ready_timeout_s: float = readiness.READY_TIMEOUT_S
    exit_timeout_s: int = EXIT_TIMEOUT_S
    detach: bool = False
    volume: VolumeSpec | None = None
    backend_dirs: tuple[Path, ...] | None = None
    tls: proxy.TlsSettings | None = None
    proxy_port: int | None = None
    allow_statistics: bool = False
    proxy_limits: proxy.ClientLimits | None = None
    allow_token_in_proc_and_readable_shm: bool = False
    usual_ports: bool = False

    def __post_init__(self) -> None:
        for name in ("extra_repositories", "backend_dirs"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(Path(v) for v in value))
        object.__setattr__(self, "load_models", tuple(self.load_models))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        check_extra_args(self.extra_args)
        for arg in self.extra_args:
            flag = arg.partition("=")[0]
            if flag in _OWNED_FLAGS:
                field_name, cli = _OWNED_FLAGS[flag]
                raise ValueError(f"the tritonserver flag {arg!r} in extra_args is a field of the server's "
                                 f"config: give it as LaunchOptions.{field_name} ({cli}).")

    @classmethod
    def from_keywords(cls, **keywords: Any) -> LaunchOptions:
        """The options of ``start``'s keyword arguments (the old calling convention); TypeError naming an
        unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise TypeError(f"start() got unexpected keyword argument(s) {unknown}; LaunchOptions has "
                            f"{sorted(known)}.")
        return cls(**keywords)


@dataclass(frozen=True)
class _Launch:
    """Everything one tritonserver start needs (built once per attempt in ``start``)."""

    installation: TritonInstallation
    server: TritonServerConfig  # the command line: ports, hosts, backend folder, pools, TLS, the token's flag
    log_file: Path
    pid_file: Path
    state_file: Path
    detach: bool
    thread_budget: ThreadBudget
    control_token: str | None  # the restricted APIs (model_control.RESTRICTED_APIS) need it
    memory_plan: dict[str, object] | None = None
    # server.preload's library: the token reaches tritonserver through its environment, not its command line
    preload_library: Path | None = None
    degraded: tuple[str, ...] = ()  # what runs unprotected (no preload library, started with the flag)

    def environment(self) -> dict[str, str]:
        # without the variables that would open Triton's SageMaker / Vertex AI frontends (also off by flag)
        env = without_frontend_environment({**server_env(self.installation),
                                            **self.thread_budget.environment()})
        if self.preload_library is not None and self.control_token:
            env["LD_PRELOAD"] = " ".join(p for p in (str(self.preload_library), env.get("LD_PRELOAD")) if p)
            env[watchdog.TOKEN_ENV] = self.control_token
        return env

    def command(self) -> list[str]:
        return self.server.to_args()


def _server_config(repositories: Sequence[Path], options: LaunchOptions, installation: TritonInstallation,
                   backend_dir: Path, load_models: Sequence[str], budget: ThreadBudget,
                   memory_pools: MemoryPools, token_flag: str | None,
                   ports: Mapping[str, int | None]) -> TritonServerConfig:
    """The tritonserver config of one start attempt: ``server_config.EMBEDDED`` and the launch choices, then
    the thread budget's rate limits and the restricted APIs' token flag (``token_flag``: the preload
    placeholder, or the token itself in a degraded start) applied with ``dataclasses.replace``."""
    tls = options.tls
    config = server_config(
        str(repositories[0]), EMBEDDED, load_models=load_models, ports=ports,
        host=DEFAULT_HOST if tls is not None else options.host, grpc_host=_grpc_host(options.host, tls),
        exit_timeout_s=options.exit_timeout_s, backend_config=options.backend_config,
        server_bin=str(installation.server_bin), backend_directory=str(backend_dir),
        cache_directory=str(installation.cache_dir), model_control_mode=options.model_control_mode,
        memory_pools=memory_pools, grpc_tls=_grpc_tls(tls), extra_args=options.extra_args)
    config = budget.applied_to(replace(config, model_repositories=tuple(str(r) for r in repositories)))
    if token_flag:
        config = config.with_restricted_apis(RESTRICTED_APIS, CONTROL_HEADER, token_flag)
    return config


def _preload_library(home: str | Path | None, allow_degraded: bool) -> tuple[Path | None, tuple[str, ...]]:
    """(server.preload's library, what the server exposes without it: empty when it is there).

    Raises:
        PreloadUnavailableError: no library and ``allow_degraded`` is False: names what is missing, the
            consequence and the flag that accepts it.
    """
    try:
        return preload.library(resolve_home(home) / "preload"), ()
    except PreloadUnavailableError as exc:
        if not allow_degraded:
            raise PreloadUnavailableError(
                f"refusing to start tritonserver without the preload library: {exc}. Without it the "
                f"server would run with {preload.CONSEQUENCE}. Install a C compiler (apt-get install gcc), "
                f"or accept that with {ALLOW_DEGRADED_FLAG} "
                f"(embedded.start(allow_token_in_proc_and_readable_shm=True); docs/security.md).") from None
        LOGGER.warning("starting DEGRADED (%s was given): %s; the server runs with %s", ALLOW_DEGRADED_FLAG,
                       exc, preload.CONSEQUENCE)
        return None, (f"no preload library ({exc}): the control token is on tritonserver's command line "
                      f"(/proc/<pid>/cmdline, readable by every local user)",
                      "the Python stubs' /dev/shm regions are 0644 (readable by every local user)")


def _die_with_parent() -> None:
    # Like pytriton: the server dies with the Python process that started it (not used when detached).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(launch: _Launch) -> ServerHandle:
    for path in (launch.log_file, launch.pid_file, launch.state_file):
        path.parent.mkdir(parents=True, exist_ok=True)
    command = launch.command()
    LOGGER.info("starting %s", " ".join(c if launch.control_token is None else
                                        c.replace(launch.control_token, "***") for c in command))
    LOGGER.info("thread budget: %s (exact: %s)", launch.thread_budget.reason, launch.thread_budget.exact)
    with _private_log(launch.log_file, truncate=True) as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=launch.environment(),
            start_new_session=True,  # own process group: stop() can kill the server and its stubs together
            preexec_fn=None if launch.detach else _die_with_parent,
            umask=PRIVATE_UMASK,
        )
    try:
        server = launch.server
        handle = ServerHandle(
            pid=process.pid,
            host=server.http_address,
            http_port=server.http_port,
            grpc_port=server.grpc_port,
            metrics_port=server.metrics_port,
            model_repository=server.model_repositories[0],
            server_bin=command[0],
            log_file=str(launch.log_file),
            pid_file=str(launch.pid_file),
            state_file=str(launch.state_file),
            exit_timeout_s=server.exit_timeout_s,
            thread_budget=launch.thread_budget.to_dict(),
            memory_plan=launch.memory_plan,
            grpc_host=server.grpc_address,
            control_token=launch.control_token,
            degraded=list(launch.degraded),
            _process=process,
        )
        write_text_atomic(launch.pid_file, f"{process.pid}\n", mode=0o600)
        _write_state(launch.state_file, handle)
    except BaseException:
        kill(process.pid, group=True)  # never leave an unrecorded server (or its stubs) behind
        process.wait()
        raise
    return handle


def _private_log(path: Path, *, truncate: bool) -> BinaryIO:
    """``path`` opened for writing (truncated or appended to), readable by its owner only: the logs name
    the cases' shapes and the errors of requests."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # a log left by an older launcher may be 0644
    os.lseek(fd, 0, os.SEEK_END)  # tell() is where this run's lines start
    return os.fdopen(fd, "wb")


def _write_state(path: Path, handle: ServerHandle) -> None:
    # holds the model-control token: readable by the owner only
    write_text_atomic(path, handle.to_json() + "\n", mode=0o600)


def _start_watchdog(handle: ServerHandle, launch: _Launch) -> None:
    """Run ``python -m nnunet_triton.server.watchdog`` for ``handle`` and record its pid in the state file."""
    assert handle.control_token is not None
    events = launch.state_file.with_name("recoveries.jsonl")
    log_path = launch.log_file.with_name(launch.log_file.stem + ".watchdog.log")
    # the watchdog's environment is the base of a restarted server's: without the frontends' variables too
    watchdog_env = without_frontend_environment({**os.environ, watchdog.TOKEN_ENV: handle.control_token})
    launch_file = launch.state_file.with_name("launch.json")  # how the watchdog restarts a dead server
    LaunchSpec.for_server(launch.server, launch.environment(), watchdog_env, log_file=launch.log_file,
                          pid_file=launch.pid_file, state_file=launch.state_file,
                          secret_keys=(watchdog.TOKEN_ENV,)).write(launch_file)
    command = [sys.executable, "-m", "nnunet_triton.server.watchdog", "--url", handle.http_url,
               "--server-pid", str(handle.pid), "--model-repository", launch.server.model_repositories[0],
               "--events-file", str(events), "--launch-file", str(launch_file),
               *(["--proxy-config", handle.proxy_config] if handle.proxy_config else [])]
    with _private_log(log_path, truncate=False) as log:
        offset = log.tell()  # the log is appended to across restarts: only this watchdog's lines count
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=watchdog_env,
            start_new_session=True, preexec_fn=None if launch.detach else _die_with_parent,
            umask=PRIVATE_UMASK,
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


def visible_gpus(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> int:
    """GPUs the server will see: ``CUDA_VISIBLE_DEVICES`` when set, else the ``/dev/nvidia<N>`` devices."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        listed = [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",")]
        return len([d for d in listed if d and not d.startswith("-")])
    return len([p for p in dev.glob("nvidia*") if p.name[len("nvidia"):].isdigit()])


def _memory_plan(repository: Path, volume: VolumeSpec,
                 gpus: int) -> tuple[MemoryPools, dict[str, object] | None]:
    """Pool sizes and their summary for a GPU repository built by this project (Triton's defaults otherwise).

    Triton's CUDA pool (default 64 MiB) holds every tensor passed between models in device memory; when it
    is full Triton silently copies through pinned host memory (``nnunet_host_fallbacks_total``). The pools
    are sized by ``server.deploy.sizing.plan_memory`` from the tiles x batch x in-flight x instances of the
    repository and the largest volume, as the docker and Kubernetes launches do.
    """
    try:
        info = RepositoryInfo.from_repository(repository)
    except DeployError:
        return MemoryPools(), None  # not a full repository of this project: Triton's defaults
    if info.target != "gpu":
        return MemoryPools(), None
    plan = plan_memory(info, volume, gpus=max(1, gpus))
    summary = {**plan.summary(), "gpus": gpus, "volume": list(volume.shape)}
    LOGGER.info("memory plan for a %s volume: CUDA pool %s MiB on each of %d GPU(s), pinned pool %s MiB",
                "x".join(map(str, volume.shape)), summary["cuda_pool_mib_per_gpu"], gpus,
                summary["pinned_pool_mib"])
    return plan.pools(gpus), summary


def _repository_load_list(repositories: Sequence[Path]) -> tuple[str, ...]:
    """Every model of the repositories: a registry's models (every endpoint and version), else every folder
    holding a config.pbtxt (a repository not built by this project)."""
    found: list[str] = []
    for repository in repositories:
        try:
            found += ModelRepository(repository).models()
        except RepositoryError as exc:
            raise ValueError(f"cannot serve {str(repository)!r}: {exc}") from None
    return tuple(found)


def _model_control(mode: str, load_models: tuple[str, ...], recovery: bool,
                   repositories: Sequence[Path] = ()) -> tuple[tuple[str, ...], bool]:
    """(models to load, whether the watchdog runs) for a model control mode; ValueError when they clash.

    Explicit mode loads ``load_models``, else every model of the repositories (:func:`_repository_load_list`:
    the old version of an endpoint stays loaded next to a new one until it is removed).
    """
    if mode not in ("none", "explicit"):
        raise ValueError(f"model_control_mode must be 'none' or 'explicit', got {mode!r}.")
    if load_models and mode != "explicit":
        raise ValueError(f"load_models {list(load_models)} needs model_control_mode='explicit'.")
    if mode == "none":
        if recovery:
            LOGGER.warning("model_control_mode 'none': no watchdog, a model whose process dies stays broken")
        return (), False
    if not load_models and repositories:
        load_models = _repository_load_list(repositories)
    return load_models or ("*",), recovery


def start(model_repository: str | Path, options: LaunchOptions | None = None, /,
          **keywords: Any) -> ServerHandle:
    """Start tritonserver on ``options.host`` and wait until ``GET /v2/health/ready`` answers 200.

    ``options`` is a :class:`LaunchOptions`; ``start(repo, http_port=..., ...)`` (its fields as keyword
    arguments, the old calling convention) still works and builds one. The server's command is its
    ``server_config.TritonServerConfig`` rendered once (``to_args``); the watchdog restarts a dead server from
    the same config (``launch.json``).

    Args (``model_repository``, then the fields of :class:`LaunchOptions`):
        model_repository: directory with one sub-directory per model.
        extra_repositories: further repositories the same server serves (``--model-repository`` each).
        host: address all three endpoints bind to (loopback by default).
        http_port, grpc_port, metrics_port: fixed ports; free ones are picked when None (``usual_ports``:
            Triton's usual ones first).
        usual_ports: a port not given is Triton's usual one (8000, 8001, metrics 8002; ``serve``'s default)
            unless it is taken, then a free one with a warning naming both (``server.ports.choose_ports``).
        metrics: open Triton's metrics endpoint (Prometheus, ``/metrics``) on a free port; a
            ``metrics_port`` opens it too. Off by default: it has no authentication and shows every local
            user the per-model counters the restricted statistics API hides (docs/security.md).
        home: server home (default ``$NNUNET_TRITON_HOME`` or ``build/triton-home``); run files default
            to ``<home>/run/{tritonserver.log,tritonserver.pid,server.json}``.
        model_control_mode: ``"explicit"`` (default: load ``load_models``, all models when empty) or
            ``"none"`` (load everything; no model-control API, so no recovery).
        recovery: run the watchdog (``server.watchdog``) that reloads a model whose process died;
            needs explicit model control. The model-repository API then needs ``handle.control_headers``.
        backend_config: ``{backend: {key: value}}`` merged over the Python backend's shm sizes and stub
            timeout (``server.server_config.EMBEDDED``).
        extra_args: further tritonserver flags, e.g. ``("--log-verbose=1",)``.
        ready_timeout_s: how long to wait for readiness (model loading included).
        exit_timeout_s: ``--exit-timeout-secs``, how long a stop drains requests and connections.
        detach: keep running after this Python process exits (CLI ``start``); otherwise the server
            gets SIGTERM when the starting thread exits.
        volume: the largest volume a GPU repository must serve (default ``VolumeSpec()``, 600x512x512):
            sizes Triton's CUDA and pinned memory pools (``server.deploy.sizing``), recorded in the
            handle's ``memory_plan``; ignored for CPU repositories.
        backend_dirs: folders of further backends (``<name>/libtriton_<name>.so``), merged with the wheel's
            Python backend into one ``--backend-directory`` (``server.backends``); None: where
            ``make triton-backends`` puts them (``build/triton-backends``) when that exists.
        tls: TLS and client authentication for the public endpoints (``server.proxy``): Triton's HTTP and
            metrics then bind 127.0.0.1 and nginx serves HTTPS on ``host:proxy_port`` with an allow-list of
            paths; gRPC binds ``host`` with Triton's own SSL (mutual with ``tls.client_ca``; loopback only
            when the clients authenticate with a bearer token alone, which Triton's gRPC cannot check).
            Required when ``host`` is not loopback (``proxy.ExposureError``).
        proxy_port: the proxy's port (default: a free one).
        allow_statistics: the proxy also lets the statistics API through (off by default).
        proxy_limits: what one client may send through the proxy (default ``proxy.ClientLimits()``).
        allow_token_in_proc_and_readable_shm: start even when ``server.preload``'s library cannot be built
            (no C compiler): the control token is then on tritonserver's command line and the stubs'
            /dev/shm regions are 0644, both readable by every local user; the handle's ``degraded`` (and
            ``server.json``, ``status``) says so. Without it such a start raises PreloadUnavailableError.

    The server's environment carries the thread budget (``nnunet_triton.server.thread_budget``: fold threads
    from the CPUs really available and the repository's fold instances, ``OMP_WAIT_POLICY=PASSIVE``),
    with the user's ``NNUNET_TRITON_THREAD_POLICY``/``NNUNET_TRITON_FOLD_THREADS``/``OMP_WAIT_POLICY``
    as overrides; the handle's ``thread_budget`` records the choice and the reason.

    Raises:
        ExposureError: ``host`` is not loopback and ``tls`` is None, or ``tls`` lacks client authentication.
        ServerError: the process died or was not ready in time (the message holds the log's last lines), or
            a backend the repository's configs name is missing (one line, before starting).
        ThreadBudgetError: a thread override that cannot be honoured (names the setting and value).
        PreloadUnavailableError: ``server.preload``'s library cannot be built and
            ``allow_token_in_proc_and_readable_shm`` is False (names what is missing and the flag).
        ValueError: bad ``model_repository``/``model_control_mode``/``load_models``, an ``extra_args``
            flag that would open Triton's SageMaker or Vertex AI frontend (``server_config.FRONTEND_FLAGS``),
            or one the config owns as a field (``--model-repository=``: ``extra_repositories``).

    The server's environment has no ``AIP_*`` nor ``SAGEMAKER_*`` variable (those frontends read them).
    """
    if keywords and options is not None:
        raise TypeError("start() takes LaunchOptions or their fields as keyword arguments, not both.")
    options = LaunchOptions.from_keywords(**keywords) if keywords else (options or LaunchOptions())
    repo = Path(model_repository).absolute()
    if not repo.is_dir():
        raise ValueError(f"model_repository must be an existing directory, got {str(model_repository)!r}.")
    if any(c.isspace() for c in str(repo)):
        # the Python backend starts each stub with a command line split at spaces: the stubs die with
        # "terminate called after throwing an instance of 'std::invalid_argument' what(): stol"
        raise ValueError(f"model_repository must not contain whitespace (Triton 2.51's Python backend cannot "
                         f"start its stubs there), got {str(repo)!r}; build or copy it to another path.")
    host, tls, home = options.host, options.tls, options.home
    proxy.check_exposure(host, tls, what="tritonserver")
    repositories = (repo, *(r.absolute() for r in options.extra_repositories))
    backend_dir = _backend_dir(home, repositories, options.backend_dirs)
    load_models, recovery = _model_control(options.model_control_mode, options.load_models, options.recovery,
                                           repositories)
    run_dir = resolve_home(home) / "run"
    installation = prepare_home(home)
    budget = decide_budget(repository_folds(repo))
    control_token = watchdog.new_token()  # the restricted APIs need it in every model control mode
    preload_library, degraded = _preload_library(home, options.allow_token_in_proc_and_readable_shm)
    token_flag = preload.PLACEHOLDER if preload_library and control_token else control_token
    memory_pools, memory_plan = _memory_plan(repo, options.volume or VolumeSpec(), visible_gpus())
    run_files = {
        "log_file": Path(options.log_file) if options.log_file else run_dir / "tritonserver.log",
        "pid_file": Path(options.pid_file) if options.pid_file else run_dir / "tritonserver.pid",
        "state_file": Path(options.state_file) if options.state_file else run_dir / "server.json",
    }
    _warn_known_cves(host)
    local, grpc_host = DEFAULT_HOST if tls is not None else host, _grpc_host(host, tls)
    http_port, grpc_port, metrics_port = options.http_port, options.grpc_port, options.metrics_port
    auto_ports = (http_port, grpc_port, metrics_port) == (None, None, None)  # only then is a retry useful
    metrics = options.metrics or metrics_port is not None
    for attempt in range(3 if auto_ports else 1):
        # a retry after a port race takes free ports
        ports = choose_ports({"http": http_port, "grpc": grpc_port, "metrics": metrics_port},
                             {"http": local, "grpc": grpc_host, "metrics": local},
                             metrics=metrics, usual=options.usual_ports and attempt == 0)
        opened = [port for port in ports.values() if port is not None]
        if len(set(opened)) < len(opened):
            continue
        server = _server_config(repositories, options, installation, backend_dir, load_models, budget,
                                memory_pools, token_flag, ports)
        launch = _Launch(installation=installation, server=server, detach=options.detach,
                         thread_budget=budget, control_token=control_token, memory_plan=memory_plan,
                         preload_library=preload_library, degraded=degraded, **run_files)
        handle = _spawn(launch)
        try:
            _wait_ready(handle, options.ready_timeout_s)
            if tls is not None:
                _start_proxy(handle, launch, _proxy_config(
                    host, options.proxy_port, handle.http_port, tls, repositories, launch.log_file.parent,
                    options.allow_statistics, options.proxy_limits or proxy.ClientLimits()))
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
    raise ServerError(f"could not find distinct free ports on {host}.")


def _backend_dir(home: str | Path | None, repositories: Sequence[Path],
                 backend_dirs: Sequence[Path] | None) -> Path:
    """The merged backend folder, checked against the backends the repositories need (Triton would keep
    only the last ``--backend-directory`` flag)."""
    dirs = list(backends.default_backend_dirs() if backend_dirs is None else backend_dirs)
    merged = backends.merged_backend_dir(prepare_home(home).backend_dir, [Path(d).absolute() for d in dirs],
                                         resolve_home(home))
    backends.check_backends(repositories, merged)
    return merged


def _grpc_host(host: str, tls: proxy.TlsSettings | None) -> str:
    # Triton's gRPC checks client certificates but no bearer token: token-only TLS keeps gRPC on loopback
    return host if tls is None or tls.client_ca is not None else DEFAULT_HOST


def _grpc_tls(tls: proxy.TlsSettings | None) -> GrpcTls | None:
    """Triton's own gRPC SSL: server certificate and key, and mutual TLS with the client CA."""
    if tls is None:
        return None
    return GrpcTls(str(Path(tls.cert).absolute()), str(Path(tls.key).absolute()),
                   None if tls.client_ca is None else str(Path(tls.client_ca).absolute()))


def _warn_known_cves(host: str) -> None:
    """The published CVEs still open where tritonserver 2.51.0 (the newest on PyPI) now listens, by severity:
    the table is ``server/cves.json`` (docs/security.md shows it)."""
    for message in cves.startup_warnings(host, loopback=proxy.is_loopback(host)):
        LOGGER.warning(message)


def _proxy_config(host: str, port: int | None, upstream_port: int, tls: proxy.TlsSettings,
                  repositories: Sequence[Path], run_dir: Path, allow_statistics: bool,
                  limits: proxy.ClientLimits) -> proxy.ProxyConfig:
    """The proxy of a server: the public endpoints of every repository (registry), else every model."""
    endpoints: list[str] = []
    models: list[str] = []
    for repository in map(ModelRepository, repositories):
        registry = repository.registry()
        if registry is None:
            models += repository.model_folders()
        else:
            endpoints += sorted(registry.endpoints)
    return proxy.ProxyConfig(
        listen_host=host, listen_port=port or _free_port(host), upstream_port=upstream_port, tls=tls,
        model_pattern=proxy.public_model_pattern(endpoints, models), run_dir=run_dir / "proxy",
        allow_statistics=allow_statistics, limits=limits)


def _start_proxy(handle: ServerHandle, launch: _Launch, config: proxy.ProxyConfig) -> None:
    started = proxy.start_proxy(config, detach=launch.detach)
    handle.proxy_pid, handle.proxy_url, handle.proxy_config = started.pid, started.url, started.config_file
    handle._proxy = started._process
    _write_state(launch.state_file, handle)


def _wait_ready(handle: ServerHandle, timeout_s: float) -> None:
    def gone() -> str | None:
        if handle.is_running():
            return None
        code = handle._process.returncode if handle._process is not None else None
        return f"tritonserver exited (code {code})"

    try:
        readiness.wait_ready(handle.http_url, timeout_s=timeout_s, gone=gone)
    except readiness.NotReadyError as exc:
        handle.stop()
        tail = _tail(Path(handle.log_file))
        raise ServerError(f"{exc}; last lines of {handle.log_file}:\n{tail}") from None
    LOGGER.info("tritonserver ready: http %s grpc %s metrics %s", handle.http_url, handle.grpc_url,
                "closed" if handle.metrics_port is None else handle.metrics_url)
