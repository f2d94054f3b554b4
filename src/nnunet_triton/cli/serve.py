"""``nnunet-triton serve | stop | status``: start, stop and query the embedded tritonserver.

    nnunet-triton serve RESULTS_FOLDER [...] [--model-repository DIR]   build the repository first, then serve
    nnunet-triton serve --model-repository DIR                           serve a built repository
    nnunet-triton stop | status

``serve`` detaches (``--foreground`` stays attached) and records pid and ports in ``<home>/run/server.json``
for ``stop``, ``status`` and the clients. ``nnunet-triton-server start|stop|status`` is the same (``start`` =
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

from nnunet_triton.cli import build
from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.server.embedded import DEFAULT_HOST, start
from nnunet_triton.server.handle import EXIT_TIMEOUT_S, ServerHandle, recorded_server
from nnunet_triton.server.triton_install import (
    DEFAULT_HOME,
    HOME_ENV,
    resolve_home,
)

__all__ = ["add_parsers", "main"]

LOGGER = logging.getLogger(__name__)


def _home_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", default=None, help=f"server home (default ${HOME_ENV} or {DEFAULT_HOME})")


def _serve_arguments(serve: argparse.ArgumentParser, *, build_first: bool, home: bool = True) -> None:
    if build_first:
        serve.add_argument("model", nargs="*", type=Path, default=[],
                           help="nnU-Net results folder(s) to build first (several: an ensemble); the "
                                "builder's flags (--target, --folds, ...) apply (see build --help)")
        serve.add_argument("--model-repository", type=Path, default=None,
                           help=f"the repository to serve (built there from MODEL when given; default "
                                f"{build.DEFAULT_OUT})")
        builder = serve.add_argument_group("building (with MODEL)")
        build.add_arguments(builder, model_required=False, out=False)
    else:
        serve.add_argument("--model-repository", required=True, type=Path)
    serve.add_argument("--host", default=DEFAULT_HOST, help="bind address for all endpoints")
    serve.add_argument("--http-port", type=int, default=None, help="default: a free port")
    serve.add_argument("--grpc-port", type=int, default=None, help="default: a free port")
    serve.add_argument("--metrics-port", type=int, default=None, help="default: a free port")
    serve.add_argument("--model-control-mode", choices=("none", "explicit"), default="explicit",
                       help="explicit (default): the watchdog can reload a model whose process died")
    serve.add_argument("--load-model", action="append", default=[],
                       help="repeatable; explicit mode only (default: every model)")
    serve.add_argument("--no-recovery", action="store_true",
                       help="no watchdog: a model whose process dies stays broken until a restart")
    serve.add_argument("--server-arg", action="append", default=[],
                       help="extra tritonserver flag, e.g. --server-arg=--log-verbose=1")
    serve.add_argument("--ready-timeout", type=float, default=300.0, help="seconds (default 300)")
    serve.add_argument("--exit-timeout", type=int, default=EXIT_TIMEOUT_S,
                       help=f"--exit-timeout-secs (default {EXIT_TIMEOUT_S})")
    serve.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the server")
    if home:
        _home_argument(serve)


def _stop_status(commands: Any, *, home: bool = True) -> None:
    stop_cmd = commands.add_parser("stop", help="stop the server recorded in <home>/run/server.json")
    stop_cmd.set_defaults(run=_cmd_stop)
    stop_cmd.add_argument("--timeout", type=float, default=None,
                          help="seconds before SIGKILL (default: exit timeout + 10)")
    status_cmd = commands.add_parser("status", help="print the recorded server state and its health; exit 0 "
                                     "when healthy (1: running but not healthy, 3: not running)")
    status_cmd.set_defaults(run=_cmd_status)
    if home:
        for command in (stop_cmd, status_cmd):
            _home_argument(command)


def add_parsers(sub: Any) -> None:
    """Mount ``serve``, ``stop`` and ``status`` on the ``nnunet-triton`` subparsers ``sub``."""
    serve = sub.add_parser("serve", help="start tritonserver on a repository (built first from MODEL)")
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
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.model:
        args.out = args.model_repository or build.DEFAULT_OUT
        code = build.run(args)
        if code:
            return code
    args.model_repository = args.model_repository or (args.out if args.model else build.DEFAULT_OUT)
    return _cmd_start(args)


def _cmd_start(args: argparse.Namespace) -> int:
    running = recorded_server(args.home)
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
    sys.stdout.write(json.dumps(_public_state(handle), indent=2) + "\n")
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
    handle = recorded_server(args.home)
    if handle is None:
        LOGGER.info("no server recorded under %s", resolve_home(args.home) / "run")
        return 0
    handle.stop(timeout_s=args.timeout)
    LOGGER.info("stopped (pid %d)", handle.pid)
    return 0


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
        return 3
    state = _public_state(handle)
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
    try:
        return args.run(args)
    except (NnunetTritonError, ValueError) as exc:
        LOGGER.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
