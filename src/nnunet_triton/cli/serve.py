"""``nnunet-triton serve | stop | status``: start, stop and query the embedded tritonserver.

    nnunet-triton serve --model-dir RESULTS_FOLDER [...] [--model-repository DIR]   build it first, then serve
    nnunet-triton serve --model-repository DIR                           serve a built repository
    nnunet-triton stop | status

``serve`` detaches (``--foreground`` stays attached) and records pid and ports in ``<home>/run/server.json``
for ``stop``, ``status`` and the clients. Exit codes (both command lines): 0 ok, 1 ``status`` of a server
that runs but is not healthy, 2 bad usage or a server that could not start (one already runs), 3 ``stop``
or ``status`` with no server running. ``nnunet-triton-server start|stop|status`` is the same (``start`` =
``serve``), kept for existing scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from nnunet_triton.cli import build, run_command, with_epilog
from nnunet_triton.cli.common import DeprecatedAlias, add_model_dir_argument, add_model_repository_argument
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.parameters import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT
from nnunet_triton.server.embedded import ALLOW_DEGRADED_FLAG, DEFAULT_HOST, LaunchOptions, start
from nnunet_triton.server.handle import EXIT_TIMEOUT_S, ServerHandle, recorded_server
from nnunet_triton.server.proxy import ClientLimits, TlsSettings, running_pid
from nnunet_triton.server.proxy_config import (
    DEFAULT_CONCURRENT_REQUESTS,
    DEFAULT_REQUEST_BURST,
    DEFAULT_REQUESTS_PER_MINUTE,
)
from nnunet_triton.server.triton_install import (
    DEFAULT_HOME,
    HOME_ENV,
    resolve_home,
)
from nnunet_triton.util.defaults import field_default

__all__ = ["add_embedded_arguments", "add_parsers", "add_proxy_limit_arguments", "add_server_arguments",
           "add_tls_arguments", "main", "proxy_limits", "tls_settings"]

LOGGER = logging.getLogger(__name__)


def _home_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", default=None, help=f"server home (default ${HOME_ENV} or {DEFAULT_HOME})")


def _serve_arguments(serve: argparse.ArgumentParser, *, build_first: bool, home: bool = True) -> None:
    if build_first:
        add_model_dir_argument(serve, nargs="+", default=[],
                               help="nnU-Net results folder(s) to build first (several: an ensemble); the "
                                    "builder's flags (--target, --folds, ...) apply (see build --help)")
        serve.add_argument("legacy_model_dir", nargs="*", type=Path, default=[], metavar="MODEL",
                           action=DeprecatedAlias, replacement="--model-dir",
                           help="deprecated spelling of --model-dir")
        add_model_repository_argument(serve, default=None,
                                      help=f"the repository to serve (built there from --model-dir when "
                                           f"given; default {build.DEFAULT_OUT})")
        builder = serve.add_argument_group("building (with --model-dir)")
        build.add_arguments(builder, model_required=False, out=False)
    else:
        add_model_repository_argument(serve, required=True)
    serve.add_argument("--host", default=DEFAULT_HOST,
                       help="bind address (default loopback); any other address needs --tls-cert, --tls-key "
                            "and --tls-ca and/or --tls-token-file")
    taken = "; a free port when that is taken (a warning names both)"
    serve.add_argument("--http-port", type=int, default=None, help=f"default {DEFAULT_HTTP_PORT}{taken}")
    serve.add_argument("--grpc-port", type=int, default=None, help=f"default {DEFAULT_GRPC_PORT}{taken}")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help=f"open the metrics endpoint on this port (default closed; --metrics: "
                            f"{DEFAULT_METRICS_PORT}{taken})")
    serve.add_argument("--model-control-mode", choices=("none", "explicit"), default="explicit",
                       help="explicit (default): the watchdog can reload a model whose process died")
    serve.add_argument("--load-model", action="append", default=[],
                       help="repeatable; explicit mode only (default: every model)")
    serve.add_argument("--no-recovery", action="store_true",
                       help="no watchdog: a model whose process dies stays broken until a restart")
    serve.add_argument("--backend-directory", action="append", type=Path, default=None,
                       help="repeatable: a folder of further Triton backends (<name>/libtriton_<name>.so), "
                            "merged with the Python backend (default: build/triton-backends when "
                            "`nnunet-triton install-backend pytorch` made it; a checkout: `make "
                            "triton-backends`)")
    serve.add_argument("--server-arg", action="append", default=[],
                       help="extra tritonserver flag, e.g. --server-arg=--log-verbose=1")
    ready_timeout = field_default(LaunchOptions, "ready_timeout_s")
    serve.add_argument("--ready-timeout", type=float, default=ready_timeout,
                       help=f"seconds (default {ready_timeout:.0f})")
    serve.add_argument("--exit-timeout", type=int, default=EXIT_TIMEOUT_S,
                       help=f"--exit-timeout-secs (default {EXIT_TIMEOUT_S})")
    serve.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the server")
    add_server_arguments(serve)
    add_proxy_limit_arguments(serve)
    if home:
        _home_argument(serve)


def add_embedded_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics`` and the flag that starts the embedded server without its preload library
    (``server.preload``), shared by ``serve`` and ``deploy`` (both take ``--metrics-port`` too)."""
    parser.add_argument("--metrics", action="store_true",
                        help="embedded: open Triton's metrics endpoint (Prometheus /metrics, no "
                             "authentication: every local user reads the per-model counters); closed by "
                             f"default (a --metrics-port opens it too). serve: on {DEFAULT_METRICS_PORT}, "
                             "a free port when that is taken; deploy: a free port")
    parser.add_argument(ALLOW_DEGRADED_FLAG, dest="allow_token_in_proc_and_readable_shm", action="store_true",
                        help="embedded: start even when the preload library cannot be built (no C compiler): "
                             "the control token is then on tritonserver's command line (/proc/<pid>/cmdline) "
                             "and the Python stubs' /dev/shm regions are 0644, both readable by every local "
                             "user; `status` reports the server as degraded. Without it such a start is "
                             "refused.")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``serve`` and ``deploy`` share: metrics, the degraded start, TLS."""
    add_embedded_arguments(parser)
    add_tls_arguments(parser)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The TLS proxy's flags (``server.proxy``; docs/security.md), shared by ``serve`` and ``deploy``."""
    tls = parser.add_argument_group(
        "TLS (required beyond loopback): HTTPS through an nginx proxy with an allow-list of paths in front "
        "of a loopback-only Triton HTTP endpoint; gRPC with Triton's own SSL")
    tls.add_argument("--tls-cert", type=Path, default=None, help="server certificate (PEM)")
    tls.add_argument("--tls-key", type=Path, default=None, help="its private key (PEM)")
    tls.add_argument("--tls-ca", type=Path, default=None,
                     help="CA (PEM) whose client certificates are accepted (mutual TLS, HTTP and gRPC)")
    tls.add_argument("--tls-token-file", type=Path, default=None,
                     help="file holding a bearer token HTTPS clients must send (HTTP only: gRPC then stays "
                          "on loopback)")
    tls.add_argument("--proxy-port", type=int, default=None, help="the HTTPS port (default: a free port)")
    tls.add_argument("--proxy-allow-statistics", action="store_true",
                     help="let the statistics API through the proxy (refused by default)")


