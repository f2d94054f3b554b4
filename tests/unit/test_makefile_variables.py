"""Every Makefile variable reaches the tools intact: run ``make`` itself with the tools replaced.

``PY`` and ``SERVER`` are overridden on make's command line by a recorder that writes the argv it was
given (one JSON line per call), so each test sees exactly what a target hands to ``repository.build``,
``network_models.export``, ``nnunet_triton.cli deploy``, ``tools/demo.py``, ``tools.perf.run`` and the server
CLI. ``SETUP_STAMP``/``PERF_STAMP`` point at fresh stamp files so no environment is built. The real
``make serve MODEL="A B"`` end to end is in tests/triton/test_make_serve_ensemble.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RECORDER = """#!{python}
import json, os, sys
with open(os.environ["ARGV_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _make(tmp_path: Path, *args: str) -> list[list[str]]:
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed")
    recorder = tmp_path / "recorder"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    log = tmp_path / "argv.jsonl"
    log.unlink(missing_ok=True)
    # stamps newer than everything they depend on (pyproject.toml, the lock, the installer, each other),
    # so make runs no setup recipe whatever the checkout's file times are
    setup, perf = tmp_path / "setup.stamp", tmp_path / "perf.stamp"
    now = time.time()
    for stamp, mtime in ((setup, now + 60), (perf, now + 120)):
        stamp.touch()
        os.utime(stamp, (mtime, mtime))
    subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO_ROOT), *args, f"PY={recorder}", f"SERVER={recorder}",
         f"SETUP_STAMP={setup}", f"PERF_STAMP={perf}"],
        check=True, capture_output=True, text=True, timeout=60,
        env={**os.environ, "ARGV_LOG": str(log), "MAKEFLAGS": ""},
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


def _value(argv: list[str], flag: str) -> list[str]:
    """The words after ``flag`` up to the next ``--flag``."""
    start = argv.index(flag) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


def test_serve_with_two_models_builds_the_ensemble_and_serves_it(tmp_path: Path) -> None:
    calls = _make(tmp_path, "serve", "MODEL=/m/2d /m/3d", "FOLDS=0 1", "MODEL_REPOSITORY=/out/my repo")
    build, start = calls
    assert build[:2] == ["-m", "repository.build"]
    assert _value(build, "--model-dir") == ["/m/2d", "/m/3d"]
    assert _value(build, "--folds") == ["0", "1"]
    assert _value(build, "--model-repository") == ["/out/my repo"]
    assert start[:3] == ["start", "--model-repository", "/out/my repo"]


def test_serve_without_model_only_starts_the_server(tmp_path: Path) -> None:
    (start,) = _make(tmp_path, "serve", "MODEL_REPOSITORY=/out/repo")
    assert start[:3] == ["start", "--model-repository", "/out/repo"]


def test_repository_passes_several_models_configurations_and_an_out_with_a_space(tmp_path: Path) -> None:
    (build,) = _make(tmp_path, "repository", "MODEL=/m/a /m/b", "CONFIG=2d 3d_fullres", "OUT=/o/x y",
                     "FOLDS=0 1 2")
    assert _value(build, "--model-dir") == ["/m/a", "/m/b"]
    assert _value(build, "--configuration") == ["2d", "3d_fullres"]
    assert _value(build, "--model-repository") == ["/o/x y"]
    assert _value(build, "--folds") == ["0", "1", "2"]


def test_export_passes_every_model_and_fold(tmp_path: Path) -> None:
    (export,) = _make(tmp_path, "export", "MODEL=/m/a /m/b", "FOLDS=3 4", "EXPORT_OUT=/e/x y")
    assert export[:2] == ["-m", "network_models.export"]
    assert _value(export, "--model-dir") == ["/m/a", "/m/b"]
    assert _value(export, "--folds") == ["3", "4"]
    assert _value(export, "--out") == ["/e/x y"]


def test_deploy_and_demo_pass_every_model_and_fold(tmp_path: Path) -> None:
    (deploy,) = _make(tmp_path, "deploy", "MODEL=/m/a /m/b", "FOLDS=0 1", "CONFIG=3d_fullres")
    assert deploy[:3] == ["-m", "nnunet_triton.cli", "deploy"]
    assert _value(deploy, "--model-dir") == ["/m/a", "/m/b"] and _value(deploy, "--folds") == ["0", "1"]
    (demo,) = _make(tmp_path, "demo", "MODEL=/m/a /m/b", "FOLDS=0 1")
    assert demo[0] == "tools/demo.py"
    assert _value(demo, "--model-dir") == ["/m/a", "/m/b"] and _value(demo, "--folds") == ["0", "1"]


def test_perf_passes_its_arguments_word_by_word(tmp_path: Path) -> None:
    (perf,) = _make(tmp_path, "perf", "PERF_ARGS=--workloads fixture --systems endpoint,predictor")
    assert perf == ["-m", "tools.perf.run", "--workloads", "fixture", "--systems", "endpoint,predictor"]


def test_validate_passes_model_input_folds_and_its_arguments(tmp_path: Path) -> None:
    (validate,) = _make(tmp_path, "validate", "MODEL=/m/a b", "INPUT=/cases/x y", "FOLDS=0 1",
                        "VALIDATE_ARGS=--exact --disable-tta")
    assert validate[:2] == ["-m", "tools.validate"]
    assert _value(validate, "--model-dir") == ["/m/a b"] and _value(validate, "--input") == ["/cases/x y"]
    assert _value(validate, "--folds") == ["0", "1"]
    assert validate[validate.index("--", 2):] == ["--", "--exact", "--disable-tta"]
