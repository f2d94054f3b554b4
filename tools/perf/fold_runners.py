"""``make perf-fold-runners``: the Python fold runner vs libtorch folds, exact and batched, in one run.

The fixture (2 folds, mirroring on) is built four times, target cpu, differing only in the fold runner and
``per_sample_forward``; each repository is served by ``embedded_server.start`` (the launchers' call, thread
budget included; libtorch through ``make triton-backends``' build) one after the other, and measured the
same way: the median latency of ``--reps`` requests at concurrency 1 (after one untimed request) and the
throughput of ``--requests`` requests at concurrency 4. The machine load (1-minute load average) is
recorded before and after each server. Ratios are against the Python runner's exact default.

Writes ``benchmarks/results/<date>-fold-runners/results.json`` and prints a Markdown table for
BENCHMARKS.md.

Usage::

    python -m tools.perf.fold_runners [--reps 3] [--requests 8]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.builder.repository import build_repository
from nnunet_triton.client.client import NnunetClient
from nnunet_triton.server import embedded as embedded_server
from nnunet_triton.server.backend_build import build_pytorch_backend
from nnunet_triton.server.exactness import cpu_identity
from tools.perf.workloads import fixture_case, fixture_model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
WORK = REPO_ROOT / "build" / "perf" / "fold_runners"
VARIANTS = {  # name -> build options (everything else at its default)
    "python, exact (default)": {"fold_runner": "python"},
    "python, batched": {"fold_runner": "python", "per_sample_forward": False},
    "libtorch, exact": {"fold_runner": "libtorch"},
    "libtorch, batched": {"fold_runner": "libtorch", "per_sample_forward": False},
}


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _segment(url: str, case: Any) -> float:
    with NnunetClient(url, timeout_s=3600) as client:
        start = time.perf_counter()
        client.segment(case.image, case.spacing, mirroring=True)
        return time.perf_counter() - start


def _measure(repo: Path, case: Any, reps: int, requests: int) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    with embedded_server.start(repo, ready_timeout_s=1800, home=WORK / "home") as server:
        _segment(server.http_url, case)  # untimed: first-request effects
        latencies = [_segment(server.http_url, case) for _ in range(reps)]
        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: _segment(server.http_url, case), range(requests)))
        throughput = requests / (time.perf_counter() - start)
        budget = server.thread_budget
    return {"latency_s": [round(x, 2) for x in latencies],
            "latency_median_s": round(statistics.median(latencies), 2),
            "throughput_req_s": round(throughput, 4), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "thread_budget": budget.get("reason") if budget else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.perf.fold_runners",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="latency requests per variant (default 3)")
    parser.add_argument("--requests", type=int, default=8, help="requests at concurrency 4 (default 8)")
    args = parser.parse_args(argv)
    model = fixture_model_dir()
    case = fixture_case(model)
    backend = build_pytorch_backend()
    results: dict[str, Any] = {"date": dt.date.today().isoformat(), "cpu": cpu_identity(),
                               "cpus": len(os.sched_getaffinity(0)),
                               "backend_build_s": round(backend.seconds, 1),
                               "case": case.name, "mirroring": True, "variants": {}}
    for name, kwargs in VARIANTS.items():
        out = WORK / name.replace(", ", "-").replace(" (default)", "")
        repo = build_repository(model, out, options=BuildOptions(**kwargs)).out
        results["variants"][name] = _measure(repo, case, args.reps, args.requests)
        _say(f"{name}: {json.dumps(results['variants'][name])}")
    base = results["variants"]["python, exact (default)"]
    for row in results["variants"].values():
        row["latency_ratio"] = round(row["latency_median_s"] / base["latency_median_s"], 3)
        row["throughput_ratio"] = round(row["throughput_req_s"] / base["throughput_req_s"], 3)
    folder = REPO_ROOT / "benchmarks" / "results" / f"{results['date']}-fold-runners"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _say("| fold runner | median latency, c=1 | vs Python exact | throughput, c=4 | vs Python exact | load |")
    _say("|---|---|---|---|---|---|")
    for name, row in results["variants"].items():
        _say(f"| {name} | {row['latency_median_s']} s | {row['latency_ratio']}x | {row['throughput_req_s']} "
             f"req/s | {row['throughput_ratio']}x | {row['load_before']}-{row['load_after']} |")
    _say(f"results: {folder / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
