"""The prepared GPU check: one script, a Markdown report, on a machine with an NVIDIA GPU (or dry, on CPU).

Usage::

    make gpu-check                                   # --device cuda --workload realistic -> build/gpu-check/
    python -m tools.gpu_check --device cpu --workload fixture --out build/gpu-check-dry   # the dry run

Needs torch (CUDA build), CuPy, nnunetv2 + SimpleITK (the oracle and the fixture reader) and, for stages
(b) and (c), the embedded tritonserver (``nvidia-pytriton``, ~145 MB; the models pass tensors by DLPack, so
numpy 2 is fine) and ``nnunet_triton`` importable by the Triton stubs (a venv from ``make
setup``, or ``pip install --no-deps --no-build-isolation --ignore-requires-python -e .`` once); no Docker,
no network. ``make gpu-check`` puts ``src/`` on PYTHONPATH for this process. A stage whose needs are missing
is reported as skipped with the reason; the exit status is 1 when a stage fails or a correctness goal is
missed (timing goals are reported, not enforced).

Stages:

(a) ``parity``: every preprocessing, resampling, sliding-window and export function on the committed fixture,
    NumPy against the device backend (CuPy on cuda; the sliding window on torch tensors of the device), max
    abs differences. On ``--device cpu`` the xp functions compare NumPy with itself (the stage still runs)
    and the sliding window compares torch CPU tensors with the NumPy emulation: both must be exact.
(b) ``endpoint``: the whole ``nnunet`` endpoint on the embedded tritonserver with GPU instances
    (``--target gpu``, Python-backend fold runner: the embedded server has no libtorch backend) against
    ``nnUNetPredictor`` on the device (``perform_everything_on_device=True`` on cuda): per-label Dice, voxel
    agreement, max probability difference, mirroring on and off. Goal on cuda: Dice >= 0.999 per label; on
    cpu: identical label maps.
(c) ``timings``: the workload's case (``realistic``: nnU-Net's default plans, ``tools.perf.workloads``)
    through the endpoint at concurrency 1 and 4, ``nnUNetPredictor`` back to back, the network-only floor
    (the fold networks' forwards over the same tiles), GPU utilisation (nvidia-smi) during the endpoint runs.
    Goals (cuda): endpoint latency <= 0.5x nnUNetPredictor, <= 1.2x the floor, throughput at concurrency 4
    >= 3x nnUNetPredictor back to back.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
LOGGER = logging.getLogger("gpu_check")
DICE_GOAL = 0.999
GOALS = {"latency_vs_predictor": 0.5, "latency_vs_floor": 1.2, "throughput_c4_vs_predictor": 3.0}


@dataclass
class Stage:
    """One stage's outcome: ``status`` ok | failed | skipped, its rows, and why."""

    name: str
    status: str = "ok"
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class Setup:
    device: str  # "cuda" or "cpu"
    workload: str  # "fixture" or "realistic"
    out: Path
    reps: int

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")


@contextlib.contextmanager
def _stage(stages: list[Stage], name: str) -> Iterator[Stage]:
    stage = Stage(name)
    stages.append(stage)
    start = time.perf_counter()
    try:
        yield stage
    except _Skip as skip:
        stage.status, stage.notes = "skipped", [*stage.notes, str(skip)]
    except Exception as exc:  # noqa: BLE001 - a failed stage is reported, the next one still runs
        stage.status = "failed"
        stage.notes.append(f"{type(exc).__name__}: {exc}")
        LOGGER.error("stage %s failed:\n%s", name, traceback.format_exc())
    finally:
        stage.seconds = time.perf_counter() - start
        LOGGER.info("stage %s: %s (%.1f s)", name, stage.status, stage.seconds)


class _Skip(Exception):
    pass


def _needs(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise _Skip(f"{module} is not installed ({why})")


def _max_abs(a: Any, b: Any) -> float:
    from nnunet_triton.numerics._xp import to_numpy

    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


# --- environment -----------------------------------------------------------------------------------------


def environment(setup: Setup) -> dict[str, str]:
    import torch

    env = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
           "device": setup.device, "workload": setup.workload}
    if setup.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu for the dry run).")
        env["gpu"] = torch.cuda.get_device_name(0)
    for module in ("cupy", "nnunetv2", "SimpleITK", "pytriton"):
        spec = importlib.util.find_spec(module)
        env[module] = "installed" if spec is not None else "missing"
    if importlib.util.find_spec("cupy") is not None:
        import cupy

        env["cupy"] = cupy.__version__
    return env


# --- (a) parity ------------------------------------------------------------------------------------------


def _device_xp(setup: Setup) -> Any:
    if not setup.gpu:
        return np
    _needs("cupy", "the GPU preprocessing and export run on CuPy")
    import cupy

    return cupy


