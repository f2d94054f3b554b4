"""One perf_analyzer run (one concurrency level), with every flag spelled out, and its CSV parsed.

Why these settings (perf_analyzer 2.48.0, installed by ``make setup`` as ``.venv/bin/perf_analyzer``):

- ``--measurement-mode count_windows`` + ``--measurement-request-count``: a window closes after N
  requests, not after a fixed time, so multi-second requests still fill each window.
  ``time_windows`` (``measurement_mode``): every window lasts ``--measurement-interval``; two runs
  started together then load the server for the same time (``tools.perf.two_models``).
- ``--stability-percentage 1000``: on a shared 2-core machine consecutive windows never agree within
  the default 10 %; perf_analyzer then merges the last three windows (``--max-trials 3`` windows at
  most) and reports percentiles over all their requests.
- ``--request-count``: for requests of tens of seconds, exactly that many requests in ONE window
  (perf_analyzer allows it only with a single concurrency value, hence one run per level).
- ``--sync``: one client thread per concurrent request (the concurrency is exact).
- ``--request-parameter name:value:type``: the endpoint's per-request options (``mirroring``,
  ``folds``); perf_analyzer 2.48 sends request parameters over gRPC only, so HTTP runs use the
  server defaults (all deployed folds, mirroring on).
- ``--bls-composing-models``: the fold models behind the BLS orchestrator, so perf_analyzer's log
  also shows their server-side statistics (the ensemble's own steps are found from its config).
- ``-H triton-grpc-protocol-nnunet-control:@NNUNET_TRITON_CONTROL_TOKEN@``: the statistics and shared-memory
  APIs perf_analyzer calls need the launcher's token, which perf_analyzer takes only with ``-H``. The
  command line carries ``server.preload``'s placeholder; the token travels in perf_analyzer's environment
  and the preload library (``LD_PRELOAD``, for the ``perf_analyzer`` executable only, past the venv's
  bash wrapper) swaps it into argv before ``main`` and wipes it from ``/proc/<pid>/environ``: another local
  user reading ``/proc/<pid>/cmdline`` during a measurement sees the placeholder.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nnunet_triton.client.tls import ClientTls, client_tls
from nnunet_triton.server import preload
from nnunet_triton.server.model_control import CONTROL_HEADER
from nnunet_triton.server.triton_install import resolve_home

__all__ = ["PROTOCOLS", "MEASUREMENT_MODES", "AnalyzerSettings", "AnalyzerResult", "perf_analyzer_path",
           "command", "environment", "run", "parse_csv", "parse_log"]

PROTOCOLS = ("grpc", "http")
MEASUREMENT_MODES = ("count_windows", "time_windows")
_REPO_ROOT = Path(__file__).resolve().parents[2]
_PARAMETER_TYPES = ("bool", "int", "string")
# CSV column -> our key (microseconds in the CSV)
_CSV_LATENCIES = {"p50 latency": "p50_ms", "p90 latency": "p90_ms", "p95 latency": "p95_ms",
                  "p99 latency": "p99_ms", "Server Queue": "server_queue_ms",
                  "Server Compute Input": "server_compute_input_ms",
                  "Server Compute Infer": "server_compute_infer_ms",
                  "Server Compute Output": "server_compute_output_ms",
                  "Client Send": "client_send_ms", "Client Recv": "client_recv_ms",
                  "Network+Server Send/Recv": "network_server_send_recv_ms"}


@dataclass(frozen=True)
class AnalyzerSettings:
    """Everything one perf_analyzer invocation is told.

    Attributes:
        model: model to load (``nnunet`` or the monolith).
        url: ``host:port`` of the endpoint for ``protocol``.
        input_data: JSON from ``tools.perf.input_data``.
        concurrency: concurrent requests (one level per run).
        measurement_request_count: requests per count window.
        request_count: > 0: exactly this many requests in one window (long requests).
        measurement_interval_ms: first count window length; it grows until the count is reached
            (``time_windows``: the length of every window).
        measurement_mode: ``count_windows`` (default) or ``time_windows``.
        request_parameters: ``(name, value, type)`` sent with every request (gRPC only).
        bls_composing_models: models the BLS orchestrator calls, ``name[:version]`` (reported by
            perf_analyzer).
        shared_memory: ``none`` or ``system`` (client <-> server tensors through /dev/shm).
        output_shared_memory_size: bytes per output region when ``shared_memory`` is ``system``.
        tls: CA and client certificate of a TLS server (HTTPS proxy or gRPC SSL); default: from
            ``$NNUNET_TRITON_CA``/``_CERT``/``_KEY`` when set (``nnunet_triton.client.tls``).
        headers: ``(name, value)`` sent with every call (``-H``); on perf_analyzer's command line, so no
            secret: the token goes in ``control_token``.
        control_token: the launcher's token (``ServerHandle.control_token``), which the statistics and
            shared-memory APIs perf_analyzer uses need: sent as ``model_control.CONTROL_HEADER``, kept off
            the command line by ``server.preload`` (:func:`environment`).
    """

    model: str
    url: str
    protocol: str
    input_data: Path
    concurrency: int
    measurement_request_count: int
    request_count: int = 0
    measurement_interval_ms: int = 5000
    stability_percentage: int = 1000
    max_trials: int = 3
    percentile: int = 95
    request_parameters: tuple[tuple[str, str, str], ...] = ()
    bls_composing_models: tuple[str, ...] = ()
    shared_memory: str = "none"
    output_shared_memory_size: int = 64 * 2**20
    model_version: str = "1"
    measurement_mode: str = "count_windows"
    tls: ClientTls | None = None
    headers: tuple[tuple[str, str], ...] = ()
    control_token: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}.")
        if self.concurrency < 1 or self.measurement_request_count < 1 or self.request_count < 0:
            raise ValueError(
                f"concurrency and measurement_request_count must be >= 1 and request_count >= 0, got "
                f"{self.concurrency}, {self.measurement_request_count} and {self.request_count}."
            )
        if 0 < self.request_count < self.concurrency:
            raise ValueError(
                f"request_count must be 0 or >= concurrency, got {self.request_count} < {self.concurrency}."
            )
        if self.request_parameters and self.protocol != "grpc":
            raise ValueError(
                f"request_parameters {self.request_parameters} need protocol 'grpc' (perf_analyzer 2.48 "
                f"sends request parameters over gRPC only), got {self.protocol!r}."
            )
        bad = [p for p in self.request_parameters if len(p) != 3 or p[2] not in _PARAMETER_TYPES]
        if bad:
            raise ValueError(f"request_parameters must be (name, value, bool|int|string), got {bad}.")
        if self.shared_memory not in ("none", "system"):
            raise ValueError(f"shared_memory must be 'none' or 'system', got {self.shared_memory!r}.")
        if self.measurement_mode not in MEASUREMENT_MODES:
            raise ValueError(
                f"measurement_mode must be one of {MEASUREMENT_MODES}, got {self.measurement_mode!r}.")


@dataclass(frozen=True)
class AnalyzerResult:
    """What one run produced: the CSV row (ms, infer/s), client request count and the files."""

    command: tuple[str, ...]
    returncode: int
    wall_s: float
    csv_path: Path
    log_path: Path
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.metrics)


def perf_analyzer_path() -> Path:
    """``.venv/bin/perf_analyzer`` next to this interpreter (installed by ``make setup``)."""
    path = Path(sys.executable).parent / "perf_analyzer"
    if not path.is_file():
        raise FileNotFoundError(f"perf_analyzer not found at {path}; run `make setup`.")
    return path


def command(settings: AnalyzerSettings, csv_path: Path, *, binary: Path | None = None) -> list[str]:
    """The full command line; every option perf_analyzer would otherwise default is written out."""
    s = settings
    tls = s.tls or client_tls()
    # perf_analyzer's HTTP client speaks TLS only to an https:// URL (its gRPC client takes host:port)
    url = f"https://{s.url}" if tls is not None and s.protocol == "http" and "://" not in s.url else s.url
    args = [
        str(binary or perf_analyzer_path()),
        "-m", s.model,
        "-x", s.model_version,
        "--service-kind", "triton",
        "-u", url,
        "-i", s.protocol,
        "--sync",
        "-b", "1",  # max_batch_size 0 models: one case per request
        "--concurrency-range", f"{s.concurrency}:{s.concurrency}:1",
        "--measurement-mode", s.measurement_mode,
        "--measurement-request-count", str(s.measurement_request_count),
        "--measurement-interval", str(s.measurement_interval_ms),
        "--stability-percentage", str(s.stability_percentage),
        "--max-trials", str(s.max_trials),
        "--percentile", str(s.percentile),
        "--latency-threshold", "0",
        "--input-data", str(s.input_data),
        "--shared-memory", s.shared_memory,
        "-f", str(csv_path),
        "--verbose-csv",
    ]
    if s.request_count:
        args += ["--request-count", str(s.request_count)]
    if s.shared_memory == "system":
        args += ["--output-shared-memory-size", str(s.output_shared_memory_size)]
    if s.protocol == "http":
        args += ["--input-tensor-format", "binary", "--output-tensor-format", "binary"]
    for name, value, kind in s.request_parameters:
        args += ["--request-parameter", f"{name}:{value}:{kind}"]
    if s.bls_composing_models:
        args += ["--bls-composing-models", ",".join(s.bls_composing_models)]
    if tls is not None:
        args += tls.perf_analyzer_args(s.protocol)
    for name, value in s.headers:
        args += ["-H", f"{name}:{value}"]
    if s.control_token:  # the placeholder; the token is in environment()'s variables
        args += ["-H", f"{CONTROL_HEADER}:{preload.PLACEHOLDER}"]
    return args


PROGRAM = "perf_analyzer"  # the executable that takes the token (the venv's wrapper is a bash script)


def environment(settings: AnalyzerSettings, *, preload_dir: Path | None = None) -> dict[str, str] | None:
    """perf_analyzer's environment: None (inherit this one) without a control token; else this environment
    with ``server.preload``'s library (built into ``preload_dir``, default ``<home>/preload``) and the token
    for the ``perf_analyzer`` executable alone.

    Raises:
        PreloadUnavailableError: the library cannot be built (no ``cc``): the token would be on the
            command line, so perf_analyzer is not run.
    """
    if not settings.control_token:
        return None
    library = preload.library(preload_dir or resolve_home(None) / "preload")
    return preload.environment(library, settings.control_token, PROGRAM)


def parse_csv(path: Path) -> dict[str, float]:
    """The single row of a one-level CSV: throughput (infer/s) and latencies converted to ms."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if len(rows) != 1:
        raise ValueError(f"{path}: expected one CSV row (one concurrency level), got {len(rows)}.")
    row = rows[0]
    metrics = {"concurrency": float(row["Concurrency"]), "throughput_rps": float(row["Inferences/Second"])}
    for column, key in _CSV_LATENCIES.items():
        if column in row and row[column] != "":
            metrics[key] = float(row[column]) / 1000.0
    return metrics


