"""The benchmarks' one-model baseline (``nnunet_monolith``) is built from tools/perf, self-contained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.fixture_paths import SYNTH_CT, require_fixture
from tools.perf import monolith

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_monolith_repository_holds_the_step_as_model_py_the_config_and_the_deployed_folds(tmp_path: Path):
    require_fixture(SYNTH_CT.model_dir / "plans.json")
    out = monolith.build_monolith_repository(SYNTH_CT.model_dir, tmp_path / "repo", folds=(1,))
    version = out / monolith.MONOLITH_MODEL / "1"
    assert (version / "model.py").read_text() == monolith.STEP_FILE.read_text()
    assert 'name: "nnunet_monolith"' in (out / monolith.MONOLITH_MODEL / "config.pbtxt").read_text()
    files = sorted(str(p.relative_to(version)) for p in version.rglob("*") if p.is_file())
    assert files == ["inference_config.json", "model.py", "nnunet_model/dataset.json",
                     "nnunet_model/fold_1/checkpoint_final.pth", "nnunet_model/plans.json"]
    # the model.py loads where Triton loads it: the package importable, tools/ not
    child = f"""
import importlib.util, json, sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
spec = importlib.util.spec_from_file_location("model", {str(version / "model.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps([module.TritonPythonModel.__name__, "tools" in sys.modules]))
"""
    result = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, check=False, env={"PYTHONPATH": str(REPO_ROOT / "src"), "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == ["TritonPythonModel", False]
