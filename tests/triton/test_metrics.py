"""The custom ``nnunet_*`` metrics appear on Triton's metrics port next to ``nv_*`` and count exactly.

Scrapes ``metrics_url`` of the shared SynthCT server (see pipeline_support) before and after
``REQUESTS`` (the first held-out case with two option sets, so that mirror variants and folds both
vary; kept to 80 network forwards in all) and checks the deltas: requests per step, tiles per request
from the library's tiling functions for that case's preprocessed shape, network forwards (tiles x mirror
variants x folds), BLS calls (``plan_tile_batches``), and times that are > 0 and within the client-side
wall time. A rejected request counts as a failure of ``preprocess_model``.
Other tests may share the server, so only deltas are compared and this module's requests are sequential.
"""

from __future__ import annotations

import math
import re
import time
import urllib.request
from dataclasses import dataclass

import numpy as np
import pytest
from pipeline_support import SYNTHCT, TILE_BATCH_SIZE, build, cases, shared_server

from nnunet_triton import io_names
from nnunet_triton.client.client import ClientError, NnunetClient
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.numerics.preprocess import preprocess_case
from nnunet_triton.numerics.sliding_window import mirror_combinations, plan_tile_batches
from nnunet_triton.numerics.tiling import tile_slicers
from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE
from nnunet_triton.serving.metrics import (
    COMPUTE_DURATION,
    COMPUTE_LATENCY,
    ORCHESTRATOR_COUNTS,
    REQUEST_FAILURE,
    REQUEST_SUCCESS,
)

# (mirroring, folds) per request: 8 tiles x 8 variants x 1 fold + 8 tiles x 1 variant x 2 folds
REQUESTS = ((True, (0,)), (False, (0, 1)))
N_REQUESTS = len(REQUESTS)
STEPS = (io_names.PREPROCESS_MODEL, io_names.ORCHESTRATOR_MODEL, io_names.STITCH_MODEL)
STEP_SPECS = (REQUEST_SUCCESS, REQUEST_FAILURE, COMPUTE_DURATION, COMPUTE_LATENCY)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Scrape:
    """One Prometheus text page: HELP/TYPE per family and every sample."""

    help: dict[str, str]
    type: dict[str, str]
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when there is none)."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)


def parse_prometheus(text: str) -> Scrape:
    helps, types, samples = {}, {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[len("# HELP "):].partition(" ")
            helps[name] = doc
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE "):].partition(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            if match is None:
                raise ValueError(f"metrics line is not a Prometheus sample: {line!r}")
            name, labels, value = match.groups()
            samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
    return Scrape(help=helps, type=types, samples=samples)


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=30) as response:
        return parse_prometheus(response.read().decode())


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


@pytest.fixture(scope="module")
def config() -> InferenceConfig:
    return InferenceConfig.from_json(
        (build(SYNTHCT) / io_names.PREPROCESS_MODEL / "1" / "inference_config.json").read_text()
    )


@pytest.fixture(scope="module")
def measured(server):
    """Scrapes before/after the sequential ``REQUESTS`` of the first case."""
    case = cases(SYNTHCT)[0]
    with NnunetClient(server.http_url, timeout_s=1800) as client:
        client.check_ready()
        before = scrape(server.metrics_url)
        start = time.perf_counter()
        for mirroring, folds in REQUESTS:
            client.segment(case.image, case.spacing, mirroring=mirroring, folds=folds)
        wall_us = (time.perf_counter() - start) * 1e6
        after = scrape(server.metrics_url)
    return case, before, after, wall_us


def _delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def _labels(step: str, config: InferenceConfig) -> dict[str, str]:
    trainer_plans_config = f"{config.network.trainer_name}__{config.plans_name}__{config.configuration}"
    return {"model": step, "dataset": config.dataset_name, "configuration": trainer_plans_config}


def test_metrics_page_has_nnunet_families_with_help_and_type(measured):
    _, _, after, _ = measured
    specs = (*STEP_SPECS, *ORCHESTRATOR_COUNTS.values())
    assert {s.name: (after.help.get(s.name), after.type.get(s.name)) for s in specs} == {
        s.name: (s.description, s.kind.lower()) for s in specs
    }


def test_request_counters_grow_by_n_per_step_next_to_tritons_own(measured, config):
    _, before, after, _ = measured
    deltas = {step: _delta(before, after, REQUEST_SUCCESS.name, **_labels(step, config)) for step in STEPS}
    assert deltas == dict.fromkeys(STEPS, N_REQUESTS)
    nv_success = "nv_inference_request_success"
    assert after.type[nv_success] == "counter"
    endpoint = {"model": io_names.ENDPOINT_MODEL}
    assert _delta(before, after, nv_success, **endpoint) == N_REQUESTS


def test_orchestrator_counts_tiles_forwards_folds_and_calls_exactly(measured, config):
    case, before, after, _ = measured
    data, _ = preprocess_case(case.image, case.spacing, config)
    padded = [max(s, p) for s, p in zip(data.shape[1:], config.patch_size, strict=True)]
    tiles = len(tile_slicers(padded, config.patch_size, DEFAULT_TILE_STEP_SIZE))
    variants = [1 + len(mirror_combinations(config.mirror_axes if mirroring else None))
                for mirroring, _ in REQUESTS]
    folds = [len(f) for _, f in REQUESTS]
    calls_per_fold = [len(plan_tile_batches(tiles, v, TILE_BATCH_SIZE)) for v in variants]
    labels = _labels(io_names.ORCHESTRATOR_MODEL, config)
    deltas = {key: _delta(before, after, spec.name, **labels) for key, spec in ORCHESTRATOR_COUNTS.items()}
    assert deltas == {
        "tiles": N_REQUESTS * tiles,
        "forwards": sum(tiles * v * f for v, f in zip(variants, folds, strict=True)),
        "folds": sum(folds),
        "fold_calls": sum(f * c for f, c in zip(folds, calls_per_fold, strict=True)),
    }
    assert (tiles, variants, folds) == (8, [8, 1], [1, 2])  # several tiles, mirroring and folds vary


def test_compute_time_counters_grow_within_client_wall_time(measured, config):
    _, before, after, wall_us = measured
    for step in STEPS:
        labels = _labels(step, config)
        duration = _delta(before, after, COMPUTE_DURATION.name, **labels)
        assert 0 < duration <= wall_us, step
        hist = {part: _delta(before, after, f"{COMPUTE_LATENCY.name}_{part}", **labels)
                for part in ("sum", "count")}
        inf_bucket = _delta(before, after, f"{COMPUTE_LATENCY.name}_bucket", le="+Inf", **labels)
        assert (hist["count"], inf_bucket) == (N_REQUESTS, N_REQUESTS), step
        assert math.isclose(hist["sum"], duration, rel_tol=1e-9), step


def test_rejected_request_counts_as_invalid_arg_failure_of_preprocess(server, config, measured):
    case = cases(SYNTHCT)[0]
    labels = _labels(io_names.PREPROCESS_MODEL, config)
    before = scrape(server.metrics_url)
    with NnunetClient(server.http_url, timeout_s=600) as client, pytest.raises(ClientError, match="spacing"):
        client.segment(case.image, np.array([-1.0, 1.0, 1.0]), mirroring=False)
    after = scrape(server.metrics_url)
    failures = {code: _delta(before, after, REQUEST_FAILURE.name, code=code, **labels)
                for code in ("INVALID_ARG", "INTERNAL")}
    assert failures == {"INVALID_ARG": 1, "INTERNAL": 0}
    assert after.value(REQUEST_SUCCESS.name, **labels) == before.value(REQUEST_SUCCESS.name, **labels)
