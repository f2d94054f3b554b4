"""What the subcommands of ``nnunet-triton`` share: server connection flags, request-option flags, output.

Request options have one flag each, spelled after :class:`~nnunet_triton.options.RequestOptions`'s fields
(``--tile-step-size``, ``--no-mirroring``, ``--folds``, ``--probabilities``, ``--no-postprocessing``), with
nnU-Net's own spellings as aliases (``-step_size``/``--step-size``, ``--disable_tta``/``--disable-tta``,
``-f``, ``--save_probabilities``/``--save-probabilities``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.client.tls import ClientTls, add_client_tls_arguments, client_tls
from nnunet_triton.numerics.model_folder import parse_fold
from nnunet_triton.options import DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_TILE_STEP_SIZE, RequestOptions, parse_int
from nnunet_triton.parameters import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_PORTS
from nnunet_triton.server.discovery import server_url
from nnunet_triton.server.triton_install import DEFAULT_HOME, HOME_ENV

__all__ = ["DEFAULT_PORTS", "URL_ENV", "add_connection_arguments", "add_request_option_arguments",
           "add_endpoint_selection", "add_model_dir_argument", "connection_tls", "DeprecatedAlias",
           "endpoint_model", "endpoint_name", "endpoint_version", "request_options", "url", "say",
           "positive_int"]

URL_ENV = "NNUNET_TRITON_URL"
LOGGER = logging.getLogger(__name__)


def positive_int(text: str) -> int:
    return parse_int("", text, minimum=1, label="", error=argparse.ArgumentTypeError)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--url``, ``--protocol``, ``--timeout``, ``-v``, ``--ca/--cert/--key``: how a subcommand reaches the
    server."""
    parser.add_argument("--url", default=None,
                        help=f"server host:port (default: ${URL_ENV}, else the server `nnunet-triton "
                             f"serve` started on this machine, recorded in <home>/run/server.json (home: "
                             f"--home where the command has it, else ${HOME_ENV} or {DEFAULT_HOME}) while it "
                             f"runs, else 127.0.0.1:{DEFAULT_HTTP_PORT} (gRPC {DEFAULT_GRPC_PORT}); -v logs "
                             f"which one was used)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT_S,
                        help="seconds per inference call")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_client_tls_arguments(parser)


def connection_tls(args: argparse.Namespace) -> ClientTls | None:
    """The TLS files of ``--ca/--cert/--key`` (or their environment variables); None for plain HTTP/gRPC."""
    return client_tls(args.ca, args.cert, args.key)


