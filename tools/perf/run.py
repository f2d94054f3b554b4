"""``make perf``: benchmark the ``nnunet`` endpoint against nnUNetPredictor, a monolith and the network.

For each workload (``tools.perf.workloads``) the run

1. builds the pipeline repository (``repository.build``) and the monolith repository;
2. starts the pipeline server, sends warm-up requests, then runs perf_analyzer (``tools.perf.analyzer``)
   for every scenario, protocol and concurrency level, sampling tritonserver + stubs with psutil
   (``tools.perf.resources``) and diffing every model's server statistics (``tools.perf.server_stats``);
3. does the same for the monolith server (same input data, same load);
4. runs the nnUNetPredictor and network-floor baselines in subprocesses (``tools.perf.baselines``)
   while no server is running;

and writes ``<results-dir>/<date>-<host>[-quick|-tune]/results.json`` (plus every perf_analyzer CSV and
log), then the Markdown report and plots (``tools.perf.report``), and updates BENCHMARKS.md after a
full run. ``--quick``: the fixture only, concurrency 1-2, short windows (a few minutes).
``--suite tune``: the tuning variants (tile batch size, batching delay, instances, threads,
per-sample forwards) of the pipeline on one scenario.

Systems share the machine fairly: the endpoint and the monolith are served by ONE tritonserver and
measured level by level in turn, and the baselines run in persistent worker processes between the
server runs, so a change in background load hits all of them alike. The servers run with the
launchers' own defaults (``embedded_server.start``: the thread budget of ``server.thread_budget``,
which sets ``OMP_WAIT_POLICY=PASSIVE`` and the fold threads) and the baselines with nnU-Net's own
defaults: nothing is added to the environment (``--omp-wait-policy inherit``, the default). Setting
``--omp-wait-policy PASSIVE|ACTIVE`` exports it to every process: a labelled tuning variant.

Usage::

    python -m tools.perf.run [--quick] [--suite benchmark|tune] [--workloads fixture,realistic]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.repository.registry import version_metadata
from tools.perf import analyzer, baselines, repos, server_stats, workloads
from tools.perf.monolith import MONOLITH_MODEL
from tools.perf.resources import ProcessTreeSampler, ResourceUsage

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["RequestConfig", "Load", "Scenario", "WorkloadPlan", "Measurement", "plans", "main"]

LOGGER = logging.getLogger("tools.perf.run")
SYSTEMS = ("endpoint", "monolith", "predictor", "floor")


@dataclass(frozen=True)
class RequestConfig:
    """Per-request options; None = the server default (all deployed folds, mirroring on)."""

    folds: tuple[int, ...] | None = None
    mirroring: bool | None = None

    def parameters(self) -> tuple[tuple[str, str, str], ...]:
        """perf_analyzer ``--request-parameter`` triples (gRPC only)."""
        params = []
        if self.mirroring is not None:
            params.append(("mirroring", str(self.mirroring).lower(), "bool"))
        if self.folds is not None:
            params.append(("folds", ",".join(str(f) for f in self.folds), "string"))
        return tuple(params)

    def resolve(self, deployed: Sequence[int]) -> tuple[tuple[int, ...], bool]:
        return (tuple(deployed) if self.folds is None else self.folds,
                True if self.mirroring is None else self.mirroring)


@dataclass(frozen=True)
class Load:
    """How perf_analyzer loads the server in one scenario.

    ``window_requests`` > 0: three count windows of ``max(window_requests, concurrency)`` requests
    each; otherwise ONE window of ``max(min_requests, concurrency)`` requests (multi-second requests).
    ``rounds`` > 1: concurrency 1 over gRPC is measured as that many rounds of one request per system
    in turn (endpoint, monolith, nnUNetPredictor, floor), so every system sees the same background
    load; the rounds are merged into one row per system.
    """

    concurrencies: tuple[int, ...]
    protocols: tuple[str, ...] = ("grpc",)
    window_requests: int = 0
    min_requests: int = 1
    rounds: int = 1

    def settings(self, concurrency: int) -> dict[str, int]:
        if self.window_requests:
            return {"measurement_request_count": max(self.window_requests, concurrency),
                    "request_count": 0, "max_trials": 3}
        count = max(self.min_requests, concurrency)
        return {"measurement_request_count": count, "request_count": count, "max_trials": 1}


@dataclass(frozen=True)
class Scenario:
    """One request configuration on one volume, measured on some systems."""

    name: str
    volume: str
    request: RequestConfig
    load: Load
    systems: tuple[str, ...] = SYSTEMS
    reps: int = 3  # baseline repetitions


@dataclass(frozen=True)
class WorkloadPlan:
    name: str
    scenarios: tuple[Scenario, ...]
    warmups: tuple[RequestConfig, ...]


def plans(quick: bool) -> tuple[WorkloadPlan, ...]:
    """The benchmark plan (``--quick``: fixture only, concurrency 1-2, short windows).

    perf_analyzer 2.48 sends request parameters over gRPC only, so HTTP runs use the server defaults
    (all deployed folds, mirroring on); the concurrency sweeps use gRPC with explicit parameters.
    Sizes follow the measured cost on two shared cores: the fixture with 2 folds and mirroring is
    ~5 s per request (432 tiny forwards), without mirroring ~0.6 s; one default-plans tile ~12-35 s.
    """
    no_mirror_sweep = Scenario("2folds-nomirror", "typical", RequestConfig((0, 1), False),
                               Load((1, 2) if quick else (1, 2, 3, 4), window_requests=3 if quick else 5,
                                    rounds=1 if quick else 8), reps=3)
    defaults = Scenario("default", "typical", RequestConfig(),
                        Load((1,), ("http",), window_requests=1) if quick
                        else Load((1,), ("grpc", "http"), window_requests=2, rounds=3), reps=2)
    cheap_warmup = (RequestConfig((0, 1), False),)  # loads every stub and fold network
    if quick:
        return (WorkloadPlan("fixture", (no_mirror_sweep, defaults), warmups=cheap_warmup),)
    fixture = WorkloadPlan("fixture", (
        no_mirror_sweep, defaults,
        Scenario("1fold-nomirror", "typical", RequestConfig((0,), False), Load((1,), rounds=8), reps=1),
        Scenario("1fold-mirror", "typical", RequestConfig((0,), True), Load((1,), rounds=3), reps=1),
    ), warmups=cheap_warmup)
    one = Load((1,), min_requests=1)
    no_monolith = ("endpoint", "predictor", "floor")
    realistic = WorkloadPlan("realistic", (
        Scenario("main", "small", RequestConfig((0,), False), Load((1, 2, 4), min_requests=1, rounds=5),
                 reps=1),
        Scenario("5folds-nomirror", "small", RequestConfig((0, 1, 2, 3, 4), False), one, no_monolith, 1),
        Scenario("1fold-mirror", "small", RequestConfig((0,), True), one, no_monolith, 1),
        Scenario("scaling-medium", "medium", RequestConfig((0,), False), one, no_monolith, 1),
        Scenario("scaling-large", "large", RequestConfig((0,), False), one, no_monolith, 1),
    ), warmups=(RequestConfig((0,), False),))
    return fixture, realistic


TUNING_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "tile_batch_size=1": {"tile_batch_size": 1},
    "tile_batch_size=8": {"tile_batch_size": 8},
    "queue_delay=0": {"fold_queue_delay_us": 0},
    "queue_delay=20ms": {"fold_queue_delay_us": 20000},
    "per_sample_forward=false": {"per_sample_forward": False},
    "torch_threads=1": {"torch_threads": 1},
    "fold_instances=2,torch_threads=1": {"fold_instances": 2, "torch_threads": 1},
    "orchestrator_instances=2": {"orchestrator_instances": 2},
    "orchestrator_instances=4": {"orchestrator_instances": 4},
    "preprocess+stitch_instances=2": {"preprocess_instances": 2, "stitch_instances": 2},
    "client_shm=system": {},  # default build; perf_analyzer sends/receives through /dev/shm (below)
}
# perf_analyzer settings of a variant (client <-> server copies), on top of the scenario's
ANALYZER_VARIANTS: dict[str, dict[str, Any]] = {"client_shm=system": {"shared_memory": "system"}}
REALISTIC_TUNING_VARIANTS = ("default", "per_sample_forward=false", "tile_batch_size=8",
                             "fold_instances=2,torch_threads=1")


def tuning_plan(workload: str) -> WorkloadPlan:
    """One scenario measured for every variant: concurrency 1 and 4 (fixture), 1 (realistic)."""
    endpoint = ("endpoint",)
    if workload == "fixture":
        scenario = Scenario("tune", "typical", RequestConfig((0, 1), False), Load((1, 4), window_requests=4),
                            endpoint)
        return WorkloadPlan("fixture", (scenario,), warmups=(RequestConfig((0, 1), False),))
    # mirroring: 8 network inputs per request, so tile batching and per-sample forwards matter
    scenario = Scenario("tune", "small", RequestConfig((0,), True), Load((1,), min_requests=1), endpoint)
    return WorkloadPlan("realistic", (scenario,), warmups=(RequestConfig((0,), False),))


@dataclass(frozen=True)
class Measurement:
    """One row of the results: a system under one scenario at one concurrency (and protocol)."""

    workload: str
    scenario: str
    variant: str
    system: str
    protocol: str
    volume: str
    folds: tuple[int, ...]
    mirroring: bool
    concurrency: int
    tiles: int
    forwards_per_request: int
    requests: int
    throughput_rps: float
    latency_ms: dict[str, float]
    resources: dict[str, Any]
    model_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    command: str = ""
    ok: bool = True
    error: str = ""


@dataclass
class _Context:
    """Per-workload state shared by the steps of one run."""

    plan: WorkloadPlan
    model_dir: Path
    deployed_folds: tuple[int, ...]
    cases: dict[str, workloads.Case]
    case_files: dict[str, Path]
    input_files: dict[str, Path]
    tile_plans: dict[tuple[str, bool], baselines.TilePlan]
    raw_dir: Path  # committed with the results: perf_analyzer CSVs and logs
    work_dir: Path  # build/perf/runs/...: input-data JSON (large), server and worker logs (absolute paths)
    args: argparse.Namespace
    variant: str = "default"
    served_folds: tuple[int, ...] = ()
    results: list[Measurement] = field(default_factory=list)


# --- preparation --------------------------------------------------------------------------------------


def _model_dir(workload: str, args: argparse.Namespace) -> Path:
    if workload == "fixture":
        return workloads.fixture_model_dir(args.fixtures_root)
    return workloads.ensure_realistic_model()


def _cases(workload: str, model_dir: Path, scenarios: Sequence[Scenario]) -> dict[str, workloads.Case]:
    volumes = sorted({s.volume for s in scenarios})
    if workload == "fixture":
        return {v: workloads.fixture_case(model_dir) for v in volumes}
    return {v: workloads.realistic_case(model_dir, v) for v in volumes}


def _prepare(plan: WorkloadPlan, args: argparse.Namespace, raw_root: Path, work_root: Path) -> _Context:
    from nnunet_triton.numerics.model_folder import read_model_folder
    from tools.perf.input_data import write_input_data

    model_dir = _model_dir(plan.name, args)
    config = read_model_folder(model_dir)
    raw_dir, work_dir = raw_root / plan.name, work_root / plan.name
    cases = _cases(plan.name, model_dir, plan.scenarios)
    case_files, input_files, tile_plans = {}, {}, {}
    for volume, case in cases.items():
        case_files[volume] = case.save(repos.REPOS_ROOT.parent / "cases" / plan.name / f"{volume}.npz")
        input_files[volume] = write_input_data(case.image, case.spacing,
                                               work_dir / f"input-data-{volume}.json").path
        for mirroring in (False, True):
            tile_plans[(volume, mirroring)] = baselines.tile_plan(config, case, mirroring=mirroring)
    return _Context(plan=plan, model_dir=model_dir, deployed_folds=tuple(config.folds), cases=cases,
                    case_files=case_files, input_files=input_files, tile_plans=tile_plans, raw_dir=raw_dir,
                    work_dir=work_dir, args=args)


# --- servers and baseline workers -------------------------------------------------------------------

ENDPOINT_PROCESSES = ("tritonserver", io_names.PREPROCESS_MODEL, io_names.ORCHESTRATOR_MODEL,
                      io_names.STITCH_MODEL, "fold_")
MONOLITH_PROCESSES = ("tritonserver", MONOLITH_MODEL)


def _includes(system: str) -> Any:
    prefixes = ENDPOINT_PROCESSES if system == "endpoint" else MONOLITH_PROCESSES
    return lambda label: label.startswith(prefixes)


@contextlib.contextmanager
def _server(repositories: Sequence[Path], log_dir: Path, name: str) -> Iterator[Any]:
    """One tritonserver serving every repository (pipeline and monolith side by side)."""
    from nnunet_triton.server import embedded as embedded_server

    src = str(REPO_ROOT / "src")  # the stubs import nnunet_triton even without `pip install -e .`
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    log_dir.mkdir(parents=True, exist_ok=True)
    handle = embedded_server.start(repositories[0], embedded_server.LaunchOptions(
        home=REPO_ROOT / "build" / "triton-home", log_file=log_dir / f"{name}.server.log",
        pid_file=log_dir / f"{name}.server.pid", state_file=log_dir / f"{name}.server.json",
        ready_timeout_s=1800.0, exit_timeout_s=5, extra_repositories=tuple(repositories[1:]),
    ))
    try:
        yield handle
    finally:
        handle.stop()


@contextlib.contextmanager
def _workers(ctx: _Context, floor_repository: Path) -> Iterator[dict[str, baselines.BaselineWorker]]:
    """The predictor and floor workers the scenarios need, loaded once with every fold they use."""
    workers: dict[str, baselines.BaselineWorker] = {}
    with contextlib.ExitStack() as stack:
        for kind, source in (("predictor", ctx.model_dir), ("floor", floor_repository)):
            scenarios = _scenarios_for(ctx, kind)
            if ctx.args.suite != "benchmark" or not scenarios:
                continue
            folds: list[int] = []
            for scenario in scenarios:
                folds += [f for f in scenario.request.resolve(ctx.deployed_folds)[0] if f not in folds]
            LOGGER.info("starting the %s worker (folds %s)", kind, folds)
            workers[kind] = stack.enter_context(baselines.BaselineWorker(
                kind, source, folds, ctx.case_files[scenarios[0].volume], device=ctx.args.device,
                log_path=ctx.work_dir / f"{_file_label(ctx.variant)}-{kind}.log"))
        yield workers


def _scenarios_for(ctx: _Context, system: str) -> list[Scenario]:
    return [s for s in ctx.plan.scenarios if system in s.systems and system in ctx.args.systems]


def _warm_up(ctx: _Context, handle: Any, model: str) -> None:
    from nnunet_triton.client.client import NnunetClient

    case = ctx.cases[ctx.plan.scenarios[0].volume]
    with NnunetClient(handle.grpc_url, "grpc", timeout_s=3600.0, endpoint=model) as client:
        for config in ctx.plan.warmups:
            folds, mirroring = config.resolve(ctx.deployed_folds)
            start = time.perf_counter()
            client.segment(case.image, case.spacing, mirroring=mirroring, folds=list(folds))
            LOGGER.info("warm-up %s folds=%s mirroring=%s: %.1f s", model, folds, mirroring,
                        time.perf_counter() - start)


def _file_label(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _latency(metrics: dict[str, float]) -> dict[str, float]:
    keys = ("avg_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms")
    return {k.removesuffix("_ms"): round(metrics[k], 3) for k in keys if k in metrics}


def _measure_level(ctx: _Context, handle: Any, system: str, scenario: Scenario, protocol: str,
                   concurrency: int, *, round_index: int | None = None) -> Measurement:
    model = io_names.ENDPOINT_MODEL if system == "endpoint" else MONOLITH_MODEL
    folds, mirroring = scenario.request.resolve(ctx.deployed_folds)
    tiles = ctx.tile_plans[(scenario.volume, mirroring)]
    settings = analyzer.AnalyzerSettings(
        model=model, url=handle.grpc_url if protocol == "grpc" else handle.http_url, protocol=protocol,
        control_token=handle.control_token,
        input_data=ctx.input_files[scenario.volume], concurrency=concurrency,
        request_parameters=scenario.request.parameters() if protocol == "grpc" else (),
        # explicit versions: without one, perf_analyzer 2.48 fails ("failed to find the requested model
        # version") on a composing model that has not run yet (e.g. fold_2 when a request asks for fold 0)
        bls_composing_models=tuple(f"{io_names.fold_model_name(f)}:1" for f in ctx.served_folds)
        if system == "endpoint" else (),
        **ANALYZER_VARIANTS.get(ctx.variant, {}),
        **(scenario.load.settings(concurrency) if round_index is None
           else {"measurement_request_count": 1, "request_count": 1, "max_trials": 1}),
    )
    label = _file_label(f"{ctx.variant}-{system}-{scenario.name}-{protocol}-c{concurrency}"
                        + ("" if round_index is None else f"-r{round_index}"))
    before = server_stats.snapshot(handle.http_url, headers=handle.control_headers)
    with ProcessTreeSampler(handle.pid, include=_includes(system)) as sampler:
        result = analyzer.run(settings, ctx.raw_dir, label, timeout_s=ctx.args.pa_timeout)
    stats = server_stats.diff(before, server_stats.snapshot(handle.http_url, headers=handle.control_headers))
    metrics = result.metrics
    requests = int(metrics.get("requests", 0))
    measurement = Measurement(
        workload=ctx.plan.name, scenario=scenario.name, variant=ctx.variant, system=system, protocol=protocol,
        volume=scenario.volume, folds=folds, mirroring=mirroring, concurrency=concurrency, tiles=tiles.tiles,
        forwards_per_request=tiles.forwards(len(folds)), requests=requests,
        throughput_rps=_throughput(concurrency, metrics, windowed=not settings.request_count),
        latency_ms=_latency(metrics),
        resources={**_resources(sampler.usage, requests), "pa_throughput_rps": metrics.get("throughput_rps")},
        model_stats={name: server_stats.summary(s) for name, s in sorted(stats.items())},
        command=analyzer.shell_command(result.command, REPO_ROOT), ok=result.ok,
        error="" if result.ok else f"perf_analyzer exit {result.returncode}; see {result.log_path.name}",
    )
    LOGGER.info("%s %s %s c=%d: %.4f infer/s, p50 %.2f s (%s)", system, scenario.name, protocol, concurrency,
                measurement.throughput_rps, measurement.latency_ms.get("p50", float("nan")) / 1000,
                "ok" if result.ok else measurement.error)
    return measurement


def _throughput(concurrency: int, metrics: dict[str, float], *, windowed: bool) -> float:
    """Requests/s of one level.

    Count windows (steady state, many requests per client): concurrency / mean latency (Little's law
    for perf_analyzer's closed-loop --sync clients); perf_analyzer's own value divides by windows of
    whole seconds, off by up to ~10 % for windows of a few multi-second requests, and is kept as
    ``pa_throughput_rps``. ``--request-count`` runs (one request per client, no steady state):
    perf_analyzer's requests / window time, which is then the right measure.
    """
    if windowed and metrics.get("avg_ms"):
        return round(concurrency * 1000.0 / metrics["avg_ms"], 5)
    return metrics.get("throughput_rps", 0.0)


def _resources(usage: ResourceUsage | None, requests: int) -> dict[str, Any]:
    if usage is None:
        return {}
    data = usage.to_dict()
    data["cpu_s_per_request"] = round(usage.cpu_s / requests, 3) if requests else None
    return data


def _levels(ctx: _Context, scenario: Scenario) -> Iterator[tuple[str, int]]:
    for protocol in scenario.load.protocols:
        if protocol not in ctx.args.protocols:
            continue
        if protocol == "http" and scenario.request.parameters():
            LOGGER.warning("skipping %s over http: perf_analyzer sends request parameters over gRPC only",
                           scenario.name)
            continue
        for concurrency in scenario.load.concurrencies:
            if not ctx.args.max_concurrency or concurrency <= ctx.args.max_concurrency:
                yield protocol, concurrency


def _server_systems(ctx: _Context, scenario: Scenario) -> list[str]:
    return [s for s in ("endpoint", "monolith") if s in scenario.systems and s in ctx.args.systems
            and (s == "endpoint" or ctx.args.suite == "benchmark")]


def _run_scenario(ctx: _Context, handle: Any, workers: dict[str, baselines.BaselineWorker],
                  scenario: Scenario, save: Any) -> None:
    """Every level for the server systems (endpoint then monolith, level by level), then the baselines."""
    levels = list(_levels(ctx, scenario))
    rounds = scenario.load.rounds > 1 and ("grpc", 1) in levels
    if rounds:
        _run_rounds(ctx, handle, workers, scenario, save)
        levels.remove(("grpc", 1))
    for protocol, concurrency in levels:
        for system in _server_systems(ctx, scenario):
            ctx.results.append(_measure_level(ctx, handle, system, scenario, protocol, concurrency))
            save()
    if not rounds:
        ctx.results.extend(_run_baselines(ctx, workers, scenario, ctx.args.reps or scenario.reps))
        save()


def _run_baselines(ctx: _Context, workers: dict[str, baselines.BaselineWorker], scenario: Scenario,
                   reps: int) -> list[Measurement]:
    measured = []
    for kind, worker in workers.items():
        system = "predictor" if kind == "predictor" else "floor"
        if system not in scenario.systems:
            continue
        folds, mirroring = scenario.request.resolve(ctx.deployed_folds)
        job = baselines.Job(ctx.case_files[scenario.volume], folds, mirroring, reps)
        try:
            result, usage = worker.run(job, timeout_s=ctx.args.baseline_timeout)
            measured.append(_baseline_measurement(ctx, system, scenario, result, usage, worker.command))
            LOGGER.info("%s %s: median %.2f s over %d reps", system, scenario.name, result.median_s,
                        len(result.latencies_s))
        except (RuntimeError, TimeoutError) as exc:
            LOGGER.error("%s %s failed: %s", system, scenario.name, exc)
            measured.append(_failed(ctx, system, scenario, str(exc)))
    return measured


def _run_rounds(ctx: _Context, handle: Any, workers: dict[str, baselines.BaselineWorker], scenario: Scenario,
                save: Any) -> None:
    """Concurrency 1 as rounds of one request per system in turn, merged per system afterwards."""
    parts: dict[str, list[Measurement]] = {}
    for index in range(scenario.load.rounds):
        for system in _server_systems(ctx, scenario):
            parts.setdefault(system, []).append(
                _measure_level(ctx, handle, system, scenario, "grpc", 1, round_index=index))
        for measurement in _run_baselines(ctx, workers, scenario, 1):
            parts.setdefault(measurement.system, []).append(measurement)
    for system_parts in parts.values():
        ctx.results.append(_merge(system_parts))
        save()


def _merge_stats(parts: Sequence[Measurement]) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = {}
    for part in parts:
        for model, s in part.model_stats.items():
            m = merged.setdefault(model, {key: 0.0 for key in s})
            for key in ("avg_request_ms", "avg_queue_ms", "avg_compute_ms"):
                m[key] += s[key] * s["requests"]
            m["avg_batch"] += s["avg_batch"] * s["executions"]
            for key in ("requests", "failures", "executions"):
                m[key] += s[key]
    for m in merged.values():
        for key in ("avg_request_ms", "avg_queue_ms", "avg_compute_ms"):
            m[key] = m[key] / m["requests"] if m["requests"] else 0.0
        m["avg_batch"] = m["avg_batch"] / m["executions"] if m["executions"] else 0.0
    return merged


def _merge(parts: Sequence[Measurement]) -> Measurement:
    """One row from rounds of single requests (latencies pooled, resources summed, peaks maxed)."""
    ok = [p for p in parts if p.ok]
    if len(ok) != len(parts):
        bad = next(p for p in parts if not p.ok)
        return replace(bad, error=f"{bad.error} (round {parts.index(bad)} of {len(parts)})")
    latencies = [p.latency_ms["p50"] if p.requests == 1 else p.latency_ms["avg"]
                 for p in ok for _ in range(p.requests)]
    resources = [p.resources for p in ok]
    cpu = sum(r.get("cpu_s") or 0.0 for r in resources)
    wall = sum(r.get("wall_s") or 0.0 for r in resources)
    merged_resources = {
        "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
        "cpu_percent": round(100 * cpu / wall, 1) if wall else None,
        "cpu_s_per_request": round(cpu / len(latencies), 3),
        "peak_rss_mib": max(r.get("peak_rss_mib") or 0.0 for r in resources),
        "loadavg_start": resources[0].get("loadavg_start"), "loadavg_end": resources[-1].get("loadavg_end"),
        "rounds": len(ok), "torch_threads": resources[0].get("torch_threads"),
    }
    by_process: dict[str, float] = {}
    for r in resources:
        for label, mib in (r.get("peak_rss_by_process_mib") or {}).items():
            by_process[label] = max(by_process.get(label, 0.0), mib)
    if by_process:
        merged_resources["peak_rss_by_process_mib"] = by_process
    return replace(
        ok[0], requests=len(latencies), throughput_rps=round(1000.0 / statistics.mean(latencies), 5),
        latency_ms={"avg": round(statistics.mean(latencies), 3),
                    **{f"p{q}": round(_percentile(latencies, q), 3) for q in (50, 90, 95, 99)}},
        resources={k: v for k, v in merged_resources.items() if v is not None},
        model_stats=_merge_stats(ok), command=f"{ok[0].command}  # x{len(ok)} rounds, one request each",
    )


def _failed(ctx: _Context, system: str, scenario: Scenario, error: str) -> Measurement:
    folds, mirroring = scenario.request.resolve(ctx.deployed_folds)
    tiles = ctx.tile_plans[(scenario.volume, mirroring)]
    return Measurement(ctx.plan.name, scenario.name, ctx.variant, system, "inproc", scenario.volume, folds,
                       mirroring, 1, tiles.tiles, tiles.forwards(len(folds)), 0, 0.0, {}, {}, ok=False,
                       error=error)


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _baseline_measurement(ctx: _Context, system: str, scenario: Scenario, result: baselines.BaselineResult,
                          usage: ResourceUsage, command: list[str]) -> Measurement:
    latencies = [s * 1000.0 for s in result.latencies_s]
    # CPU of the timed repetitions only (the worker's process time); the sampled usage also covers
    # the job's untimed set-up (preprocessing the case once to count its tiles)
    resources = {
        **usage.to_dict(), "cpu_s": round(result.cpu_s, 3), "sampled_cpu_s": round(usage.cpu_s, 3),
        "cpu_s_per_request": round(result.cpu_s / len(latencies), 3), "torch_threads": result.torch_threads,
    }
    return Measurement(
        workload=ctx.plan.name, scenario=scenario.name, variant=ctx.variant, system=system, protocol="inproc",
        volume=scenario.volume, folds=tuple(int(f) for f in result.folds), mirroring=result.mirroring,
        concurrency=1, tiles=result.tiles, forwards_per_request=result.forwards_per_request,
        requests=len(latencies), throughput_rps=round(1000.0 / statistics.mean(latencies), 5),
        latency_ms={"avg": round(statistics.mean(latencies), 3),
                    **{f"p{q}": round(_percentile(latencies, q), 3) for q in (50, 90, 95, 99)}},
        resources=resources, command=analyzer.shell_command(command, REPO_ROOT),
    )


# --- whole run ------------------------------------------------------------------------------------------


def _host_info() -> dict[str, Any]:
    import importlib.metadata

    import psutil

    from nnunet_triton.server.exactness import cpu_identity

    cpu = cpu_identity()  # oneDNN picks kernels (and so rounding) by CPU: results name it and its SIMD
    versions = {}
    for package in ("torch", "nnunetv2", "numpy", "tritonclient", "nvidia-pytriton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {
        "host": socket.gethostname(), "cpu_model": cpu["model"], "cpu_simd": cpu["simd"],
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
        "versions": {**versions, "tritonserver": "2.51.0 (pytriton 0.7.0)", "perf_analyzer": "2.48.0"},
        "gpu": "none (CPU only)",
    }


def _workload_info(ctx: _Context) -> dict[str, Any]:
    from nnunet_triton.numerics.model_folder import read_model_folder

    config = read_model_folder(ctx.model_dir)
    plans = json.loads((ctx.model_dir / "plans.json").read_text())
    arch = plans["configurations"][config.configuration]["architecture"]
    volumes = {}
    for volume, case in ctx.cases.items():
        plan = ctx.tile_plans[(volume, False)]
        volumes[volume] = {"image_shape": list(case.image.shape), "spacing": list(case.spacing),
                           "preprocessed_shape": list(plan.preprocessed_shape), "tiles": plan.tiles,
                           "mirror_variants": ctx.tile_plans[(volume, True)].variants}
    try:
        model_folder = str(ctx.model_dir.relative_to(REPO_ROOT))
    except ValueError:
        model_folder = ctx.model_dir.name
    return {"model_folder": model_folder, "configuration": config.configuration,
            "patch_size": list(config.patch_size), "spacing": list(config.spacing),
            "network": arch["network_class_name"].rsplit(".", 1)[-1],
            "features_per_stage": list(arch["arch_kwargs"]["features_per_stage"]),
            "folds": list(ctx.deployed_folds), "volumes": volumes}


def _write(path: Path, meta: dict[str, Any], results: Sequence[Measurement],
           previous: Sequence[dict[str, Any]] = ()) -> None:
    rows = [*previous, *(asdict(m) for m in results)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "measurements": rows}, indent=1))
    tmp.replace(path)


def _appended(results_path: Path, meta: dict[str, Any], rerun: set[tuple[str, str]]) -> list[dict[str, Any]]:
    """``--append``: keep the rows of an earlier results.json that this run does not redo; merge meta."""
    if not results_path.is_file():
        return []
    old = json.loads(results_path.read_text())
    old_meta = old["meta"]
    meta.update(started=old_meta.get("started", meta["started"]),
                loadavg_start=old_meta.get("loadavg_start", meta["loadavg_start"]),
                command=f"{old_meta['command']} && {meta['command']}",
                workloads={**old_meta.get("workloads", {}), **meta["workloads"]},
                build_options={**old_meta.get("build_options", {}), **meta["build_options"]},
                previous_wall_s=old_meta.get("wall_s", 0.0) + old_meta.get("previous_wall_s", 0.0))
    return [row for row in old["measurements"] if (row["workload"], row["scenario"]) not in rerun]


def _parse_build_option(text: str) -> tuple[str, Any]:
    """``key=value`` for a :class:`BuildOptions` field; ints and true/false are converted."""
    key, sep, value = text.partition("=")
    names = {f.name for f in fields(BuildOptions)}
    if not sep or key not in names:
        raise argparse.ArgumentTypeError(
            f"--build-option must be KEY=VALUE with KEY in {sorted(names)}, got {text!r}.")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


def _base_options(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(target=args.target, fold_precision=args.precision,
                        tile_batch_size=args.tile_batch_size, **dict(args.build_option))


def _run_workload(plan: WorkloadPlan, args: argparse.Namespace, out_dir: Path, meta: dict[str, Any],
                  results: list[Measurement], write: Any, variants: Sequence[str]) -> None:
    ctx = _prepare(plan, args, out_dir / "raw", repos.REPOS_ROOT.parent / "runs" / out_dir.name)
    meta["workloads"][plan.name] = _workload_info(ctx)

    def save() -> None:
        write([*results, *ctx.results])

    benchmark = args.suite == "benchmark"
    monolith = None
    if benchmark and _scenarios_for(ctx, "monolith"):
        monolith = repos.monolith_repository(ctx.model_dir, plan.name, device=args.device.split(":")[0])
    for variant in variants:
        ctx.variant = variant
        options = replace(_base_options(args), **TUNING_VARIANTS[variant])
        folds = (0,) if not benchmark and plan.name == "realistic" else None  # tuning: one fold, less memory
        pipeline = repos.pipeline_repository(ctx.model_dir, plan.name, options=options, folds=folds,
                                             variant=variant if benchmark else f"tune-{variant}")
        ctx.served_folds = tuple(version_metadata(pipeline)["folds"])
        meta["build_options"][f"{plan.name}/{variant}"] = json.loads(json.dumps(asdict(options), default=str))
        served = [pipeline] + ([monolith] if monolith is not None else [])
        server = _server(served, ctx.work_dir, _file_label(variant))
        with server as handle, _workers(ctx, pipeline) as workers:
            _warm_up(ctx, handle, io_names.ENDPOINT_MODEL)
            if monolith is not None:
                _warm_up(ctx, handle, MONOLITH_MODEL)
            for scenario in plan.scenarios:
                _run_scenario(ctx, handle, workers, scenario, save)
    save()
    results.extend(ctx.results)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fixture only, concurrency 1-2, short windows")
    p.add_argument("--suite", choices=("benchmark", "tune"), default="benchmark")
    p.add_argument("--workloads", default=None, help="comma list of fixture,realistic (default: by mode)")
    p.add_argument("--variants", default=None, help="tune: comma list of TUNING_VARIANTS keys")
    p.add_argument("--fixtures-root", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    p.add_argument("--results-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--stem", default=None,
                   help="results name (default <date>-<host>[-quick|-tune-<workloads>])")
    p.add_argument("--benchmarks-md", type=Path, default=REPO_ROOT / "BENCHMARKS.md",
                   help="updated after a full benchmark run")
    p.add_argument("--append", action="store_true",
                   help="add to an existing <stem>/results.json, replacing only the scenarios run now")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--target", choices=("cpu", "gpu"), default="cpu", help="repository build target")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32", help="fold networks (fp16: gpu)")
    p.add_argument("--tile-batch-size", type=int, default=BuildOptions.tile_batch_size)
    p.add_argument("--build-option", type=_parse_build_option, action="append", default=[],
                   help="extra BuildOptions field for every pipeline build, e.g. orchestrator_instances=2")
    p.add_argument("--device", default="cpu", help="baselines and monolith: cpu or cuda")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="subset of " + ",".join(SYSTEMS))
    p.add_argument("--scenarios", default="", help="comma list of scenario names (default: all in the plan)")
    p.add_argument("--protocols", default="grpc,http")
    p.add_argument("--max-concurrency", type=int, default=0, help="skip higher levels (0: plan's levels)")
    p.add_argument("--concurrencies", default="",
                   help="comma list of concurrency levels for every scenario, e.g. 1,2,4,8 (default: plan's)")
    p.add_argument("--window-requests", type=int, default=0, help="override the windowed scenarios' size")
    p.add_argument("--reps", type=int, default=0, help="override the baselines' repetitions")
    p.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE", "inherit"), default="inherit",
                   help="inherit (default): what users get; PASSIVE|ACTIVE: export to every process (tuning)")
    p.add_argument("--pa-timeout", type=float, default=3600.0, help="seconds per perf_analyzer run")
    p.add_argument("--baseline-timeout", type=float, default=7200.0, help="seconds per baseline subprocess")
    return p


def _apply_overrides(plan: WorkloadPlan, args: argparse.Namespace) -> WorkloadPlan:
    scenarios = plan.scenarios
    if args.scenarios:
        scenarios = tuple(s for s in scenarios if s.name in args.scenarios)
    if args.concurrencies:
        levels = tuple(int(c) for c in args.concurrencies.split(","))
        if min(levels) < 1:
            raise SystemExit(f"--concurrencies must list levels >= 1, got {args.concurrencies!r}.")
        scenarios = tuple(replace(s, load=replace(s.load, concurrencies=levels)) for s in scenarios)
    if args.window_requests:
        scenarios = tuple(replace(s, load=replace(s.load, window_requests=args.window_requests))
                          if s.load.window_requests else s for s in scenarios)
    if not scenarios:
        raise SystemExit(f"--scenarios {list(args.scenarios)} selects nothing in workload {plan.name!r}.")
    return replace(plan, scenarios=scenarios)


def _select(args: argparse.Namespace) -> tuple[list[WorkloadPlan], list[str]]:
    if args.suite == "tune":
        names = (args.workloads or "fixture").split(",")
        selected = [tuning_plan(name) for name in names]
        default_variants = REALISTIC_TUNING_VARIANTS if names == ["realistic"] else tuple(TUNING_VARIANTS)
        variants = args.variants.split(",") if args.variants else list(default_variants)
        unknown = [v for v in variants if v not in TUNING_VARIANTS]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known: {list(TUNING_VARIANTS)}")
        return [_apply_overrides(p, args) for p in selected], variants
    available = {p.name: p for p in plans(args.quick)}
    names = args.workloads.split(",") if args.workloads else list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; available in this mode: {list(available)}")
    return [_apply_overrides(available[n], args) for n in names], ["default"]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or the tuning suite), write results.json, the report and BENCHMARKS.md."""
    args = _parser().parse_args(argv)
    args.systems = tuple(args.systems.split(","))
    args.protocols = tuple(args.protocols.split(","))
    args.scenarios = tuple(s for s in args.scenarios.split(",") if s)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.omp_wait_policy != "inherit":  # inherited by tritonserver, its stubs and the baseline workers
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    selected, variants = _select(args)
    today = dt.date.today().isoformat()
    suffix = "-quick" if args.quick else ""
    if args.suite == "tune":
        suffix = "-tune-" + "-".join(plan.name for plan in selected)
    stem = args.stem or f"{today}-{socket.gethostname()}{suffix}"
    out_dir = args.results_dir / stem
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.json"
    meta: dict[str, Any] = {
        "stem": stem, "date": today, "started": dt.datetime.now().isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full", "suite": args.suite, "host": _host_info(),
        "command": " ".join(["python -m tools.perf.run", *(argv if argv is not None else sys.argv[1:])]),
        "loadavg_start": list(os.getloadavg()), "workloads": {}, "build_options": {},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: launcher defaults; baselines ACTIVE)"),
    }
    rerun = {(p.name, s.name) for p in selected for s in p.scenarios}
    previous = _appended(results_path, meta, rerun) if args.append else []
    results: list[Measurement] = []
    start = time.perf_counter()
    for plan in selected:
        _run_workload(plan, args, out_dir, meta, results,
                      lambda current: _write(results_path, meta, current, previous), variants)
    meta.update(loadavg_end=list(os.getloadavg()),
                wall_s=round(time.perf_counter() - start + meta.pop("previous_wall_s", 0.0), 1),
                finished=dt.datetime.now().isoformat(timespec="seconds"))
    _write(results_path, meta, results, previous)
    LOGGER.info("wrote %s (%d measurements, %.0f s)", results_path, len(results), meta["wall_s"])
    if args.no_report:
        return 0
    from tools.perf import report

    report_argv = ["--results", str(results_path)]
    if args.suite == "benchmark" and not args.quick and args.benchmarks_md:
        report_argv += ["--benchmarks-md", str(args.benchmarks_md)]
    return report.main(report_argv)


if __name__ == "__main__":
    sys.exit(main())
