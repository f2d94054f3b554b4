"""``nnunet-triton``: every command line of the project, one subcommand per task.

    nnunet-triton build    --model-dir RESULTS_FOLDER [--endpoint N] [--new-version]
                           [--model-repository DIR] ...                            (cli.build)
    nnunet-triton versions / load / promote / rollback / remove --endpoint N [--endpoint-version V]
                                                                                        (cli.rollout)
    nnunet-triton export   --model-dir RESULTS_FOLDER --out DIR ...                         (cli.export)
    nnunet-triton serve    [--model-dir RESULTS_FOLDER | --model-repository DIR] / stop / status (cli.serve)
    nnunet-triton deploy   --model-dir RESULTS_FOLDER [--target embedded|docker|k8s] / undeploy  (cli.deploy)
    nnunet-triton predict  -i IN -o OUT [request options] ...  /  info [--json]          (cli.predict)
    nnunet-triton validate (--model-dir RESULTS_FOLDER | --against DIR) -i CASES ...        (cli.validate)
    nnunet-triton listen   --spool DIR --destination ... / requeue / node-status         (cli.listen)
    nnunet-triton install-backend pytorch [--source DIR]                               (cli.install_backend)

Each module mounts its subcommands with ``add_parsers(sub)`` and sets ``run`` (``args -> exit code``);
they are imported when the parser is made, not with this package, so ``python -m repository.build`` (which
imports :mod:`.build`) runs where the DICOM packages are not installed (the serving image's export stage).
The library (``client``, ``validate``, ``builder``, ``server``) imports nothing from here.

Exit codes follow one policy (:mod:`nnunet_triton.exit_codes`, shown under every ``--help``): 0 ok, 1 a
check failed, 2 bad usage or a project error, 3 the server or node is not running. :func:`exit_code` maps the
errors a command ends with to them, here only: subcommands raise, and :func:`run_command` (used by
``nnunet-triton``, ``nnunet-triton-server`` and the ``python -m`` entry points of build, export and deploy)
maps and reports them; the error is one line.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import subprocess
from collections.abc import Callable
from typing import Any

from nnunet_triton import __version__
from nnunet_triton.cli.common import say
from nnunet_triton.errors import ClientError, NnunetTritonError, ServerNotRunningError
from nnunet_triton.exit_codes import EPILOG, ExitCode

__all__ = ["exit_code", "main", "parser", "run_command", "with_epilog"]

_COMMANDS = ("build", "rollout", "export", "serve", "deploy", "predict", "validate", "listen",
             "install_backend")


def parser() -> argparse.ArgumentParser:
    """The ``nnunet-triton`` parser with every subcommand mounted."""
    root = argparse.ArgumentParser(prog="nnunet-triton",
                                   description="Serve nnU-Net v2 models on Triton: build, serve, predict, "
                                               "validate, listen.")
    root.add_argument("--version", action="version", version=f"nnunet-triton {__version__}")
    sub = root.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parsers(sub)
    return with_epilog(root)


def with_epilog(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` and every subcommand under it with the exit-code policy as the ``--help`` epilog."""
    parser.epilog = EPILOG
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in set(action.choices.values()):
                with_epilog(command)
    return parser


def exit_code(exc: BaseException) -> ExitCode | None:
    """The exit code of an error a command ended with, the one mapping of every command: 3 when the server
    was not reached (:class:`~nnunet_triton.errors.ServerNotRunningError`), 2 for the project's errors (the
    server's answers included), bad values and a tool the command ran that failed
    (``subprocess.CalledProcessError``: its own output says why); None for anything else (a bug: it
    propagates with its traceback)."""
    if isinstance(exc, ServerNotRunningError):
        return ExitCode.NOT_RUNNING
    if isinstance(exc, (NnunetTritonError, ValueError, subprocess.CalledProcessError)):
        return ExitCode.USAGE
    return None


def run_command(run: Callable[[argparse.Namespace], int], args: argparse.Namespace, *,
                logger: logging.Logger | None = None) -> int:
    """``run(args)``'s exit code; an error it ends with becomes :func:`exit_code`'s, reported in one line:
    through ``logger`` (``ERROR <logger>: <message>``) where the command logs its progress, else as
    ``nnunet-triton: <message>`` on stderr. Errors :func:`exit_code` does not know propagate."""
    try:
        return int(run(args))
    except Exception as exc:
        code = exit_code(exc)
        if code is None:
            raise
        if logger is not None:
            logger.error("%s", exc)
        else:
            answered = isinstance(exc, ClientError) and code != ExitCode.NOT_RUNNING
            say(f"nnunet-triton: {'server error: ' if answered else ''}{exc}")
        return code


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through atomic_output, which removes its temporary file


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nnunet-triton`` console script; returns the exit code."""
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False)
        or args.command in ("build", "export", "serve", "deploy", "undeploy", "load", "promote", "rollback",
                            "remove")
        else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run_command(args.run, args)
    finally:
        signal.signal(signal.SIGTERM, previous)
