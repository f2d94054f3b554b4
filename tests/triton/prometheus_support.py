"""A real Prometheus (Debian's ``prometheus`` package) for tests: its own config and storage in a temp dir,
listening on loopback only, scraping given targets every second; queried through its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS = shutil.which("prometheus")
SKIP_REASON = "prometheus not installed (Debian: apt-get install prometheus; .ci/run installs it)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Prometheus:
    url: str
    log: Path

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Instant query: {sorted labels: value} (NaN and infinities kept as floats)."""
        data = self.get("/api/v1/query", query=expr)
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in data["result"]}

    def scalar(self, expr: str) -> float | None:
        """The one value of ``expr`` now, None when it has none."""
        values = list(self.query(expr).values())
        if len(values) > 1:
            raise AssertionError(f"{expr} has {len(values)} series, expected one: {values}")
        return values[0] if values else None

    def wait_for(self, expr: str, timeout_s: float) -> float:
        """Poll until ``expr`` has a value; that value."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.scalar(expr)
            if value is not None:
                return value
            time.sleep(0.5)
        raise AssertionError(f"{expr} had no value within {timeout_s} s; log: {self.log.read_text()[-3000:]}")


@contextmanager
def prometheus(workdir: Path, targets: list[str], *, labels: dict[str, str], job: str,
               rule_files: dict[str, dict[str, Any]]) -> Iterator[Prometheus]:
    """Start Prometheus on 127.0.0.1 scraping ``targets`` (``host:port``, path /metrics) every second with
    the static ``labels`` (what a ServiceMonitor adds: namespace, pod), with ``rule_files``
    ({name: rule file}); stopped (and waited for) on exit."""
    assert PROMETHEUS is not None, SKIP_REASON
    workdir.mkdir(parents=True, exist_ok=True)
    for name, rules in rule_files.items():
        (workdir / name).write_text(yaml.safe_dump(rules))
    scrape = {"job_name": job, "static_configs": [{"targets": targets, "labels": labels}]}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
              "rule_files": sorted(rule_files), "scrape_configs": [scrape]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
             "--log.level=info"],
            stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    server = Prometheus(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"Prometheus did not start (exit {process.poll()}): {log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
