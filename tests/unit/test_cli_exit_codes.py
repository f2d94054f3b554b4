"""One exit-code policy for every command line (``nnunet_triton.exit_codes``): 0 ok, 1 a check failed,
2 bad usage or a project error, 3 the server or node is not running; each subcommand's cheapest way to end
with each code it has, through ``main`` and through the installed console scripts. No server runs: "not
running" is a port bound without listening (connections to it are refused)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_support import write_repository

from nnunet_triton import cli
from nnunet_triton.cli import serve
from nnunet_triton.errors import DeployError, ServerNotRunningError
from nnunet_triton.exit_codes import EPILOG, ExitCode

BIN = Path(sys.executable).parent


@pytest.fixture
def closed_url() -> Iterator[str]:
    """host:port where nothing listens: bound (so no one else takes it) but never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    (tmp_path / "case_0000.nii.gz").touch()
    return tmp_path


def _node_spool(folder: Path, state: str) -> Path:
    folder.mkdir()
    (folder / "status.json").write_text(json.dumps({"state": state, "pid": os.getpid(),
                                                    "updated": time.time(), "heartbeat_s": 2.0}))
    return folder


TABLE = [  # (code, argv); {w}: a scratch folder (with empty/ and case_0000.nii.gz), {url}: nothing listens,
    # {repo}: a built repository
    (ExitCode.USAGE, "build --model-dir {w}/missing --configuration 2d 3d_fullres --out {w}/out"),
    (ExitCode.USAGE, "export --model-dir {w}/missing --out {w}/out"),
    (ExitCode.USAGE, "versions --model-repository {w}/empty"),
    (ExitCode.NOT_RUNNING,
     "load --model-repository {w}/empty --home {w}/h --endpoint x --endpoint-version 1"),
    (ExitCode.USAGE, "promote --model-repository {w}/empty --endpoint x --endpoint-version 1"),
    (ExitCode.NOT_RUNNING, "promote --model-repository {repo} --url {url} --endpoint nnunet "
                           "--endpoint-version 1"),
    (ExitCode.NOT_RUNNING, "versions --model-repository {repo} --url {url}"),
    (ExitCode.USAGE, "rollback --model-repository {w}/empty --endpoint x"),
    (ExitCode.USAGE, "remove --model-repository {w}/empty --endpoint x"),
    (ExitCode.USAGE, "serve --model-repository {w}/empty --home {w}/home --tls-cert {w}/cert.pem"),
    (ExitCode.NOT_RUNNING, "stop --home {w}/home"),
    (ExitCode.NOT_RUNNING, "status --home {w}/home"),
    (ExitCode.USAGE, "predict -i {w}/missing.nii.gz -o {w}/out --url {url}"),
    (ExitCode.NOT_RUNNING, "predict -i {w}/case_0000.nii.gz -o {w}/out --url {url}"),
    (ExitCode.NOT_RUNNING, "predict -i dicomweb://{url}/dicom-web --study 1.2.3 -o {w}/out --url {url}"),
    (ExitCode.NOT_RUNNING, "info --url {url} --home {w}/home"),
    (ExitCode.USAGE, "validate --against {w}/empty -i {w}/empty --url {url}"),
    (ExitCode.NOT_RUNNING, "validate --against {w}/empty -i {w}/case_0000.nii.gz --url {url}"),
    (ExitCode.USAGE, "listen --spool {w}/spool --destination nowhere --url {url}"),
    (ExitCode.NOT_RUNNING, "listen --spool {w}/spool --destination DEST@127.0.0.1:1 --url {url}"),
    (ExitCode.USAGE, "requeue --spool {w}/empty"),
    (ExitCode.NOT_RUNNING, "node-status --spool {w}/empty"),
    (ExitCode.CHECK_FAILED, "node-status --spool {unhealthy}"),
    (ExitCode.OK, "node-status --spool {ok}"),
    (ExitCode.USAGE, "install-backend pytorch --source {w}/missing --out {w}/backends"),
]


