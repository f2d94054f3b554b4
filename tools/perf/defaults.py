"""``make perf-defaults``: what a user gets with the launchers' defaults, side by side in one run.

Nothing is tuned and no environment variable is added: the endpoint is started by
``embedded_server.start`` (the same call as ``make serve``/``deploy``/``demo``, thread budget
included) and nnU-Net runs as its users run it (``nnUNetPredictor`` in a plain Python process with its
own defaults; ``nnUNetv2_predict_from_modelfolder`` with its default worker processes). The
environment of every process is this one minus ``OMP_*`` and ``NNUNET_TRITON_*`` variables.

Measured, in this order, on one machine:

1. build time of the fixture (2 folds) and of the realistic default-plans model (5 folds), ``--force``;
2. time to first answer: server start to ready, then the first and the second request (the realistic
   model's second request is the first of step 3);
3. latency at concurrency 1, alternating request by request with nnUNetPredictor (fixture, mirroring
   on; realistic small volume, 5 folds, mirroring off);
4. throughput at concurrency 4 (fixture) against nnUNetPredictor back to back;
5. a folder of cases: ``nnunet-triton predict`` (default ``--concurrency``) against
   ``nnUNetv2_predict_from_modelfolder`` on the same folder;
6. throughput at concurrency 4 on the realistic model;
7. the request time an int16 CT of 300x512x512 saves by travelling as INT16 instead of FP32.

Writes ``benchmarks/results/<date>-defaults/results.json`` and ``report.md``, and rewrites the block
between the ``perf-defaults`` markers of BENCHMARKS.md.

Usage::

    python -m tools.perf.defaults [--reps 3] [--no-realistic]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.client.client import NnunetClient
from nnunet_triton.options import DEFAULT_CLIENT_TIMEOUT_S
from nnunet_triton.server import embedded as embedded_server
from nnunet_triton.server.exactness import cpu_identity
from tools.perf import benchmarks_md
from tools.perf.baselines import BaselineWorker, Job
from tools.perf.workloads import ensure_realistic_model, fixture_case, fixture_model_dir, realistic_case

REPO_ROOT = Path(__file__).resolve().parents[2]

WORK = REPO_ROOT / "build" / "perf" / "defaults"


def _build(model: Path, out: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "repository.build", "--model-dir", str(model),
                    "--model-repository", str(out), "--force"],
                   check=True, cwd=REPO_ROOT, capture_output=True)
    return round(time.perf_counter() - start, 1)


def _segment(url: str, case: Any, mirroring: bool) -> float:
    with NnunetClient(url, timeout_s=3600) as client:
        start = time.perf_counter()
        client.segment(case.image, case.spacing, mirroring=mirroring)
        return time.perf_counter() - start


def _alternate(server: Any, worker: BaselineWorker, case: Any, case_file: Path, folds: tuple,
               mirroring: bool, reps: int) -> dict[str, Any]:
    endpoint, predictor = [], []
    for _ in range(reps):
        endpoint.append(_segment(server.http_url, case, mirroring))
        result, _ = worker.run(Job(case_file, folds, mirroring, 1), timeout_s=7200)
        predictor.append(result.latencies_s[0])
    e, p = statistics.median(endpoint), statistics.median(predictor)
    return {"endpoint_s": [round(x, 2) for x in endpoint], "predictor_s": [round(x, 2) for x in predictor],
            "endpoint_median_s": round(e, 2), "predictor_median_s": round(p, 2), "ratio": round(e / p, 3),
            "predictor_threads": result.torch_threads}


def _throughput(server: Any, case: Any, mirroring: bool, requests: int, concurrency: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: _segment(server.http_url, case, mirroring), range(requests)))
    return requests / (time.perf_counter() - start)


def _throughput_vs_predictor(server: Any, case: Any, mirroring: bool, requests: int,
                             predictor_median_s: float) -> dict[str, float]:
    """Endpoint throughput at concurrency 4 (after one untimed request) vs nnUNetPredictor back to back."""
    _segment(server.http_url, case, mirroring)
    thr = _throughput(server, case, mirroring, requests=requests, concurrency=4)
    back_to_back = 1.0 / predictor_median_s
    return {"endpoint_req_s": round(thr, 4), "predictor_back_to_back_req_s": round(back_to_back, 4),
            "ratio": round(thr / back_to_back, 3)}


def _first_answer(repo: Path, case: Any, mirroring: bool) -> dict[str, float]:
    start = time.perf_counter()
    with embedded_server.start(repo, ready_timeout_s=1800) as server:
        ready = time.perf_counter() - start
        first = _segment(server.http_url, case, mirroring)
        second = _segment(server.http_url, case, mirroring)
    return {"ready_s": round(ready, 1), "first_request_s": round(first, 2),
            "second_request_s": round(second, 2), "time_to_first_answer_s": round(ready + first, 1)}


def _folder(server: Any, model: Path, folds: tuple, cases: int) -> dict[str, Any]:
    images = fixture_model_dir().parent / "imagesTs"
    folder = WORK / "folder_in"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    sources = sorted(images.glob("*_0000.nii.gz"))
    for k in range(cases):
        shutil.copy(sources[k % len(sources)], folder / f"case{k:03d}_0000.nii.gz")
    outs = {name: WORK / f"folder_out_{name}" for name in ("cli", "nnunet")}
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    bin_dir = Path(sys.executable).parent
    start = time.perf_counter()
    subprocess.run([str(bin_dir / "nnunet-triton"), "predict", "-i", str(folder), "-o", str(outs["cli"]),
                    "--url", server.http_url], check=True, capture_output=True)
    cli = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([str(bin_dir / "nnUNetv2_predict_from_modelfolder"), "-i", str(folder), "-o",
                    str(outs["nnunet"]), "-m", str(model), "-f", *map(str, folds), "-device", "cpu"],
                   check=True, capture_output=True)
    nnunet = time.perf_counter() - start
    import SimpleITK as sitk

    identical = all(
        (sitk.GetArrayFromImage(sitk.ReadImage(str(outs["cli"] / f.name))) ==
         sitk.GetArrayFromImage(sitk.ReadImage(str(outs["nnunet"] / f.name)))).all()
        for f in sorted(outs["nnunet"].glob("*.nii.gz")))
    return {"cases": cases, "cli_s": round(cli, 1), "nnunetv2_predict_s": round(nnunet, 1),
            "cli_cases_per_min": round(60 * cases / cli, 2),
            "nnunet_cases_per_min": round(60 * cases / nnunet, 2),
            "throughput_ratio": round(nnunet / cli, 3), "label_maps_identical": bool(identical)}


def _transfer(fixture: Path, shape: tuple[int, int, int], reps: int) -> dict[str, Any]:
    """Request time of a ``shape`` int16 CT sent as INT16 (``nnunet_int16``) vs the same values as FP32.

    The repository's ``max_voxels`` is set below the volume, so preprocess_model answers INVALID_ARG
    right after the IMAGE arrived in its stub: the time is serialising, sending, the ensemble hop and
    the copy into the stub, the part a dtype changes (the inference itself is the same)."""
    from nnunet_triton.errors import ClientError

    repo = WORK / "transfer_repo"
    subprocess.run([sys.executable, "-m", "repository.build", "--model-dir", str(fixture),
                    "--model-repository", str(repo), "--max-voxels", "1000000"], check=True, cwd=REPO_ROOT,
                   capture_output=True)
    image = (np.random.default_rng(0).integers(-1024, 2000, size=(1, *shape))).astype(np.int16)
    times: dict[str, list[float]] = {"INT16": [], "FP32": []}
    with embedded_server.start(repo) as server:
        for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
            with NnunetClient(url, protocol=protocol, timeout_s=DEFAULT_CLIENT_TIMEOUT_S) as client:
                for _ in range(reps):
                    for wire, array in (("INT16", image), ("FP32", image.astype(np.float32))):
                        start = time.perf_counter()
                        try:
                            client.segment(array, (1.0, 0.8, 0.8), mirroring=False)
                        except ClientError as exc:
                            assert "max_voxels" in str(exc) or "limit" in str(exc), exc
                        times[wire].append(time.perf_counter() - start)
            int16, fp32 = (statistics.median(times[w][-reps:]) for w in ("INT16", "FP32"))
            times[f"{protocol}_median_s"] = {"INT16": round(int16, 3), "FP32": round(fp32, 3),
                                             "saved_s": round(fp32 - int16, 3),
                                             "ratio": round(int16 / fp32, 3)}
    return {"shape": list(shape), "mib_int16": round(image.nbytes / 2**20),
            "mib_fp32": round(image.nbytes / 2**19),
            **{k: v for k, v in times.items() if k.endswith("median_s")}}


BLOCK = "perf-defaults"  # its markers in BENCHMARKS.md (tools/perf/benchmarks_md.py)


def _row(name: str, value: str, goal: str, met: bool | None) -> str:
    verdict = "" if met is None else (" **met**" if met else " **missed**")
    return f"| {name} | {value} | {goal}{verdict} |"


def report(results: dict[str, Any]) -> str:
    """Markdown of one run (also the block between the perf-defaults markers in BENCHMARKS.md)."""
    lf, tf = results["latency_fixture"], results["throughput_fixture_c4"]
    folder, fa = results["folder_fixture"], results["first_answer_fixture"]
    rows = [
        "| measurement | value | goal |", "|---|---|---|",
        _row("fixture latency, concurrency 1 (2 folds, mirroring): endpoint / nnUNetPredictor",
             f"{lf['endpoint_median_s']} s / {lf['predictor_median_s']} s = **{lf['ratio']}**", "<= 1.0",
             lf["ratio"] <= 1.0),
        _row("fixture throughput, concurrency 4 vs nnUNetPredictor back to back",
             f"{tf['endpoint_req_s']} / {tf['predictor_back_to_back_req_s']} req/s = **{tf['ratio']}**",
             ">= 1.2", tf["ratio"] >= 1.2),
    ]
    if "latency_realistic" in results:
        lr = results["latency_realistic"]
        rows.append(_row("realistic latency, concurrency 1 (default plans, 5 folds, small volume, "
                         "no mirroring)",
                         f"{lr['endpoint_median_s']} s / {lr['predictor_median_s']} s = **{lr['ratio']}**",
                         "<= 1.0", lr["ratio"] <= 1.0))
    if "throughput_realistic_c4" in results:
        tr = results["throughput_realistic_c4"]
        rows.append(_row("realistic throughput, concurrency 4 vs nnUNetPredictor back to back",
                         f"{tr['endpoint_req_s']} / {tr['predictor_back_to_back_req_s']} req/s = "
                         f"**{tr['ratio']}**", ">= 1.2", tr["ratio"] >= 1.2))
    rows += [
        _row(f"folder of {folder['cases']} cases: `nnunet-triton predict` vs "
             "`nnUNetv2_predict_from_modelfolder`",
             f"{folder['cli_s']} s vs {folder['nnunetv2_predict_s']} s = **{folder['throughput_ratio']}x** "
             f"(label maps identical: {folder['label_maps_identical']})", ">= 1.0",
             folder["throughput_ratio"] >= 1.0),
        _row("build, fixture (2 folds), `--force`", f"{results['build_fixture_s']} s", "minutes", None),
    ]
    if "build_realistic_5folds_s" in results:
        rows.append(_row("build, default-plans model (5 folds, one weight set), `--force`",
                         f"{results['build_realistic_5folds_s']} s", "minutes, not tens of minutes", None))
    rows.append(_row("time to first answer, fixture: ready + first request (second request)",
                     f"{fa['ready_s']} s + {fa['first_request_s']} s ({fa['second_request_s']} s)",
                     "first not slower than second", fa["first_request_s"] <= fa["second_request_s"] * 1.05))
    if "first_answer_realistic" in results:
        fr = results["first_answer_realistic"]
        second = results["latency_realistic"]["endpoint_s"][0]
        rows.append(_row("time to first answer, realistic: ready + first request (second request)",
                         f"{fr['ready_s']} s + {fr['first_request_s']} s ({second} s)",
                         "first not slower than second", fr["first_request_s"] <= second * 1.05))
    if "transfer_int16_vs_fp32" in results:
        tx = results["transfer_int16_vs_fp32"]
        for protocol in ("grpc", "http"):
            m = tx[f"{protocol}_median_s"]
            shape = "x".join(map(str, tx["shape"]))
            rows.append(_row(f"request transfer of a {shape} int16 CT ({protocol}): "
                             f"INT16 ({tx['mib_int16']} MiB) vs FP32 ({tx['mib_fp32']} MiB)",
                             f"{m['INT16']} s vs {m['FP32']} s: {m['saved_s']} s saved ({m['ratio']})",
                             "measured", None))
    budgets = [results.get("thread_budget"), results.get("thread_budget_realistic")]
    cpu = (f"{results['cpu_model']}; SIMD: {results['cpu_simd']}" if results.get("cpu_model")
           else "CPU model not recorded")
    lines = [f"Run {results['date']} on {results['cpus']} CPUs ({cpu}) "
             f"(load average {results['loadavg_start'][0]:.2f} "
             f"at the start, {results['loadavg_end'][0]:.2f} at the end); raw numbers in "
             f"`benchmarks/results/{results['date'][:10]}-defaults/results.json`. Nothing tuned: the servers "
             "were started by `embedded_server.start` (what `make serve`/`deploy`/`demo` run) with no "
             "variable added, nnU-Net with its own defaults.", "", *rows, ""]
    for label, budget in zip(("fixture", "realistic"), budgets, strict=True):
        if budget:
            verdict = {True: "exact", False: "NOT exact", None: "exactness not checked"}[budget.get("exact")]
            lines.append(f"- thread budget chosen for the {label} server ({verdict}): {budget['reason']}")
    return "\n".join(lines) + "\n"


def update_benchmarks_md(text: str, path: Path = REPO_ROOT / "BENCHMARKS.md") -> None:
    benchmarks_md.replace_block(path, BLOCK, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-realistic", action="store_true")
    p.add_argument("--folder-cases", type=int, default=6)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--report-only", type=Path, default=None, help="re-render a results.json")
    args = p.parse_args(argv)
    if args.report_only is not None:
        results = json.loads(args.report_only.read_text())
        (args.report_only.parent / "report.md").write_text(report(results))
        update_benchmarks_md(report(results))
        return 0
    for key in [k for k in os.environ if k.startswith(("OMP_", "NNUNET_TRITON_"))]:
        del os.environ[key]  # the servers get exactly the launcher's defaults
    WORK.mkdir(parents=True, exist_ok=True)
    cpu = cpu_identity()
    results: dict[str, Any] = {"date": dt.datetime.now().isoformat(timespec="seconds"),
                               "cpus": len(os.sched_getaffinity(0)), "cpu_model": cpu["model"],
                               "cpu_simd": cpu["simd"], "loadavg_start": os.getloadavg()}
    fixture = fixture_model_dir()
    fx_case = fixture_case(fixture)
    fx_file = fx_case.save(WORK / "fixture_case.npz")
    fx_folds = (0, 1)
    fx_repo = WORK / "fixture_repo"
    results["build_fixture_s"] = _build(fixture, fx_repo)
    realistic = rl_repo = None
    if not args.no_realistic:
        realistic = ensure_realistic_model()
        rl_repo = WORK / "realistic_repo"
        results["build_realistic_5folds_s"] = _build(realistic, rl_repo)
    results["first_answer_fixture"] = _first_answer(fx_repo, fx_case, True)
    with embedded_server.start(fx_repo) as server:
        results["thread_budget"] = server.thread_budget
        log = WORK / "predictor.log"
        with BaselineWorker("predictor", fixture, fx_folds, fx_file, log_path=log) as worker:
            results["latency_fixture"] = _alternate(server, worker, fx_case, fx_file, fx_folds, True,
                                                    args.reps)
        results["throughput_fixture_c4"] = _throughput_vs_predictor(
            server, fx_case, True, 8, results["latency_fixture"]["predictor_median_s"])
        results["folder_fixture"] = _folder(server, fixture, fx_folds, args.folder_cases)
    if realistic is not None:
        rl_case = realistic_case(realistic, "small")
        rl_file = rl_case.save(WORK / "realistic_case.npz")
        folds = (0, 1, 2, 3, 4)
        start = time.perf_counter()
        with embedded_server.start(rl_repo, ready_timeout_s=1800) as server:
            ready = time.perf_counter() - start
            first = _segment(server.http_url, rl_case, False)
            results["first_answer_realistic"] = {
                "ready_s": round(ready, 1), "first_request_s": round(first, 2),
                "time_to_first_answer_s": round(ready + first, 1)}
            results["thread_budget_realistic"] = server.thread_budget
            log = WORK / "predictor_rl.log"
            with BaselineWorker("predictor", realistic, folds, rl_file, log_path=log) as w:
                results["latency_realistic"] = _alternate(server, w, rl_case, rl_file, folds, False, 2)
            results["throughput_realistic_c4"] = _throughput_vs_predictor(
                server, rl_case, False, 4, results["latency_realistic"]["predictor_median_s"])
    results["transfer_int16_vs_fp32"] = _transfer(fixture, (300, 512, 512), reps=3)
    results["loadavg_end"] = os.getloadavg()
    stem = args.out / f"{dt.date.today().isoformat()}-defaults"
    stem.mkdir(parents=True, exist_ok=True)
    (stem / "results.json").write_text(json.dumps(results, indent=2, default=list) + "\n")
    (stem / "report.md").write_text(report(results))
    update_benchmarks_md(report(results))
    sys.stdout.write(json.dumps(results, indent=2, default=list) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
