"""The prepared GPU check: one script, a Markdown report, on a machine with an NVIDIA GPU (or dry, on CPU).

Usage::

    # the GPU test machine (docs/deploy.md, "GPU check"): one command, every stage in order of value, its
    # report under $OUT as each stage finishes, stopped by itself before its budget (tools.gpu_budget)
    set -o pipefail; PYTHONUNBUFFERED=1 python3 -m tools.gpu_check \
        --bundle build/gpu-bundle/nnunet-gpu-bundle.tar.xz --budget-s 450 --out $OUT 2>&1 \
        | tee $OUT/gpu-check.log
    # the dry run (tests/triton/test_gpu_check_dry_run.py): the same stages on CPU tensors, from the bundle
    python -m tools.gpu_check --device cpu --bundle build/gpu-bundle/nnunet-gpu-bundle.tar.xz \
        --emulate-device --budget-s 2400

Needs torch (a CUDA build on cuda), CuPy on cuda, and either this venv (``make setup``) or the bundle
(``make gpu-bundle``, ``tools.gpu_bundle``): with ``--bundle`` the file is unpacked into a temporary folder,
its packages go first on ``sys.path`` and the stubs' ``PYTHONPATH``, and tritonserver, its libraries and the
Python-backend stub come from it (never from an installed pytriton); its fixture cases are ``.npy``, so no
SimpleITK is needed (``tools.gpu_env.guard_simpleitk``). No Docker, no network. The report is rewritten
after every stage, and a stage the budget cuts short is written as ``stopped (budget)``. Exit status
(``tools.gpu_budget.exit_status``): 1 when a stage fails or a goal is missed on cuda (``tools.gpu_goals``),
else 3 when the budget stopped or skipped a stage, else 0.

Stages:

(a) ``parity``: every preprocessing, resampling, sliding-window and export function on the committed fixture,
    NumPy against the device backend (CuPy on cuda; the sliding window on torch tensors of the device), max
    abs differences. On ``--device cpu`` the xp functions compare NumPy with itself (the stage still runs)
    and the sliding window compares torch CPU tensors with the NumPy emulation: both must be exact.
(b) ``endpoint``: the whole ``nnunet`` endpoint on the embedded tritonserver with GPU instances
    (``--target gpu`` with the builder's defaults, Python-backend fold runner: the embedded server has no
    libtorch backend) against ``nnUNetPredictor`` on the device (``perform_everything_on_device=True`` on
    cuda): per-label Dice, voxel agreement, max probability difference, mirroring on and off. Goal on cuda:
    Dice >= 0.999 per label; on cpu: identical label maps. Then where tritonserver and each stub came from
    and which libpython they mapped (``/proc``); with ``--bundle`` every one must come from the bundle and no
    process may have SimpleITK mapped.
(c) ``timings`` (``tools.gpu_timings``): a volume of at least 2x2x2 tiles of the workload's model
    (``realistic``: nnU-Net's default plans, weights made on the device; ``fixture``: the 3d_tiny model),
    every fold batch size warmed, latency at concurrency 1, throughput at concurrency 4 over ``--waves``
    waves, nnUNetPredictor back to back, the batched network floor, the fold models' batch statistics and
    the ``nnunet_host_fallbacks_total`` counter, each against its goal (enforced on cuda).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tools.gpu_goals import DICE_GOAL, NEAR_TIE_FP16_STEPS, NEAR_TIE_LOGIT_GAP, compare_confident

REPO_ROOT = Path(__file__).resolve().parents[1]

LOGGER = logging.getLogger("gpu_check")
UNPACKED_ENV = "NNUNET_TRITON_GPU_BUNDLE_UNPACKED"  # the temporary folder the bundle was unpacked into
LIBPYTHON_ENV = "NNUNET_TRITON_GPU_BUNDLE_LIBPYTHON"  # the stub's libpython plan, for the report
START_ENV = "NNUNET_TRITON_GPU_CHECK_START"  # time.monotonic() when the command started (the budget's start)


@dataclass
class Stage:
    """One stage's outcome: ``status`` ok | failed | skipped, its rows, and why."""

    name: str
    status: str = "ok"
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    finished: bool = False  # False while it runs: the budget's watchdog marks it stopped
    started: float = 0.0  # time.perf_counter() at its start


