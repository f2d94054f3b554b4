"""One launch pipeline as data: every launcher renders tritonserver's final command once, from a typed
``server_config.TritonServerConfig``.

Each target runs through its real entry chain; only the execs along the chain and the final start of
tritonserver are stubbed (they record the argv; the next step then runs in this process): the embedded
server (``embedded.start``), the watchdog's restart (``launch.json`` read back, ``watchdog._spawn_server``),
the container (the command ``docker``/Kubernetes render -> ``deploy.entrypoint`` -> ``thread_budget exec
--watchdog`` -> the watchdog's fork -> exec), the image check (``image_check.fixture_command`` ->
``thread_budget exec``) and the perf harness (``tools.perf.run._server``). The watchdog process itself is not
forked (``os.fork`` answers "parent") and this host's /dev/shm is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from deploy_support import write_repository

from nnunet_triton.server import embedded, model_control, preload, watchdog
from nnunet_triton.server import thread_budget as tb
from nnunet_triton.server.deploy import docker, entrypoint, image_check, sizing
from nnunet_triton.server.deploy.repository_info import RepositoryInfo
from nnunet_triton.server.restart import LaunchSpec
from nnunet_triton.server.server_config import TritonServerConfig, from_args

REPO_ROOT = Path(__file__).resolve().parents[2]
# tritonserver flags that may be given several times (one value each); every other flag exactly once
REPEATABLE = {"--model-repository", "--load-model", "--backend-config", "--cuda-memory-pool-byte-size",
              "--rate-limit-resource"}


class _Exec(Exception):
    """Raised by the stubbed exec/Popen of tritonserver, carrying the argv it was given."""

    def __init__(self, argv: Sequence[str]) -> None:
        super().__init__("tritonserver would start here")
        self.argv = [str(a) for a in argv]


def _is_server(argv: Sequence[Any]) -> bool:
    return Path(str(argv[0])).name == "tritonserver"


@pytest.fixture
def stub_server_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stub only the execs of the chain and the final start of tritonserver (they raise :class:`_Exec`, and
    the next step of the chain runs in this process); every other process runs for real."""
    real_popen = subprocess.Popen

    def popen(argv: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(argv, (list, tuple)) and argv and _is_server(argv):
            raise _Exec(argv)
        return real_popen(argv, *args, **kwargs)

    def execvpe(file: str, argv: Sequence[str], env: Any) -> None:
        raise _Exec(argv)

    def execv(file: str, argv: Sequence[str]) -> None:  # the entry point's exec of the thread budget
        raise _Exec(argv)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(os, "execvpe", execvpe)
    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setattr(os, "fork", lambda: 4194301)  # the caller's side of the fork: no watchdog process
    monkeypatch.setattr(watchdog, "unmapped_shm_regions", lambda *a, **k: [])  # leave this host's /dev/shm
    monkeypatch.setenv(watchdog.TOKEN_ENV, "token-of-this-test")


def _final(run: Callable[[], object]) -> list[str]:
    """The argv tritonserver would be started with by ``run``."""
    with pytest.raises(_Exec) as started:
        run()
    return started.value.argv


def _through_thread_budget(argv: Sequence[str]) -> list[str]:
    """``python -m nnunet_triton.server.thread_budget ARGS`` run in this process up to its exec."""
    assert list(argv[:3]) == [sys.executable, "-m", "nnunet_triton.server.thread_budget"], argv
    return _final(lambda: tb.main(list(argv[3:])))


def _container(repo: Path, library: Path) -> tuple[tuple[str, ...], list[str]]:
    """(the container command docker and Kubernetes render, the argv its entry chain execs)."""
    info = RepositoryInfo.from_repository(repo)
    command = docker.server_command(info, sizing.plan_memory(info, sizing.VolumeSpec()), gpus=1,
                                    repository=str(repo))
    assert command[:3] == ("python3", "-m", "nnunet_triton.server.deploy.entrypoint")
    at = command.index("--")
    argv = [*command[3:at], "--preload", str(library), *command[at:]]
    budget_exec = _final(lambda: entrypoint.main(argv))
    return command[at + 1:], _through_thread_budget(budget_exec)


def _flag_names(argv: Sequence[str]) -> list[str]:
    return [arg.partition("=")[0] for arg in argv[1:]]


def _rendered_once(argv: list[str]) -> TritonServerConfig:
    """The config ``argv`` is the rendering of: read back it renders the same argv, every flag once."""
    config = from_args(argv)
    assert config.to_args() == argv
    assert config.extra_args == ()  # nothing appended past server_config's rendering
    twice = [name for name, n in Counter(_flag_names(argv)).items() if n > 1 and name not in REPEATABLE]
    assert twice == []
    return config


def test_every_launcher_renders_its_final_command_once_from_a_typed_config(
        tmp_path: Path, stub_server_start: None, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = write_repository(tmp_path / "repo")  # libtorch folds on GPU: no thread check to run
    other = write_repository(tmp_path / "other", name="other")
    library = tmp_path / "preload.so"
    library.write_bytes(b"\x7fELF")  # the entry point and the watchdog check that it is there
    run = tmp_path / "run"
    budget = tb.decide_budget(tb.repository_folds(repo))

    # the container: the rendered command is read once, the budget and the restricted APIs are added
    container, final = _container(repo, library)
    server = _rendered_once(final)
    given = from_args(container)
    assert server == given.with_rate_limits(budget.rate_limits()).with_restricted_apis(
        model_control.RESTRICTED_APIS, model_control.CONTROL_HEADER, preload.PLACEHOLDER)
    assert not any("token-of-this-test" in arg for arg in final)

    # the image check's fixture server: the same chain from its own command
    fixture = image_check.fixture_command(repo, [18000, 18001, 18002], preload=library)
    server = _rendered_once(_through_thread_budget(fixture))
    assert server.restricted_apis == model_control.RESTRICTED_APIS
    assert server.rate_limit_resources == budget.rate_limits()

    # the embedded server, serving a second repository next to the first
    options = embedded.LaunchOptions(home=tmp_path / "home", log_file=run / "log", pid_file=run / "pid",
                                     state_file=run / "server.json", extra_repositories=(other,))
    started = _final(lambda: embedded.start(repo, options))
    server = _rendered_once(started)
    assert server.model_repositories == (str(repo.absolute()), str(other.absolute()))
    assert server.control_token == preload.PLACEHOLDER and server.rate_limit_resources == budget.rate_limits()

    # the watchdog's restart: launch.json (the config serialised) read back renders the same command
    LaunchSpec.for_server(server, {}, {}, log_file=run / "log", pid_file=None, state_file=None).write(
        run / "launch.json")
    spec = LaunchSpec.read(run / "launch.json", token="token-of-this-test")
    assert _final(lambda: watchdog._spawn_server(spec)) == started

    # the perf harness: both repositories as the config's repositories, not as strings in extra_args
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # _server extends it
    from tools.perf import run as perf_run

    def perf() -> None:
        with perf_run._server([repo, other], tmp_path / "perf", "default"):
            pass

    server = _rendered_once(_final(perf))
    assert server.model_repositories == (str(repo.absolute()), str(other.absolute()))


def test_a_container_command_that_cannot_be_read_is_refused_before_anything_starts(tmp_path: Path,
                                                                                  capsys) -> None:
    repo = write_repository(tmp_path / "repo")
    library = tmp_path / "preload.so"
    library.write_bytes(b"\x7fELF")
    code = entrypoint.main(["--model-repository", str(repo), "--preload", str(library), "--",
                            "tritonserver", f"--model-repository={repo}", "--http-port=eighty"])
    assert code == entrypoint.EXIT_BAD_REPOSITORY
    assert capsys.readouterr().err == (
        "nnunet-triton: cannot start the server: cannot read the server command: the tritonserver flag "
        "--http-port must be an integer, got 'eighty'.\n")


def test_owned_flags_in_extra_args_are_refused_naming_the_field_to_use() -> None:
    with pytest.raises(ValueError, match=r"'--model-repository=/r' in extra_args is a field of the server's "
                                         r"config: give it as LaunchOptions.extra_repositories"):
        embedded.LaunchOptions(extra_args=("--log-verbose=1", "--model-repository=/r"))
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['http_prot'\]"):
        embedded.start(REPO_ROOT, http_prot=1)
