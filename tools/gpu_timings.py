"""Stage (c) of ``tools.gpu_check``: the endpoint's timings against nnUNetPredictor and a batched network
floor, Triton's fold batch statistics and the host-fallback counter, each checked against its goal
(``tools.gpu_goals``).

What it does, in order, on the running server:

1. reads the repository's own numbers from Triton (``/v2/models/<m>/config``): the fold models'
   ``max_batch_size`` and the orchestrator's ``tile_batch_size`` and instance count (nothing assumed);
2. warms every batch size 1..max_batch_size of every fold model with direct requests (cuDNN autotunes
   each new shape: ``torch.backends.cudnn.benchmark``), then one request and one wave of 4 through the
   endpoint, all before any timed window;
3. times ``reps`` requests one at a time, then ``4 x waves`` requests from 4 concurrent clients, with
   statistics snapshots of the fold models around each phase and metrics scrapes around the whole;
4. times nnUNetPredictor back to back on the same case and device, and the batched floor: every network
   input of one request (tiles x mirror variants, per fold) through the same TorchScript files in forwards
   of the fold models' ``max_batch_size``, synchronised, nothing else;
5. sends a case of an unseen shape (:data:`UNSEEN_EXTRA_VOXELS`) twice: the first request pays every
   per-shape cost (CuPy's zoom kernels are compiled per output shape, in preprocess and stitch), the
   second does not; their difference is reported against the latency of step 3.

The case is a synthetic CT of at least 2x2x2 tiles for the model's own patch and spacing
(:func:`cube_case`); its tile count is measured after nnU-Net's preprocessing, not assumed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tools import gpu_goals

# preprocessed extent = floor(1.5 * patch) - 2 voxels per axis: 2 tiles per axis at tile_step_size 0.5
CUBE_SCALE = 1.5
# the unseen case: this many more voxels per axis (on the realistic model's patch still 2 tiles per axis;
# its tile count is reported), so every resampling of the request has shapes the server has not seen: CuPy
# compiles its zoom kernels per output shape (NVRTC)
UNSEEN_EXTRA_VOXELS = 6
CONCURRENCY = 4


def cube_case(model_dir: Path, *, seed: int = 0, extra_voxels: int = 0) -> Any:
    """A synthetic CT-like case of ``CUBE_SCALE`` x patch - 2 (+ ``extra_voxels``) voxels per axis at the
    target spacing once resampled; its spacing is coarser than the target
    (``workloads.CASE_SPACING_FACTOR``), as with scans."""
    from nnunet_triton.numerics.model_folder import read_model_folder
    from tools.fixtures.synthct import CaseGeometry, synthesize_case
    from tools.perf.workloads import CASE_SPACING_FACTOR, Case

    config = read_model_folder(model_dir)
    back = config.transpose_backward  # plans' axes -> the image's (reader's) axes
    patch = [config.patch_size[a] for a in back]
    target = [config.spacing[a] for a in back]
    spacing = tuple(round(t * f, 4) for t, f in zip(target, CASE_SPACING_FACTOR, strict=True))
    extent = [int(CUBE_SCALE * p) - 2 + extra_voxels for p in patch]
    shape = tuple(round(e / f) for e, f in zip(extent, CASE_SPACING_FACTOR, strict=True))
    image, _ = synthesize_case(np.random.default_rng(seed), CaseGeometry(shape=shape, spacing=spacing,
                                                                         slice_axis=0))
    channels = config.num_input_channels
    return Case(name=f"cube-{'x'.join(map(str, shape))}", image=np.repeat(image[None], channels, 0)
                .astype(np.float32), spacing=spacing)


def tiles_of(case: Any, model_dir: Path) -> list[int]:
    """Tiles per axis of ``case`` after nnU-Net's preprocessing (this project's NumPy numerics)."""
    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.numerics.preprocess import preprocess_case
    from nnunet_triton.numerics.tiling import compute_steps_for_sliding_window, pad_to_patch

    config = read_model_folder(model_dir)
    data, _ = preprocess_case(case.image, case.spacing, config)
    padded, _ = pad_to_patch(data, config.patch_size)
    return [len(s) for s in compute_steps_for_sliding_window(padded.shape[1:], config.patch_size, 0.5)]


def _get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback server we started
        return json.loads(response.read())


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310
        return response.read().decode()


def repository_numbers(http_url: str, fold_models: Sequence[str]) -> dict[str, Any]:
    """The served repository's batch limits, as Triton loaded them."""
    from nnunet_triton import io_names

    folds = [_get_json(f"http://{http_url}/v2/models/{m}/config") for m in fold_models]
    orchestrator = _get_json(f"http://{http_url}/v2/models/{io_names.ORCHESTRATOR_MODEL}/config")
    parameters = orchestrator.get("parameters", {})
    return {
        "fold_max_batch_size": min(int(f.get("max_batch_size", 0)) for f in folds),
        "fold_dynamic_batching": all("dynamic_batching" in f for f in folds),
        "tile_batch_size": int(parameters["tile_batch_size"]["string_value"]),
        "max_inflight": int(parameters.get("max_inflight", {}).get("string_value", 0)),
        "orchestrator_instances": sum(int(g.get("count", 1)) for g in orchestrator.get("instance_group", [])),
        "fold_instance_kind": folds[0].get("instance_group", [{}])[0].get("kind", "?"),
    }