_REQUEST_COUNT = re.compile(r"Client:\s*\n\s*Request count: (\d+)")
_AVG_LATENCY = re.compile(r"Avg (?:gRPC|HTTP) time: (\d+) usec")
_AVG_LATENCY_HTTP = re.compile(r"Avg latency: (\d+) usec")


def parse_log(text: str) -> dict[str, float]:
    """Client request count and average latency (ms) from perf_analyzer's stdout."""
    metrics: dict[str, float] = {}
    if match := _REQUEST_COUNT.search(text):
        metrics["requests"] = float(match.group(1))
    if match := _AVG_LATENCY.search(text) or _AVG_LATENCY_HTTP.search(text):
        metrics["avg_ms"] = float(match.group(1)) / 1000.0
    return metrics


# perf_analyzer's error when the server-side statistics it reads lack a composing model's version; it
# happened once in a full suite run under load and never alone, so one retry separates it from a real failure
STATS_RACE = "failed to find the requested model version"


def _attempt(args: Sequence[str], timeout_s: float, env: dict[str, str] | None) -> tuple[int, str]:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        partial = [s.decode(errors="replace") if isinstance(s, bytes) else s
                   for s in (exc.stdout, exc.stderr) if s]
        return 124, "".join(partial) + f"\nTIMEOUT after {timeout_s:.0f} s"


