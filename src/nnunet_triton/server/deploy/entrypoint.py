"""The serving container's command: refuse a repository that cannot be served, then start the server.

    python3 -m nnunet_triton.server.deploy.entrypoint --model-repository /models -- tritonserver ...

Checks, before anything starts: the repository is readable and built (the registry
``repository_metadata.json`` with every listed model's ``config.pbtxt`` and no unlisted model directory:
:meth:`RepositoryInfo.from_repository`), every endpoint version in it was built for one target (one server
serves them all), and the TorchScript fold models of each endpoint version that uses the Python runner were
exported by a torch not newer than this image's (:func:`check_torch_compatible`). A refusal is one line on
stderr, ``nnunet-triton: cannot serve the model repository /models: <reason>``, and exit status
:data:`~.docker.EXIT_BAD_REPOSITORY` (78); the generated ``docker run`` restarts on failure a bounded number
of times (:data:`~.docker.RESTART_POLICY`), so such a container ends up exited with that line in its log
instead of restarting without a word.

Otherwise it execs (same pid, so PID 1 of the container stays the server)
``python3 -m nnunet_triton.server.thread_budget exec --watchdog --model-repository DIR -- <command>``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.server.deploy.repository_info import RepositoryInfo, check_torch_compatible

__all__ = ["repository_problem", "budget_command", "main"]

EXIT_BAD_REPOSITORY = 78  # = docker.EXIT_BAD_REPOSITORY (not imported: keep this start light)


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


def budget_command(repository: Path, command: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "nnunet_triton.server.thread_budget", "exec", "--watchdog",
            "--model-repository", str(repository), "--", *command]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m nnunet_triton.server.deploy.entrypoint",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("server_command", nargs=argparse.REMAINDER, help="-- tritonserver ...")
    args = parser.parse_args(argv)
    command = list(args.server_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.stderr.write("nnunet-triton: no server command after --\n")
        return 2
    problem = repository_problem(args.model_repository)
    if problem is not None:
        sys.stderr.write(
            f"nnunet-triton: cannot serve the model repository {args.model_repository}: {problem}\n")
        sys.stderr.flush()
        return EXIT_BAD_REPOSITORY
    argv_exec = budget_command(args.model_repository, command)
    os.execv(argv_exec[0], argv_exec)
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
