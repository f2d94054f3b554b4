"""``make perf-two-models``: two nnU-Net models behind one server, vs each alone, vs two servers.

Two endpoints, each on its own fixture and that fixture's held-out cases (``imagesTs/``):

* ``ct``: ``Dataset901_SynthCT`` 3d_tiny (2 folds, 1 channel);
* ``multi``: ``Dataset903_SynthMulti`` 3d_tiny (1 fold, 2 channels, regions).

Three situations, measured in one run with perf_analyzer (``tools.perf.analyzer``) over gRPC:

1. **alone**: one server holding both endpoints (``build_repository(..., endpoint=VersionChoice(name=...))``);
   only ``ct`` is loaded, then only ``multi``;
2. **both**: the same server, both endpoints loaded at once: two perf_analyzer processes started together
   in ``time_windows`` mode, so both load the server for the same windows;
3. **two-servers**: two tritonservers on the same cores, one repository each (default name ``nnunet``),
   loaded at once in the same way.

Every server is started by ``embedded.start`` (what ``make serve``/``deploy`` run) with nothing tuned and no
``OMP_*``/``NNUNET_TRITON_*`` variable inherited: the shared server gets ONE thread budget over the three
fold models; each of the two servers gets its own budget for all CPUs, which is what a user starting two
servers gets (together they can run more fold threads than there are cores). The three servers stay up for
the whole run (an idle server takes no requests) and the situations run in rounds, the order reversed every
other round, so a drift of the machine's background load hits every situation alike. Requests use all
deployed folds and mirroring off (a request parameter; ``--mirroring`` sends the server default, mirroring
on, and needs windows of a minute), cycling through the held-out cases.

Writes ``<results-dir>/<date>-<host>-two-models[-quick]/`` (``results.json``, ``report.md``, perf_analyzer
CSVs and logs under ``raw/``); a full run whose measurements all succeeded also rewrites the block between
the ``perf-two-models`` markers of BENCHMARKS.md. A full run takes ~10 min on two cores (two rounds of
3 x 15 s windows); ``--quick``: one round of 3 x 8 s windows (~3-4 min), never written to BENCHMARKS.md.

Usage::

    python -m tools.perf.two_models [--quick] [--rounds N] [--window-s S] [--concurrency C]
    python -m tools.perf.two_models --report-only benchmarks/results/<stem>/results.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton import io_names
from nnunet_triton.options import DEFAULT_CLIENT_TIMEOUT_S
from tools.perf import analyzer, benchmarks_md
from tools.perf.input_data import tensor_entry
from tools.perf.workloads import Case, read_image

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["MODELS", "SITUATIONS", "BLOCK", "ModelSpec", "Measurement", "schedule", "input_document",
           "summarize", "ratios", "render_section", "render_report", "main"]

LOGGER = logging.getLogger("tools.perf.two_models")
BLOCK = "perf-two-models"  # its markers in BENCHMARKS.md (tools/perf/benchmarks_md.py)
SITUATIONS = ("alone", "both", "two-servers")
SITUATION_LABELS = {"alone": "alone (one server, only this model loaded)",
                    "both": "both loaded, one server",
                    "two-servers": "both loaded, two servers"}
WINDOWS = 3  # perf_analyzer merges three time windows per measurement (--max-trials 3)
WORK_ROOT = REPO_ROOT / "build" / "perf"


@dataclass(frozen=True)
class ModelSpec:
    """One endpoint of the shared server and the fixture it serves."""

    name: str
    dataset: str
    folder: str = "nnUNetTrainer__nnUNetPlans__3d_tiny"

    def model_dir(self, fixtures_root: Path) -> Path:
        return fixtures_root / self.dataset / self.folder


MODELS = (ModelSpec("ct", "Dataset901_SynthCT"), ModelSpec("multi", "Dataset903_SynthMulti"))


@dataclass(frozen=True)
class Measurement:
    """One perf_analyzer run: one model in one situation of one round."""

    round: int
    situation: str
    model: str
    server: str  # "one" (both endpoints) or "two-<model>" (one repository, default name)
    triton_model: str  # what perf_analyzer loads: the endpoint name, or "nnunet" on a server of its own
    concurrency: int
    requests: int
    throughput_rps: float
    latency_ms: dict[str, float]
    loadavg_start: list[float]
    loadavg_end: list[float]
    started_s: float  # after the step began (the two runs of a "both" step start together)
    wall_s: float
    command: str
    ok: bool = True
    error: str = ""


# --- pure parts: plan, input data, summary, ratios, Markdown ------------------------------------------


def schedule(round_index: int,
             models: Sequence[str] = tuple(m.name for m in MODELS)) -> list[tuple[str, tuple[str, ...]]]:
    """The steps of one round: (situation, models loaded at once); every other round in reverse order."""
    steps = [*(("alone", (m,)) for m in models), ("both", tuple(models)), ("two-servers", tuple(models))]
    return steps if round_index % 2 == 0 else steps[::-1]


def input_document(cases: Sequence[Case]) -> dict[str, Any]:
    """perf_analyzer ``--input-data`` with one entry per case (perf_analyzer sends them in turn)."""
    if not cases:
        raise ValueError("need at least one case.")
    return {"data": [{io_names.IMAGE: tensor_entry(np.asarray(c.image, dtype=np.float32), "b64"),
                      io_names.SPACING: tensor_entry(np.asarray(c.spacing, dtype=np.float64), "b64")}
                     for c in cases]}


def _div(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per model and situation, the successful rounds merged.

    Requests and throughput add up over rounds (throughput: the mean of the rounds, whose windows are
    equally long); the mean latency is the request-weighted mean of the rounds' means (exact); p50/p95
    are perf_analyzer's per-round percentiles weighted by requests (exact for one round).
    """
    summary: dict[str, dict[str, dict[str, float]]] = {}
    models = list(dict.fromkeys(r["model"] for r in rows))
    for model in models:
        for situation in SITUATIONS:
            ok = [r for r in rows if r["model"] == model and r["situation"] == situation and r["ok"]
                  and r["requests"] > 0]
            if not ok:
                continue
            n = sum(r["requests"] for r in ok)

            def weighted(key: str, ok: list = ok, n: int = n) -> float:
                return round(sum(r["latency_ms"][key] * r["requests"] for r in ok) / n, 3)

            summary.setdefault(model, {})[situation] = {
                "rounds": len(ok), "requests": n,
                "throughput_rps": round(statistics.mean(r["throughput_rps"] for r in ok), 4),
                "p50_ms": weighted("p50"), "p95_ms": weighted("p95"), "avg_ms": weighted("avg"),
            }
    return summary