def add_proxy_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """What one client may send through the TLS proxy (``proxy_config.ClientLimits``; beyond it: 429)."""
    limits = parser.add_argument_group(
        "TLS proxy limits per client (its certificate with --tls-ca, else its address): beyond them 429")
    limits.add_argument("--proxy-requests-per-minute", type=int, default=DEFAULT_REQUESTS_PER_MINUTE,
                        help=f"average request rate (default {DEFAULT_REQUESTS_PER_MINUTE})")
    limits.add_argument("--proxy-burst", type=int, default=DEFAULT_REQUEST_BURST,
                        help=f"requests beyond the rate at once (default {DEFAULT_REQUEST_BURST})")
    limits.add_argument("--proxy-concurrent-requests", type=int, default=DEFAULT_CONCURRENT_REQUESTS,
                        help=f"requests in progress (default {DEFAULT_CONCURRENT_REQUESTS})")


def proxy_limits(args: argparse.Namespace) -> ClientLimits:
    """The per-client limits of ``add_proxy_limit_arguments``' flags (ProxyError naming a bad one)."""
    return ClientLimits(requests_per_minute=args.proxy_requests_per_minute, burst=args.proxy_burst,
                        concurrent=args.proxy_concurrent_requests)


def tls_settings(args: argparse.Namespace) -> TlsSettings | None:
    """The TLS settings of ``add_tls_arguments``' flags; None when none is given; ValueError when half."""
    given = {flag: getattr(args, flag.replace("-", "_")) for flag in ("tls-cert", "tls-key", "tls-ca",
                                                                        "tls-token-file")}
    if not any(given.values()):
        return None
    if given["tls-cert"] is None or given["tls-key"] is None:
        missing = [f"--{flag}" for flag in ("tls-cert", "tls-key") if given[flag] is None]
        raise ValueError(f"TLS needs --tls-cert and --tls-key; missing {', '.join(missing)}.")
    return TlsSettings(cert=given["tls-cert"], key=given["tls-key"], client_ca=given["tls-ca"],
                       token_file=given["tls-token-file"])