def fold_stats(http_url: str, fold_models: Sequence[str],
               headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """``{fold model: gpu_goals.batch_counts(...)}`` from Triton's statistics API (it needs the launcher's
    token: ``ServerHandle.control_headers``)."""
    out = {}
    for model in fold_models:
        entries = _get_json(f"http://{http_url}/v2/models/{model}/stats", headers)["model_stats"]
        out[model] = gpu_goals.batch_counts(entries[0])
    return out


def warm_fold_batch_sizes(grpc_url: str, fold_models: Sequence[str], sample_shape: Sequence[int],
                          max_batch: int) -> int:
    """One direct request of every batch size 1..max_batch to every fold model (zeros); returns the count."""
    import tritonclient.grpc as grpcclient

    from nnunet_triton import io_names

    sent = 0
    with grpcclient.InferenceServerClient(grpc_url) as client:
        for model in fold_models:
            for batch in range(1, max_batch + 1):
                x = np.zeros((batch, *sample_shape), np.float32)
                tensor = grpcclient.InferInput(io_names.FOLD_INPUT, list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                client.infer(model, [tensor], client_timeout=600)
                sent += 1
    return sent


class BatchedFloor:
    """The fold TorchScript networks alone on one request's network inputs, in forwards of ``batch``."""

    def __init__(self, repository: Path, model_dir: Path, folds: Sequence[int | str], device: str,
                 batch: int) -> None:
        from nnunet_triton import io_names
        from nnunet_triton.numerics.model_folder import read_model_folder
        from nnunet_triton.pipeline.fold_runner import load_runner

        self.config, self.device, self.batch = read_model_folder(model_dir), device, max(1, batch)
        self.runners = [load_runner(repository / io_names.fold_model_name(f) / io_names.VERSION_DIR
                                    / io_names.TORCHSCRIPT_FILE, device=device) for f in folds]

    def inputs(self, case: Any, mirroring: bool) -> Any:
        import torch

        from nnunet_triton.numerics.preprocess import preprocess_case
        from nnunet_triton.numerics.sliding_window import mirror_combinations
        from nnunet_triton.numerics.tiling import pad_to_patch, tile_slicers

        data, _ = preprocess_case(case.image, case.spacing, self.config)
        padded, _ = pad_to_patch(data, self.config.patch_size)
        tiles = [torch.from_numpy(np.ascontiguousarray(padded[(slice(None), *s)])) for s in
                 tile_slicers(padded.shape[1:], self.config.patch_size, 0.5)]
        variants = [()] + (mirror_combinations(self.config.mirror_axes) if mirroring else [])
        stacked = torch.stack([torch.flip(t, [a + 1 for a in v]) if v else t
                               for t in tiles for v in variants])
        return stacked.to(self.device)

    def run(self, x: Any) -> float:
        """Seconds of all forwards (every fold, chunks of ``batch``), synchronised on a GPU."""
        import torch

        sync = torch.cuda.synchronize if self.device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            for runner in self.runners:
                for i in range(0, x.shape[0], self.batch):
                    runner.module(x[i:i + self.batch])
        sync()
        return time.perf_counter() - start


class GpuSampler:
    """nvidia-smi utilisation samples (percent) while active; nothing on CPU."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "--id=0"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=10)
            with contextlib.suppress(ValueError):
                self.samples.append(float(out.stdout.strip().splitlines()[0]))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def summary(self) -> str:
        if not self.enabled:
            return "n/a (no GPU)"
        if not self.samples:
            return "no samples"
        return f"mean {statistics.mean(self.samples):.0f} %, max {max(self.samples):.0f} %"


# --- report ----------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def stage_timings(stage: Any, setup: Any, model_dir: Path, repository: Path, case: Any, handle: Any) -> None:
    """Fill ``stage`` (tools.gpu_check.Stage) with the measures, the goals and their verdicts."""
    import torch

    from nnunet_triton import io_names
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.validate.oracle import nnunet_predictor

    config = read_model_folder(model_dir)
    folds = tuple(config.folds)
    fold_models = [io_names.fold_model_name(f) for f in folds]
    mirroring = setup.gpu  # nnU-Net's default on a GPU; the CPU dry run leaves it off (8x fewer forwards)
    tiles = tiles_of(case, model_dir)
    numbers = repository_numbers(handle.http_url, fold_models)
    stage.notes.append(f"case {case.name} {tuple(case.image.shape)} spacing {case.spacing}: tiles {tiles}, "
                       f"folds {list(folds)}, mirroring {'on' if mirroring else 'off'}, "
                       f"repository {repository}")
    stage.notes.append("served repository: " + ", ".join(f"{k} {v}" for k, v in numbers.items()))

    def one(_: object = None) -> Any:  # one request on its own connection
        with NnunetClient(handle.grpc_url, protocol="grpc", timeout_s=3600) as client:
            return client.segment(case.image, case.spacing, mirroring=mirroring)

    metrics_url = handle.metrics_url  # http://host:port/metrics
    warmed = warm_fold_batch_sizes(handle.grpc_url, fold_models,
                                   (config.network.num_input_channels, *config.patch_size),
                                   numbers["fold_max_batch_size"])
    metrics_before = _get_text(metrics_url)
    one()
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        list(pool.map(one, range(CONCURRENCY)))
    stage.notes.append(f"warm-up: {warmed} direct fold requests (batch sizes "
                       f"1..{numbers['fold_max_batch_size']} of every fold model), 1 request, 1 wave of "
                       f"{CONCURRENCY}")
    before_c1 = fold_stats(handle.http_url, fold_models, handle.control_headers)
    with GpuSampler(setup.gpu) as c1_gpu:
        c1 = _timed(one, setup.reps)
    before_c4 = fold_stats(handle.http_url, fold_models, handle.control_headers)
    c4_requests = CONCURRENCY * setup.waves
    with GpuSampler(setup.gpu) as c4_gpu, ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        start = time.perf_counter()
        list(pool.map(one, range(c4_requests)))
        c4_s = time.perf_counter() - start
    after_c4 = fold_stats(handle.http_url, fold_models, handle.control_headers)
    fallbacks, by_tensor = gpu_goals.host_fallbacks(metrics_before, _get_text(metrics_url))
    one_at_a_time, concurrent = gpu_goals.batch_delta(before_c1, before_c4), gpu_goals.batch_delta(before_c4,
                                                                                                 after_c4)

    predictor = nnunet_predictor(model_dir, folds=folds, mirroring=mirroring, device=setup.device)

    def predict() -> Any:
        predictor.predict_single_npy_array(case.image, {"spacing": list(case.spacing)})
        if setup.gpu:
            torch.cuda.synchronize()

    if setup.gpu:  # CUDA context, cuDNN autotuning; on CPU nothing to warm (the dry run stays short)
        predict()
    predictor_s = _timed(predict, setup.reps)

    floor = BatchedFloor(repository, model_dir, folds, "cuda:0" if setup.gpu else "cpu",
                         numbers["fold_max_batch_size"])
    inputs = floor.inputs(case, mirroring)
    if setup.gpu:
        floor.run(inputs)  # warm-up: cuDNN autotunes the batch size of the floor's forwards
    floor_s = [floor.run(inputs) for _ in range(setup.reps)]
    del floor, inputs
    unseen = cube_case(model_dir, seed=1, extra_voxels=UNSEEN_EXTRA_VOXELS)

    def one_unseen() -> Any:
        with NnunetClient(handle.grpc_url, protocol="grpc", timeout_s=3600) as client:
            return client.segment(unseen.image, unseen.spacing, mirroring=mirroring)

    cold, warm = _timed(one_unseen, 2)

    endpoint, nnunet, net = statistics.median(c1), statistics.median(predictor_s), statistics.median(floor_s)
    throughput_c4 = c4_requests / c4_s
    stage.rows.extend([
        {"measure": "endpoint latency, concurrency 1 (median s)", "value": endpoint,
         "detail": c1_gpu.summary()},
        {"measure": f"endpoint throughput, concurrency {CONCURRENCY} (requests/s)", "value": throughput_c4,
         "detail": f"{c4_requests} requests in {c4_s:.2f} s; GPU {c4_gpu.summary()}"},
        {"measure": "nnUNetPredictor latency, back to back (median s)", "value": nnunet, "detail": ""},
        {"measure": "batched network floor (median s)", "value": net,
         "detail": f"{inputs_count(tiles, config, mirroring) * len(folds)} network inputs in forwards of "
                   f"{numbers['fold_max_batch_size']}"},
        {"measure": "fold batches, one request at a time", "value": one_at_a_time.mean,
         "detail": f"mean batch; largest {one_at_a_time.largest}; sizes {one_at_a_time.batches}"},
        {"measure": f"fold batches, concurrency {CONCURRENCY}", "value": concurrent.mean,
         "detail": f"mean batch; largest {concurrent.largest}; sizes {concurrent.batches}"},
        {"measure": "unseen case shape, first request (s)", "value": cold,
         "detail": f"{unseen.name}: tiles {tiles_of(unseen, model_dir)}; pays the per-shape compiles"},
        {"measure": "unseen case shape, second request (s)", "value": warm,
         "detail": f"first - second = {cold - warm:.3f} s = {100 * (cold - warm) / endpoint:.1f} % of the "
                   "latency at concurrency 1 (above 10 %: warm up over the expected shapes, "
                   "tools/gpu_warmup.py)"},
        {"measure": "host fallbacks (nnunet_host_fallbacks_total, during the measured traffic)",
         "value": "not measured" if fallbacks is None else fallbacks,
         "detail": "counter family absent from the metrics endpoint" if fallbacks is None
         else str(by_tensor)},
    ])
    goals = [
        gpu_goals.check("tiles_per_axis", float(min(tiles)), f"tiles {tiles}"),
        gpu_goals.check("waves_at_concurrency_4", float(setup.waves), f"{c4_requests} requests"),
        gpu_goals.check("latency_vs_predictor", endpoint / nnunet),
        gpu_goals.check("latency_vs_batched_floor", endpoint / net),
        gpu_goals.check("throughput_c4_vs_predictor", throughput_c4 * nnunet),
        gpu_goals.check("largest_fold_batch_vs_tile_batch", concurrent.largest / numbers["tile_batch_size"],
                        f"largest batch {concurrent.largest} at concurrency {CONCURRENCY} vs one "
                        f"orchestrator call's {numbers['tile_batch_size']} tiles (fold max_batch_size "
                        f"{numbers['fold_max_batch_size']})"),
        gpu_goals.check("host_fallbacks", fallbacks),
    ]
    always = {"tiles_per_axis", "waves_at_concurrency_4"}  # properties of the check itself, on any device
    for goal in goals:
        applies = setup.gpu or goal.name in always
        stage.rows.append({"measure": f"goal {goal.name}", **_goal_columns(goal.row(applies))})
        if applies and not goal.met:
            stage.status = "failed"
            stage.notes.append(f"goal {goal.name} {goal.op} {goal.limit:g}: "
                               f"{'not measured' if goal.met is None else 'missed'} ({goal.value})")


def inputs_count(tiles: Sequence[int], config: Any, mirroring: bool) -> int:
    """Network inputs of one request per fold: tiles x (1 + mirror variants)."""
    from nnunet_triton.numerics.sliding_window import mirror_combinations

    n = 1
    for t in tiles:
        n *= t
    return n * (1 + (len(mirror_combinations(config.mirror_axes)) if mirroring else 0))


def _goal_columns(row: dict[str, Any]) -> dict[str, Any]:
    return {"value": row["value"], "detail": f"{row['limit']}: {row['verdict']}"
            + (f"; {row['note']}" if row["note"] else "")}