def run(settings: AnalyzerSettings, out_dir: Path, label: str, *, timeout_s: float,
        binary: Path | None = None) -> AnalyzerResult:
    """Run perf_analyzer once; the CSV and the full log go to ``out_dir/<label>.{csv,log}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, log_path = out_dir / f"{label}.csv", out_dir / f"{label}.log"
    csv_path.unlink(missing_ok=True)
    args = command(settings, csv_path, binary=binary)
    env = environment(settings)
    start = time.perf_counter()
    returncode, output = _attempt(args, timeout_s, env)
    if returncode == 99 and STATS_RACE in output:  # seen once on a loaded 2-core machine; retried once
        first = output
        returncode, output = _attempt(args, timeout_s, env)
        output = f"{first}\n--- retried once after perf_analyzer's '{STATS_RACE}' ---\n{output}"
    wall = time.perf_counter() - start
    log_path.write_text(shell_command(args, _REPO_ROOT) + "\n\n" + output)
    metrics: dict[str, float] = {}
    if returncode == 0 and csv_path.is_file():
        metrics = {**parse_csv(csv_path), **parse_log(output)}
    return AnalyzerResult(command=tuple(args), returncode=returncode, wall_s=wall, csv_path=csv_path,
                          log_path=log_path, metrics=metrics)


def shell_command(args: Sequence[str], repo_root: Path) -> str:
    """``args`` as a copy-pasteable line with paths relative to the repository root."""
    root = str(repo_root) + "/"
    return " ".join(a.replace(root, "") for a in args)
