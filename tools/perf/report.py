"""Turn a benchmark's ``results.json`` into ``<date>-<host>.md``, PNG plots and the BENCHMARKS.md summary.

The three ratios (targets on the 2-core CPU machine in brackets):

- endpoint latency / nnUNetPredictor (<= 1.05): endpoint p50 at concurrency 1 over gRPC vs the
  median of ``predict_single_npy_array``, same case, folds and mirroring;
- endpoint throughput / monolith (>= 1.3 at concurrency 4): same scenario, protocol and concurrency;
- end-to-end / network floor (<= 1.15): endpoint p50 at concurrency 1 vs the median time of the
  fold networks' forwards alone for the same tiles.

Usage::

    python -m tools.perf.report --results benchmarks/results/<stem>/results.json \
        [--benchmarks-md BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tools.perf import benchmarks_md as _benchmarks_md

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["TARGETS", "ratios", "render_report", "plot", "main"]

TARGETS = {"latency_vs_predictor": 1.05, "throughput_vs_monolith_c4": 1.3, "end_to_end_vs_floor": 1.15}
BLOCK = "perf-results"  # its markers in BENCHMARKS.md (tools/perf/benchmarks_md.py)
Row = dict[str, Any]


# --- selection helpers -----------------------------------------------------------------------------------


def _ok(rows: Iterable[Row]) -> list[Row]:
    return [r for r in rows if r.get("ok") and r.get("latency_ms")]


def _find(rows: Sequence[Row], **where: Any) -> Row | None:
    for row in rows:
        if all(row.get(k) == v for k, v in where.items()):
            return row
    return None


def _p50_s(row: Row) -> float:
    return row["latency_ms"]["p50"] / 1000.0


def _cpu(row: Row) -> float | None:
    return row.get("resources", {}).get("cpu_s_per_request")


def _cpu_ratio(a: Row, b: Row) -> float | None:
    return _cpu(a) / _cpu(b) if _cpu(a) and _cpu(b) else None


def _scenarios(rows: Sequence[Row]) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for row in rows:
        seen[(row["workload"], row["scenario"])] = None
    return list(seen)


def others_load(row: Row) -> float | None:
    """Estimated load of OTHER processes during a row: mean 1-min load minus the row's own CPU use.

    The load average counts runnable threads, ours included; one busy core of our own adds ~1.
    """
    res = row.get("resources", {})
    start, end = res.get("loadavg_start"), res.get("loadavg_end")
    if not start or not end or res.get("cpu_percent") is None:
        return None
    return (start[0] + end[0]) / 2 - res["cpu_percent"] / 100.0


def _noisy(row: Row, cores: int) -> bool:
    others = others_load(row)
    return others is not None and others >= cores / 2


# --- ratios --------------------------------------------------------------------------------------------


def ratios(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """The three ratios for every scenario that has both sides (default variant only)."""
    rows = [r for r in _ok(rows) if r["variant"] == "default"]
    result: dict[str, list[Row]] = {"latency_vs_predictor": [], "throughput_vs_monolith": [],
                                    "end_to_end_vs_floor": []}
    for workload, scenario in _scenarios(rows):
        key = {"workload": workload, "scenario": scenario}
        endpoint = _find(rows, **key, system="endpoint", protocol="grpc", concurrency=1)
        predictor = _find(rows, **key, system="predictor")
        floor = _find(rows, **key, system="floor")
        for name, other in (("latency_vs_predictor", predictor), ("end_to_end_vs_floor", floor)):
            if endpoint and other:
                result[name].append(
                    {**key, "endpoint_s": _p50_s(endpoint), "other_s": _p50_s(other),
                     "ratio": _p50_s(endpoint) / _p50_s(other), "forwards": endpoint["forwards_per_request"],
                     "endpoint_cpu": _cpu(endpoint), "other_cpu": _cpu(other),
                     "cpu_ratio": _cpu_ratio(endpoint, other),
                     "requests": (endpoint["requests"], other["requests"])})
        for row in rows:
            if row["system"] != "endpoint" or (row["workload"], row["scenario"]) != (workload, scenario):
                continue
            monolith = _find(rows, **key, system="monolith", protocol=row["protocol"],
                             concurrency=row["concurrency"])
            if monolith and monolith["throughput_rps"] > 0:
                result["throughput_vs_monolith"].append(
                    {**key, "protocol": row["protocol"], "concurrency": row["concurrency"],
                     "endpoint_rps": row["throughput_rps"], "other_rps": monolith["throughput_rps"],
                     "ratio": row["throughput_rps"] / monolith["throughput_rps"],
                     "endpoint_cpu": _cpu(row), "other_cpu": _cpu(monolith),
                     "cpu_ratio": _cpu_ratio(row, monolith)})
    return result


def _verdict(value: float, target: float, higher_is_better: bool) -> str:
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "**missed**"


def _latency_table(rows: Sequence[Row], other: str, target: float) -> list[str]:
    lines = [f"| workload | scenario | forwards/request | requests (endpoint/{other}) | endpoint s | "
             f"{other} s | ratio | target | endpoint CPU s/req | {other} CPU s/req | CPU ratio |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for x in rows:
        lines.append(f"| {x['workload']} | {x['scenario']} | {x['forwards']} | "
                     f"{x['requests'][0]}/{x['requests'][1]} | {x['endpoint_s']:.2f} | {x['other_s']:.2f} | "
                     f"{x['ratio']:.3f} | {_verdict(x['ratio'], target, False)} | "
                     f"{_fmt(x['endpoint_cpu'])} | {_fmt(x['other_cpu'])} | {_fmt(x['cpu_ratio'], '.3f')} |")
    return lines


def _ratio_tables(r: dict[str, list[Row]]) -> list[str]:
    lines = [f"Endpoint latency / nnUNetPredictor (target <= {TARGETS['latency_vs_predictor']}; p50 at "
             "concurrency 1 over gRPC vs the median of `predict_single_npy_array`). The CPU ratio (CPU "
             "seconds per request, all processes of each system) does not depend on how much of the machine "
             "other jobs took:", "", *_latency_table(r["latency_vs_predictor"], "nnUNetPredictor",
                                               TARGETS["latency_vs_predictor"])]
    lines += ["", f"Endpoint throughput / monolith (target >= {TARGETS['throughput_vs_monolith_c4']} at "
              "concurrency 4):", "",
              "| workload | scenario | protocol | concurrency | endpoint req/s | monolith req/s | ratio | "
              "endpoint CPU s/req | monolith CPU s/req |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for x in r["throughput_vs_monolith"]:
        mark = ""
        if x["concurrency"] == 4:
            mark = " (" + _verdict(x["ratio"], TARGETS["throughput_vs_monolith_c4"], True) + ")"
        lines.append(f"| {x['workload']} | {x['scenario']} | {x['protocol']} | {x['concurrency']} | "
                     f"{x['endpoint_rps']:.4f} | {x['other_rps']:.4f} | {x['ratio']:.3f}{mark} | "
                     f"{_fmt(x['endpoint_cpu'])} | {_fmt(x['other_cpu'])} |")
    lines += ["", f"End-to-end / network floor (target <= {TARGETS['end_to_end_vs_floor']}; endpoint p50 at "
              "concurrency 1 vs the fold networks' forwards alone, same tiles):", "",
              *_latency_table(r["end_to_end_vs_floor"], "floor", TARGETS["end_to_end_vs_floor"])]
    return lines


# --- tables --------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "" if value is None else format(value, spec)


def _main_table(rows: Sequence[Row], cores: int) -> list[str]:
    lines = ["| workload | scenario | variant | system | protocol | folds | mirroring | tiles | forwards | "
             "concurrency | requests | req/s | p50 s | p95 s | p99 s | CPU s/req | CPU % | peak RSS MiB | "
             "load1 start/end | others' load |",
             "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in rows:
        lat, res = row.get("latency_ms", {}), row.get("resources", {})
        load_start = (res.get("loadavg_start") or [None])[0]
        load_end = (res.get("loadavg_end") or [None])[0]
        noisy = " (noisy)" if _noisy(row, cores) else ""
        status = "" if row.get("ok") else f" FAILED: {row.get('error', '')}"
        lines.append(
            f"| {row['workload']} | {row['scenario']} | {row['variant']} | {row['system']}{status} | "
            f"{row['protocol']} | {','.join(map(str, row['folds']))} | "
            f"{'on' if row['mirroring'] else 'off'} | "
            f"{row['tiles']} | {row['forwards_per_request']} | {row['concurrency']} | {row['requests']} | "
            f"{_fmt(row['throughput_rps'], '.4f')} | "
            f"{_fmt(lat.get('p50') and lat['p50'] / 1000)} | {_fmt(lat.get('p95') and lat['p95'] / 1000)} | "
            f"{_fmt(lat.get('p99') and lat['p99'] / 1000)} | {_fmt(res.get('cpu_s_per_request'))} | "
            f"{_fmt(res.get('cpu_percent'), '.0f')} | {_fmt(res.get('peak_rss_mib'), '.0f')} | "
            f"{_fmt(load_start)}/{_fmt(load_end)} | {_fmt(others_load(row), '.1f')}{noisy} |")
    return lines


def _model_stats_table(rows: Sequence[Row]) -> list[str]:
    lines = ["| workload | scenario | variant | protocol | concurrency | model | requests | executions | "
             "avg batch | avg queue ms | avg compute ms |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if row["system"] != "endpoint":
            continue
        for model, s in row.get("model_stats", {}).items():
            lines.append(f"| {row['workload']} | {row['scenario']} | {row['variant']} | {row['protocol']} | "
                         f"{row['concurrency']} | {model} | {s['requests']:.0f} | {s['executions']:.0f} | "
                         f"{s['avg_batch']:.2f} | {s['avg_queue_ms']:.1f} | {s['avg_compute_ms']:.1f} |")
    return lines


def _scaling_table(rows: Sequence[Row]) -> list[str]:
    rows = [r for r in _ok(rows) if r["variant"] == "default" and r["concurrency"] == 1
            and r["protocol"] in ("grpc", "inproc") and r["folds"] == [0] and not r["mirroring"]]
    by_volume: dict[tuple[str, str], dict[str, Row]] = defaultdict(dict)
    for row in rows:
        by_volume[(row["workload"], row["volume"])].setdefault(row["system"], row)
    if not any(w == "realistic" for w, _ in by_volume):
        return []
    lines = ["| volume | tiles | endpoint s | nnUNetPredictor s | network floor s | endpoint s/tile | "
             "floor s/tile |", "|---|---:|---:|---:|---:|---:|---:|"]
    ordered = sorted(by_volume.items(), key=lambda kv: next(iter(kv[1].values()))["tiles"])
    for (workload, volume), systems in ordered:
        if workload != "realistic" or "endpoint" not in systems:
            continue
        tiles = systems["endpoint"]["tiles"]
        endpoint = _p50_s(systems["endpoint"])
        predictor = _p50_s(systems["predictor"]) if "predictor" in systems else None
        floor = _p50_s(systems["floor"]) if "floor" in systems else None
        lines.append(f"| {volume} | {tiles} | {endpoint:.2f} | {_fmt(predictor)} | {_fmt(floor)} | "
                     f"{endpoint / tiles:.2f} | {_fmt(floor and floor / tiles)} |")
    return lines


def _tuning_table(rows: Sequence[Row]) -> list[str]:
    rows = [r for r in _ok(rows) if r["system"] == "endpoint"]
    variants = sorted({r["variant"] for r in rows})
    if variants == ["default"] or not variants:
        return []
    lines = ["| workload | variant | concurrency | req/s | p50 s | p95 s | CPU % | throughput vs default | "
             "p50 vs default |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in sorted(rows, key=lambda r: (r["workload"], r["concurrency"], r["variant"] != "default",
                                            r["variant"])):
        base = _find(rows, workload=row["workload"], scenario=row["scenario"], variant="default",
                     protocol=row["protocol"], concurrency=row["concurrency"])
        thr = f"{row['throughput_rps'] / base['throughput_rps']:.2f}" if base else ""
        lat = f"{_p50_s(row) / _p50_s(base):.2f}" if base else ""
        lines.append(f"| {row['workload']} | {row['variant']} | {row['concurrency']} | "
                     f"{row['throughput_rps']:.4f} | {_p50_s(row):.3f} | "
                     f"{row['latency_ms']['p95'] / 1000:.3f} | "
                     f"{_fmt(row['resources'].get('cpu_percent'), '.0f')} | {thr} | {lat} |")
    return lines


# --- plots ---------------------------------------------------------------------------------------------


def _series(subset: Sequence[Row]) -> dict[str, list[Row]]:
    """One line per system and protocol (and per variant when several were measured)."""
    several = len({r["variant"] for r in subset}) > 1
    series: dict[str, list[Row]] = defaultdict(list)
    for r in subset:
        label = f"{r['system']} ({r['protocol']})" + (f" {r['variant']}" if several else "")
        series[label].append(r)
    return {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in sorted(series.items())}


def _figure(workload: str, scenario: str, kind: str, series: dict[str, list[Row]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    with_p95 = len(series) <= 4  # p95 lines only while the plot stays readable
    for label, points in series.items():
        xs = [p["concurrency"] for p in points]
        if kind == "throughput":
            ax.plot(xs, [p["throughput_rps"] for p in points], marker="o", label=label)
            continue
        p50 = [p["latency_ms"]["p50"] / 1000 for p in points]
        line = ax.plot(xs, p50, marker="o", label=f"{label} p50")[0]
        if with_p95:
            ax.plot(xs, [p["latency_ms"]["p95"] / 1000 for p in points], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{label} p95")
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("throughput (requests/s)" if kind == "throughput" else "latency (s)")
    ax.set_title(f"{workload} / {scenario}: {kind} vs concurrency")
    ax.set_xticks(sorted({p["concurrency"] for points in series.values() for p in points}))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(rows: Sequence[Row], plots_dir: Path) -> list[Path]:
    """Throughput and latency (p50, and p95 dashed) vs concurrency, one pair per scenario with several
    concurrency levels; tuning variants are lines of the same plot."""
    rows = [r for r in _ok(rows) if r["system"] in ("endpoint", "monolith")]
    written = []
    plots_dir.mkdir(parents=True, exist_ok=True)
    for workload, scenario in _scenarios(rows):
        subset = [r for r in rows if (r["workload"], r["scenario"]) == (workload, scenario)]
        if len({r["concurrency"] for r in subset}) < 2:
            continue
        stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{workload}-{scenario}")
        for kind in ("throughput", "latency"):
            path = plots_dir / f"{stem}-{kind}.png"
            _figure(workload, scenario, kind, _series(subset), path)
            written.append(path)
    return written


# --- documents -----------------------------------------------------------------------------------------


def _rel(path: Path, start: Path) -> str:
    try:
        return str(path.resolve().relative_to(start.resolve()))
    except ValueError:
        return str(path)


def _header(meta: dict[str, Any]) -> list[str]:
    host = meta["host"]
    versions = ", ".join(f"{k} {v}" for k, v in host.get("versions", {}).items())
    load_start, load_end = meta.get("loadavg_start", [0])[0], meta.get("loadavg_end", [0])[0]
    cores = host.get("logical_cpus") or 1
    lines = [
        f"- Date: {meta.get('started', meta['date'])} -> {meta.get('finished', '(incomplete)')}, "
        f"wall time {meta.get('wall_s', 0) / 60:.1f} min, mode {meta['mode']}, suite {meta['suite']}",
        f"- Host: {host['host']}, {host['cpu_model']} (SIMD: {host.get('cpu_simd') or 'not recorded'}), "
        f"{host['logical_cpus']} logical CPUs, {host['memory_gib']} GiB RAM, GPU: {host['gpu']}",
        f"- Software: Python {host['python']}, {versions}",
        f"- Command: `{meta['command'].strip()}`",
        f"- 1-min load average: {load_start:.2f} at start, {load_end:.2f} at end "
        f"({cores} CPUs; each row below also gives it before/after its measurement).",
    ]
    lines.append(f"- *others' load* = mean 1-min load average during a row minus that row's own CPU use "
                 f"(cores): rows where other processes kept >= {cores / 2:g} of the {cores} CPUs busy are "
                 "marked (noisy). On a shared machine compare rows measured close together (the rounds "
                 "interleave the systems request by request), and prefer the CPU-seconds-per-request ratios, "
                 "which do not depend on the CPU share a system got.")
    return lines


def _workloads_section(meta: dict[str, Any]) -> list[str]:
    lines = ["| workload | model | configuration | network | patch | target spacing | folds | volume | "
             "image shape (C,z,y,x) | spacing | preprocessed | tiles |",
             "|---|---|---|---|---|---|---|---|---|---|---|---:|"]
    for name, w in meta.get("workloads", {}).items():
        for volume, v in w["volumes"].items():
            lines.append(
                f"| {name} | {w['model_folder']} | {w['configuration']} | {w['network']} "
                f"{w['features_per_stage']} | {w['patch_size']} | {[round(s, 3) for s in w['spacing']]} | "
                f"{w['folds']} | {volume} | {v['image_shape']} | {[round(s, 3) for s in v['spacing']]} | "
                f"{v['preprocessed_shape']} | {v['tiles']} (x{v['mirror_variants']} with mirroring) |")
    return lines


def _commands(rows: Sequence[Row]) -> list[str]:
    seen: dict[str, str] = {}
    for row in rows:
        key = f"{row['system']} ({row['protocol']})"
        if row.get("command") and key not in seen:
            seen[key] = row["command"]
    return [line for key, command in seen.items() for line in (f"- {key}:", "", f"  `{command}`", "")]


def render_report(meta: dict[str, Any], rows: Sequence[Row], plot_paths: Sequence[Path], md_path: Path
                  ) -> str:
    cores = meta["host"].get("logical_cpus") or 1
    r = ratios(rows)
    sections = [f"# Benchmark {meta['stem']}", "", *_header(meta), "", "## Workloads", "",
                *_workloads_section(meta), "", "## Ratios", "", *_ratio_tables(r), "",
                "## All measurements", "",
                "Latencies are perf_analyzer's client-side percentiles (three merged count windows, one "
                "`--request-count` window, or rounds of single requests pooled); baselines (protocol "
                "`inproc`) give the percentiles of their repetitions. req/s: concurrency / mean latency for "
                "count windows (Little's law; perf_analyzer's own value, quantized by whole-second windows, "
                "is kept as `pa_throughput_rps` in results.json), perf_analyzer's requests / window time for "
                "`--request-count` runs, 1 / mean latency for rounds and baselines. "
                "CPU and peak RSS: tritonserver + every Python stub (psutil, summed RSS), or the baseline "
                "process; perf_analyzer's own CPU is not counted.", "", *_main_table(rows, cores), ""]
    scaling = _scaling_table(rows)
    if scaling:
        title = "## Cost vs volume size (realistic, 1 fold, no mirroring, concurrency 1)"
        sections += [title, "", *scaling, ""]
    tuning = _tuning_table(rows)
    if tuning:
        sections += ["## Tuning", "", *tuning, ""]
    sections += ["## Per-model server statistics (endpoint runs)", "",
                 "From Triton's `/v2/models/stats` diffed around each run: the ensemble, its steps and the "
                 "fold models behind the BLS orchestrator. avg batch = inferences per execution (dynamic "
                 "batching of tiles).", "", *_model_stats_table(rows), ""]
    if plot_paths:
        sections += ["## Plots", ""] + [f"![{p.stem}]({_rel(p, md_path.parent)})" for p in plot_paths] + [""]
    sections += ["## Commands", "", *_commands(rows)]
    return "\n".join(sections) + "\n"


def _summary_block(meta: dict[str, Any], rows: Sequence[Row], plot_paths: Sequence[Path], md_path: Path,
                   benchmarks_md: Path) -> str:
    cores = meta["host"].get("logical_cpus") or 1
    main_rows = [r for r in rows if r["variant"] == "default"]
    lines = ["", f"Latest full run: [{meta['stem']}]({_rel(md_path, benchmarks_md.parent)}) "
             "(generated by `tools/perf/report.py`; do not edit between the markers).", "",
             *_header(meta), "",
             "### Ratios", "", *_ratio_tables(ratios(rows)), "", "### Measurements", "",
             *_main_table(main_rows, cores), ""]
    if plot_paths:
        lines += ["### Plots", "", *(f"![{p.stem}]({_rel(p, benchmarks_md.parent)})" for p in plot_paths), ""]
    lines += ["### Commands that produced these numbers", "",
              f"- `{meta['command'].strip()}` (`make perf`)", "", *_commands(rows)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the report (and plots) for one results.json; update BENCHMARKS.md when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="<results-dir>/<stem>/results.json")
    parser.add_argument("--out", type=Path, default=None, help="default: <results-dir>/<stem>.md")
    parser.add_argument("--benchmarks-md", type=Path, default=None, help="update this file's results block")
    args = parser.parse_args(argv)
    document = json.loads(args.results.read_text())
    meta, rows = document["meta"], document["measurements"]
    run_dir = args.results.parent
    md_path = args.out or run_dir.parent / f"{meta['stem']}.md"
    plot_paths = plot(rows, run_dir)
    md_path.write_text(render_report(meta, rows, plot_paths, md_path))
    print(f"wrote {md_path} ({len(plot_paths)} plots in {run_dir})")
    if args.benchmarks_md is not None:
        block = _summary_block(meta, rows, plot_paths, md_path, args.benchmarks_md)
        _benchmarks_md.replace_block(args.benchmarks_md, BLOCK, block)
        print(f"updated {args.benchmarks_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
