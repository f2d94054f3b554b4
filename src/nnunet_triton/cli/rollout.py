"""``nnunet-triton versions | load | promote | rollback | remove``: endpoint versions of a repository, on the
running server without a restart (:mod:`nnunet_triton.server.rollout`).

    nnunet-triton versions [--model-repository DIR] [--json]
    nnunet-triton load     --endpoint liver --endpoint-version 2     answers on liver__v2 (validate it)
    nnunet-triton promote  --endpoint liver --endpoint-version 2     liver (+ liver_int16, ...) runs version 2
    nnunet-triton rollback --endpoint liver                          back to the version promoted before
    nnunet-triton remove   --endpoint liver [--endpoint-version 1]   unload and delete a version (or the name)

``--name`` / ``--version`` are the deprecated spellings of ``--endpoint`` / ``--endpoint-version`` (accepted
with a warning for one release).

The repository is ``--model-repository`` (default: the one the server of ``--home`` serves, else
``build/model_repository``). The server is the one ``nnunet-triton serve`` recorded for that repository, or
``--url HOST:PORT`` with the server's model-control token in ``$NNUNET_TRITON_CONTROL_TOKEN``; without a
server only the repository's files change (``load`` needs a server).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from nnunet_triton.cli.build import DEFAULT_OUT
from nnunet_triton.cli.common import (
    DeprecatedAlias,
    add_model_repository_argument,
    endpoint_name,
    endpoint_version,
    say,
)
from nnunet_triton.errors import ServerNotRunningError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.server import rollout
from nnunet_triton.server.handle import recorded_server
from nnunet_triton.server.model_control import ModelControl
from nnunet_triton.server.triton_install import DEFAULT_HOME, HOME_ENV

__all__ = ["add_parsers"]


def _common(p: argparse.ArgumentParser) -> None:
    add_model_repository_argument(p, default=None, help=f"the repository (default: the one the server of "
                                                        f"--home serves, else {DEFAULT_OUT})")
    p.add_argument("--home", default=None, help=f"server home (default ${HOME_ENV} or {DEFAULT_HOME})")
    p.add_argument("--url", default=None,
                   help="HTTP host:port of a server not started here (token: $NNUNET_TRITON_CONTROL_TOKEN)")


def add_parsers(sub: Any) -> None:
    """Mount ``versions``, ``load``, ``promote``, ``rollback`` and ``remove`` on the subparsers ``sub``."""
    p = sub.add_parser("versions", help="list the endpoints of a repository, their versions, which is "
                                        "promoted and which are loaded")
    p.add_argument("--json", action="store_true")
    _common(p)
    p.set_defaults(run=_versions)
    for command, text, version in (
            ("load", "load a version on the running server (it answers on <name>__v<N>)", "required"),
            ("promote", "make the public endpoint run a version (loaded first), no restart", "required"),
            ("rollback", "promote the version the endpoint ran before", None),
            ("remove", "unload and delete a version (not the promoted one), or an endpoint", "optional")):
        p = sub.add_parser(command, help=text)
        names = p.add_mutually_exclusive_group(required=True)
        names.add_argument("--endpoint", type=endpoint_name, dest="name", help="endpoint name")
        names.add_argument("--name", type=endpoint_name, dest="name", action=DeprecatedAlias,
                           replacement="--endpoint", help="deprecated spelling of --endpoint")
        if version is not None:
            versions = p.add_mutually_exclusive_group(required=version == "required")
            versions.add_argument("--endpoint-version", type=endpoint_version, dest="endpoint_version",
                                  help="the version" + ("" if version == "required" else
                                                        " (default: every version)"))
            versions.add_argument("--version", type=endpoint_version, dest="endpoint_version",
                                  action=DeprecatedAlias, replacement="--endpoint-version",
                                  help="deprecated spelling of --endpoint-version")
        _common(p)
        p.set_defaults(run=_run, action=command)


def _repository(args: argparse.Namespace) -> Path:
    if args.model_repository is not None:
        return args.model_repository
    handle = recorded_server(args.home)
    return Path(handle.model_repository) if handle is not None and handle.is_running() else DEFAULT_OUT


def _control(args: argparse.Namespace, repository: Path) -> rollout.ModelControl | None:
    if args.url:
        return ModelControl.from_env(args.url)
    return rollout.local_control(repository, args.home)


def _versions(args: argparse.Namespace) -> int:
    repository = _repository(args)
    rows = rollout.versions(repository, _control(args, repository))
    if args.json:
        sys.stdout.write(json.dumps({"model_repository": str(repository), "versions": rows}, indent=2) + "\n")
    else:
        sys.stdout.write(f"{repository}\n{rollout.format_versions(rows)}\n")
    return ExitCode.OK


def _run(args: argparse.Namespace) -> int:
    repository = _repository(args)
    control = _control(args, repository)
    version = getattr(args, "endpoint_version", None)
    if args.action == "load":
        if control is None:
            raise ServerNotRunningError(
                f"no running server serves {repository} (start one with `nnunet-triton serve "
                f"--model-repository {repository}`, or give --url and the token): load needs one.")
        step = rollout.load_version(repository, args.name, version, control)
        say(step.summary("loaded") + f"; call it as {args.name}__v{version}")
    elif args.action == "promote":
        say(rollout.promote(repository, args.name, version, control).summary("promoted"))
    elif args.action == "rollback":
        say(rollout.rollback(repository, args.name, control).summary("rolled back to"))
    else:
        say(rollout.remove(repository, args.name, version, control).summary("removed"))
    return ExitCode.OK