@dataclass(frozen=True)
class Setup:
    device: str  # "cuda" or "cpu"
    workload: str  # "fixture" or "realistic"
    out: Path
    reps: int
    waves: int = 3
    bundle_root: Path | None = None  # the unpacked bundle, when --bundle

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")


@contextlib.contextmanager
def _stage(stages: list[Stage], name: str) -> Iterator[Stage]:
    stage = Stage(name, started=time.perf_counter())
    stages.append(stage)
    start = stage.started
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
        stage.finished = True
        LOGGER.info("stage %s: %s (%.1f s)", name, stage.status, stage.seconds)


class _Skip(Exception):
    pass


def _needs(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise _Skip(f"{module} is not installed ({why})")


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


def _repository(setup: Setup, model_dir: Path) -> Path:
    import torch

    from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner
    from nnunet_triton.builder.torch_compat import torch_minor_text
    from tools.perf.repos import pipeline_repository

    if setup.gpu:  # the embedded server has the Python backend only: the Python fold runner, on KIND_GPU;
        # fp16 (traced under CUDA autocast, what `make deploy TARGET=docker` builds and nnU-Net runs on cuda)
        # orchestrator instances and fold batch limits: the builder's defaults for target gpu, read back
        # from the served configs by the timings stage (nothing assumed here)
        options = BuildOptions(target="gpu", fold_runner=FoldRunner.PYTHON, fold_precision="fp16",
                               serving_torch=torch_minor_text(torch.__version__))
    else:  # the dry run: 4 orchestrator instances so that concurrent requests can share fold batches
        options = BuildOptions(orchestrator_instances=4)
    return pipeline_repository(model_dir, f"gpu-check-{setup.workload}", variant=setup.device,
                               options=options)


@contextlib.contextmanager
def _server(repository: Path, out: Path, name: str, live: list[Any]) -> Iterator[Any]:
    """The embedded server on ``repository``: its logs in ``out`` (few files: the GPU machine returns at
    most 8), pid and state files in a temporary folder; listed in ``live`` while it runs (the budget's
    watchdog kills what is listed there)."""
    from nnunet_triton.server import embedded

    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as run:
        handle = embedded.start(repository, log_file=out / f"tritonserver-{name}.log",
                                pid_file=Path(run) / "tritonserver.pid", state_file=Path(run) / "server.json",
                                ready_timeout_s=900.0, exit_timeout_s=5, metrics=True)  # gpu_timings scrapes
        live.append(handle)
        try:
            yield handle
        finally:
            live.remove(handle)
            handle.stop()


def stage_endpoint(stage: Stage, setup: Setup, model_dir: Path, case: Any, handle: Any) -> None:
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.validate.compare import compare_case, segmentation_labels
    from nnunet_triton.validate.oracle import nnunet_predictor

    config = read_model_folder(model_dir)
    labels = segmentation_labels(config.labels.label_names, config.labels.regions_class_order)
    regions = bool(config.labels.regions_class_order)
    stage.notes.append(f"near-tie: the reference's top two logits within {NEAR_TIE_FP16_STEPS} fp16 steps "
                       f"({NEAR_TIE_LOGIT_GAP:g}); the Dice goal counts the other voxels")
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
            split = compare_confident(case.name, ref_seg, result.segmentation, ref_probs, labels,
                                      case.spacing, regions=regions)
            dice = split.confident.min_dice
            ok = dice >= DICE_GOAL if setup.gpu else comparison.differing_voxels == 0
            stage.rows.append({
                "mirroring": mirroring, "min_dice_confident": dice,
                "dice_confident": {label.value: round(label.dice, 6) for label in split.confident.labels},
                "min_dice_all_voxels": comparison.min_dice, "agreement": comparison.agreement,
                "differing_voxels": comparison.differing_voxels, "near_tie_voxels": split.near_tie_voxels,
                "differing_near_ties": split.differing_near_tie_voxels,
                "max_probability_difference": comparison.max_probability_difference,
                "goal": f"Dice >= {DICE_GOAL} outside near-ties" if setup.gpu else "identical labels",
                "ok": ok})
    if not all(r["ok"] for r in stage.rows):
        stage.status = "failed"


def stage_provenance(stage: Stage, setup: Setup, handle: Any) -> None:
    """Where tritonserver and its stubs came from (``/proc``); with a bundle, all of it must be the bundle's,
    and no process may have SimpleITK mapped."""
    from tools.gpu_env import process_provenance

    home = Path(handle.server_bin).parents[2]  # <home>/server/bin/tritonserver
    marker = json.loads((home / "server" / ".prepared.json").read_text())
    stage.notes.append(f"tritonserver {handle.server_bin}, home prepared from {marker['source']} "
                       f"(nvidia-pytriton {marker['pytriton']}, Python {marker['python']})")
    root = str(setup.bundle_root) if setup.bundle_root is not None else None
    for row in process_provenance(handle.pid):
        problems = ["SimpleITK mapped"] if row["simpleitk"] else []
        if root is not None:
            problems += [] if row["exe"].startswith(root) else ["executable not from the bundle"]
            problems += [] if all(p.startswith(root) for p in row["libtritonserver"]) else \
                ["libtritonserver not from the bundle"]
        stage.rows.append({"process": "tritonserver" if row["exe"].endswith("/tritonserver") else
                           f"stub {row['model']}", "pid": row["pid"], "exe": row["exe"],
                           "libpython": ", ".join(row["libpython"]) or "-",
                           "libtritonserver": ", ".join(row["libtritonserver"]) or "-",
                           "simpleitk": ", ".join(row["simpleitk"]) or "none",
                           "ok": not problems, "problems": "; ".join(problems)})
    if root is not None and not marker["source"].startswith(root):
        stage.notes.append(f"the server home was prepared from {marker['source']}, not from the bundle")
        stage.status = "failed"
    if not any(r["process"].startswith("stub") for r in stage.rows):
        stage.notes.append("no Python-backend stub process found under tritonserver")
        stage.status = "failed"
    if not all(r["ok"] for r in stage.rows):
        stage.status = "failed"


def _fmt(value: Any) -> str:
    if value is None:  # a parity row that compared nothing (NumPy with NumPy)
        return "skipped"
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
    p.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "gpu-check", help="report folder")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per measure")
    p.add_argument("--waves", type=int, default=3,
                   help="waves of 4 concurrent requests in the throughput run")
    p.add_argument("--stages", default="parity,endpoint,timings",
                   help="comma list of stages to run (always in the order parity, endpoint, timings)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop by this many seconds after the start: a stage starts only when the time left "
                        "covers its minimum (tools.gpu_budget), a running one is stopped with its section "
                        "written; exit 3 when the budget cut a stage short")
    p.add_argument("--bundle", type=Path, default=None,
                   help="run from this bundle (make gpu-bundle): server, stubs, packages, cases, plans")
    p.add_argument("--unpack-dir", type=Path, default=None, help="where the bundle's temporary folder goes")
    p.add_argument("--keep-unpacked", action="store_true", help="keep the unpacked bundle")
    p.add_argument("--libpython", choices=("auto", "bundle"), default="auto",
                   help="the stub's libpython: the machine's if it has one (auto), or the bundle's fallback")
    p.add_argument("--emulate-device", action="store_true",
                   help="dry run: refuse imports of packages the GPU machine lacks and the bundle does not "
                        "carry, and run without SimpleITK")
    return p


