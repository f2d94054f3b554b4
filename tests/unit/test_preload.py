"""server.preload: the LD_PRELOAD library that takes the control token off tritonserver's command line and
keeps /dev/shm objects private, exercised on ordinary programs (printf, sh, python)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

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
