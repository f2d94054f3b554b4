"""server.preload: the LD_PRELOAD library that takes the control token off tritonserver's command line and
keeps /dev/shm objects private, exercised on ordinary programs (printf, sh, python): the token also
leaves the program's /proc/<pid>/environ, and a wrapper script on the way to the named program passes it
on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from nnunet_triton.errors import PreloadUnavailableError
from nnunet_triton.server import preload
from nnunet_triton.server.model_control import TOKEN_ENV

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) here")


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = preload.library(tmp_path_factory.mktemp("preload"))
    assert built is not None
    return built


def _run(library: Path, command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env={"PATH": os.environ["PATH"], "LD_PRELOAD": str(library), **env},
                          capture_output=True, text=True, timeout=60, check=True)


def test_library_is_compiled_once_per_source_and_kept_private(library):
    assert preload.library(library.parent) == library
    assert library.parent.stat().st_mode & 0o077 == 0


def test_placeholder_in_argv_becomes_the_token_from_the_environment(library):
    argv = ["printf", "%s\\n", f"--flag=key={preload.PLACEHOLDER}", "plain"]
    out = _run(library, argv, **{TOKEN_ENV: "s3cret"})
    assert out.stdout.splitlines() == ["--flag=key=s3cret", "plain"]


def test_token_variable_is_removed_before_the_program_starts(library):
    out = _run(library, ["sh", "-c", f'echo "[${TOKEN_ENV}]"'], **{TOKEN_ENV: "s3cret"})
    assert out.stdout == "[]\n"


def test_argv_is_left_alone_without_the_token_variable(library):
    out = _run(library, ["printf", "%s\\n", f"x={preload.PLACEHOLDER}"])
    assert out.stdout == f"x={preload.PLACEHOLDER}\n"


def test_dev_shm_objects_keep_only_the_owners_bits_even_after_fchmod(library):
    name = f"nnunet-triton-test-{uuid.uuid4().hex}"
    script = ("import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o666); "
              "os.fchmod(fd, 0o644); print(oct(os.fstat(fd).st_mode & 0o777))")
    try:
        out = _run(library, [sys.executable, "-c", script, f"/dev/shm/{name}"])
    finally:
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert out.stdout == "0o600\n"


def test_the_preload_wipes_the_token_from_proc_environ(library):
    """/proc/<pid>/environ shows the block the kernel copied at exec: unsetenv alone leaves the token."""
    env = {"PATH": os.environ["PATH"], "LD_PRELOAD": str(library), TOKEN_ENV: "s3cret-in-environ"}
    reader = "import sys; print(open(f'/proc/{sys.argv[1]}/environ', 'rb').read().hex())"
    program = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], env=env,
                               stdin=subprocess.PIPE)
    try:
        # another process reads it (root here, or the owner): what a local attacker of the same user sees
        shown = bytes.fromhex(subprocess.run([sys.executable, "-c", reader, str(program.pid)],
                                             capture_output=True, text=True, timeout=60, check=True).stdout)
    finally:
        program.communicate(b"", timeout=60)
    assert b"s3cret-in-environ" not in shown
    assert f"{TOKEN_ENV}=".encode() + b"*" * len("s3cret-in-environ") in shown.split(b"\0")


def test_only_the_named_program_takes_the_token_a_wrapper_on_the_way_passes_it_on(library):
    """perf_analyzer runs behind a bash wrapper that execs it: the wrapper must neither put the token on
    the command line it execs nor drop the variable."""
    wrapper = f'printf "%s|%s\\n" "$1" "${{{TOKEN_ENV}:+set}}"; exec printf "%s\\n" "$1"'
    env = preload.environment(library, "s3cret", "printf", base={"PATH": os.environ["PATH"]})
    out = subprocess.run(["bash", "-c", wrapper, "bash", f"-H=x:{preload.PLACEHOLDER}"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == [f"-H=x:{preload.PLACEHOLDER}|set", "-H=x:s3cret"]


def test_building_without_a_compiler_names_cc_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(PreloadUnavailableError, match=r"no C compiler \(`cc`\) on PATH"):
        preload.library(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_build_step_compiles_the_library_to_a_given_path(tmp_path):
    out = tmp_path / "lib" / "nnunet_triton_preload.so"
    assert preload.main([str(out)]) == 0
    assert out.is_file() and list(out.parent.iterdir()) == [out]
    shown = _run(out, ["printf", "%s", preload.PLACEHOLDER], **{TOKEN_ENV: "t"})
    assert shown.stdout == "t"