@pytest.mark.parametrize(("code", "argv"), TABLE, ids=[f"{a.split()[0]}-{int(c)}" for c, a in TABLE])
def test_every_subcommand_exits_with_the_code_of_the_policy(code, argv, work, closed_url, capsys) -> None:
    repo = write_repository(work / "repo") if "{repo}" in argv else None
    text = argv.format(w=work, url=closed_url, repo=repo, unhealthy=_node_spool(work / "sick", "unhealthy"),
                       ok=_node_spool(work / "fine", "ok"))
    assert cli.main(text.split()) == code
    if code == ExitCode.NOT_RUNNING and not argv.startswith(("stop", "status", "node-status")):
        err = capsys.readouterr().err
        assert "not reachable" in err or "no running server" in err, err


@pytest.mark.parametrize("argv", [["predict", "-o", "out"], ["status", "--no-such-flag"]])
def test_usage_errors_of_argparse_exit_with_2(argv, capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == ExitCode.USAGE


def test_nnunet_triton_server_exits_by_the_same_policy(work) -> None:
    home = ["--home", str(work / "home")]
    assert serve.main([*home, "status"]) == ExitCode.NOT_RUNNING
    assert serve.main([*home, "stop"]) == ExitCode.NOT_RUNNING
    assert serve.main([*home, "start", "--model-repository", str(work / "empty"), "--tls-cert",
                       str(work / "cert.pem")]) == ExitCode.USAGE


def test_the_console_scripts_return_the_policy_codes(work) -> None:
    home = str(work / "home")
    status = subprocess.run([BIN / "nnunet-triton", "status", "--home", home], capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == ExitCode.NOT_RUNNING, status.stderr
    start = subprocess.run([BIN / "nnunet-triton-server", "--home", home, "start", "--model-repository",
                            str(work / "empty"), "--tls-cert", str(work / "cert.pem")],
                           capture_output=True, text=True, timeout=120)
    assert (start.returncode, start.stderr.strip()) == (
        ExitCode.USAGE, "ERROR TLS needs --tls-cert and --tls-key; missing --tls-key.")


def _commands(parser) -> list:
    found = [parser]
    for action in parser._actions:
        for command in getattr(action, "_name_parser_map", {}).values():
            found += _commands(command)
    return found


@pytest.mark.parametrize("make", [cli.parser, serve._parser], ids=["nnunet-triton", "nnunet-triton-server"])
def test_every_help_shows_the_exit_code_policy(make) -> None:
    parsers = _commands(make())
    assert len(parsers) > 3
    for parser in parsers:
        assert EPILOG in " ".join(parser.format_help().split()), parser.prog


@pytest.mark.parametrize(("error", "code"), [
    (lambda: ServerNotRunningError("the server is not reachable"), ExitCode.NOT_RUNNING),
    (lambda: DeployError("--max-volume must be positive"), ExitCode.USAGE),
    (lambda: subprocess.CalledProcessError(1, ["docker", "build"]), ExitCode.USAGE),
], ids=["not-running", "deploy-error", "tool-failed"])
def test_deploy_maps_its_errors_through_the_one_policy(error, code, work, monkeypatch, caplog) -> None:
    # the service raised while deploying (e.g. the server it started is no longer reached): deploy exits
    # with the policy's code for that error, as every other command does, and logs the error in one line
    from nnunet_triton.server.deploy import service

    def deploy(plan, say):
        raise error()

    monkeypatch.setattr(service, "deploy", deploy)
    argv = ["deploy", "--model-dir", str(work / "empty"), "--out", str(work / "repo")]
    assert cli.main(argv) == code
    assert str(error()) in caplog.text


def test_the_exit_codes_live_below_the_command_line_for_every_layer() -> None:
    # the health probe, the watchdog, the thread budget and the container entry point read them too
    from nnunet_triton.cli import exit_codes as old_path
    from nnunet_triton.server.deploy import docker, entrypoint

    assert old_path.ExitCode is ExitCode
    assert entrypoint.EXIT_BAD_REPOSITORY is docker.EXIT_BAD_REPOSITORY is ExitCode.CONFIG == 78
