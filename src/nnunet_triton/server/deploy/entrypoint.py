"""The serving container's command: refuse a repository that cannot be served, then start the server.

    python3 -m nnunet_triton.server.deploy.entrypoint --model-repository /models -- tritonserver ...

Checks, before anything starts: the repository is readable and built (the registry
``repository_metadata.json`` with every listed model's ``config.pbtxt`` and no unlisted model directory:
:meth:`RepositoryInfo.from_repository`), every endpoint version in it was built for one target (one server
serves them all), and the TorchScript fold models of each endpoint version that uses the Python runner were
exported by a torch not newer than this image's (:func:`check_torch_compatible`). A refusal is one line on
stderr, ``nnunet-triton: cannot serve the model repository /models: <reason>``, and exit status
``ExitCode.CONFIG`` (78, :mod:`nnunet_triton.exit_codes`); the generated ``docker run`` restarts on
failure a bounded number of times (:data:`~.docker.RESTART_POLICY`), so such a container ends up exited with
that line in its log instead of restarting without a word.

Then the image's preload library (:data:`PRELOAD_LIBRARY`, built by docker/Dockerfile) must be there: without
it the control token would be on tritonserver's command line and /dev/shm regions 0644, so the entry point
refuses to start (same line format, exit 78) instead of falling back. With ``--tls-cert``, ``--tls-key`` and
``--tls-ca`` and/or ``--tls-token-file`` (files mounted read-only by the generated ``docker run``), the TLS
proxy's nginx.conf is written and checked (``server.deploy.container_proxy``) and tritonserver must bind
every endpoint to 127.0.0.1; a problem there is refused the same way.

The command after ``--`` is read once, by ``server_config.from_args``, into a ``TritonServerConfig`` (an
unreadable one is refused the same way); the proxy check reads its fields. Then it execs (same pid, so PID 1
of the container stays the server) ``python3 -m nnunet_triton.server.thread_budget exec --watchdog --preload
LIB [--proxy-config FILE] --model-repository DIR --server-config JSON``: the config serialised (its
``to_dict``, the shape of ``launch.json``), to which the thread budget adds its rate limits and the watchdog
the restricted APIs before the command is rendered, once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.server.deploy.repository_info import RepositoryInfo, check_torch_compatible
from nnunet_triton.server.server_config import TritonServerConfig, from_args

__all__ = ["PRELOAD_LIBRARY", "repository_problem", "preload_problem", "budget_command", "main"]

EXIT_BAD_REPOSITORY = ExitCode.CONFIG  # EX_CONFIG: a restart policy gives up on it (docker.RESTART_POLICY)
# where docker/Dockerfile puts server.preload's library (its `preload` stage compiles it)
PRELOAD_LIBRARY = Path("/opt/nnunet_triton/lib/nnunet_triton_preload.so")
LOOPBACK = "127.0.0.1"


def repository_problem(repository: Path) -> str | None:
    """Why ``repository`` cannot be served by this image, or None."""
    if not repository.is_dir():
        return f"{str(repository)!r} is not a directory (mount the built repository there)"
    try:
        info = RepositoryInfo.from_repository(repository)
        info.target  # noqa: B018 - raises DeployError when the endpoint versions mix targets
        python_runner = [p for p in info.pipelines if p.fold_runner == "python"]
        if python_runner:
            try:
                torch = importlib.metadata.version("torch")
            except importlib.metadata.PackageNotFoundError:
                return "torch is not installed in this image (the Python fold runner needs it)"
            for pipeline in python_runner:
                check_torch_compatible(RepositoryInfo(pipelines=(pipeline,), models=pipeline.models), torch,
                                       f"the torch {torch} of this image")
    except (NnunetTritonError, OSError, ValueError, KeyError, TypeError) as exc:
        return str(exc)
    return None


def preload_problem(library: Path) -> str | None:
    """Why ``library`` cannot be preloaded, or None."""
    if not library.is_file():
        return (f"the preload library {library} is missing from this image: the control token would be on "
                "tritonserver's command line and /dev/shm regions readable by other users; rebuild the image "
                "from docker/Dockerfile (its preload stage compiles it)")
    return None


def budget_command(repository: Path, server: TritonServerConfig, *, preload: Path = PRELOAD_LIBRARY,
                   proxy_config: Path | None = None) -> list[str]:
    """``thread_budget exec`` of ``server``, handed on serialised (its ``to_dict``; a token given on the
    container's command line stays as given)."""
    proxy = ["--proxy-config", str(proxy_config)] if proxy_config is not None else []
    serialised = json.dumps(server.to_dict(keep_token=server.control_token), separators=(",", ":"))
    return [sys.executable, "-m", "nnunet_triton.server.thread_budget", "exec", "--watchdog",
            "--preload", str(preload), *proxy, "--model-repository", str(repository),
            "--server-config", serialised]


def _tls(args: argparse.Namespace) -> Any:
    from nnunet_triton.server.proxy_config import TlsSettings

    if args.tls_cert is None and args.tls_key is None and args.tls_ca is None and args.tls_token_file is None:
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("the TLS proxy needs --tls-cert and --tls-key")
    return TlsSettings(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_ca,
                       token_file=args.tls_token_file)


def proxy_problem(args: argparse.Namespace, server: TritonServerConfig) -> tuple[str | None, Path | None]:
    """(why the TLS proxy cannot start, None) or (None, its nginx.conf; None without TLS)."""
    try:
        tls = _tls(args)
        if tls is None:
            return None, None
        exposed = {"http": server.http_address, "grpc": server.grpc_address}
        if server.metrics_port is not None:  # closed otherwise (server_config renders --allow-metrics=false)
            exposed["metrics"] = server.metrics_address
        if any(address != LOOPBACK for address in exposed.values()):
            return (f"with the TLS proxy tritonserver must bind {LOOPBACK} only (it would be reachable past "
                    f"the proxy): {exposed}"), None
        from nnunet_triton.server.deploy import container_proxy

        info = RepositoryInfo.from_repository(args.model_repository)
        config = container_proxy.proxy_config(info.endpoints, tls, upstream_port=server.http_port,
                                              allow_statistics=args.proxy_allow_statistics)
        return None, container_proxy.prepare(config)
    except (NnunetTritonError, OSError, ValueError, subprocess.SubprocessError) as exc:
        return str(exc), None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m nnunet_triton.server.deploy.entrypoint",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--preload", type=Path, default=PRELOAD_LIBRARY,
                        help=f"server.preload's library (default: the image's {PRELOAD_LIBRARY})")
    tls = parser.add_argument_group("TLS proxy (server.deploy.container_proxy)")
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--tls-token-file"):
        tls.add_argument(flag, type=Path, default=None)
    tls.add_argument("--proxy-allow-statistics", action="store_true")
    parser.add_argument("server_command", nargs=argparse.REMAINDER, help="-- tritonserver ...")
    args = parser.parse_args(argv)
    command = list(args.server_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.stderr.write("nnunet-triton: no server command after --\n")
        return ExitCode.USAGE
    problem = repository_problem(args.model_repository)
    if problem is not None:
        sys.stderr.write(
            f"nnunet-triton: cannot serve the model repository {args.model_repository}: {problem}\n")
        sys.stderr.flush()
        return EXIT_BAD_REPOSITORY
    problem, server, proxy_config = preload_problem(args.preload), None, None
    if problem is None:
        try:
            server = from_args(command)  # the one read of the server command
        except ValueError as exc:
            problem = f"cannot read the server command: {exc}"
    if server is not None:
        problem, proxy_config = proxy_problem(args, server)
    if problem is not None or server is None:
        sys.stderr.write(f"nnunet-triton: cannot start the server: {problem}\n")
        sys.stderr.flush()
        return EXIT_BAD_REPOSITORY
    argv_exec = budget_command(args.model_repository, server, preload=args.preload,
                               proxy_config=proxy_config)
    os.execv(argv_exec[0], argv_exec)
    return ExitCode.OK  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
