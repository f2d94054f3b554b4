"""``pip install`` and go: the wheel of this checkout, installed in a fresh venv, builds, serves and predicts.

``pip wheel .`` makes the wheel; a fresh venv outside the checkout gets it (``pip install --no-deps``) and
reaches the heavy dependencies (torch, nnunetv2, pytriton's tritonserver ...) through a path entry to this
environment's site-packages (nothing of the checkout: this venv's editable install of the package is a
``.pth`` there, which a path entry does not run). From a temporary directory, the console commands
``nnunet-triton build``, ``serve``, ``predict``, ``info`` and ``stop`` run on the SynthCT fixture, and the
label map equals nnU-Net's.
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


def test_build_serve_predict_stop_from_any_directory_answer_as_nnunet(installed, tmp_path: Path) -> None:
    venv, env = installed
    command = str(venv / "bin" / "nnunet-triton")
    work = tmp_path / "elsewhere"
    work.mkdir()
    built = _run([command, "build", "--model-dir", str(model_dir(SYNTHCT)), "--out", "repo"], cwd=work,
                 env=env)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (work / "repo" / "preprocess_model" / "1" / "model.py").read_text().startswith('"""Triton model')
    home = ["--home", str(work / "home")]
    served = _run([command, "serve", "--model-repository", "repo", *home], cwd=work, env=env)
    assert served.returncode == 0, served.stderr[-3000:]
    state = json.loads(served.stdout[served.stdout.index("{"):])
    try:
        assert Path(state["server_bin"]).is_relative_to(work / "home")
        case = probe_case(SYNTHCT)
        import SimpleITK as sitk

        image = sitk.GetImageFromArray(case.image[0])
        image.SetSpacing(tuple(reversed(case.spacing)))
        (work / "in").mkdir()
        sitk.WriteImage(image, str(work / "in" / "case_0000.nii.gz"))
        url = f"127.0.0.1:{state['http_port']}"
        predicted = _run([command, "predict", "-i", "in", "-o", "out", "--url", url, "--no-mirroring"],
                         cwd=work, env=env)
        assert predicted.returncode == 0, predicted.stderr[-3000:]
        answer = sitk.GetArrayFromImage(sitk.ReadImage(str(work / "out" / "case.nii.gz")))
        np.testing.assert_array_equal(answer, reference(SYNTHCT, case.name, False).segmentation)
        info = _run([command, "info", "--url", url, "--json", *home], cwd=work, env=env)
        assert info.returncode == 0, info.stderr[-3000:]
        (endpoint,) = json.loads(info.stdout)["endpoints"]
        assert endpoint["published"]["dataset_name"] == SYNTHCT
        assert [(v["version"], v["promoted"], v["loaded"]) for v in endpoint["versions"]] == [(1, True, True)]
    finally:
        stopped = _run([command, "stop", *home], cwd=work, env=env)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    status = _run([command, "status", *home], cwd=work, env=env)
    assert status.returncode == 3  # not running
