"""Container-host provisioning is developer tooling (``tools.container_host``); the package only looks for an
engine and says how to get one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from deploy_support import REPO_ROOT

from nnunet_triton.cli import deploy as tool
from nnunet_triton.errors import DeployError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.server.deploy import engine
from tools import container_host

PACKAGE = REPO_ROOT / "src" / "nnunet_triton"
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny"
# what container-host provisioning runs or writes: podman's packages, debootstrap, podman import, podman's
# host configuration and its ulimits
_PROVISIONING = re.compile(r"""["']debootstrap["']|containers\.conf|default_ulimits|RLIMIT_"""
                           r"""|["']import["'],\s*["']-["']|["']podman["'],\s*["']runc["']""")


def test_the_package_runs_no_provisioning() -> None:
    found = [f"{path.relative_to(PACKAGE)}: {match.group(0)}" for path in sorted(PACKAGE.rglob("*.py"))
             for match in _PROVISIONING.finditer(path.read_text())]
    assert found == []


def test_the_package_does_not_import_tools() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(PACKAGE)}: {name}" for name in names
                      if name == "tools" or name.startswith("tools.")]
    assert found == []


def test_require_engine_without_one_says_how_to_get_one_with_console_commands(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither docker nor podman here
    with pytest.raises(DeployError) as error:
        engine.require_engine("auto", why="--execute")
    message = str(error.value)
    assert message.startswith("--execute needs a working container engine (docker or podman); none answers")
    assert "`apt-get install podman`" in message and "`python -m tools.container_host`" in message
    assert "make " not in message


def test_deploy_execute_without_an_engine_fails_naming_how_to_get_one(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    code = tool.main(["--target", "docker", "--model-dir", str(FIXTURE), "--variant", "cpu", "--execute",
                      "--out", str(tmp_path / "repo")])
    assert code == ExitCode.USAGE
    assert "`python -m tools.container_host`" in caplog.text and "make container-engine" not in caplog.text
    assert not (tmp_path / "repo").exists()


def test_debian_mirror_is_the_one_apt_uses(tmp_path) -> None:
    one_line = tmp_path / "sources.list"
    one_line.write_text("deb http://security.debian.org/debian-security bookworm-security main\n"
                        "deb [arch=amd64] http://mirror.example/debian bookworm main\n")
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: http://deb822.example/debian\nSuites: bookworm\n")
    assert container_host.debian_mirror([one_line, deb822]) == "http://mirror.example/debian"
    assert container_host.debian_mirror([deb822]) == "http://deb822.example/debian"
    assert container_host.debian_mirror([tmp_path / "missing"]) == "http://deb.debian.org/debian"


def test_make_container_engine_runs_the_tooling_not_the_package() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    recipe = makefile.split("\ncontainer-engine:", 1)[1].split("\n\n", 1)[0]
    assert "-m tools.container_host" in recipe and "nnunet_triton" not in recipe
    assert Path(container_host.__file__).parent == REPO_ROOT / "tools"
