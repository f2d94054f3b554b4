"""In-process baselines, each run in its own subprocess so its CPU and memory are measured alone.

``predictor``: nnU-Net's own ``nnUNetPredictor.predict_single_npy_array`` on CPU (what a user would
run without Triton): preprocessing, sliding window over the selected folds (one after another, as
nnU-Net does), export resampling. ``floor``: the network-only floor, the fold TorchScript networks of
the built repository (``fold_<k>/1/model.pt``, loaded through ``nnunet_triton.pipeline.fold_runner`` like the
Python fold runner, one tile per forward) run on the same tiles as the endpoint, mirrored copies
included; only the forwards are timed (preprocessing, tile extraction and flips are not).

A subprocess loads the model once (every fold the jobs need), does ``--warmup`` untimed requests with
the cheapest setting (first fold, no mirroring: loads libraries, oneDNN kernels and thread pools, as
the warm-up request does for the servers), then runs jobs (case, folds, mirroring, repetitions):
given on the command line (``--job``), or one JSON line at a time on stdin (``--serve``, used by
``tools.perf.run`` through :class:`BaselineWorker` to interleave baselines with the server runs).

Usage::

    python -m tools.perf.baselines predictor --model-dir <results folder> \
        --job case.npz 0 false 3 [--job ...] --out predictor.json
    python -m tools.perf.baselines floor --repository <built repository> \
        --job case.npz 0,1 true 3 [--job ...] --out floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from nnunet_triton import io_names
from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE
from tools.perf.resources import ProcessTreeSampler, ResourceUsage
from tools.perf.workloads import Case

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["Job", "BaselineResult", "TilePlan", "tile_plan", "BaselineWorker", "main"]

KINDS = ("predictor", "floor")


@dataclass(frozen=True)
class Job:
    """One baseline configuration: a saved case, the folds, mirroring, timed repetitions."""

    case: Path
    folds: tuple[int | str, ...]
    mirroring: bool
    reps: int

    def argv(self) -> list[str]:
        return ["--job", str(self.case), ",".join(str(f) for f in self.folds), str(self.mirroring).lower(),
                str(self.reps)]

    def to_json(self) -> str:
        return json.dumps({"case": str(self.case), "folds": list(self.folds), "mirroring": self.mirroring,
                           "reps": self.reps})

    @classmethod
    def from_json(cls, text: str) -> Job:
        data = json.loads(text)
        return cls(Path(data["case"]), tuple(data["folds"]), bool(data["mirroring"]), int(data["reps"]))


@dataclass(frozen=True)
class TilePlan:
    """How the endpoint cuts one case: preprocessed shape, tiles, network forwards per request."""

    preprocessed_shape: tuple[int, ...]
    tiles: int
    variants: int

    def forwards(self, n_folds: int) -> int:
        return self.tiles * self.variants * n_folds


@dataclass(frozen=True)
class BaselineResult:
    """Timed repetitions of one job (seconds per request-equivalent)."""

    kind: str
    case: str
    folds: tuple[int | str, ...]
    mirroring: bool
    latencies_s: tuple[float, ...]
    forwards_per_request: int
    tiles: int
    preprocessed_shape: tuple[int, ...]
    torch_threads: int
    cpu_s: float  # process CPU time over the timed repetitions
    peak_rss_mib: float  # process peak RSS at the end of the job (monotonic over jobs)
    loadavg_start: tuple[float, float, float]
    loadavg_end: tuple[float, float, float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.latencies_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "median_s": self.median_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BaselineResult:
        values = {k: v for k, v in data.items() if k != "median_s"}
        for key in ("folds", "latencies_s", "preprocessed_shape", "loadavg_start", "loadavg_end"):
            values[key] = tuple(values[key])
        return cls(**values)


def tile_plan(config: Any, case: Case, *, mirroring: bool,
              tile_step_size: float = DEFAULT_TILE_STEP_SIZE) -> TilePlan:
    """Preprocess ``case`` like the endpoint and count its tiles and mirror variants."""
    from nnunet_triton.numerics.preprocess import preprocess_case
    from nnunet_triton.numerics.sliding_window import mirror_combinations
    from nnunet_triton.numerics.tiling import pad_to_patch, tile_slicers

    data, _ = preprocess_case(case.image, case.spacing, config)
    padded, _ = pad_to_patch(data, config.patch_size)
    tiles = len(tile_slicers(padded.shape[1:], config.patch_size, tile_step_size))
    variants = 1 + (len(mirror_combinations(config.mirror_axes)) if mirroring else 0)
    return TilePlan(tuple(int(s) for s in data.shape[1:]), tiles, variants)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


class _Predictor:
    """nnUNetPredictor (CPU, or CUDA with everything on the device) with every fold the jobs use loaded."""

    def __init__(self, model_dir: Path, folds: Sequence[int | str], tile_step_size: float, device: str
                 ) -> None:
        from nnunet_triton.numerics.model_folder import read_model_folder
        from nnunet_triton.validate.oracle import nnunet_predictor

        self.config = read_model_folder(model_dir, folds=folds)
        self.predictor = nnunet_predictor(model_dir, folds=folds, tile_step_size=tile_step_size,
                                          device=device)
        self.weights = dict(zip(folds, self.predictor.list_of_parameters, strict=True))

    def run(self, case: Case, folds: Sequence[int | str], mirroring: bool) -> None:
        self.predictor.use_mirroring = mirroring
        self.predictor.list_of_parameters = [self.weights[f] for f in folds]
        self.predictor.predict_single_npy_array(case.image, {"spacing": list(case.spacing)})


class _Floor:
    """The repository's fold TorchScript networks on the tiles of a case, forwards timed alone."""

    def __init__(self, repository: Path, folds: Sequence[int | str], tile_step_size: float, device: str
                 ) -> None:
        from nnunet_triton.numerics.plans import InferenceConfig
        from nnunet_triton.pipeline.fold_runner import load_runner

        # the Python runner writes inference_config.json next to model.pt; libtorch folds have none
        self.config = InferenceConfig.load(repository / io_names.PREPROCESS_MODEL / io_names.VERSION_DIR)
        self.step = tile_step_size
        self.device = device
        self.runners = {f: load_runner(repository / io_names.fold_model_name(f) / io_names.VERSION_DIR
                                       / io_names.TORCHSCRIPT_FILE, device=device,
                                       max_forward_batch=1) for f in folds}
        self._tiles: dict[str, list[Any]] = {}

    def _case_tiles(self, case: Case) -> list[Any]:
        import numpy as np
        import torch

        from nnunet_triton.numerics.preprocess import preprocess_case
        from nnunet_triton.numerics.tiling import pad_to_patch, tile_slicers

        if case.name not in self._tiles:
            data, _ = preprocess_case(case.image, case.spacing, self.config)
            padded, _ = pad_to_patch(data, self.config.patch_size)
            slicers = tile_slicers(padded.shape[1:], self.config.patch_size, self.step)
            self._tiles[case.name] = [
                torch.from_numpy(np.ascontiguousarray(padded[(slice(None), *s)])[None]).to(self.device)
                for s in slicers
            ]
        return self._tiles[case.name]

    def _synchronize(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def run(self, case: Case, folds: Sequence[int | str], mirroring: bool) -> float:
        import torch

        from nnunet_triton.numerics.sliding_window import mirror_combinations

        variants = [()] + (mirror_combinations(self.config.mirror_axes) if mirroring else [])
        total = 0.0
        for fold in folds:
            for tile in self._case_tiles(case):
                for variant in variants:
                    x = torch.flip(tile, [a + 2 for a in variant]) if variant else tile
                    self._synchronize()
                    start = time.perf_counter()
                    self.runners[fold].forward(x)
                    self._synchronize()
                    total += time.perf_counter() - start
        return total


def _warm_up(engine: Any, case_file: Path, folds: Sequence[int | str], warmup: int) -> None:
    case = Case.load(case_file)
    for _ in range(warmup):
        engine.run(case, tuple(folds)[:1], False)


def _run_job(kind: str, engine: Any, job: Job, step: float) -> BaselineResult:
    import torch

    case = Case.load(job.case)
    plan = tile_plan(engine.config, case, mirroring=job.mirroring, tile_step_size=step)
    loadavg_start, cpu_start = os.getloadavg(), time.process_time()
    latencies = []
    for _ in range(job.reps):
        start = time.perf_counter()
        forwards_s = engine.run(case, job.folds, job.mirroring)
        latencies.append(forwards_s if kind == "floor" else time.perf_counter() - start)
    return BaselineResult(
        kind="network_floor" if kind == "floor" else "nnUNetPredictor", case=case.name,
        folds=job.folds, mirroring=job.mirroring, latencies_s=tuple(latencies),
        forwards_per_request=plan.forwards(len(job.folds)), tiles=plan.tiles,
        preprocessed_shape=plan.preprocessed_shape, torch_threads=torch.get_num_threads(),
        cpu_s=time.process_time() - cpu_start, peak_rss_mib=_peak_rss_mib(),
        loadavg_start=loadavg_start, loadavg_end=os.getloadavg(),
    )


def _serve(kind: str, engine: Any, step: float, channel: IO[str]) -> None:
    """Answer one JSON job per stdin line with one JSON line on ``channel`` until stdin closes."""
    channel.write(json.dumps({"ready": True}) + "\n")
    channel.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = {"result": _run_job(kind, engine, Job.from_json(line), step).to_dict()}
        except Exception as exc:  # reported to the driver, which records a failed measurement
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        channel.write(json.dumps(reply) + "\n")
        channel.flush()


def _parse_folds(text: str) -> tuple[int | str, ...]:
    return tuple("all" if t == "all" else int(t) for t in text.split(","))


def _parse_job(values: Sequence[str]) -> Job:
    case, folds, mirroring, reps = values
    if mirroring not in ("true", "false") or int(reps) < 1:
        raise argparse.ArgumentTypeError(f"--job CASE FOLDS true|false REPS>=1, got {list(values)}.")
    return Job(Path(case), _parse_folds(folds), mirroring == "true", int(reps))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for kind in KINDS:
        sub = commands.add_parser(kind)
        if kind == "predictor":
            sub.add_argument("--model-dir", "--model", dest="model", type=Path, required=True,
                             help="nnU-Net results folder")
        else:
            sub.add_argument("--repository", type=Path, required=True, help="built model repository")
        sub.add_argument("--job", nargs=4, action="append", default=[],
                         metavar=("CASE_NPZ", "FOLDS", "MIRRORING", "REPS"))
        sub.add_argument("--serve", action="store_true", help="read JSON jobs from stdin (needs --folds)")
        sub.add_argument("--folds", type=_parse_folds, default=None,
                         help="folds to load (default: the jobs')")
        sub.add_argument("--warmup-case", type=Path, default=None, help="default: the first job's case")
        sub.add_argument("--tile-step-size", type=float, default=DEFAULT_TILE_STEP_SIZE)
        sub.add_argument("--device", default="cpu", help="cpu or cuda[:k]")
        sub.add_argument("--warmup", type=int, default=1)
        sub.add_argument("--out", type=Path, default=None, help="JSON results of the --job runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the jobs of one baseline (``--job`` -> ``--out`` JSON list, or ``--serve``)."""
    args = _parser().parse_args(argv)
    jobs = [_parse_job(values) for values in args.job]
    folds: list[int | str] = list(args.folds or ())
    for job in jobs:
        folds += [f for f in job.folds if f not in folds]
    warmup_case = args.warmup_case or (jobs[0].case if jobs else None)
    if not folds or warmup_case is None or (jobs and args.out is None) or (not jobs and not args.serve):
        raise SystemExit("give --job ... --out FILE, or --serve --folds F --warmup-case CASE_NPZ.")
    channel = sys.stdout
    if args.serve:  # keep stdout for the protocol: everything printed (nnU-Net, C libraries) goes to stderr
        channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    if args.command == "predictor":
        engine: Any = _Predictor(args.model, folds, args.tile_step_size, args.device)
    else:
        engine = _Floor(args.repository, folds, args.tile_step_size, args.device)
    _warm_up(engine, warmup_case, folds, args.warmup)
    if args.serve:
        _serve(args.command, engine, args.tile_step_size, channel)
        return 0
    results = [_run_job(args.command, engine, job, args.tile_step_size) for job in jobs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([r.to_dict() for r in results], indent=2))
    for r in results:
        print(f"{r.kind} {r.case} folds={r.folds} mirroring={r.mirroring}: median {r.median_s:.3f} s "
              f"over {len(r.latencies_s)} reps, {r.forwards_per_request} forwards/request")
    return 0


class BaselineWorker:
    """A ``--serve`` subprocess: loaded and warmed up once, then one job at a time, psutil-sampled.

    Args:
        kind: ``predictor`` or ``floor``.
        source: the results folder (predictor) or the built repository (floor).
        folds: every fold the jobs will use (loaded at start).
        warmup_case: ``.npz`` case of the warm-up requests.
    """

    def __init__(self, kind: str, source: Path, folds: Sequence[int | str], warmup_case: Path, *,
                 log_path: Path, device: str = "cpu", warmup: int = 1, start_timeout_s: float = 1800.0
                 ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
        self.kind = kind
        self.command = [sys.executable, "-m", "tools.perf.baselines", kind,
                        "--model-dir" if kind == "predictor" else "--repository", str(source),
                        "--folds", ",".join(str(f) for f in folds), "--warmup-case", str(warmup_case),
                        "--device", device, "--warmup", str(warmup), "--serve"]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        self._process = subprocess.Popen(self.command, cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._process.stdout, selectors.EVENT_READ)
        ready = self._read(start_timeout_s)
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"baseline worker {kind} did not start: {ready}; see {log_path}")

    def _read(self, timeout_s: float) -> dict[str, Any]:
        if not self._selector.select(timeout_s):
            raise TimeoutError(f"baseline worker {self.kind} gave no answer in {timeout_s:.0f} s.")
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"baseline worker {self.kind} exited (code {self._process.poll()}).")
        return json.loads(line)

    def run(self, job: Job, *, timeout_s: float,
            interval_s: float | None = None) -> tuple[BaselineResult, ResourceUsage]:
        """Run one job; returns its result and the worker's resource use during it, sampled every
        ``interval_s`` (default: the sampler's)."""
        sampler = ProcessTreeSampler(self._process.pid, **({} if interval_s is None else
                                                            {"interval_s": interval_s})).start()
        try:
            self._process.stdin.write(job.to_json() + "\n")
            self._process.stdin.flush()
            reply = self._read(timeout_s)
        finally:
            usage = sampler.stop()
        if "error" in reply:
            raise RuntimeError(f"baseline {self.kind} job failed: {reply['error']}")
        return BaselineResult.from_dict(reply["result"]), usage

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._selector.close()
        self._log.close()

    def __enter__(self) -> BaselineWorker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