_RATIO_KEYS = ("p50_ms", "p95_ms", "avg_ms", "throughput_rps")


def ratios(summary: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, Any]:
    """both / alone (one server) and one server / two servers (both loaded), per model and metric;
    the two models' throughput added up in each situation where both were loaded."""
    per_model: dict[str, dict[str, dict[str, float | None]]] = {}
    for model, situations in summary.items():
        alone, both, two = (situations.get(s) for s in SITUATIONS)
        entry = {}
        if alone and both:
            entry["both_vs_alone"] = {k: _div(both[k], alone[k]) for k in _RATIO_KEYS}
        if both and two:
            entry["one_vs_two_servers"] = {k: _div(both[k], two[k]) for k in _RATIO_KEYS}
        per_model[model] = entry
    totals: dict[str, float | None] = {}
    for situation in ("both", "two-servers"):
        parts = [s[situation]["throughput_rps"] for s in summary.values() if situation in s]
        totals[situation] = round(sum(parts), 4) if parts and len(parts) == len(summary) else None
    totals["one_vs_two_servers"] = _div(totals["both"], totals["two-servers"])
    return {"per_model": per_model, "total_throughput_rps": totals}


def round_ratios(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, float | None]]]:
    """p50 both/alone and one/two servers of every round on its own (the spread the merged values hide)."""
    out: dict[str, list[dict[str, float | None]]] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        for index in sorted({r["round"] for r in rows}):
            rows_r = [r for r in rows if r["round"] == index]
            s = summarize(rows_r).get(model, {})
            p50 = {k: v["p50_ms"] for k, v in s.items()}
            out.setdefault(model, []).append(
                {"round": index, "both_vs_alone": _div(p50.get("both"), p50.get("alone")),
                 "one_vs_two_servers": _div(p50.get("both"), p50.get("two-servers"))})
    return out


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.3f}"