def _run_from_bundle(args: argparse.Namespace, argv: list[str]) -> None:
    """Unpack the bundle and run this command again in a process started from it (its paths and libpython
    in the environment: nothing of this process's import paths is changed); does not return."""
    from tools import gpu_bundle

    dest = Path(tempfile.mkdtemp(prefix="nnunet-gpu-bundle-", dir=args.unpack_dir))
    root = gpu_bundle.unpack(args.bundle, dest)
    activation = gpu_bundle.activation_env(root, libpython=args.libpython)
    env = {**activation.env, UNPACKED_ENV: str(dest), LIBPYTHON_ENV: json.dumps(asdict(activation.libpython)),
           START_ENV: os.environ.get(START_ENV, repr(args.started))}
    os.execve(sys.executable, [sys.executable, "-m", "tools.gpu_check", *argv], env)


def _bundle_in_use(args: argparse.Namespace, stack: contextlib.ExitStack, env: dict[str, str]) -> Path:
    """The bundle this process was started from (by :func:`_run_from_bundle`), checked and noted."""
    from nnunet_triton.server.triton_install import HOME_ENV
    from tools import gpu_bundle

    root = Path(os.environ[gpu_bundle.ACTIVE_ENV])
    if not args.keep_unpacked:
        stack.callback(shutil.rmtree, os.environ.get(UNPACKED_ENV, str(root)), True)
    gpu_bundle.check_active(root)
    os.environ[HOME_ENV] = str(root / "triton-home")  # never a home prepared from another tritonserver
    manifest = json.loads((root / "MANIFEST.json").read_text())
    libpython = json.loads(os.environ.get(LIBPYTHON_ENV, "{}"))
    env.update({"bundle": f"{args.bundle} ({args.bundle.stat().st_size / 2**20:.1f} MiB) unpacked in {root}",
                "bundle inputs": manifest["inputs_digest"][:16],
                "libpython for the stub": f"{libpython.get('path')} ({libpython.get('source')})"})
    return root


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tools import gpu_budget
    from tools.gpu_bundle import ACTIVE_ENV

    wanted = gpu_budget.ordered_stages(args.stages.split(","))
    # the budget counts from this command's start, the bundle's unpacking before the re-exec included
    args.started = float(os.environ.get(START_ENV, time.monotonic()))
    if args.bundle is not None and ACTIVE_ENV not in os.environ:
        _run_from_bundle(args, argv)
    budget = gpu_budget.Budget(args.budget_s, start=args.started)
    with contextlib.ExitStack() as stack:
        extra: dict[str, str] = {}
        root = _bundle_in_use(args, stack, extra) if args.bundle is not None else None
        from tools.gpu_env import DeviceOnly, guard_simpleitk

        emulation = None
        if args.emulate_device:
            from tools import gpu_bundle

            allowed = {*gpu_bundle.DEVICE_PACKAGES, *gpu_bundle.DEVICE_PURE, *gpu_bundle.DEVICE_COMPILED,
                       "nvidia-pytriton", "nnunet-triton"}
            emulation = DeviceOnly(allowed).install()
        extra["SimpleITK"] = guard_simpleitk(force=args.emulate_device)  # ahead of the emulation's finder
        setup = Setup(device=args.device, workload=args.workload or ("realistic" if args.device == "cuda"
                                                                      else "fixture"),
                      out=args.out, reps=max(1, args.reps), waves=args.waves, bundle_root=root)
        env = {**environment(setup), **extra,
               "budget": "none" if args.budget_s is None else f"{args.budget_s:g} s "
                         f"(stages stop {budget.reserve_s:g} s before its end)"}
        stages: list[Stage] = []
        live: list[Any] = []

        def report() -> Path:
            if emulation is not None:
                refused = ", ".join(sorted(emulation.refused)) or "none"
                env["imports refused (not on the GPU machine)"] = refused
            return write_report(setup, env, stages)

        stack.callback(_cancel, budget.watchdog(lambda: _stop_on_budget(stages, report, live)))
        _run_stages(setup, wanted, stages, report, budget, live)
        report_file = report()
    print(report_file.read_text())
    print(f"report: {report_file}")
    return gpu_budget.exit_status(stage.status for stage in stages)


