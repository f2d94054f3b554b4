"""Importing nnunet_triton and each of its modules must not load torch, cupy or Triton client/stub packages.

Runs in a fresh interpreter (this test process already imported torch through other tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
FORBIDDEN = ("torch", "cupy", "cupyx", "tritonclient", "triton_python_backend_utils")

CHILD = """
import importlib, json, pkgutil, sys
forbidden = {forbidden!r}
def loaded():
    return sorted(n for n in sys.modules if n.split(".")[0] in forbidden)
report = {{}}
import nnunet_triton
report["nnunet_triton"] = loaded()
for info in pkgutil.walk_packages(nnunet_triton.__path__, "nnunet_triton."):
    before = set(loaded())
    importlib.import_module(info.name)
    report[info.name] = sorted(set(loaded()) - before)
print(json.dumps(report))
"""


def test_importing_every_library_module_loads_no_heavy_dependency_when_fresh_interpreter():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", CHILD.format(forbidden=FORBIDDEN)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        "nnunet_triton.numerics.tiling",
        "nnunet_triton.numerics.gaussian",
        "nnunet_triton.numerics.sliding_window",
        "nnunet_triton.numerics.prediction_export",
        "nnunet_triton.numerics.resampling",
        "nnunet_triton.numerics.cropping",
        "nnunet_triton.numerics.normalization",
        "nnunet_triton.numerics.preprocess",
        "nnunet_triton.numerics.plans",
    }
    assert expected <= set(report)
    assert {name: mods for name, mods in report.items() if mods} == {}


def test_health_probe_and_watchdog_import_only_the_standard_library():
    # they run every few seconds as a Kubernetes exec probe / next to the server: cheap to start
    code = ("import sys, json, nnunet_triton.server.health, nnunet_triton.server.watchdog; "
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules} - "
            "set(sys.stdlib_module_names))))")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                            env=env, check=True)
    assert set(json.loads(result.stdout)) - {"__main__"} == {"nnunet_triton"}


def test_the_builder_command_runs_without_the_dicom_packages_the_serving_image_lacks():
    # the image's export stage runs `python -m repository.build` with the serving image's packages only
    code = ("import sys, importlib.abc\n"
            "class Refuse(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('pydicom', 'highdicom', 'pynetdicom', 'dicomweb_client'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Refuse())\n"
            "import repository.build, nnunet_triton.cli.build, nnunet_triton.cli.serve\n"
            "import nnunet_triton.cli.export, nnunet_triton.cli.deploy\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(SRC.parent)])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=env, check=False, cwd=SRC.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "ok"