def _r(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _load(values: Sequence[float] | None) -> str:
    return "?" if not values else f"{values[0]:.2f}"


def _budget_line(budget: Mapping[str, Any] | None) -> str:
    if not budget:
        return "(not recorded)"
    return (f"{budget.get('policy')}: {budget.get('fold_slots')} fold execution(s) at once x "
            f"{budget.get('fold_threads')} thread(s) ({budget.get('reason', '')})")


def _threads(budget: Mapping[str, Any] | None) -> int:
    return (budget or {}).get("fold_slots", 0) * (budget or {}).get("fold_threads", 0)


def _loadavg_by_situation(rows: Sequence[Mapping[str, Any]], model: str, situation: str) -> str:
    ok = [r for r in rows if r["model"] == model and r["situation"] == situation]
    return ", ".join(f"{_load(r['loadavg_start'])} -> {_load(r['loadavg_end'])}" for r in ok) or "-"


def render_section(meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """The results of one run as Markdown (the block between the BENCHMARKS.md markers)."""
    summary = summarize(rows)
    result = ratios(summary)
    settings, host, servers = meta["settings"], meta["host"], meta.get("servers", {})
    cpus = host.get("cpus") or host.get("logical_cpus")
    models = meta.get("models", {})
    model_lines = [f"`{name}` = `{m['model_folder']}` ({len(m['folds'])} fold(s), {m['channels']} "
                   f"channel(s); {len(m['cases'])} held-out case(s))" for name, m in models.items()]
    results = meta.get("results") or f"benchmarks/results/{meta['stem']}/results.json"
    mirroring = "mirroring on (the server default)" if settings["mirroring"] else \
        "mirroring off (request parameter)"
    lines = [
        f"Run `{meta['stem']}` ({meta['mode']}), {meta['started']}, on `{host.get('host')}`: {cpus} CPUs "
        f"({host.get('cpu_model')}). Load average (1 min) {_load(meta.get('loadavg_start'))} before the "
        f"servers started, {_load(meta.get('loadavg_servers_ready'))} once they were up and warmed up, "
        f"{_load(meta.get('loadavg_end'))} at the end; our own busy servers add up to about {cpus}. Raw "
        f"numbers: `{results}` (perf_analyzer CSVs and logs in `raw/` beside it).", "",
        f"- Models: {'; '.join(model_lines)}.",
        f"- Load: perf_analyzer 2.48 over gRPC, concurrency {settings['concurrency']} per model (`--sync`), "
        f"all deployed folds, {mirroring}, the held-out cases in turn; {WINDOWS} time windows of "
        f"{settings['window_s']:g} s per measurement; {settings['rounds']} round(s) of the situations, the "
        "order reversed every other round. *both*: two perf_analyzer processes started together.",
        "- Servers: `embedded.start` with the launcher's defaults, nothing tuned, no `OMP_*` or "
        "`NNUNET_TRITON_*` variable inherited. All three stay up for the whole run; an idle one takes no "
        "requests.",
        f"  - one server (`ct` + `multi`, one thread budget over all fold models): "
        f"{_budget_line(servers.get('one', {}).get('thread_budget'))}",
    ]
    for spec in models:
        budget = servers.get(f"two-{spec}", {}).get("thread_budget")
        lines.append(f"  - server of `{spec}` alone (default name `nnunet`): {_budget_line(budget)}")
    threads = [_threads(v.get("thread_budget")) for key, v in servers.items() if key.startswith("two-")]
    lines += [
        f"  - The two servers each size their thread budget for all {cpus} CPUs, as two servers a user "
        f"starts would: together up to {sum(threads)} fold threads at once on {cpus} CPUs, against "
        f"{_threads(servers.get('one', {}).get('thread_budget'))} for the one server.", "",
        "| model | situation | p50 (s) | p95 (s) | mean (s) | throughput (req/s) | requests | "
        "load average start -> end |", "|---|---|---|---|---|---|---|---|",
    ]
    for model, situations in summary.items():
        for situation in SITUATIONS:
            s = situations.get(situation)
            if s is None:
                lines.append(f"| `{model}` | {SITUATION_LABELS[situation]} | failed | | | | | |")
                continue
            lines.append(f"| `{model}` | {SITUATION_LABELS[situation]} | {_s(s['p50_ms'])} | "
                         f"{_s(s['p95_ms'])} | {_s(s['avg_ms'])} | {s['throughput_rps']:.3f} | "
                         f"{s['requests']} | {_loadavg_by_situation(rows, model, situation)} |")
    lines += ["", "| model | both / alone: p50 | p95 | mean | throughput | one server / two servers: p50 | "
              "p95 | mean | throughput |", "|---|---|---|---|---|---|---|---|---|"]
    for model, entry in result["per_model"].items():
        a, t = entry.get("both_vs_alone", {}), entry.get("one_vs_two_servers", {})
        lines.append(f"| `{model}` | " + " | ".join(_r(a.get(k)) for k in _RATIO_KEYS) + " | "
                     + " | ".join(_r(t.get(k)) for k in _RATIO_KEYS) + " |")
    totals = result["total_throughput_rps"]
    per_round = round_ratios(rows)
    lines += ["", f"Both models together: {_r(totals['both'])} req/s on one server, "
              f"{_r(totals['two-servers'])} req/s on two servers "
              f"(one / two = **{_r(totals['one_vs_two_servers'])}**). Latency ratios below 1 and throughput "
              "ratios above 1 favour the first-named side.", ""]
    if settings["rounds"] > 1:
        spread = "; ".join(
            f"`{model}` " + ", ".join(f"round {r['round'] + 1}: both/alone {_r(r['both_vs_alone'])}, "
                                      f"one/two {_r(r['one_vs_two_servers'])}" for r in entries)
            for model, entries in per_round.items())
        lines.append(f"p50 ratios per round: {spread}. With several rounds p50 and p95 are perf_analyzer's "
                     "per-round percentiles weighted by requests; the mean is exact.")
        lines.append("")
    failed = [r for r in rows if not r["ok"]]
    if failed:
        lines += [f"**{len(failed)} measurement(s) failed**: " + "; ".join(
            f"round {r['round'] + 1} {r['situation']} `{r['model']}`: {r['error']}" for r in failed), ""]
    lines.append(f"Command: `{meta['command']}`")
    return "\n".join(lines) + "\n"


def render_report(meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """``report.md``: the section plus every measurement and its perf_analyzer command."""
    lines = ["# Several models on one server", "", render_section(meta, rows), "## Every measurement", "",
             "| round | situation | model | server | Triton model | requests | p50 (s) | p95 (s) | "
             "mean (s) | req/s | started (s) | load avg |", "|---" * 12 + "|"]
    for r in rows:
        lat = r["latency_ms"]
        lines.append(
            f"| {r['round'] + 1} | {r['situation']} | `{r['model']}` | {r['server']} | "
            f"`{r['triton_model']}` | {r['requests']} | {_s(lat.get('p50'))} | {_s(lat.get('p95'))} | "
            f"{_s(lat.get('avg'))} | "
            f"{r['throughput_rps']:.3f} | {r['started_s']:.2f} | {_load(r['loadavg_start'])} -> "
            f"{_load(r['loadavg_end'])} |" + ("" if r["ok"] else f" failed: {r['error']}"))
    lines += ["", "## Commands", "", *(f"- `{r['command']}`" for r in rows)]
    return "\n".join(lines) + "\n"


# --- the run: repositories, servers, perf_analyzer -------------------------------------------------------


def held_out_cases(model_dir: Path) -> list[Case]:
    """Every case of the fixture's ``imagesTs/`` (all channels), in name order."""
    images = model_dir.parent / "imagesTs"
    ids = sorted(f.name[: -len("_0000.nii.gz")] for f in images.glob("*_0000.nii.gz"))
    if not ids:
        raise FileNotFoundError(f"no held-out case in {images}")
    return [read_image(sorted(images.glob(f"{i}_[0-9][0-9][0-9][0-9].nii.gz")), i) for i in ids]


def _build(fixtures_root: Path, root: Path) -> dict[str, Path]:
    """The shared repository (``ct`` + ``multi``) and one repository per model (default name)."""
    from nnunet_triton.builder.model_specs import BuildOptions
    from nnunet_triton.builder.repository import VersionChoice, build_repository
    from tools.perf import repos

    built = {}
    # light_export: the builder's reload check once and exports cached; the served models are the same
    with repos.light_export():
        for spec in MODELS:
            model_dir = spec.model_dir(fixtures_root)
            start = time.perf_counter()
            built["one"] = build_repository(model_dir, root / "one", options=BuildOptions(),
                                            endpoint=VersionChoice(name=spec.name)).out
            built[f"two-{spec.name}"] = build_repository(model_dir, root / f"two-{spec.name}",
                                                         options=BuildOptions()).out
            LOGGER.info("repositories of %s (shared and alone) ready: %.1f s", spec.name,
                        time.perf_counter() - start)
    return built


def _warm_up(url: str, triton_model: str, cases: Sequence[Case], mirroring: bool) -> None:
    from nnunet_triton.client.client import NnunetClient

    with NnunetClient(url, "grpc", timeout_s=DEFAULT_CLIENT_TIMEOUT_S, endpoint=triton_model) as client:
        for case in cases:
            start = time.perf_counter()
            client.segment(case.image, case.spacing, mirroring=mirroring)
            LOGGER.info("warm-up %s %s: %.2f s", triton_model, case.name, time.perf_counter() - start)


def _settings(handle: Any, triton_model: str, input_file: Path,
              args: argparse.Namespace) -> analyzer.AnalyzerSettings:
    return analyzer.AnalyzerSettings(
        model=triton_model, url=handle.grpc_url, protocol="grpc", input_data=input_file,
        concurrency=args.concurrency, control_token=handle.control_token,
        measurement_mode="time_windows", measurement_interval_ms=int(args.window_s * 1000),
        measurement_request_count=1,  # unused in time_windows mode
        max_trials=WINDOWS, request_parameters=() if args.mirroring else (("mirroring", "false", "bool"),))


def _step(round_index: int, situation: str, models: Sequence[str], handles: Mapping[str, Any],
          input_files: Mapping[str, Path], raw_dir: Path, args: argparse.Namespace) -> list[Measurement]:
    """One situation: a perf_analyzer per model, all started together."""
    jobs = []
    for model in models:
        server = f"two-{model}" if situation == "two-servers" else "one"
        triton_model = io_names.ENDPOINT_MODEL if situation == "two-servers" else model
        jobs.append((model, server, triton_model,
                     _settings(handles[server], triton_model, input_files[model], args)))
    load_start = list(os.getloadavg())
    begin = time.perf_counter()

    def run(job: tuple[str, str, str, analyzer.AnalyzerSettings]) -> tuple[float, analyzer.AnalyzerResult]:
        started = time.perf_counter() - begin
        label = f"r{round_index + 1}-{situation}-{job[0]}"
        return started, analyzer.run(job[3], raw_dir, label, timeout_s=args.pa_timeout)

    with ThreadPoolExecutor(len(jobs)) as pool:
        outcomes = list(pool.map(run, jobs))
    load_end = list(os.getloadavg())
    measured = []
    for (model, server, triton_model, settings), (started, result) in zip(jobs, outcomes, strict=True):
        m = result.metrics
        measured.append(Measurement(
            round=round_index, situation=situation, model=model, server=server, triton_model=triton_model,
            concurrency=settings.concurrency, requests=int(m.get("requests", 0)),
            throughput_rps=round(m.get("throughput_rps", 0.0), 5),
            latency_ms={k.removesuffix("_ms"): round(m[k], 3)
                        for k in ("avg_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms") if k in m},
            loadavg_start=load_start, loadavg_end=load_end, started_s=round(started, 3),
            wall_s=round(result.wall_s, 2), command=analyzer.shell_command(result.command, REPO_ROOT),
            ok=result.ok, error="" if result.ok
            else f"perf_analyzer exit {result.returncode}; see raw/{result.log_path.name}"))
        LOGGER.info("round %d %s %s: %s req, %.3f req/s, p50 %.3f s (%s)", round_index + 1, situation, model,
                    measured[-1].requests, measured[-1].throughput_rps,
                    measured[-1].latency_ms.get("p50", float("nan")) / 1000, "ok" if result.ok else "FAILED")
    return measured


def _write(path: Path, meta: Mapping[str, Any], rows: Sequence[Measurement]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "measurements": [asdict(r) for r in rows]}, indent=1))
    tmp.replace(path)


def _relative(path: Path) -> str:
    path = path.absolute()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _model_info(spec: ModelSpec, model_dir: Path, cases: Sequence[Case], repository: Path) -> dict[str, Any]:
    from nnunet_triton.repository.registry import version_metadata

    folds = version_metadata(repository, spec.name)["folds"]
    return {"model_folder": _relative(model_dir), "folds": list(folds),
            "channels": int(cases[0].image.shape[0]),
            "cases": [{"name": c.name, "shape": list(c.image.shape), "spacing": list(c.spacing)}
                      for c in cases]}


def _finish(meta: dict[str, Any], rows: Sequence[Mapping[str, Any]], out_dir: Path,
            page: Path | None) -> None:
    (out_dir / "report.md").write_text(render_report(meta, rows))
    LOGGER.info("wrote %s", out_dir / "report.md")
    if page is None:
        return
    if meta["mode"] != "full" or not rows or not all(r["ok"] for r in rows):
        LOGGER.warning("not updating %s: only a full run whose measurements all succeeded does",
                       page)
        return
    benchmarks_md.replace_block(page, BLOCK, render_section(meta, rows).rstrip() + "\n")
    LOGGER.info("updated %s", page)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="one round of 8 s windows (~3-4 min); no BENCHMARKS.md")
    p.add_argument("--rounds", type=int, default=0, help="rounds of the situations (default: 2, quick 1)")
    p.add_argument("--window-s", type=float, default=0.0,
                   help=f"length of each of the {WINDOWS} time windows (default: 15 s, quick 8 s)")
    p.add_argument("--concurrency", type=int, default=2, help="concurrent requests per model")
    p.add_argument("--mirroring", action="store_true",
                   help="send the server default (mirroring on: ~10x slower; use --window-s 60 or more)")
    p.add_argument("--fixtures-root", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    p.add_argument("--results-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--stem", default=None, help="results name (default <date>-<host>-two-models[-quick])")
    p.add_argument("--benchmarks-md", type=Path, default=REPO_ROOT / "BENCHMARKS.md",
                   help="rewritten between the perf-two-models markers after a full run")
    p.add_argument("--no-benchmarks-md", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--pa-timeout", type=float, default=900.0, help="seconds per perf_analyzer run")
    p.add_argument("--report-only", type=Path, default=None,
                   help="re-render a results.json (and BENCHMARKS.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Build, serve, measure the three situations, write results.json, report.md and BENCHMARKS.md."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    page = None if args.no_benchmarks_md else args.benchmarks_md
    if args.report_only is not None:
        document = json.loads(args.report_only.read_text())
        _finish(document["meta"], document["measurements"], args.report_only.parent, page)
        return 0
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.window_s = args.window_s or (8.0 if args.quick else 15.0)
    if args.rounds < 1 or args.window_s <= 0 or args.concurrency < 1:
        raise SystemExit("--rounds, --window-s and --concurrency must be positive.")
    from tools.perf.run import _host_info, _server

    removed = sorted(k for k in os.environ if k.startswith(("OMP_", "NNUNET_TRITON_")))
    for key in removed:  # the servers get exactly the launcher's defaults
        del os.environ[key]
    today = dt.date.today().isoformat()
    stem = args.stem or f"{today}-{socket.gethostname()}-two-models" + ("-quick" if args.quick else "")
    out_dir, work_dir = args.results_dir / stem, WORK_ROOT / "runs" / stem
    raw_dir = out_dir / "raw"
    for d in (raw_dir, work_dir):
        d.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "stem": stem, "date": today, "started": dt.datetime.now().isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "command": " ".join(["python -m tools.perf.two_models",
                             *(argv if argv is not None else sys.argv[1:])]),
        "host": {**_host_info(), "cpus": len(os.sched_getaffinity(0))},
        "loadavg_start": list(os.getloadavg()), "environment_removed": removed,
        "settings": {"concurrency": args.concurrency, "window_s": args.window_s, "windows": WINDOWS,
                     "rounds": args.rounds, "mirroring": args.mirroring, "protocol": "grpc",
                     "measurement_mode": "time_windows", "build_options": "BuildOptions() defaults"},
    }
    results_path = out_dir / "results.json"
    meta["results"] = _relative(results_path)
    start = time.perf_counter()
    cases = {spec.name: held_out_cases(spec.model_dir(args.fixtures_root)) for spec in MODELS}
    input_files = {}
    for name, model_cases in cases.items():
        input_files[name] = work_dir / f"input-data-{name}.json"
        input_files[name].write_text(json.dumps(input_document(model_cases)))
    repositories = _build(args.fixtures_root, WORK_ROOT / "repos" / "two-models")
    meta["models"] = {spec.name: _model_info(spec, spec.model_dir(args.fixtures_root), cases[spec.name],
                                             repositories["one"]) for spec in MODELS}
    rows: list[Measurement] = []
    with contextlib.ExitStack() as stack:
        handles = {key: stack.enter_context(_server([repo], work_dir, key))
                   for key, repo in repositories.items()}
        meta["servers"] = {key: {"repository": _relative(repo), "thread_budget": handles[key].thread_budget}
                           for key, repo in repositories.items()}
        for spec in MODELS:
            _warm_up(handles["one"].grpc_url, spec.name, cases[spec.name], args.mirroring)
            _warm_up(handles[f"two-{spec.name}"].grpc_url, io_names.ENDPOINT_MODEL, cases[spec.name],
                     args.mirroring)
        meta["loadavg_servers_ready"] = list(os.getloadavg())
        for index in range(args.rounds):
            for situation, models in schedule(index):
                rows += _step(index, situation, models, handles, input_files, raw_dir, args)
                _write(results_path, meta, rows)
    meta.update(loadavg_end=list(os.getloadavg()), wall_s=round(time.perf_counter() - start, 1),
                finished=dt.datetime.now().isoformat(timespec="seconds"))
    _write(results_path, meta, rows)
    LOGGER.info("wrote %s (%d measurements, %.0f s)", results_path, len(rows), meta["wall_s"])
    _finish(meta, [asdict(r) for r in rows], out_dir, page)
    sys.stdout.write(render_section(meta, [asdict(r) for r in rows]))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