def _cancel(timer: Any) -> None:
    if timer is not None:
        timer.cancel()


def _stop_on_budget(stages: list[Stage], report: Any, live: list[Any]) -> None:
    """The budget's watchdog (its own thread): mark the running stage stopped, write the report, kill the
    servers (their process groups: tritonserver and its stubs) and exit with ``EXIT_BUDGET``."""
    import signal

    from tools.gpu_budget import BUDGET_STOPPED, EXIT_BUDGET

    for stage in stages:
        if not stage.finished:
            stage.status, stage.seconds = BUDGET_STOPPED, time.perf_counter() - stage.started
            stage.notes.append("the budget ran out while this stage ran; its rows so far are above")
    try:
        report_file = report()
        print(report_file.read_text(), flush=True)
    finally:
        for handle in list(live):
            with contextlib.suppress(OSError):
                os.killpg(handle.pid, signal.SIGKILL)
        LOGGER.error("budget spent: stopped (exit %d)", EXIT_BUDGET)
        logging.shutdown()
        os._exit(EXIT_BUDGET)  # the main thread may be blocked in a request: no orderly unwinding


STAGE_TITLES = {"parity": "(a) parity: NumPy vs device backend",
                "endpoint": "(b) endpoint vs nnUNetPredictor", "timings": "(c) timings"}


