"""``pip install`` and go: the wheel of this checkout, installed in a fresh venv, builds, serves and predicts.

``pip wheel .`` makes the wheel; a fresh venv outside the checkout gets it (``pip install --no-deps``) and
reaches the heavy dependencies (torch, nnunetv2, pytriton's tritonserver ...) through a path entry to this
environment's site-packages (nothing of the checkout: this venv's editable install of the package is a
``.pth`` there, which a path entry does not run). From a temporary directory, the console commands
``nnunet-triton build``, ``serve``, ``predict``, ``info`` and ``stop`` run on the SynthCT fixture, and the
label map equals nnU-Net's; ``predict`` finds the server ``serve`` started without any port flag.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pipeline_support import SYNTHCT, model_dir, probe_case, reference

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with the wheel, and an environment that knows nothing of the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                  str(root / "dist"), str(REPO_ROOT)], cwd=root, env=env)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (root / "dist").glob("nnunet_triton-*.whl")
    venv = root / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=root, env=env)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=root, env=env).stdout.strip())
    (purelib / "_nnunet_triton_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], cwd=root,
                   env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv, env


def test_the_package_comes_from_the_wheel_not_from_the_checkout(installed, tmp_path: Path) -> None:
    venv, env = installed
    code = "import nnunet_triton.cli; print(nnunet_triton.__file__)"
    where = _run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv) and not Path(where.stdout.strip()).is_relative_to(
        REPO_ROOT)


@pytest.fixture(scope="module")
def served(installed, tmp_path_factory: pytest.TempPathFactory):
    """``build`` then ``serve`` as a new user runs them: no port flags, no ``--home`` (the default
    ``build/triton-home`` under the working directory); one SynthCT case under ``in/``; ``stop`` after."""
    venv, env = installed
    env = {k: v for k, v in env.items() if k not in ("NNUNET_TRITON_HOME", "NNUNET_TRITON_URL")}  # a new user
    command = str(venv / "bin" / "nnunet-triton")
    work = tmp_path_factory.mktemp("elsewhere")
    built = _run([command, "build", "--model-dir", str(model_dir(SYNTHCT)), "--model-repository", "repo"],
                 cwd=work, env=env)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (work / "repo" / "preprocess_model" / "1" / "model.py").read_text().startswith('"""Triton model')
    served = _run([command, "serve", "--model-repository", "repo"], cwd=work, env=env)
    assert served.returncode == 0, served.stderr[-3000:]
    state = json.loads(served.stdout[served.stdout.index("{"):])
    try:
        case = probe_case(SYNTHCT)
        import SimpleITK as sitk

        image = sitk.GetImageFromArray(case.image[0])
        image.SetSpacing(tuple(reversed(case.spacing)))
        (work / "in").mkdir()
        sitk.WriteImage(image, str(work / "in" / "case_0000.nii.gz"))
        yield command, work, env, state, served.stderr, case.name
    finally:
        stopped = _run([command, "stop"], cwd=work, env=env)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    status = _run([command, "status"], cwd=work, env=env)
    assert status.returncode == 3  # not running


def test_build_serve_predict_stop_from_any_directory_answer_as_nnunet(served) -> None:
    command, work, env, state, _, case_name = served
    import SimpleITK as sitk

    assert Path(state["server_bin"]).is_relative_to(work / "build" / "triton-home")
    url = f"127.0.0.1:{state['http_port']}"
    predicted = _run([command, "predict", "-i", "in", "-o", "out", "--url", url, "--no-mirroring"],
                     cwd=work, env=env)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    answer = sitk.GetArrayFromImage(sitk.ReadImage(str(work / "out" / "case.nii.gz")))
    np.testing.assert_array_equal(answer, reference(SYNTHCT, case_name, False).segmentation)
    info = _run([command, "info", "--url", url, "--json"], cwd=work, env=env)
    assert info.returncode == 0, info.stderr[-3000:]
    (endpoint,) = json.loads(info.stdout)["endpoints"]
    assert endpoint["published"]["dataset_name"] == SYNTHCT
    assert [(v["version"], v["promoted"], v["loaded"]) for v in endpoint["versions"]] == [(1, True, True)]


def test_the_installed_wheels_serve_then_predict_need_no_port_flags(served) -> None:
    """``serve`` takes Triton's usual ports (or says which free ones it took), and ``predict`` without
    ``--url`` finds that server through its state file."""
    command, work, env, state, serve_log, case_name = served
    import SimpleITK as sitk

    predicted = _run([command, "predict", "-i", "in", "-o", "found", "--no-mirroring", "-v"], cwd=work,
                     env=env)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    state_file = work / "build" / "triton-home" / "run" / "server.json"
    found = f"server 127.0.0.1:{state['http_port']} (from {state_file} (pid {state['pid']}))"
    assert found in predicted.stderr, predicted.stderr[-3000:]
    answer = sitk.GetArrayFromImage(sitk.ReadImage(str(work / "found" / "case.nii.gz")))
    np.testing.assert_array_equal(answer, reference(SYNTHCT, case_name, False).segmentation)
    usual = (state["http_port"], state["grpc_port"]) == (8000, 8001)
    assert usual or "Triton's usual port(s) taken" in serve_log, serve_log[-3000:]
    assert state["metrics_port"] is None  # closed unless asked for
