"""Self-healing: a watchdog next to tritonserver reloads every model whose process died.

Triton 2.51 never restarts a dead Python-backend stub (see ``health``): the model fails every request
until someone reloads it. The watchdog does that, through Triton's own model-control API, which is why
every launcher starts the server with ``--model-control-mode=explicit``:

* every ``interval_s`` (1 s) it runs ``health.check_health``; a model that Triton reports ready but
  with a missing stub is **unloaded and loaded again** (``POST /v2/repository/models/<m>/unload`` then
  ``/load``: a plain ``load`` of a loaded, unchanged model is a no-op in 2.51). Ensembles using the model
  turn UNAVAILABLE for that moment and READY again with it;
* a reload that fails is retried with exponential backoff (1 s doubling to 30 s, ``util.retry.RetryPolicy``)
  until it succeeds;
* every recovery is appended to ``events_file`` (JSON lines: model, dead instances, seconds taken).

A model somebody unloaded on purpose has no stubs *and* is not ready: the watchdog leaves it alone.
A model whose stub's ``/dev/shm`` region grew (one large or refused request grows it for good) is loaded
again once idle, which gives the memory back without failing a request (``server.shm_reclaim``; events
``shm_reclaim``; ``$NNUNET_TRITON_SHM_RECLAIM_MIB`` / ``$NNUNET_TRITON_SHM_RECLAIM_IDLE_S``). The
repository's model folders are listed again every ``RESCAN_S`` seconds, so an endpoint version built and
loaded while the server runs (``server.rollout``) is watched too.
``make stop`` stops the watchdog first. When the server died on its own (``kill -9``, the OOM killer, an
abort) the watchdog ends the orphaned stubs (some linger for minutes), removes the ``/dev/shm`` regions
they leave behind (Triton removes them only on a clean exit), logs what happened and, when the launcher
gave it a ``--launch-file`` (the embedded server), starts tritonserver again from the same
``server_config.TritonServerConfig``: ports, repository, every flag (``server.restart``: backoff 0, 1,
2, 4 ... 30 s; a sixth restart within 10 minutes is a crash loop: it gives up, logs and records why).
The new pid goes into the launcher's pid and state files; restarts are appended to ``events_file`` and
counted in the state (``nnunet-triton status``). In a
container, tritonserver is PID 1: its death ends the container and the restart policy (``docker run
--restart``, the kubelet) starts a new one.

The model-repository, shared-memory, statistics, trace and logging APIs are restricted to requests
carrying the header ``CONTROL_HEADER`` with a token only the launcher and the watchdog know
(``model_control.restricted_api_args``): explicit model control does not let every client that can reach
the port load code or unload models, nor register a stub's own shared-memory region.

Launchers: ``server.embedded.start`` runs ``python -m nnunet_triton.server.watchdog`` as a sibling process;
containers run ``python3 -m nnunet_triton.server.thread_budget exec --watchdog ...``, which forks the
watchdog and then execs tritonserver (``fork_for_exec``: the restricted APIs go into the server's
``TritonServerConfig``, rendered once by its ``to_args``). Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.errors import ServerError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.server import readiness
from nnunet_triton.server.health import (
    ModelHealth,
    StubProcess,
    check_health,
    pid_alive,
    remove_shm_regions,
    repository_models,
    stub_processes,
    unmapped_shm_regions,
)
from nnunet_triton.server.model_control import (
    CONTROL_HEADER,
    RESTRICTED_APIS,
    TOKEN_ENV,
    ModelControl,
    restricted_api_args,
)
from nnunet_triton.server.proxy_keeper import ProxyKeeper
from nnunet_triton.server.restart import LaunchSpec, RestartPolicy
from nnunet_triton.server.server_config import TritonServerConfig
from nnunet_triton.server.shm_reclaim import ReclaimPolicy, ShmReclaimer
from nnunet_triton.util.durable import write_json_atomic, write_text_atomic
from nnunet_triton.util.process import kill, wait_gone
from nnunet_triton.util.retry import RetryPolicy

__all__ = [
    "CONTROL_HEADER",
    "TOKEN_ENV",
    "Recovery",
    "Watchdog",
    "new_token",
    "restricted_api_args",
    "fork_for_exec",
    "main",
]

LOGGER = logging.getLogger("nnunet_triton.server.watchdog")
DEFAULT_INTERVAL_S = 1.0
WATCHING = "watching"  # first word of the log line written after the first check
MAX_BACKOFF_S = 30.0
RELOAD_BACKOFF = RetryPolicy(backoff_s=1.0, max_delay_s=MAX_BACKOFF_S)  # 1, 2, 4, ... 30 s between reloads
RESCAN_S = 10.0  # how often the repository's model folders are listed again
PRIVATE_UMASK = 0o077


def new_token() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Recovery:
    """One reload of one model."""

    model: str
    dead: tuple[str, ...]  # instance names whose process had died
    detected_at: float  # time.time()
    seconds: float  # detection to ready again (or to the failure)
    ok: bool
    attempt: int = 1
    error: str | None = None


def _is_stub(stub: StubProcess) -> bool:
    """``stub``'s pid still runs that stub (not a reused pid)."""
    try:
        argv = Path(f"/proc/{stub.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return pid_alive(stub.pid) and len(argv) > 2 and argv[2].decode(errors="replace") == stub.shm_region


@dataclass
class _Pending:
    """A model being recovered: when to try next, which try, what had died."""

    retry_at: float  # time.monotonic()
    attempt: int
    dead: tuple[str, ...]  # instance names
    regions: tuple[str, ...]  # their shm regions
    detected_at: float  # time.time()


class Watchdog:
    """Watch one tritonserver (``server_pid``, HTTP ``url``) and reload its models whose process died."""

    def __init__(self, url: str, server_pid: int, models: Sequence[str], token: str, *,
                 events_file: str | Path | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 load_timeout_s: float = 900.0, shm: str | Path = "/dev/shm",
                 model_repository: str | Path | None = None, proxy_config: str | Path | None = None,
                 launch: LaunchSpec | None = None, policy: RestartPolicy | None = None,
                 reclaim: ReclaimPolicy | None = None) -> None:
        self.url = url
        # the TLS proxy in front of the server (server.proxy): started again when its nginx died
        self._proxy = ProxyKeeper(proxy_config) if proxy_config is not None else None
        self.server_pid = server_pid
        self.launch = launch  # None: a server that dies stays down (containers: their restart policy)
        self.policy = policy or RestartPolicy()
        self.restarts = 0
        self._server: subprocess.Popen[bytes] | None = None  # a server this watchdog restarted (its child)
        self.models = list(models)
        self.model_repository = Path(model_repository) if model_repository is not None else None
        self._listed_at = time.monotonic()
        self.token = token
        self.events_file = Path(events_file) if events_file else None
        self.interval_s = interval_s
        self._api = ModelControl(url, token, timeout_s=load_timeout_s)
        self.shm = Path(shm)
        # grown shm regions given back (None: the environment's policy, server.shm_reclaim)
        self._reclaimer = ShmReclaimer(self._api, reclaim or ReclaimPolicy.from_env(), shm=self.shm)
        self._configs: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, _Pending] = {}
        self._stop = False
        self._stubs: dict[tuple[str, str], StubProcess] = {}  # (model, instance) -> stub, last scan with any
        self._needed: dict[str, int] = {}  # model -> live stubs it needs, once seen ready and complete

    def stop(self, *_: object) -> None:
        self._stop = True

    def server_alive(self) -> bool:
        if self._server is not None:  # our child: poll() also reaps it
            return self._server.poll() is None
        return pid_alive(self.server_pid)

    def run(self) -> int:
        """Loop until ``stop`` is called or the server is gone for good (0), or a crash loop (1).

        A server that exits without being stopped is restarted with its ``launch`` spec (``server.restart``
        policy); without one it stays down."""
        announced = False
        while True:
            while not self._stop and self.server_alive():
                self.tick()
                if self._proxy is not None:
                    self._proxy.check()
                if not announced:  # after the first check: the launcher waits for this line
                    LOGGER.info("%s tritonserver pid %d at %s (%d models, %d processes, every %.1f s)",
                                WATCHING, self.server_pid, self.url, len(self.models), len(self._stubs),
                                self.interval_s)
                    announced = True
                time.sleep(self.interval_s)
            if self._stop:
                LOGGER.info("watchdog stops (asked to)")
                return ExitCode.OK
            code = self._server.returncode if self._server is not None else None
            LOGGER.error("tritonserver pid %d exited without being stopped (%s)", self.server_pid,
                         "exit status unknown" if code is None else
                         f"killed by signal {-code}" if code < 0 else f"exit code {code}")
            self.clean_up_after_server()
            if self.launch is None:
                LOGGER.error("nothing restarts it here (start it again: `nnunet-triton serve` / "
                             "`nnunet-triton deploy`)")
                return ExitCode.OK
            if not self.restart():
                return ExitCode.OK if self._stop else ExitCode.CHECK_FAILED  # the restart gave up

    def restart(self) -> bool:
        """Start the server again after the policy's delay and wait until it is ready; False when the policy
        gives up (logged and recorded) or the watchdog is stopped meanwhile."""
        assert self.launch is not None
        delay = self.policy.next_delay(time.monotonic())
        if delay is None:
            LOGGER.error("tritonserver keeps dying: %s", self.policy.describe_give_up())
            self._record_event({"event": "gave_up", "at": time.time(), "restarts": self.restarts,
                                "reason": self.policy.describe_give_up()})
            return False
        LOGGER.warning("restarting tritonserver in %.0f s (restart %d within %.0f s)", delay,
                       self.policy.recent(time.monotonic()), self.policy.window_s)
        deadline = time.monotonic() + delay
        while not self._stop and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._stop:
            return False
        detected = time.time()
        self._server = _spawn_server(self.launch)
        self.server_pid, self.restarts = self._server.pid, self.restarts + 1
        self._stubs, self._needed, self._pending, self._configs = {}, {}, {}, {}
        self._reclaimer = ShmReclaimer(self._api, self._reclaimer.policy, shm=self.shm)
        self._record_restart()
        ready = self._wait_ready()
        LOGGER.warning("tritonserver restarted as pid %d: %s %.1f s after the restart began", self.server_pid,
                       "ready" if ready else "NOT ready", time.time() - detected)
        self._record_event({"event": "restart", "at": detected, "pid": self.server_pid, "ok": ready,
                            "restarts": self.restarts, "seconds": round(time.time() - detected, 3)})
        return True

    def _wait_ready(self) -> bool:
        def gone() -> str | None:
            return "stopping" if self._stop else None if self.server_alive() else "tritonserver died"

        try:
            readiness.wait_ready(self.url, timeout_s=readiness.READY_TIMEOUT_S, gone=gone)
        except readiness.NotReadyError:
            return False
        return True

    def _record_restart(self) -> None:
        """The new pid (and the restart count) in the launcher's pid and state files, for ``stop``/``status``
        and the launcher's ``ServerHandle``."""
        assert self.launch is not None
        if self.launch.pid_file:
            write_text_atomic(self.launch.pid_file, f"{self.server_pid}\n", mode=0o600)
        if self.launch.state_file and Path(self.launch.state_file).is_file():
            path = Path(self.launch.state_file)
            state = json.loads(path.read_text()) | {"pid": self.server_pid, "restarts": self.restarts}
            write_json_atomic(path, state, indent=2, mode=0o600)

    def clean_up_after_server(self, grace_s: float = 5.0) -> list[str]:
        """After the server died: end its orphaned stubs (they serve nothing; some linger for minutes) once
        ``grace_s`` has passed, then remove their shm regions. Returns the regions removed."""
        stubs = list(self._stubs.values())
        wait_gone(lambda: any(_is_stub(s) for s in stubs), grace_s, poll_s=0.2)
        lingering = [s for s in stubs if _is_stub(s)]
        for stub in lingering:
            kill(stub.pid)
        wait_gone(lambda: any(pid_alive(s.pid) for s in stubs), grace_s, poll_s=0.1)
        removed = remove_shm_regions((s.shm_region for s in stubs), self.shm)
        LOGGER.warning("%d orphaned stub process(es) of %d ended with SIGKILL; removed %d shared-memory "
                       "region(s) from %s", len(lingering), len(stubs), len(removed), self.shm)
        return removed

    def tick(self) -> list[Recovery]:
        """One check; reload what is broken or still pending. Returns the recoveries attempted.

        Cheap when nothing is wrong: one ``/proc`` scan; Triton is asked (``check_health``) only about
        models with fewer live stubs than their config needs, or not seen ready yet."""
        self._rescan()
        previous = self._stubs
        stubs = stub_processes(self.server_pid)
        if stubs:
            self._stubs = {(s.model, s.instance): s for s in stubs}
        alive = Counter(s.model for s in stubs)
        suspects = [m for m in self.models if m not in self._needed or alive[m] < self._needed[m]]
        if suspects:
            report = check_health(self.url, suspects, server_pid=self.server_pid, config_cache=self._configs,
                                  stubs=stubs)
            if not report.server_live:  # not "ready": strict readiness is false while a reload is pending
                return []
            for model in report.models:
                if model.ok:
                    self._needed[model.name] = len(model.expected)  # 0: not a Python-backend model
                if model.broken and model.name not in self._pending:
                    self._start_recovery(model, previous)
        now = time.monotonic()
        recoveries = [self._recover(name, pending) for name, pending in list(self._pending.items())
                      if now >= pending.retry_at]
        busy = set(suspects) | set(self._pending)  # models being checked or recovered keep their stubs
        for reclaim in self._reclaimer.check([s for s in stubs if s.model not in busy]):  # grown shm regions
            self._record_event(reclaim.to_event())
        return recoveries

    def _rescan(self) -> None:
        """List the repository's model folders again (every ``RESCAN_S``): versions come and go."""
        if self.model_repository is None or time.monotonic() - self._listed_at < RESCAN_S:
            return
        self._listed_at = time.monotonic()
        try:
            listed = repository_models(self.model_repository)
        except OSError as exc:
            LOGGER.warning("cannot list %s (%s); watching the %d models known", self.model_repository, exc,
                           len(self.models))
            return
        gone = set(self.models) - set(listed)
        for model in gone:
            self._needed.pop(model, None)
            self._configs.pop(model, None)
        self.models = listed

    def _start_recovery(self, model: ModelHealth, previous: dict[tuple[str, str], StubProcess]) -> None:
        dead = tuple(sorted(set(model.expected) - set(model.alive)))
        regions = tuple(previous[(model.name, i)].shm_region for i in dead if (model.name, i) in previous)
        LOGGER.warning("%s; reloading it", model.problem())
        self._pending[model.name] = _Pending(0.0, 1, dead, regions, time.time())

    def _recover(self, model: str, pending: _Pending) -> Recovery:
        try:
            self._api.unload(model)
            self._api.wait_not_ready(model)
            self._api.load(model)
            error = None
        except ServerError as exc:
            error = str(exc)
        recovery = Recovery(model=model, dead=pending.dead, detected_at=pending.detected_at,
                            seconds=round(time.time() - pending.detected_at, 3), ok=error is None,
                            attempt=pending.attempt, error=error)
        if recovery.ok:
            del self._pending[model]
            LOGGER.warning("model %r reloaded: ready again %.1f s after the dead process was found",
                           model, recovery.seconds)
            self._release_regions(model, pending.regions)
        else:
            delay = RELOAD_BACKOFF.delay(pending.attempt - 1)
            pending.retry_at, pending.attempt = time.monotonic() + delay, pending.attempt + 1
            LOGGER.error("reloading model %r failed (attempt %d): %s; next try in %.0f s", model,
                         recovery.attempt, error, delay)
        self._record(recovery)
        return recovery

    def _release_regions(self, model: str, regions: Sequence[str]) -> None:
        """Triton 2.51 frees a dead stub's shm region when the old instance goes, but mostly keeps the
        instance (and the region) for good once requests failed on it, even past a clean server exit.
        After the reload the region serves nobody: unlink its name, so nothing outlives the server (the
        pages stay mapped in tritonserver until it exits; Triton's own later unlink is a no-op)."""
        kept = remove_shm_regions(regions, self.shm)
        if kept:
            LOGGER.warning("removed the shm region(s) %s of model %r's dead process (their memory is "
                           "released when tritonserver exits)", kept, model)

    def _record(self, recovery: Recovery) -> None:
        self._record_event(asdict(recovery))

    def _record_event(self, event: dict[str, Any]) -> None:
        if self.events_file is None:
            return
        self.events_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.events_file, "a") as events:
            events.write(json.dumps(event) + "\n")


