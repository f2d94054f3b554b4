"""One spelling per concept on the command line: ``--endpoint``/``--endpoint-version`` name an endpoint in
every subcommand, ``--model-dir`` a results folder; the old spellings (``--model``, ``--model-version``,
``--name``, ``--version``) still work for one release, with a warning. Parsing only: no server."""

from __future__ import annotations

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


@pytest.mark.parametrize("argv", [["build", "--out", "o"], ["export", "--out", "o"], ["deploy"]])
def test_the_results_folder_is_model_dir_and_model_is_its_old_spelling(argv, capsys) -> None:
    for flag in ("--model-dir", "--model"):
        args = cli.parser().parse_args([*argv, flag, "a", "b"])
        assert [str(m) for m in args.model] == ["a", "b"]
    assert capsys.readouterr().err.count(
        "warning: --model is deprecated and will be removed in the next release; use --model-dir") == 1


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