def _run_stages(setup: Setup, wanted: list[str], stages: list[Stage], report: Any, budget: Any,
                live: list[Any]) -> None:
    """Run ``wanted`` (in ``gpu_budget.STAGE_ORDER``), each only if the budget allows it, and rewrite the
    report after each, so that its section is under ``--out`` as soon as it finished."""
    from nnunet_triton import io_names
    from nnunet_triton.numerics.model_folder import read_model_folder
    from tools import gpu_budget, gpu_bundle, gpu_parity, gpu_timings
    from tools.perf import workloads

    fixture_dir = workloads.fixture_model_dir()
    fixture = (gpu_bundle.fixture_cases(setup.bundle_root)[0] if setup.bundle_root is not None
               else workloads.fixture_case(fixture_dir))  # the latter reads NIfTI with SimpleITK

    def parity() -> None:
        with _stage(stages, STAGE_TITLES["parity"]) as stage:
            fold = io_names.fold_model_name(read_model_folder(fixture_dir).folds[0])  # what (b) serves
            version_dir = _repository(setup, fixture_dir) / fold / io_names.VERSION_DIR
            torchscript = version_dir / io_names.TORCHSCRIPT_FILE
            gpu_parity.stage_parity(stage, setup, fixture_dir, fixture, _device_xp(setup), torchscript)

    def endpoint() -> None:
        with _stage(stages, STAGE_TITLES["endpoint"]) as stage:
            _needs("pytriton", "it ships the embedded tritonserver")
            with _server(_repository(setup, fixture_dir), setup.out, "endpoint", live) as handle:
                stage_endpoint(stage, setup, fixture_dir, fixture, handle)
                with _stage(stages, "(b) provenance: tritonserver and its stubs") as inner:
                    stage_provenance(inner, setup, handle)

    def timings() -> None:
        with _stage(stages, STAGE_TITLES["timings"]) as stage:
            _needs("pytriton", "it ships the embedded tritonserver")
            if setup.workload == "realistic":
                model_dir = (gpu_bundle.materialize_realistic_model(setup.bundle_root)
                             if setup.bundle_root is not None else workloads.ensure_realistic_model())
            else:
                model_dir = fixture_dir
            case = gpu_timings.cube_case(model_dir)
            repository = _repository(setup, model_dir)
            with _server(repository, setup.out, "timings", live) as handle:
                gpu_timings.stage_timings(stage, setup, model_dir, repository, case, handle)

    runners = {"parity": parity, "endpoint": endpoint, "timings": timings}
    for name in wanted:
        if budget.allows(name):
            runners[name]()
        else:
            why = (f"{max(0.0, budget.left_s()):.0f} s of the budget left, the stage needs at least "
                   f"{gpu_budget.MIN_STAGE_SECONDS[name]:g} s: rerun it with --stages {name}")
            stages.append(Stage(STAGE_TITLES[name], status=gpu_budget.BUDGET_NOT_STARTED, notes=[why],
                                finished=True))
        report()


if __name__ == "__main__":
    sys.exit(main())
