"""`make gpu-check` in its dry mode, from the bundle `make gpu-bundle` builds: the bundle is unpacked into a
temporary folder, tritonserver and its stubs start from it (not from the venv's pytriton), the check's own
process sees only what the GPU machine has plus the bundle (``--emulate-device``, no SimpleITK), and the
endpoint's answer equals nnU-Net's. The bundle is built once and reused while its inputs are unchanged
(``tools.gpu_bundle.inputs_digest``), so the prepared GPU check cannot rot while no GPU is lent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tools import gpu_bundle

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.triton, pytest.mark.slow]
# the device command's budget is 450 s (docs/deploy.md); on CPU tensors, on a loaded 2-core machine, the
# same stages take far longer (the network on the CPU, 4 orchestrator instances sharing 2 cores): with
# 1200 s, parity (421 s) and the endpoint (426 s) finished and the budget stopped the timings (2026-12-03,
# load average 15-18). The dry run gets a budget sized for this machine: the same script and stages
DRY_RUN_BUDGET_S = 2400


@pytest.fixture(scope="module")
def bundle() -> Path:
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton (which ships tritonserver) is not installed; run `make setup`")
    return gpu_bundle.build()


@pytest.fixture(scope="module")
def unpacked(bundle, tmp_path_factory) -> Path:
    return gpu_bundle.unpack(bundle, tmp_path_factory.mktemp("bundle"))


@pytest.fixture(scope="module")
def dry_run(bundle, tmp_path_factory):
    out, unpack_dir = tmp_path_factory.mktemp("gpu-check"), tmp_path_factory.mktemp("unpack")
    argv = [sys.executable, "-m", "tools.gpu_check", "--device", "cpu", "--workload", "fixture",
            "--reps", "1", "--bundle", str(bundle), "--unpack-dir", str(unpack_dir), "--emulate-device",
            "--budget-s", str(DRY_RUN_BUDGET_S), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "NNUNET_TRITON_HOME"}
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=DRY_RUN_BUDGET_S + 300,
                          env=env)
    stages = {s["name"]: s for s in json.loads((out / "gpu-check.json").read_text())["stages"]} \
        if (out / "gpu-check.json").is_file() else {}
    return proc, out, unpack_dir, stages


def _stage(stages, prefix):
    return next(s for name, s in stages.items() if name.startswith(prefix))


def test_the_bundle_fits_the_limit_and_holds_both_stubs_and_the_server_closure(bundle, unpacked):
    assert bundle.stat().st_size <= gpu_bundle.MAX_BUNDLE_BYTES
    manifest = json.loads((unpacked / "MANIFEST.json").read_text())
    tree = unpacked / "site" / "pytriton" / "tritonserver"
    assert os.access(tree / "bin" / "tritonserver", os.X_OK)
    for version in ("3.11", "3.12"):
        assert os.access(tree / "python_backend_stubs" / version / "triton_python_backend_stub", os.X_OK)
    libraries = sorted(p.name for p in (unpacked / "site" / "nvidia_pytriton.libs").iterdir())
    assert libraries == manifest["triton"]["libraries"] and "libtritonserver" in " ".join(libraries)
    assert not any(name.startswith("libpython") for name in libraries)  # the wheel's libpython 3.13 stays
    for name, package in manifest["packages"].items():
        assert package["version"] == gpu_bundle.lock_versions([name])[name]


def test_the_loader_resolves_every_library_of_the_312_stub_from_the_bundle_and_its_libpython_fallback(
        unpacked):
    stub = unpacked / "site" / "pytriton" / "tritonserver" / "python_backend_stubs" / "3.12" / \
        "triton_python_backend_stub"
    fallback = unpacked / "libpython" / "3.12"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{fallback}:{unpacked / 'site' / 'nvidia_pytriton.libs'}"}
    resolved = gpu_bundle.parse_ldd(subprocess.run(["ldd", str(stub)], capture_output=True, text=True,
                                                   env=env, check=True).stdout)
    assert None not in resolved.values(), resolved
    assert resolved["libpython3.12.so.1.0"] == str(fallback / "libpython3.12.so.1.0")
    plan = gpu_bundle.libpython_plan(unpacked, version="3.12", python_libdir=str(unpacked))
    assert plan.source == "bundle"  # this machine has no Python 3.12: the fallback is what the stub gets


def test_the_bundles_fixture_cases_are_the_nifti_cases_as_simpleitk_reads_them(unpacked):
    from tools.perf import workloads

    reference = workloads.fixture_case(workloads.fixture_model_dir())  # SimpleITK, here
    first = gpu_bundle.fixture_cases(unpacked)[0]
    assert first.name == reference.name and first.spacing == reference.spacing
    np.testing.assert_array_equal(first.image, reference.image)


def test_the_bundle_is_reproducible_from_the_same_inputs(bundle):
    with tarfile.open(bundle, "r:xz") as tar:
        members = tar.getmembers()
    assert all(m.mtime == 0 and m.uid == 0 and (m.isfile() or m.isdir()) for m in members)
    assert [Path(m.name) for m in members] == sorted(Path(m.name) for m in members)  # no file-system order


def test_dry_run_passes_and_writes_the_report_with_every_stage(dry_run):
    proc, out, _, stages = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = (out / "gpu-check.md").read_text()
    for heading in ("## (a) parity: NumPy vs device backend: ok", "## (b) endpoint vs nnUNetPredictor: ok",
                    "## (b) provenance: tritonserver and its stubs: ok", "## (c) timings: ok"):
        assert heading in report
    assert "SimpleITK | absent" in report


def test_dry_run_serves_from_the_unpacked_bundle_not_from_the_venv(dry_run):
    _, out, unpack_dir, stages = dry_run
    rows = _stage(stages, "(b) provenance")["rows"]
    assert {r["process"] for r in rows} >= {"tritonserver", "stub fold_0", "stub orchestrator_model",
                                            "stub preprocess_model", "stub stitch_model"}
    assert all(r["exe"].startswith(str(unpack_dir)) and r["simpleitk"] == "none" and r["ok"] for r in rows)
    server = next(r for r in rows if r["process"] == "tritonserver")
    assert server["libtritonserver"].startswith(str(unpack_dir))
    assert any(note.startswith("tritonserver ") and f"home prepared from {unpack_dir}" in note
               for note in _stage(stages, "(b) provenance")["notes"])


def test_dry_run_finds_the_cpu_paths_exact_and_the_answer_equal_to_nnunet(dry_run):
    _, _, _, stages = dry_run
    parity = _stage(stages, "(a)")["rows"]
    assert {r["function"].split(" ")[0] for r in parity} >= {
        "preprocess_case", "resize", "resize_segmentation", "resample_data_or_seg_to_shape",
        "predict_sliding_window", "convert_logits_to_segmentation:"}
    sliding = next(r for r in parity if r["function"].startswith("predict_sliding_window"))
    assert sliding["backend"] == "torch on cpu" and sliding["value"] == 0.0  # the device loop, bit for bit
    assert sliding["ok"] is True
    # NumPy against NumPy compares nothing: those rows are skipped, never passed
    assert all(r["ok"] is None for r in parity if r is not sliding)
    endpoint = _stage(stages, "(b) endpoint")["rows"]
    assert [r["mirroring"] for r in endpoint] == [True, False]
    assert all(r["differing_voxels"] == 0 and r["differing_near_ties"] == 0 for r in endpoint)
    assert all(r["min_dice_all_voxels"] == 1.0 and r["min_dice_confident"] == 1.0 for r in endpoint)


def test_dry_run_measures_every_timing_on_a_volume_of_2x2x2_tiles_and_reports_every_goal(dry_run):
    _, _, _, stages = dry_run
    timings = _stage(stages, "(c)")
    rows = {r["measure"]: r for r in timings["rows"]}
    for measure in ("endpoint latency, concurrency 1 (median s)", "endpoint throughput, concurrency 4 "
                    "(requests/s)", "nnUNetPredictor latency, back to back (median s)",
                    "batched network floor (median s)", "unseen case shape, first request (s)",
                    "unseen case shape, second request (s)"):
        assert rows[measure]["value"] > 0
    assert rows["fold batches, concurrency 4"]["value"] >= 1.0
    goals = {name[len("goal "):]: r for name, r in rows.items() if name.startswith("goal ")}
    assert set(goals) == {"tiles_per_axis", "waves_at_concurrency_4", "latency_vs_predictor",
                          "latency_vs_batched_floor", "throughput_c4_vs_predictor",
                          "largest_fold_batch_vs_tile_batch", "host_fallbacks"}
    assert goals["tiles_per_axis"]["value"] >= 2 and "met" in goals["tiles_per_axis"]["detail"]
    assert all("enforced on a GPU only" in goals[g]["detail"] for g in goals
               if g not in ("tiles_per_axis", "waves_at_concurrency_4"))


REALISTIC = """
import json, sys
from pathlib import Path
from tools import gpu_bundle, gpu_env, gpu_timings
root, models = Path(sys.argv[1]), Path(sys.argv[2])
gpu_bundle.check_active(root)
allowed = {*gpu_bundle.DEVICE_PACKAGES, *gpu_bundle.DEVICE_PURE, *gpu_bundle.DEVICE_COMPILED, "nnunet-triton"}
emulation = gpu_env.DeviceOnly(allowed).install()
gpu_env.guard_simpleitk(force=True)
model_dir = gpu_bundle.materialize_realistic_model(root, models)
case = gpu_timings.cube_case(model_dir)
print(json.dumps({"model_dir": str(model_dir), "tiles": gpu_timings.tiles_of(case, model_dir),
                  "refused": sorted(emulation.refused)}))
"""


def test_the_realistic_model_is_made_from_the_bundle_as_on_the_device_and_its_volume_has_2x2x2_tiles(
        unpacked, tmp_path):
    """What the timings command does first there (weights from the bundle's plans, no SimpleITK, only the
    GPU machine's packages and the bundle's), and the geometry of the goal's volume."""
    import torch

    env = gpu_bundle.activation_env(unpacked).env  # the process runs from the bundle, as on the device
    proc = subprocess.run([sys.executable, "-c", REALISTIC, str(unpacked), str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    model_dir = Path(result["model_dir"])
    assert result["tiles"] == [2, 2, 2]
    checkpoints = sorted(model_dir.glob("fold_*/checkpoint_final.pth"))
    assert len(checkpoints) == 5 and len({c.stat().st_ino for c in checkpoints}) == 1  # one weight set
    weights = torch.load(checkpoints[0], map_location="cpu", weights_only=False)["network_weights"]
    assert sum(w.numel() for w in weights.values() if w.dtype.is_floating_point) > 30e6  # the default plans'