def _stop_status(commands: Any, *, home: bool = True) -> None:
    stop_cmd = commands.add_parser("stop", help="stop the server recorded in <home>/run/server.json")
    stop_cmd.set_defaults(run=_cmd_stop)
    stop_cmd.add_argument("--timeout", type=float, default=None,
                          help="seconds before SIGKILL (default: exit timeout + 10)")
    status_cmd = commands.add_parser("status", help="print the recorded server state and its health; exit 0 "
                                     "when healthy (1: running but not healthy, 3: not running)")
    stop_cmd.help = "stop the server recorded in <home>/run/server.json (exit 3: none was running)"
    status_cmd.set_defaults(run=_cmd_status)
    if home:
        for command in (stop_cmd, status_cmd):
            _home_argument(command)


def add_parsers(sub: Any) -> None:
    """Mount ``serve``, ``stop`` and ``status`` on the ``nnunet-triton`` subparsers ``sub``."""
    serve = sub.add_parser("serve", help="start tritonserver on a repository (built first from --model-dir)")
    serve.set_defaults(run=_cmd_serve)
    _serve_arguments(serve, build_first=True)
    _stop_status(sub)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nnunet-triton-server", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    _home_argument(parser)  # before the command, as this command line always took it
    commands = parser.add_subparsers(dest="command", required=True)
    start_cmd = commands.add_parser("start", help="start tritonserver and wait until it is ready")
    start_cmd.set_defaults(run=_cmd_start)
    _serve_arguments(start_cmd, build_first=False, home=False)
    _stop_status(commands, home=False)
    return with_epilog(parser)


def _cmd_serve(args: argparse.Namespace) -> int:
    args.model = args.model or args.legacy_model_dir
    args.model_repository = args.model_repository or build.DEFAULT_OUT
    if args.model:
        code = build.run(args)
        if code:
            return code
    return _cmd_start(args)