def _spawn_server(launch: LaunchSpec) -> subprocess.Popen[bytes]:
    """tritonserver as the launcher started it (own session, private umask, appending to its log); the
    token reaches it through this process's environment (``server.preload``)."""
    fd = os.open(launch.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as log:
        return subprocess.Popen(list(launch.command), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **launch.environment},
                                start_new_session=True, umask=PRIVATE_UMASK)


def fork_for_exec(server: TritonServerConfig, model_repository: str | Path, *,
                  preload: str | Path | None = None, events_file: str | Path | None = None,
                  proxy_config: str | Path | None = None) -> tuple[TritonServerConfig, dict[str, str]]:
    """For a container entry point that is about to ``exec`` tritonserver: fork the watchdog (it will
    watch its parent, which becomes tritonserver, and keeps the TLS proxy of ``proxy_config`` running) and
    return ``server`` with the restricted APIs (``dataclasses.replace``; its ``to_args`` is the command to
    exec), and the environment to add for the exec.

    The config carries ``server.preload.PLACEHOLDER`` as the token; the fresh token goes into the returned
    environment with ``LD_PRELOAD=<preload>`` (the library swaps it into argv before tritonserver's ``main``
    and keeps /dev/shm regions owner-only), never onto the command line. ``preload`` must be a file:
    ValueError otherwise, before anything is forked (no fallback to the token on the command line)."""
    from nnunet_triton.server.preload import PLACEHOLDER

    if preload is None or not Path(preload).is_file():
        raise ValueError(f"the preload library {str(preload)!r} is not a file: without it the control token "
                         "would be on tritonserver's command line (readable in /proc by every process that "
                         "sees it) and /dev/shm regions 0644; refusing to start (docker/Dockerfile builds "
                         "it into the image, server.preload compiles it).")
    token = os.environ.get(TOKEN_ENV) or new_token()
    reclaim = ReclaimPolicy.from_env()  # a bad value stops the entry point here, not the watchdog unseen
    # a container's /dev/shm (a pod's emptyDir) outlives a crashed server: nothing of ours runs yet here
    stale = remove_shm_regions(unmapped_shm_regions())
    if stale:
        LOGGER.warning("removed %d shm region(s) a previous server left in /dev/shm", len(stale))
    models = repository_models(model_repository)
    url = f"127.0.0.1:{server.http_port}"
    parent = os.getpid()
    if os.fork() == 0:  # the child never returns into the caller
        code = 1
        try:
            logging.basicConfig(level=logging.INFO, format="watchdog %(levelname)s %(message)s")
            if proxy_config is not None:
                LOGGER.info("starting the TLS proxy (nginx on %s); it is kept running from here",
                            proxy_config)
            watchdog = Watchdog(url, parent, models, token, events_file=events_file,
                                model_repository=model_repository, reclaim=reclaim,
                                proxy_config=proxy_config)
            signal.signal(signal.SIGTERM, watchdog.stop)
            code = watchdog.run()
        finally:
            os._exit(code)
    preloads = " ".join(p for p in (str(Path(preload).absolute()), os.environ.get("LD_PRELOAD")) if p)
    return (server.with_restricted_apis(RESTRICTED_APIS, CONTROL_HEADER, PLACEHOLDER),
            {"LD_PRELOAD": preloads, TOKEN_ENV: token})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nnunet_triton.server.watchdog",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="host:port of the server's HTTP endpoint")
    parser.add_argument("--server-pid", required=True, type=int)
    parser.add_argument("--model-repository", required=True, type=Path)
    parser.add_argument("--events-file", type=Path, default=None, help="append one JSON line per recovery")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="seconds between checks")
    parser.add_argument("--proxy-config", type=Path, default=None,
                        help="nginx.conf of the server's TLS proxy: started again when it died")
    parser.add_argument("--launch-file", type=Path, default=None,
                        help="server.restart.LaunchSpec JSON: restart a server that exits unexpectedly")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nnunet_triton.server.watchdog``; the token comes from ``$NNUNET_TRITON_CONTROL_TOKEN``."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s watchdog %(levelname)s %(message)s")
    token = os.environ.get(TOKEN_ENV)
    if not token:
        LOGGER.error("%s is not set: the watchdog cannot use the model-control API", TOKEN_ENV)
        return ExitCode.USAGE
    try:
        reclaim = ReclaimPolicy.from_env()
    except ValueError as exc:
        LOGGER.error("%s", exc)
        return ExitCode.USAGE
    watchdog = Watchdog(args.url, args.server_pid, repository_models(args.model_repository), token,
                        events_file=args.events_file, interval_s=args.interval, reclaim=reclaim,
                        model_repository=args.model_repository, proxy_config=args.proxy_config,
                        launch=LaunchSpec.read(args.launch_file, token=token) if args.launch_file else None)
    signal.signal(signal.SIGTERM, watchdog.stop)
    return watchdog.run()


if __name__ == "__main__":
    sys.exit(main())
