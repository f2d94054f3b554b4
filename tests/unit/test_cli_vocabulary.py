"""One spelling per concept on the command line: ``--endpoint``/``--endpoint-version`` name an endpoint in
every subcommand, ``--model-dir`` a results folder, ``--model-repository`` a model repository; the old
spellings (``--model``, ``--model-version``, ``--name``, ``--version``, ``build --out``,
``deploy --repository``) still work for one release, with a warning. Parsing only: no server."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nnunet_triton import cli
from nnunet_triton.cli.common import endpoint_model

PREDICT = ["predict", "-i", "in", "-o", "out"]


@pytest.mark.parametrize("argv", [[*PREDICT, "--endpoint", "liver", "--endpoint-version", "2"],
                                  ["validate", "--against", "ref", "-i", "in", "--endpoint", "liver",
                                   "--endpoint-version", "2"]])
def test_client_commands_take_the_endpoint_as_endpoint_and_endpoint_version(argv, capsys) -> None:
    assert endpoint_model(cli.parser().parse_args(argv)) == "liver__v2"
    assert "deprecated" not in capsys.readouterr().err


def test_the_old_spellings_of_predict_and_info_still_work_with_a_warning(capsys) -> None:
    args = cli.parser().parse_args([*PREDICT, "--model", "liver", "--model-version", "3"])
    assert endpoint_model(args) == "liver__v3"
    err = capsys.readouterr().err
    assert "warning: --model is deprecated and will be removed in the next release; use --endpoint" in err
    assert "warning: --model-version is deprecated and will be removed in the next release; use " \
           "--endpoint-version" in err
    assert cli.parser().parse_args(["info", "--model", "liver"]).only == "liver"
    assert "use --endpoint" in capsys.readouterr().err
    assert cli.parser().parse_args(["info", "--endpoint", "lung"]).only == "lung"


def test_validate_takes_the_results_folder_as_model_dir_and_model_still_works(capsys) -> None:
    for flag in ("--model-dir", "--model"):
        args = cli.parser().parse_args(["validate", flag, "results", "-i", "in", "--endpoint", "liver"])
        assert (str(args.model), endpoint_model(args)) == ("results", "liver")
    assert capsys.readouterr().err.count("use --model-dir") == 1


@pytest.mark.parametrize("argv", [["build", "--model-repository", "o"], ["export", "--out", "o"], ["deploy"]])
def test_the_results_folder_is_model_dir_and_model_is_its_old_spelling(argv, capsys) -> None:
    for flag in ("--model-dir", "--model"):
        args = cli.parser().parse_args([*argv, flag, "a", "b"])
        assert [str(m) for m in args.model] == ["a", "b"]
    assert capsys.readouterr().err.count(
        "warning: --model is deprecated and will be removed in the next release; use --model-dir") == 1


@pytest.mark.parametrize(("argv", "old", "dest"), [
    (["build", "--model-dir", "m"], "--out", "model_repository"),
    (["deploy", "--target", "k8s"], "--repository", "repository"),
])
def test_the_model_repository_is_model_repository_and_the_old_spelling_still_works(argv, old, dest,
                                                                                    capsys) -> None:
    args = cli.parser().parse_args([*argv, "--model-repository", "r"])
    assert str(getattr(args, dest)) == "r"
    assert "deprecated" not in capsys.readouterr().err
    args = cli.parser().parse_args([*argv, old, "r"])
    assert str(getattr(args, dest)) == "r"
    assert capsys.readouterr().err == (f"warning: {old} is deprecated and will be removed in the next "
                                       "release; use --model-repository\n")


def test_every_command_taking_a_model_repository_spells_it_model_repository() -> None:
    import argparse

    def commands(parser: argparse.ArgumentParser, prefix: str = ""):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from commands(sub, f"{prefix}{name} ")
        yield prefix.strip(), parser

    spellings = {}
    for name, parser in commands(cli.parser()):
        for action in parser._actions:
            if action.dest in ("model_repository", "repository") and action.option_strings:
                spellings.setdefault(name, set()).update(
                    s for s in action.option_strings if "deprecated" not in (action.help or ""))
    assert spellings and all(flags == {"--model-repository"} for flags in spellings.values()), spellings
    assert {"build", "serve", "deploy", "load", "promote", "rollback", "remove", "info"} <= set(spellings)


def test_a_bad_endpoint_name_is_refused_by_either_spelling(capsys) -> None:
    for flag in ("--endpoint", "--model"):
        with pytest.raises(SystemExit):
            cli.parser().parse_args([*PREDICT, flag, "Liver"])
        assert "lowercase" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "name", "version"), [
    (["build", "--model-dir", "m", "--endpoint", "liver", "--endpoint-version", "2"], "liver", 2),
    (["load", "--endpoint", "liver", "--endpoint-version", "2"], "liver", 2),
    (["promote", "--endpoint", "liver", "--endpoint-version", "2"], "liver", 2),
    (["remove", "--endpoint", "liver"], "liver", None),
    (["rollback", "--endpoint", "liver"], "liver", "absent"),
])
def test_build_and_rollouts_take_the_endpoint_as_endpoint_and_endpoint_version(argv, name, version,
                                                                                capsys) -> None:
    args = cli.parser().parse_args(argv)
    assert (args.name, getattr(args, "endpoint_version", "absent")) == (name, version)
    old = [{"--endpoint": "--name", "--endpoint-version": "--version"}.get(a, a) for a in argv]
    args = cli.parser().parse_args(old)
    assert (args.name, getattr(args, "endpoint_version", "absent")) == (name, version)
    assert "warning: --name is deprecated and will be removed in the next release; use --endpoint" in \
        capsys.readouterr().err


def test_deploy_takes_one_endpoint_per_results_folder_as_endpoint() -> None:
    from nnunet_triton.cli import deploy

    args = deploy._parser(False).parse_args(["--model-dir", "a", "b", "--endpoint", "liver", "lung"])
    assert args.name == ["liver", "lung"]


def test_rollouts_need_an_endpoint_and_promote_a_version(capsys) -> None:
    for argv in (["promote", "--endpoint-version", "2"], ["promote", "--endpoint", "liver"]):
        with pytest.raises(SystemExit):
            cli.parser().parse_args(argv)
    err = capsys.readouterr().err
    assert "one of the arguments --endpoint --name is required" in err
    assert "one of the arguments --endpoint-version --version is required" in err


def test_listen_takes_the_endpoint_as_endpoint_and_model_still_works(capsys) -> None:
    listen = ["listen", "--spool", "s", "--destination", "A@h:1"]
    assert cli.parser().parse_args([*listen, "--endpoint", "liver"]).model == "liver"
    assert "deprecated" not in capsys.readouterr().err
    assert cli.parser().parse_args([*listen, "--model", "liver"]).model == "liver"
    assert "warning: --model is deprecated and will be removed in the next release; use --endpoint" in \
        capsys.readouterr().err


def test_serve_takes_the_results_folder_as_model_dir_and_the_positional_still_works(capsys) -> None:
    for argv in (["--model-dir", "a", "b"], ["a", "b"], ["--model", "a", "b"]):
        args = cli.parser().parse_args(["serve", *argv])
        assert [str(m) for m in args.model or args.legacy_model_dir] == ["a", "b"]
    err = capsys.readouterr().err
    assert err.count("deprecated") == 2
    assert "warning: MODEL as a positional argument is deprecated and will be removed in the next release; " \
           "use --model-dir" in err
    assert cli.parser().parse_args(["serve", "--model-repository", "r"]).legacy_model_dir == []
    assert "deprecated" not in capsys.readouterr().err


def test_describe_endpoint_takes_endpoint_and_model_name_is_deprecated() -> None:
    import socket
    import warnings

    from nnunet_triton.client.endpoint import describe_endpoint
    from nnunet_triton.errors import ServerNotRunningError

    with socket.socket() as closed:  # bound, never listening: the call fails fast, after the arguments
        closed.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{closed.getsockname()[1]}"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ServerNotRunningError, match="cannot describe model 'liver__v2' on http://"):
                describe_endpoint(url, endpoint="liver__v2", timeout_s=5.0)
        with pytest.warns(DeprecationWarning, match=r"describe_endpoint\(model_name=...\) is deprecated .* "
                                                    "endpoint="), \
                pytest.raises(ServerNotRunningError, match="cannot describe model 'liver'"):
            describe_endpoint(url, model_name="liver", timeout_s=5.0)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="disagree"):
        describe_endpoint(url, endpoint="lung", model_name="liver")


REPO = Path(__file__).resolve().parents[2]
_COMMAND = re.compile(r"(?:nnunet-triton|nnunet_triton\.cli)[\s\"',)]+([a-z][\w-]*)(.*)")
_OLD_FLAGS = re.compile(r"--model(?![-\w])|--model-version|--name(?![-\w])|--version[\s=\"',]+[\d$]")
# a flag that is old in one command only: ``build --out`` (export's --out is its own), ``deploy --repository``
_OLD_COMMAND_FLAGS = {"build": re.compile(r"--out(?![-\w])"), "deploy": re.compile(r"--repository(?![-\w])")}
_BUILD_SHORTHAND = re.compile(r"-m[\s\"',]+repository\.build(.*)")  # python -m repository.build: build


def _command_lines() -> list[tuple[str, str]]:
    """(where, line) of every text the project ships that runs ``nnunet-triton``: README, docs, Makefile,
    tools (backslash-continued lines joined)."""
    files = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "tools").rglob("*.py"))]
    found = []
    for path in files:
        text = path.read_text().replace("\\\n", " ")
        found += [(f"{path.relative_to(REPO)}: {line.strip()}", line) for line in text.splitlines()]
    return found


def _uses_an_old_spelling(line: str) -> bool:
    match = _COMMAND.search(line)
    shorthand = _BUILD_SHORTHAND.search(line)
    if (match is None and shorthand is None) or "deprecated" in line:  # naming an old spelling as such: fine
        return False
    command, rest = match.groups() if match is not None else ("build", shorthand.group(1))
    positional = command == "serve" and re.match(r"\s+[^-\s|`]", rest) is not None  # serve RESULTS_FOLDER
    old_here = _OLD_COMMAND_FLAGS.get(command)
    return positional or _OLD_FLAGS.search(rest) is not None or (
        old_here is not None and old_here.search(rest) is not None)


def test_the_old_spelling_check_finds_old_spellings_and_passes_new_ones() -> None:
    old = ["nnunet-triton listen --spool s --model liver", "nnunet-triton serve results/ --folds 0",
           "$(PY) -m nnunet_triton.cli build --model $(MODEL) --name $(NAME)",
           "nnunet-triton promote --version 2",
           '[str(bin_dir / "nnunet-triton"), "predict", "-i", "x", "--model-version", "2"]',
           "nnunet-triton build --model-dir m --out repo", "nnunet-triton deploy --target k8s --repository r",
           '$(PY) -m repository.build --model-dir $(MODEL) --out "$(OUT)"']
    new = ["nnunet-triton listen --spool s --endpoint liver", "nnunet-triton serve --model-dir results/",
           "nnunet-triton serve --model-repository r", "nnunet-triton --version",
           "`nnunet-triton serve|stop`",
           "nnunet-triton predict --endpoint liver (--model: deprecated spelling)",
           "nnunet-triton build --model-dir m --model-repository repo", "nnunet-triton export --out o",
           "nnunet-triton deploy --target k8s --out build/k8s --model-repository r"]
    assert [_uses_an_old_spelling(line) for line in old + new] == [True] * len(old) + [False] * len(new)


def test_readme_docs_makefile_and_tools_use_only_the_new_spellings() -> None:
    assert [where for where, line in _command_lines() if _uses_an_old_spelling(line)] == []


def test_the_projects_code_calls_the_client_with_endpoint_only() -> None:
    deprecated = {"describe_endpoint": {"model_name"}, "NnunetClient": {"model", "model_name"}}
    old = []
    for path in [*sorted((REPO / "src").rglob("*.py")), *sorted((REPO / "tools").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                old += [f"{path.relative_to(REPO)}:{node.lineno} {name}({k.arg}=)" for k in node.keywords
                        if k.arg in deprecated.get(name, ())]
    assert old == []