def _cmd_start(args: argparse.Namespace) -> int:
    running = recorded_server(args.home)
    if running is not None and running.is_running():
        LOGGER.error(
            "a server is already running (pid %d, http %s); run `stop` first", running.pid, running.http_url
        )
        return ExitCode.USAGE
    handle = start(args.model_repository, LaunchOptions(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        metrics=args.metrics,
        allow_token_in_proc_and_readable_shm=args.allow_token_in_proc_and_readable_shm,
        home=args.home,
        model_control_mode=args.model_control_mode,
        load_models=tuple(args.load_model),
        recovery=not args.no_recovery,
        extra_args=tuple(args.server_arg),
        ready_timeout_s=args.ready_timeout,
        exit_timeout_s=args.exit_timeout,
        detach=not args.foreground,
        backend_dirs=args.backend_directory,
        tls=tls_settings(args),
        proxy_port=args.proxy_port,
        allow_statistics=args.proxy_allow_statistics,
        proxy_limits=proxy_limits(args),
        usual_ports=True,  # Triton's 8000/8001(/8002), where the clients look first; free ones when taken
    ))
    sys.stdout.write(json.dumps(_public_state(handle), indent=2) + "\n")
    sys.stdout.flush()
    if not args.foreground:
        return ExitCode.OK
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM -> KeyboardInterrupt -> clean stop
    try:
        status = handle._process.wait() if handle._process is not None else 0
        if status != 0:  # it died on its own (Ctrl-C and SIGTERM end here as KeyboardInterrupt)
            LOGGER.error("tritonserver exited with status %d; see %s", status, handle.log_file)
            return ExitCode.USAGE
        return ExitCode.OK
    except KeyboardInterrupt:
        return ExitCode.OK
    finally:
        handle.stop()


def _cmd_stop(args: argparse.Namespace) -> int:
    handle = recorded_server(args.home)
    if handle is None:
        LOGGER.info("no server recorded under %s", resolve_home(args.home) / "run")
        return ExitCode.NOT_RUNNING
    running = handle.is_running()
    handle.stop(timeout_s=args.timeout)  # also clears the record of a server that died
    if not running:
        LOGGER.info("the recorded server (pid %d) was not running", handle.pid)
        return ExitCode.NOT_RUNNING
    LOGGER.info("stopped (pid %d)", handle.pid)
    return ExitCode.OK


def _public_state(handle: ServerHandle) -> dict[str, Any]:
    """The recorded state without the control token: where it is (the state file, mode 0600), not what."""
    state = json.loads(handle.to_json())
    if state.pop("control_token", None):
        state["control_token_file"] = handle.state_file
    return state


def _cmd_status(args: argparse.Namespace) -> int:
    handle = recorded_server(args.home)
    if handle is None:
        sys.stdout.write(json.dumps({"running": False, "ready": False}) + "\n")
        return ExitCode.NOT_RUNNING
    state = _public_state(handle)
    running = handle.is_running()
    health = handle.health() if running else None
    state |= {"running": running, "ready": handle.is_ready(), "watchdog_running": handle.watchdog_running(),
              "healthy": bool(health and health.healthy),
              "problems": health.problems() if health else ["tritonserver is not running"]}
    if handle.proxy_pid is not None and handle.proxy_config is not None:
        state["proxy_running"] = running_pid(handle.proxy_config) is not None  # restarts included
        if not state["proxy_running"]:  # the public endpoint is unreachable (closed, not open)
            state["healthy"] = False
            state["problems"].append(f"the TLS proxy (nginx pid {handle.proxy_pid}) is not running: "
                                     f"{handle.proxy_url} does not answer")
    if handle.degraded:  # started with ALLOW_DEGRADED_FLAG: healthy, but not protected (said on every status)
        LOGGER.warning("the server runs DEGRADED (started with %s): %s", ALLOW_DEGRADED_FLAG,
                       "; ".join(handle.degraded))
    if handle.events_file and Path(handle.events_file).is_file():
        events = [json.loads(line) for line in Path(handle.events_file).read_text().splitlines()]
        state["recoveries"] = events[-10:]  # the last ten
        # grown Python-backend shm regions given back by reloading their model (server.shm_reclaim)
        state["shm_reclaims"] = sum(1 for e in events if e.get("event") == "shm_reclaim" and e.get("ok"))
    sys.stdout.write(json.dumps(state, indent=2) + "\n")
    if state["healthy"]:
        return ExitCode.OK
    return ExitCode.CHECK_FAILED if running else ExitCode.NOT_RUNNING


def main(argv: list[str] | None = None) -> int:
    """``nnunet-triton-server start|stop|status``; exit codes as ``nnunet-triton``'s (:func:`exit_code`)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s"
    )
    return run_command(args.run, args, logger=LOGGER)


if __name__ == "__main__":
    sys.exit(main())
