"""Memory of one request: peak PSS of the endpoint vs nnUNetPredictor on a large volume, side by side.

One run, one machine: the endpoint (``embedded.start`` on a repository built with ``BuildOptions()``, what
``make serve`` runs) and nnU-Net's ``nnUNetPredictor.predict_single_npy_array`` in a worker subprocess
(``tools.perf.baselines``, every deployed fold loaded) are both started, warmed up on a held-out case of the
SynthCT fixture and then, round by round, each given the same large volume (a held-out case resampled to
``--shape`` at the case's own spacing: a larger field of view, so the resampled grid, the tiles and the
fold accumulators grow with it), all folds, mirroring off. Each side's process tree (tritonserver +
stubs; the worker) is sampled every 0.1 s by ``tools.perf.resources``: the sum of PSS over the tree
(``/proc/<pid>/smaps_rollup``: a shared page counts once, however many processes map it) just before the
request, its peak during it, and their difference, what one request adds. The sum of RSS is reported next
to it for comparison with earlier tables (it counts shared memory once per process mapping it). The load
average says how busy the machine was.

Usage::

    python -m tools.perf.request_memory [--shape 96 192 192] [--rounds 1] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tools.perf.baselines import BaselineWorker, Job
from tools.perf.resources import ProcessTreeSampler
from tools.perf.workloads import Case

REPO_ROOT = Path(__file__).resolve().parents[2]
WORK_ROOT = REPO_ROOT / "build" / "perf" / "request-memory"
LOGGER = logging.getLogger(__name__)
SAMPLE_S = 0.1

__all__ = ["enlarge", "main"]


def enlarge(case: Case, shape: tuple[int, int, int]) -> Case:
    """``case`` resampled (linear) to ``shape`` (z, y, x) at its own spacing (a larger field of view)."""
    from scipy.ndimage import zoom

    factors = [n / o for n, o in zip(shape, case.image.shape[1:], strict=True)]
    image = np.stack([zoom(channel, factors, order=1) for channel in case.image]).astype(np.float32)
    return Case(name=f"{case.name}-{'x'.join(map(str, shape))}", image=image, spacing=case.spacing)


def _idle(pid: int) -> Any:
    sampler = ProcessTreeSampler(pid, interval_s=SAMPLE_S).start()
    time.sleep(1.0)  # a few samples of the settled process tree
    return sampler.stop()


def _row(system: str, idle: Any, usage: Any) -> dict[str, Any]:
    return {"system": system, "idle_pss_mib": round(idle.peak_pss_mib, 1),
            "peak_pss_mib": round(usage.peak_pss_mib, 1),
            "peak_minus_idle_pss_mib": round(usage.peak_pss_mib - idle.peak_pss_mib, 1),
            "idle_rss_mib": round(idle.peak_rss_mib, 1), "peak_rss_mib": round(usage.peak_rss_mib, 1),
            "peak_minus_idle_rss_mib": round(usage.peak_rss_mib - idle.peak_rss_mib, 1),
            "idle_pss_by_process_mib": {k: round(v, 1) for k, v in idle.peak_pss_by_process_mib.items()},
            "wall_s": round(usage.wall_s, 1), "loadavg_1min": round(usage.loadavg_end[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(96, 192, 192), metavar=("Z", "Y", "X"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=WORK_ROOT / "results.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.builder.repository import build_repository
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.server.deploy.repository_info import RepositoryInfo
    from tests.fixture_paths import SYNTH_CT
    from tools.perf import repos
    from tools.perf.run import _server
    from tools.perf.two_models import held_out_cases

    model_dir = SYNTH_CT.model_dir
    warm = held_out_cases(model_dir)[0]
    big = enlarge(warm, tuple(args.shape))
    warm_path, big_path = warm.save(WORK_ROOT / "warm.npz"), big.save(WORK_ROOT / "big.npz")
    repository = WORK_ROOT / "repository"
    if not repository.is_dir():  # built once, reused by later runs
        with repos.light_export():
            repository = build_repository(model_dir, repository, options=BuildOptions()).out
    folds = RepositoryInfo.from_repository(repository).first.folds
    rows: list[dict[str, Any]] = []
    meta = {"command": " ".join(["python -m tools.perf.request_memory", *(argv or sys.argv[1:])]),
            "cpus": len(os.sched_getaffinity(0)), "volume": list(big.image.shape), "spacing": big.spacing,
            "folds": list(folds), "mirroring": False, "loadavg_start": list(os.getloadavg())}
    logs = WORK_ROOT / "logs"
    with _server([repository], logs, "request-memory") as handle, \
            BaselineWorker("predictor", model_dir, folds, warm_path, log_path=logs / "log.txt") as worker, \
            NnunetClient(handle.grpc_url, "grpc", timeout_s=3600.0) as client:
        client.segment(warm.image, warm.spacing, mirroring=False)
        for _ in range(args.rounds):
            idle = _idle(handle.pid)
            sampler = ProcessTreeSampler(handle.pid, interval_s=SAMPLE_S).start()
            client.segment(big.image, big.spacing, mirroring=False)
            rows.append(_row("endpoint", idle, sampler.stop()))
            idle = _idle(worker._process.pid)
            _, usage = worker.run(Job(case=big_path, folds=tuple(folds), mirroring=False, reps=1),
                                  timeout_s=3600.0, interval_s=SAMPLE_S)
            rows.append(_row("nnUNetPredictor", idle, usage))
            LOGGER.info("round: %s", rows[-2:])
    meta["loadavg_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    sys.stdout.write(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
