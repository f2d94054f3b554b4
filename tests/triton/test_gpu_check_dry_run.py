"""`make gpu-check` in its dry mode (``--device cpu``: the same stages on CPU tensors) runs from this tree and
reports every stage, so the prepared GPU check cannot rot while no GPU is lent."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton (which ships tritonserver) is not installed; run `make setup`")
    out = tmp_path_factory.mktemp("gpu-check")
    argv = [sys.executable, "-m", "tools.gpu_check", "--device", "cpu", "--workload", "fixture",
            "--reps", "1",
            "--out", str(out)]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    return proc, out


def test_dry_run_passes_and_writes_the_report_with_every_stage(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = (out / "gpu-check.md").read_text()
    for heading in ("## (a) parity: NumPy vs device backend: ok", "## (b) endpoint vs nnUNetPredictor: ok",
                    "## (c) timings: ok"):
        assert heading in report


def test_dry_run_finds_the_cpu_paths_exact_and_measures_every_timing(dry_run):
    _, out = dry_run
    stages = {s["name"][:3]: s for s in json.loads((out / "gpu-check.json").read_text())["stages"]}
    parity = stages["(a)"]["rows"]
    assert {r["function"].split(" ")[0] for r in parity} >= {
        "preprocess_case", "resize", "resize_segmentation", "resample_data_or_seg_to_shape",
        "predict_sliding_window", "convert_logits_to_segmentation:"}
    sliding = next(r for r in parity if r["function"].startswith("predict_sliding_window"))
    assert sliding["backend"] == "torch on cpu" and sliding["value"] == 0.0  # the device loop, bit for bit
    endpoint = stages["(b)"]["rows"]
    assert [r["mirroring"] for r in endpoint] == [True, False]
    assert all(r["differing_voxels"] == 0 and r["min_dice"] == 1.0 for r in endpoint)
    timings = {r["measure"]: r["value"] for r in stages["(c)"]["rows"]}
    assert len(timings) == 7 and all(v > 0 for v in timings.values())