def endpoint_name(text: str) -> str:
    """argparse type of an endpoint name (``io_names.check_endpoint_name``)."""
    try:
        return io_names.check_endpoint_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def endpoint_version(text: str) -> int:
    """argparse type of an endpoint version (an integer >= 1)."""
    try:
        return io_names.check_version(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag, kept for one release: stores like the new one and warns on stderr. On a
    positional argument (an old spelling of a flag: ``serve MODEL`` for ``--model-dir``) it warns only when
    the argument is given, and leaves the new flag's value alone when it is not."""

    def __init__(self, option_strings: list[str], dest: str, *, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string is None and not values:  # an optional positional argument, not given
            return
        spelling = option_string or f"{self.metavar or self.dest} as a positional argument"
        say(f"warning: {spelling} is deprecated and will be removed in the next release; "
            f"use {self.replacement}")
        setattr(namespace, self.dest, values)


def add_model_dir_argument(parser: Any, *, help: str, nargs: str | None = None, required: bool = False,
                           default: Any = None) -> None:
    """``--model-dir`` (dest ``model``): an nnU-Net results folder; ``--model`` is its deprecated spelling
    (accepted with a warning for one release). ``required``: one of the two must be given. ``parser`` may be
    a mutually exclusive group (``validate``'s ``--model-dir | --against``)."""
    group = parser.add_mutually_exclusive_group(required=True) if required else parser
    group.add_argument("--model-dir", dest="model", type=Path, nargs=nargs, default=default, help=help)
    group.add_argument("--model", dest="model", type=Path, nargs=nargs, action=DeprecatedAlias,
                       replacement="--model-dir", help="deprecated spelling of --model-dir")


def add_model_repository_argument(parser: Any, *, dest: str = "model_repository", old: str | None = None,
                                  **kwargs: Any) -> None:
    """``--model-repository``: the one spelling of a model repository folder on every command line
    (``kwargs``: its ``default``, ``required``, ``help``); ``old`` is a deprecated spelling of it
    (``build --out``, ``deploy --repository``), accepted with a warning for one release."""
    parser.add_argument("--model-repository", dest=dest, type=Path, **kwargs)
    if old is not None:
        new = "--model-repository"
        parser.add_argument(old, dest=dest, type=Path, action=DeprecatedAlias, replacement=new,
                            help=f"deprecated spelling of {new}")


def add_endpoint_selection(parser: argparse.ArgumentParser, *, model_aliases: bool = True) -> None:
    """Which endpoint a client command calls: ``--endpoint NAME`` and ``--endpoint-version N`` (a pinned
    version; default: the promoted one). ``model_aliases``: the old spellings ``--model`` /
    ``--model-version`` are accepted with a warning (not where ``--model`` is the results folder, as in
    ``validate``). Read back with :func:`endpoint_model`."""
    parser.add_argument("--endpoint", dest="endpoint", type=endpoint_name, default=io_names.ENDPOINT_MODEL,
                        help=f"endpoint name on the server (default {io_names.ENDPOINT_MODEL}; "
                             "`nnunet-triton info` lists them)")
    parser.add_argument("--endpoint-version", dest="endpoint_version", type=endpoint_version, default=None,
                        help="call exactly this version of the endpoint (<name>__v<N>; default: the version "
                             "the server promoted)")
    if model_aliases:
        parser.add_argument("--model", dest="endpoint", type=endpoint_name, action=DeprecatedAlias,
                            replacement="--endpoint", help="deprecated spelling of --endpoint")
        parser.add_argument("--model-version", dest="endpoint_version", type=endpoint_version,
                            action=DeprecatedAlias, replacement="--endpoint-version",
                            help="deprecated spelling of --endpoint-version")


def endpoint_model(args: argparse.Namespace) -> str:
    """The Triton model :func:`add_endpoint_selection`'s flags ask for (public or pinned endpoint)."""
    version = getattr(args, "endpoint_version", None)
    name = getattr(args, "endpoint", io_names.ENDPOINT_MODEL)
    return name if version is None else io_names.pinned_endpoint(name, version)


def add_request_option_arguments(parser: argparse.ArgumentParser, *,
                                 probabilities: str | None = None) -> None:
    """One flag per request option (nnU-Net's spellings as aliases); read back with :func:`request_options`.

    Args:
        probabilities: help text of ``--probabilities`` (None: the subcommand has its own flag for it).
    """
    parser.add_argument("-f", "--folds", nargs="+", type=parse_fold, default=None,
                        help="subset of the deployed folds, in averaging order (default: all)")
    parser.add_argument("--tile-step-size", "--step-size", "-step_size", type=float,
                        default=DEFAULT_TILE_STEP_SIZE, dest="tile_step_size",
                        help="sliding-window step as a fraction of the patch (default "
                             f"{DEFAULT_TILE_STEP_SIZE}, nnU-Net's)")
    parser.add_argument("--no-mirroring", "--disable-tta", "--disable_tta", action="store_false",
                        dest="mirroring", help="no test-time mirroring (faster, slightly less accurate)")
    parser.add_argument("--no-postprocessing", "--disable-postprocessing", action="store_false",
                        dest="postprocessing",
                        help="skip the postprocessing deployed with the model (nnU-Net's postprocessing.pkl)")
    if probabilities is not None:
        parser.add_argument("--probabilities", action="store_true", help=probabilities)


def request_options(args: argparse.Namespace, **overrides: Any) -> RequestOptions:
    """The :class:`RequestOptions` the flags of :func:`add_request_option_arguments` asked for."""
    values = {"mirroring": args.mirroring, "tile_step_size": args.tile_step_size,
              "folds": tuple(args.folds) if args.folds else None, "postprocessing": args.postprocessing,
              "probabilities": bool(getattr(args, "probabilities", False))}
    return RequestOptions(**{**values, **overrides})


def url(args: argparse.Namespace) -> str:
    """``--url``, else ``$NNUNET_TRITON_URL``, else the running server ``serve`` recorded (its state file),
    else loopback on the protocol's usual port (``server.discovery.server_url``); logged once (INFO: -v)."""
    chosen = getattr(args, "_server_url", None)
    if chosen is None:
        chosen = server_url(args.protocol, given=args.url, home=getattr(args, "home", None), env_var=URL_ENV)
        args._server_url = chosen
        LOGGER.info("server %s (from %s)", chosen.url, chosen.source)
    return str(chosen.url)


def say(text: str, stream: Any = None) -> None:
    """Terminal output of the CLI (results and the end report are its product, not log records)."""
    (stream or sys.stderr).write(text + "\n")