def stage_parity(stage: Stage, setup: Setup, model_dir: Path, case: Any) -> None:
    import torch

    from nnunet_triton import io_names
    from nnunet_triton.numerics._xp import to_numpy
    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation
    from nnunet_triton.numerics.preprocess import preprocess_case
    from nnunet_triton.numerics.resampling import resample_data_or_seg_to_shape, resize, resize_segmentation
    from nnunet_triton.numerics.sliding_window import predict_sliding_window
    from nnunet_triton.pipeline.fold_runner import load_runner

    xp = _device_xp(setup)
    config = read_model_folder(model_dir)
    backend = "cupy" if setup.gpu else "numpy (dry run: NumPy against itself)"

    def row(function: str, diff: float, tolerance: float, what: str = "max abs") -> None:
        stage.rows.append({"function": function, "backend": backend, "metric": what, "value": diff,
                           "tolerance": tolerance, "ok": diff <= tolerance})

    data, props = preprocess_case(case.image, case.spacing, config)
    data_d, props_d = preprocess_case(xp.asarray(case.image), case.spacing, config)
    row("preprocess_case (crop, normalize, resample)", _max_abs(data, data_d), 1e-4)
    image = case.image[0].astype(np.float32)
    shape = tuple(max(2, s * 3 // 4) for s in image.shape)
    row("resize (order 3)", _max_abs(resize(image, shape, 3), resize(xp.asarray(image), shape, 3)), 1e-4)
    labels = (image > np.median(image)).astype(np.uint8)
    seg, seg_d = resize_segmentation(labels, shape, 1), resize_segmentation(xp.asarray(labels), shape, 1)
    row("resize_segmentation (order 1)", float(np.count_nonzero(to_numpy(seg) != to_numpy(seg_d))), 0,
        "differing voxels")
    anisotropic = (3.0, 0.8, 0.8)
    sep = resample_data_or_seg_to_shape(image[None], shape, anisotropic, (1.0,) * 3, order=3)
    sep_d = resample_data_or_seg_to_shape(xp.asarray(image[None]), shape, anisotropic, (1.0,) * 3, order=3)
    row("resample_data_or_seg_to_shape (separate z)", _max_abs(sep, sep_d), 1e-4)

    torch_device = "cuda:0" if setup.gpu else "cpu"
    fold = io_names.fold_model_name(config.folds[0])  # the repository stages (b)/(c) serve, built once
    torchscript = _repository(setup, model_dir) / fold / io_names.VERSION_DIR / io_names.TORCHSCRIPT_FILE
    runner = load_runner(torchscript, device=torch_device, max_forward_batch=1)

    def network(x: Any) -> Any:  # the same device forward for both loops: only the loops differ
        if isinstance(x, np.ndarray):
            return runner.forward(torch.from_numpy(x).to(torch_device)).cpu().numpy()
        return runner.forward(x)

    kwargs = dict(patch_size=config.patch_size, num_heads=config.labels.num_segmentation_heads,
                  mirror_axes=config.mirror_axes, batch_size=4)
    logits = predict_sliding_window(data, network, **kwargs)
    logits_d = predict_sliding_window(torch.from_numpy(data).to(torch_device), network, **kwargs)
    stage.rows.append({"function": "predict_sliding_window (tiles, TTA, Gaussian, fp16 sums)",
                       "backend": f"torch on {torch_device}", "metric": "max abs (fp16 logits)",
                       "value": _max_abs(logits, logits_d), "tolerance": 0.0,
                       "ok": _max_abs(logits, logits_d) == 0.0})
    seg, probs = convert_logits_to_segmentation(logits, props, config, return_probabilities=True)
    seg_d, probs_d = convert_logits_to_segmentation(xp.asarray(logits), props_d, config,
                                                    return_probabilities=True)
    row("convert_logits_to_segmentation: probabilities", _max_abs(probs, probs_d), 1e-4)
    row("convert_logits_to_segmentation: labels", float(np.count_nonzero(to_numpy(seg) != to_numpy(seg_d))),
        0, "differing voxels")
    if not all(r["ok"] for r in stage.rows):
        stage.status = "failed"


# --- (b) endpoint and (c) timings --------------------------------------------------------------------------


def _repository(setup: Setup, model_dir: Path) -> Path:
    import torch

    from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner
    from nnunet_triton.builder.torch_compat import torch_minor_text
    from tools.perf.repos import pipeline_repository

    if setup.gpu:  # the embedded server has the Python backend only: the Python fold runner, on KIND_GPU;
        # fp16 (traced under CUDA autocast, what `make deploy TARGET=docker` builds and nnU-Net runs on cuda)
        options = BuildOptions(target="gpu", fold_runner=FoldRunner.PYTHON, fold_precision="fp16",
                               orchestrator_instances=4, serving_torch=torch_minor_text(torch.__version__))
    else:
        options = BuildOptions(orchestrator_instances=4)
    return pipeline_repository(model_dir, f"gpu-check-{setup.workload}", variant=setup.device,
                               options=options)


@contextlib.contextmanager
def _server(repository: Path, out: Path) -> Iterator[Any]:
    from nnunet_triton.server import embedded

    handle = embedded.start(repository, log_file=out / "tritonserver.log", pid_file=out / "tritonserver.pid",
                            state_file=out / "server.json", ready_timeout_s=900.0, exit_timeout_s=5)
    try:
        yield handle
    finally:
        handle.stop()


def stage_endpoint(stage: Stage, setup: Setup, model_dir: Path, case: Any, handle: Any) -> None:
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.validate.compare import compare_case, segmentation_labels
    from nnunet_triton.validate.oracle import nnunet_predictor

    config = read_model_folder(model_dir)
    labels = segmentation_labels(config.labels.label_names, config.labels.regions_class_order)
    predictor = nnunet_predictor(model_dir, device=setup.device)
    with NnunetClient(handle.grpc_url, protocol="grpc", timeout_s=3600) as client:
        for mirroring in (True, False):
            predictor.use_mirroring = mirroring
            ref_seg, ref_probs = predictor.predict_single_npy_array(
                case.image, {"spacing": list(case.spacing)}, save_or_return_probabilities=True)
            result = client.segment(case.image, case.spacing, mirroring=mirroring, probabilities=True)
            comparison = compare_case(case.name, ref_seg, result.segmentation, labels, case.spacing,
                                      reference_probabilities=np.asarray(ref_probs, np.float32),
                                      endpoint_probabilities=result.probabilities)
            ok = comparison.min_dice >= DICE_GOAL if setup.gpu else comparison.differing_voxels == 0
            stage.rows.append({
                "mirroring": mirroring, "min_dice": comparison.min_dice,
                "dice": {label.value: round(label.dice, 6) for label in comparison.labels},
                "agreement": comparison.agreement, "differing_voxels": comparison.differing_voxels,
                "max_probability_difference": comparison.max_probability_difference,
                "goal": f"Dice >= {DICE_GOAL}" if setup.gpu else "identical labels", "ok": ok})
    if not all(r["ok"] for r in stage.rows):
        stage.status = "failed"


class _GpuSampler:
    """nvidia-smi utilisation samples (percent) while active; nothing on CPU."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _GpuSampler:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "--id=0"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=10)
            with contextlib.suppress(ValueError):
                self.samples.append(float(out.stdout.strip().splitlines()[0]))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def summary(self) -> str:
        if not self.enabled:
            return "n/a (no GPU)"
        if not self.samples:
            return "no samples"
        return f"mean {statistics.mean(self.samples):.0f} %, max {max(self.samples):.0f} %"


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def stage_timings(stage: Stage, setup: Setup, model_dir: Path, repository: Path, case: Any,
                  handle: Any) -> None:
    import torch

    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.validate.oracle import nnunet_predictor
    from tools.perf.baselines import _Floor

    folds = tuple(read_model_folder(model_dir).folds)
    mirroring = setup.gpu  # nnU-Net's default; the CPU dry run leaves it off (8 network inputs per tile)
    stage.notes.append(f"case {case.name} {tuple(case.image.shape)}, folds {list(folds)}, "
                       f"mirroring {'on' if mirroring else 'off'}, repository {repository}")
    def one(_: object = None) -> Any:  # one request on its own connection
        with NnunetClient(handle.grpc_url, protocol="grpc", timeout_s=3600) as client:
            return client.segment(case.image, case.spacing, mirroring=mirroring)

    one()  # warm-up (CUDA contexts, cuDNN autotuning, CuPy kernels)
    with _GpuSampler(setup.gpu) as c1_gpu:
        c1 = _timed(one, setup.reps)
    c4_requests = 4 * max(1, setup.reps // 2)
    with _GpuSampler(setup.gpu) as c4_gpu, ThreadPoolExecutor(max_workers=4) as pool:
        start = time.perf_counter()
        list(pool.map(one, range(c4_requests)))
        c4_s = time.perf_counter() - start
    predictor = nnunet_predictor(model_dir, folds=folds, mirroring=mirroring, device=setup.device)

    def predict() -> Any:
        predictor.predict_single_npy_array(case.image, {"spacing": list(case.spacing)})
        if setup.gpu:
            torch.cuda.synchronize()

    predict()
    predictor_s = _timed(predict, setup.reps)
    floor = _Floor(repository, folds, 0.5, "cuda:0" if setup.gpu else "cpu")
    floor.run(case, folds, mirroring)  # warm-up
    floor_s = [floor.run(case, folds, mirroring) for _ in range(setup.reps)]
    endpoint, nnunet, net = statistics.median(c1), statistics.median(predictor_s), statistics.median(floor_s)
    throughput_c4, throughput_predictor = c4_requests / c4_s, 1.0 / nnunet
    ratios = {"latency_vs_predictor": endpoint / nnunet, "latency_vs_floor": endpoint / net,
              "throughput_c4_vs_predictor": throughput_c4 / throughput_predictor}
    stage.rows.extend([
        {"measure": "endpoint latency, concurrency 1 (median s)", "value": endpoint, "gpu": c1_gpu.summary()},
        {"measure": "endpoint throughput, concurrency 4 (requests/s)", "value": throughput_c4,
         "gpu": c4_gpu.summary()},
        {"measure": "nnUNetPredictor latency, back to back (median s)", "value": nnunet, "gpu": ""},
        {"measure": "network-only floor (median s of forwards)", "value": net, "gpu": ""},
    ])
    for name, value in ratios.items():
        goal = GOALS[name]
        met = value >= goal if name.startswith("throughput") else value <= goal
        stage.rows.append({"measure": f"ratio {name}", "value": value,
                           "gpu": f"goal {'>=' if name.startswith('throughput') else '<='} {goal}: "
                                  f"{'met' if met else 'missed'}" if setup.gpu else "goal applies on a GPU"})


# --- report ----------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return str(value)


def write_report(setup: Setup, env: dict[str, str], stages: list[Stage]) -> Path:
    lines = [f"# GPU check ({'dry run on CPU tensors' if not setup.gpu else 'device ' + setup.device})", "",
             f"Written by `python -m tools.gpu_check` on {time.strftime('%Y-%m-%d %H:%M')}.", "",
             "| environment | |", "|---|---|", *(f"| {k} | {v} |" for k, v in env.items()), ""]
    for stage in stages:
        lines += [f"## {stage.name}: {stage.status} ({stage.seconds:.1f} s)", ""]
        lines += [f"- {note}" for note in stage.notes]
        if stage.rows:
            keys = list(stage.rows[0])
            lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in stage.rows]
        lines.append("")
    setup.out.mkdir(parents=True, exist_ok=True)
    report = setup.out / "gpu-check.md"
    report.write_text("\n".join(lines))
    (setup.out / "gpu-check.json").write_text(json.dumps(
        {"environment": env, "stages": [stage.__dict__ for stage in stages]}, indent=2, default=str))
    return report


# --- command line ----------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the GPU check; cpu: the dry run (same stages, CPU tensors)")
    p.add_argument("--workload", choices=("fixture", "realistic"), default=None,
                   help="timings workload (default: realistic on cuda, fixture on cpu)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "gpu-check")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per measure")
    p.add_argument("--stages", default="parity,endpoint,timings", help="comma list of stages to run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup = Setup(device=args.device, workload=args.workload or ("realistic" if args.device == "cuda"
                                                                  else "fixture"),
                  out=args.out, reps=max(1, args.reps))
    wanted = set(args.stages.split(","))
    env = environment(setup)
    from tools.perf import workloads

    fixture_dir = workloads.fixture_model_dir()
    fixture = workloads.fixture_case(fixture_dir)
    stages: list[Stage] = []
    if "parity" in wanted:
        with _stage(stages, "(a) parity: NumPy vs device backend") as stage:
            stage_parity(stage, setup, fixture_dir, fixture)
    for name, model_dir, case, run in (
        ("(b) endpoint vs nnUNetPredictor", fixture_dir, fixture, "endpoint"),
        ("(c) timings", None, None, "timings"),
    ):
        if run not in wanted:
            continue
        with _stage(stages, name) as stage:
            _needs("pytriton", "it ships the embedded tritonserver")
            if run == "timings":
                realistic = setup.workload == "realistic"
                model_dir = workloads.ensure_realistic_model() if realistic else fixture_dir
                case = workloads.realistic_case(model_dir, "small") if realistic else fixture
            repository = _repository(setup, model_dir)
            run_dir = setup.out / f"server-{run}"
            run_dir.mkdir(parents=True, exist_ok=True)
            with _server(repository, run_dir) as handle:
                if run == "endpoint":
                    stage_endpoint(stage, setup, model_dir, case, handle)
                else:
                    stage_timings(stage, setup, model_dir, repository, case, handle)
    report = write_report(setup, env, stages)
    print(report.read_text())
    print(f"report: {report}")
    return 0 if all(stage.status != "failed" for stage in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
