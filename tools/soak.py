"""Bounded soak of the ``nnunet`` endpoint: mixed valid and invalid requests, answers checked, memory sampled.

``python tools/soak.py --duration 600 --concurrency 4`` starts the embedded server on loopback (or uses
``--url``), runs ``concurrency`` client threads for ``duration`` seconds, and:

* checks every valid answer bit for bit against nnU-Net's segmentation of the same case, computed once
  with ``nnUNetPredictor.predict_single_npy_array`` (CPU, same options);
* checks every invalid request is answered with INVALID_ARG (HTTP 400 / gRPC INVALID_ARGUMENT);
* samples the RSS of ``tritonserver`` and of each Python-backend stub (its child processes) and the
  ``/dev/shm`` bytes those processes map, every ``--sample-interval`` seconds;
* reports growth after warmup (median of the last 3 samples vs. median of the first 3 after warmup) as
  ``<out>/soak_report.json`` and ``<out>/soak_report.md``.

Exit status: 0 when every answer was right and growth <= ``--growth-threshold``; 1 on any wrong answer
or unexpected error; 2 on growth over the threshold (when both, 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.util.retry import TritonCode, triton_code

REPO_ROOT = Path(__file__).resolve().parents[1]

LOGGER = logging.getLogger("soak")
DEFAULT_MODEL = (
    REPO_ROOT / "tests" / "fixtures" / "Dataset901_SynthCT" / "nnUNetTrainer__nnUNetPlans__3d_tiny"
)
DEFAULT_OUT = REPO_ROOT / "build" / "soak"


@dataclass(frozen=True)
class Job:
    """One kind of request: inputs, options and what the answer must be."""

    name: str
    image: np.ndarray
    spacing: np.ndarray
    parameters: dict[str, Any]
    expected: np.ndarray | None  # the segmentation for a valid job; None = INVALID_ARG expected
    outputs: tuple[str, ...] = ("SEGMENTATION",)


@dataclass(frozen=True)
class Sample:
    """One memory sample."""

    t_s: float
    server_rss: int
    stub_rss: dict[str, int]
    shm_bytes: int
    devshm_used_bytes: int

    @property
    def total_rss(self) -> int:
        return self.server_rss + sum(self.stub_rss.values())


@dataclass
class Tally:
    """Counters shared by the client threads (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, job: str, outcome: str, latency_s: float, detail: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            self.counts[f"{job}:{outcome}"] += 1
            self.latencies.setdefault(job, []).append(latency_s)
            if detail is not None and len(self.failures) < 50:
                self.failures.append(f"{job}: {detail}")


# --- inputs and references ------------------------------------------------------------------------


def _first_case(model_dir: Path) -> tuple[np.ndarray, tuple[float, ...]]:
    import SimpleITK as sitk

    first = sorted((model_dir.parent / "imagesTs").glob("*_0000.nii.gz"))
    if not first:
        raise FileNotFoundError(f"no imagesTs/*_0000.nii.gz next to {model_dir}")
    name = first[0].name[: -len("_0000.nii.gz")]
    channels = sorted((model_dir.parent / "imagesTs").glob(f"{name}_[0-9][0-9][0-9][0-9].nii.gz"))
    images = [sitk.ReadImage(str(f)) for f in channels]
    image = np.stack([sitk.GetArrayFromImage(i) for i in images]).astype(np.float32)
    return image, tuple(float(s) for s in reversed(images[0].GetSpacing()))


def _nnunet_segmentation(model_dir: Path, image: np.ndarray, spacing: Sequence[float]) -> np.ndarray:
    """nnU-Net's answer (no mirroring, step 0.5, all folds, CPU): the reference for valid requests."""
    import torch

    from nnunet_triton.validate.oracle import nnunet_predictor

    predictor = nnunet_predictor(model_dir, mirroring=False)
    with torch.no_grad():
        return np.asarray(predictor.predict_single_npy_array(image, {"spacing": list(spacing)}))


def make_jobs(model_dir: Path) -> list[Job]:
    """Two valid crops of the first test case (references from nnU-Net) and six invalid requests."""
    image, spacing = _first_case(model_dir)
    spacing_arr = np.asarray(spacing, np.float64)
    crops = {
        "valid_crop_a": (slice(None), slice(0, 12), slice(0, 24), slice(0, 24)),
        "valid_crop_b": (slice(None), slice(8, 24), slice(10, 40), slice(12, 40)),
    }
    no_mirroring = {"mirroring": False}
    jobs = []
    for name, crop in crops.items():
        crop_image = np.ascontiguousarray(image[crop])
        LOGGER.info("computing nnU-Net's reference for %s %s", name, crop_image.shape)
        expected = _nnunet_segmentation(model_dir, crop_image, spacing)
        jobs.append(Job(name, crop_image, spacing_arr, no_mirroring, expected))
    small = jobs[0].image
    nan_image = small.copy()
    nan_image[0, 1, 2, 3] = np.nan
    jobs += [
        Job("invalid_nan_voxel", nan_image, spacing_arr, no_mirroring, None),
        Job("invalid_spacing_zero", small, np.array([spacing[0], 0.0, spacing[2]]), no_mirroring, None),
        Job("invalid_tile_step_size", small, spacing_arr, {"mirroring": False, "tile_step_size": 0.0}, None),
        Job("invalid_unknown_option", small, spacing_arr, {"mirroring": False, "tile_size": 1}, None),
        Job("invalid_two_channels", np.concatenate([small, small]), spacing_arr, no_mirroring, None),
        Job(
            "invalid_output_name", small, spacing_arr, no_mirroring, None, outputs=("SEGMENTATION", "LOGITS")
        ),
    ]
    return jobs


# --- requests ---------------------------------------------------------------------------------------


class Worker:
    """One client thread with its own connection (HTTP or gRPC)."""

    def __init__(self, url: str, protocol: str, timeout_s: float) -> None:
        if protocol == "http":
            import tritonclient.http as module

            self.client = module.InferenceServerClient(url, network_timeout=timeout_s, connection_timeout=60)
        else:
            import tritonclient.grpc as module

            self.client = module.InferenceServerClient(url)
        self.module, self.protocol, self.timeout_s = module, protocol, timeout_s

    def infer(self, job: Job) -> np.ndarray:
        binary = {"binary_data": True} if self.protocol == "http" else {}
        image = self.module.InferInput("IMAGE", list(job.image.shape), "FP32")
        image.set_data_from_numpy(job.image, **binary)
        spacing = self.module.InferInput("SPACING", list(job.spacing.shape), "FP64")
        spacing.set_data_from_numpy(job.spacing, **binary)
        outputs = [self.module.InferRequestedOutput(n, **binary) for n in job.outputs]
        kwargs = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
        result = self.client.infer(
            "nnunet", [image, spacing], outputs=outputs, parameters=job.parameters, **kwargs
        )
        return result.as_numpy("SEGMENTATION")

    def close(self) -> None:
        self.client.close()


def run_one(worker: Worker, job: Job, tally: Tally) -> None:
    from tritonclient.utils import InferenceServerException

    start = time.perf_counter()
    try:
        segmentation = worker.infer(job)
    except InferenceServerException as exc:
        elapsed = time.perf_counter() - start
        status = str(exc.status())
        if job.expected is None and triton_code(status) is TritonCode.INVALID_ARG:
            tally.add(job.name, "invalid_rejected", elapsed)
        else:
            tally.add(job.name, "unexpected_error", elapsed, f"{worker.protocol} {status}: {exc.message()}")
        return
    except Exception as exc:  # transport failure: the server did not answer
        tally.add(job.name, "unexpected_error", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
        return
    elapsed = time.perf_counter() - start
    if job.expected is None:
        tally.add(job.name, "invalid_accepted", elapsed, "an invalid request was answered with a result")
    elif segmentation is None or segmentation.shape != job.expected.shape:
        tally.add(job.name, "wrong_answer", elapsed, f"shape {getattr(segmentation, 'shape', None)}")
    elif not np.array_equal(segmentation, job.expected):
        differ = int((segmentation != job.expected).sum())
        tally.add(job.name, "wrong_answer", elapsed, f"{differ} voxels differ from nnU-Net")
    else:
        tally.add(job.name, "valid_ok", elapsed)


def client_loop(
    index: int,
    url: dict[str, str],
    jobs: Sequence[Job],
    invalid_every: int,
    stop: threading.Event,
    tally: Tally,
    timeout_s: float,
) -> None:
    protocol = "http" if index % 2 == 0 else "grpc"
    worker = Worker(url[protocol], protocol, timeout_s)
    valid = [j for j in jobs if j.expected is not None]
    invalid = [j for j in jobs if j.expected is None]
    n = index  # threads start at different points of the mix
    try:
        while not stop.is_set():
            if invalid and n % invalid_every == invalid_every - 1:
                job = invalid[(n // invalid_every) % len(invalid)]
            else:
                job = valid[n % len(valid)]
            run_one(worker, job, tally)
            n += 1
    finally:
        worker.close()


# --- memory sampling --------------------------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return sorted(set(found))


def _stub_label(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return f"pid{pid}"
    for arg in args:  # the stub's first argument is the model's model.py path: .../<model>/1/model.py
        text = arg.decode(errors="replace")
        if text.endswith("model.py"):
            return f"{Path(text).parents[1].name}[{pid}]"
    return f"pid{pid}"


def _mapped_shm_bytes(pids: Sequence[int]) -> int:
    """Allocated bytes of the /dev/shm files mapped by ``pids`` (the Python backend's regions)."""
    files = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    files.add(parts[5].removesuffix(" (deleted)"))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    total = 0
    for path in files:
        try:
            total += os.stat(path).st_blocks * 512
        except FileNotFoundError:
            continue
    return total


def sample_memory(server_pid: int, t0: float) -> Sample:
    stubs = _children(server_pid)
    vfs = os.statvfs("/dev/shm")
    return Sample(
        t_s=round(time.monotonic() - t0, 2),
        server_rss=_rss_bytes(server_pid),
        stub_rss={_stub_label(p): _rss_bytes(p) for p in stubs},
        shm_bytes=_mapped_shm_bytes([server_pid, *stubs]),
        devshm_used_bytes=(vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize,
    )


def _growth(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    k = min(3, len(values) // 2) or 1
    base, last = statistics.median(values[:k]), statistics.median(values[-k:])
    return None if base <= 0 else (last - base) / base


# --- report -----------------------------------------------------------------------------------------


def build_report(
    args: argparse.Namespace, tally: Tally, samples: list[Sample], elapsed_s: float
) -> dict[str, Any]:
    after = [s for s in samples if s.t_s >= args.warmup]
    stub_names = sorted({name for s in after for name in s.stub_rss})
    growth = {
        "total_rss": _growth([s.total_rss for s in after]),
        "server_rss": _growth([s.server_rss for s in after]),
        "shm_bytes": _growth([s.shm_bytes for s in after]),
        **{f"stub_rss:{n}": _growth([s.stub_rss.get(n, 0) for s in after]) for n in stub_names},
    }
    latency = {
        job: {"n": len(v), "median_s": round(statistics.median(v), 3), "max_s": round(max(v), 3)}
        for job, v in sorted(tally.latencies.items())
    }
    counts = dict(sorted(tally.counts.items()))
    checked = ("total_rss", "shm_bytes")
    over = [k for k in checked if growth[k] is not None and growth[k] > args.growth_threshold]
    wrong = (
        counts.get("wrong_answer", 0) + counts.get("unexpected_error", 0) + counts.get("invalid_accepted", 0)
    )
    return {
        "duration_s": round(elapsed_s, 1),
        "concurrency": args.concurrency,
        "warmup_s": args.warmup,
        "requests": sum(v for k, v in counts.items() if ":" not in k),
        "counts": counts,
        "wrong_or_unexpected": wrong,
        "failures": tally.failures,
        "latency": latency,
        "growth_after_warmup": {k: (None if v is None else round(v, 4)) for k, v in growth.items()},
        "growth_threshold": args.growth_threshold,
        "growth_checked": list(checked),
        "growth_over_threshold": over,
        "samples_after_warmup": len(after),
        "samples": [asdict(s) | {"total_rss": s.total_rss} for s in samples],
        "passed": wrong == 0 and not over,
    }


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def write_markdown(report: dict[str, Any], path: Path) -> None:
    samples = report["samples"]
    after = [s for s in samples if s["t_s"] >= report["warmup_s"]] or samples
    first, last = (after[0], after[-1]) if after else ({}, {})
    lines = [
        "# Soak report",
        "",
        f"- duration {report['duration_s']} s at concurrency {report['concurrency']} "
        f"(warmup {report['warmup_s']} s), {report['requests']} requests",
        f"- wrong answers / unexpected errors: **{report['wrong_or_unexpected']}**",
        f"- growth after warmup (threshold {report['growth_threshold']:.0%}, checked "
        f"{', '.join(report['growth_checked'])}): over = {report['growth_over_threshold'] or 'none'}",
        f"- result: **{'PASS' if report['passed'] else 'FAIL'}**",
        "",
        "| outcome | count |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in report["counts"].items()),
        "",
        "| request kind | n | median s | max s |",
        "|---|---|---|---|",
        *(f"| {k} | {v['n']} | {v['median_s']} | {v['max_s']} |" for k, v in report["latency"].items()),
        "",
        "| memory | first after warmup (MiB) | last (MiB) | growth |",
        "|---|---|---|---|",
    ]
    for key in ("total_rss", "server_rss", "shm_bytes"):
        growth = report["growth_after_warmup"][key]
        lines.append(
            f"| {key} | {_mib(first.get(key, 0))} | {_mib(last.get(key, 0))} | "
            f"{'n/a' if growth is None else f'{growth:+.2%}'} |"
        )
    for name in sorted(last.get("stub_rss", {})):
        growth = report["growth_after_warmup"].get(f"stub_rss:{name}")
        lines.append(
            f"| stub {name} | {_mib(first['stub_rss'].get(name, 0))} | {_mib(last['stub_rss'][name])} | "
            f"{'n/a' if growth is None else f'{growth:+.2%}'} |"
        )
    if report["failures"]:
        lines += ["", "## First failures", "", *(f"- {f}" for f in report["failures"])]
    path.write_text("\n".join(lines) + "\n")


# --- main -------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir",
        "--model",
        dest="model",
        type=Path,
        default=DEFAULT_MODEL,
        help="nnU-Net results folder (with its "
        "dataset's imagesTs next to it); default: the SynthCT test fixture",
    )
    parser.add_argument(
        "--repository",
        type=Path,
        default=None,
        help="built model repository (default build/test-repositories/<dataset>, built if needed)",
    )
    parser.add_argument(
        "--url", default=None, help="HTTP host:port of a running server (else one is started)"
    )
    parser.add_argument("--grpc-url", default=None, help="gRPC host:port of that server")
    parser.add_argument("--server-pid", type=int, default=None, help="pid of that server (memory sampling)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds excluded from growth (default: 20%% of duration)"
    )
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument(
        "--invalid-every", type=int, default=4, help="every n-th request is invalid (default 4)"
    )
    parser.add_argument("--growth-threshold", type=float, default=0.05, help="max growth after warmup (0.05)")
    parser.add_argument("--timeout", type=float, default=900.0, help="per-request client timeout, seconds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report folder (default build/soak)")
    return parser


def _start_server(args: argparse.Namespace) -> Any:
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.builder.repository import build_repository
    from nnunet_triton.parameters import DEFAULT_MAX_INFLIGHT, DEFAULT_TILE_BATCH_SIZE
    from nnunet_triton.server import embedded as embedded_server
    from nnunet_triton.server import readiness

    repository = args.repository
    if repository is None:
        # same build options as tests/triton/pipeline_support.py (nnU-Net-exact CPU settings), so both
        # share one built repository and the builder's no-op check
        options = BuildOptions(
            tile_batch_size=DEFAULT_TILE_BATCH_SIZE, per_sample_forward=True,
            max_inflight=DEFAULT_MAX_INFLIGHT,
        )
        dataset = args.model.parent.name
        repository = build_repository(
            args.model, REPO_ROOT / "build" / "test-repositories" / dataset, options=options
        ).out
    run = args.out / "server"
    return embedded_server.start(
        repository,
        log_file=run / "tritonserver.log",
        pid_file=run / "tritonserver.pid",
        state_file=run / "server.json",
        ready_timeout_s=readiness.READY_TIMEOUT_S,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak; write ``<out>/soak_report.{json,md}``; exit 0 / 1 (wrong answers) / 2 (growth)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.concurrency < 1 or args.duration <= 0 or args.invalid_every < 2:
        raise SystemExit("--concurrency must be >= 1, --duration > 0, --invalid-every >= 2")
    if args.warmup is None:
        args.warmup = round(0.2 * args.duration, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(args.model)
    handle = None
    if args.url is None:
        handle = _start_server(args)
        urls, server_pid = {"http": handle.http_url, "grpc": handle.grpc_url}, handle.pid
    else:
        urls, server_pid = {"http": args.url, "grpc": args.grpc_url or args.url}, args.server_pid
    tally, samples, stop = Tally(), [], threading.Event()
    try:
        t0 = time.monotonic()
        threads = [
            threading.Thread(
                target=client_loop,
                name=f"soak-{i}",
                daemon=True,
                args=(i, urls, jobs, args.invalid_every, stop, tally, args.timeout),
            )
            for i in range(args.concurrency)
        ]
        for thread in threads:
            thread.start()
        while time.monotonic() - t0 < args.duration:
            if server_pid is not None:
                samples.append(sample_memory(server_pid, t0))
            LOGGER.info(
                "t=%.0f s %s", time.monotonic() - t0, {k: v for k, v in tally.counts.items() if ":" not in k}
            )
            time.sleep(min(args.sample_interval, max(0.0, args.duration - (time.monotonic() - t0))))
        stop.set()
        for thread in threads:
            thread.join(timeout=args.timeout)
        if server_pid is not None:
            samples.append(sample_memory(server_pid, t0))
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        if handle is not None:
            handle.stop()
    report = build_report(args, tally, samples, elapsed)
    (args.out / "soak_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, args.out / "soak_report.md")
    LOGGER.info(
        "requests %d, wrong/unexpected %d, growth %s -> %s",
        report["requests"],
        report["wrong_or_unexpected"],
        report["growth_after_warmup"],
        "PASS" if report["passed"] else "FAIL",
    )
    if report["wrong_or_unexpected"]:
        return 1
    return 2 if report["growth_over_threshold"] else 0


if __name__ == "__main__":
    sys.exit(main())
