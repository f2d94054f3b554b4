"""Export one nnU-Net fold's network to TorchScript and prove the file reproduces the eager network.

The network is rebuilt exactly as ``nnUNetPredictor.initialize_from_trained_model_folder``
(nnunetv2/inference/predict_from_raw_data.py) does: ``PlansManager(plans)``, the configuration and
trainer named in the fold's checkpoint, ``recursive_find_trainer_class_by_name(trainer_name)``
(nnunetv2/utilities/find_objects.py), ``trainer_class.build_network_architecture(plans_manager,
configuration_manager, num_input_channels, num_output_channels, enable_deep_supervision=False)``,
``load_state_dict(checkpoint["network_weights"])``, ``eval()``.

It is then traced with ``torch.jit.trace`` (``torch.jit.script`` fails on nnU-Net's networks,
MIC-DKFZ/nnUNet#2088) at batch size 2, saved, RELOADED, and the reloaded file is run against the
eager network on random input at the trace batch size and at every check batch size (the batch
dimension must be dynamic: Triton's dynamic batcher sends 1..max_batch_size tiles). A difference
beyond the tolerance raises :class:`ExportError` and nothing is written.

Quick by default (``check_input="smallest"``): the trace and those checks run on the smallest input
that passes every stage of the network (twice its total downsampling per axis, e.g. 64^3 instead of
112x160x128 for nnU-Net's default 3d_fullres plans), and one more batch-1 forward at the full patch
size proves the trace generalises (same tolerance). Should the small input not pass, the fold is
traced and checked at the patch size as before (``check_input="patch"`` forces that).

Precisions:
    ``fp32``: float32 weights, FP32 in, FP32 out.
    ``fp16``: traced under ``torch.autocast(device, dtype=float16)``, the way nnU-Net runs its network
        on CUDA (``predict_sliding_window_return_logits``). The trace records autocast's casts, so the
        file takes FP32 input and returns FP16 logits without an autocast context at run time
        (checked on CPU with bfloat16 autocast, which uses the same mechanism). CUDA only; it cannot
        be validated on a machine without a GPU.

Tolerance (max |reloaded - eager| <= rel * max(1, max |eager|)):
    cpu fp32: 0 -- the reloaded graph runs the same ATen kernels in the same order as eager mode
        (TorchScript's CPU fuser is off by default), so the results are bit-identical; measured 0.0.
    cuda fp32: 1e-3 -- cuDNN may choose a different convolution algorithm (and TF32) per call.
    fp16: 1e-2 -- a few fp16 ulps (eps 9.8e-4) per layer from algorithm choice.
The eager network runs as nnU-Net runs it (under autocast for fp16); the reloaded file runs without
autocast, as Triton's libtorch backend and the Python runner run it.

TorchScript compatibility: a file saved by a newer torch may not load in an older libtorch. The GPU
image's Triton 26.09 has libtorch 2.14; export with ``torch==2.14.x`` for the ``pytorch_libtorch`` runner.
The Python runner loads the file with the torch that exported it, so any version works there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.builder.fold_network import load_fold_network
from nnunet_triton.errors import ExportError
from nnunet_triton.numerics.model_folder import CHECKPOINT_NAME
from nnunet_triton.util.hashing import sha256_file

__all__ = [
    "PRECISIONS",
    "ExportOptions",
    "ExportResult",
    "default_tolerance",
    "export_fold",
    "export_fold_reusing",
    "export_folds",
]

LOGGER = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16")
CHECK_INPUTS = ("smallest", "patch")
EXTRA_FILE = "nnunet_triton.json"  # metadata stored inside model.pt (torch.jit.save _extra_files)
_RELATIVE_TOLERANCE = {("cpu", "fp32"): 0.0, ("cuda", "fp32"): 1e-3, ("cpu", "fp16"): 1e-2,
                       ("cuda", "fp16"): 1e-2}


def default_tolerance(precision: str, device: str) -> float:
    """Relative tolerance for reloaded-vs-eager (see module docstring for the reasons)."""
    key = ("cpu" if device == "cpu" else "cuda", precision)
    if key not in _RELATIVE_TOLERANCE:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
    return _RELATIVE_TOLERANCE[key]


@dataclass(frozen=True)
class ExportOptions:
    """How to trace and check one fold."""

    precision: str = "fp32"
    device: str = "cpu"
    trace_batch_size: int = 2
    check_batch_sizes: tuple[int, ...] = (1, 3)
    check_runs: int = 3  # the profiling executor re-optimizes the graph during the first runs
    seed: int = 0
    tolerance: float | None = None  # relative; None means default_tolerance(precision, device)
    checkpoint_name: str = CHECKPOINT_NAME
    # "smallest": trace and run the checks on the smallest input that passes every stage of the
    # network (2x its total downsampling per axis), then ONE batch-1 check at the full patch size;
    # "patch": every trace and check at the patch size (minutes per fold for nnU-Net's default plans).
    check_input: str = "smallest"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}.")
        if self.precision == "fp16" and not self.device.startswith("cuda"):
            raise ValueError(
                f"precision 'fp16' traces under CUDA autocast and needs device 'cuda', got {self.device!r}."
            )
        if self.trace_batch_size < 2:
            raise ValueError(
                f"trace_batch_size must be >= 2 so the batch dim is not specialised to 1, "
                f"got {self.trace_batch_size}."
            )
        if self.check_input not in CHECK_INPUTS:
            raise ValueError(f"check_input must be one of {CHECK_INPUTS}, got {self.check_input!r}.")
        if any(b < 1 for b in self.check_batch_sizes) or self.check_runs < 1:
            raise ValueError(
                f"check_batch_sizes must be >= 1 and check_runs >= 1, got {self.check_batch_sizes} "
                f"and {self.check_runs}."
            )

    @property
    def relative_tolerance(self) -> float:
        return default_tolerance(self.precision, self.device) if self.tolerance is None else self.tolerance


@dataclass(frozen=True)
class ExportResult:
    """What was exported and how well the reloaded file matched the eager network."""

    fold: int | str
    path: str
    precision: str
    device: str
    torch_version: str
    input_shape: tuple[int, ...]  # per sample: (C_in, *patch)
    output_shape: tuple[int, ...]  # per sample: (K, *patch)
    output_dtype: str
    max_abs_diff: tuple[tuple[int, float], ...]  # (batch size, max |reloaded - eager|) over check_runs
    tolerance_abs: float
    batch_vs_single_max_abs_diff: float  # traced batch of N vs N batch-1 calls (informational)
    sha256: str
    seconds: float
    check_shape: tuple[int, ...] = ()  # per sample: the input the trace and batch checks ran on
    patch_max_abs_diff: float | None = None  # the batch-1 full-patch check (None: checked at the patch)
    reused_from: int | str | None = None  # fold whose identical weights gave this file

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _random_input(batch_size: int, sample_shape: tuple[int, ...], *, seed: int, device: str) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn((batch_size, *sample_shape), generator=generator, dtype=torch.float32).to(device)


def _autocast(options: ExportOptions) -> Any:
    import torch

    if options.precision == "fp16":
        return torch.autocast("cuda", dtype=torch.float16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _quiet_jit() -> Iterator[None]:
    """Silence newer torch's FutureWarning that TorchScript is deprecated (Triton's libtorch runs it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.", category=FutureWarning)
        yield


def _trace(network: Any, example: Any, options: ExportOptions) -> Any:
    """``torch.jit.trace`` under ``no_grad`` (and autocast for fp16), TracerWarnings logged, not printed.

    nnU-Net's networks raise two TracerWarnings from ``InstanceNorm``'s input checks (channel count and
    spatial size, both False for valid input and recording no data flow); anything shape-dependent
    that matters would show up as a failure of the dynamic-batch check instead.
    """
    import torch

    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), _autocast(options):
        warnings.simplefilter("always", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.", category=FutureWarning)
        traced = torch.jit.trace(network, example, check_trace=False)
    for item in {(str(w.message), w.filename, w.lineno) for w in caught}:
        LOGGER.info("trace warning at %s:%d: %s", item[1], item[2], item[0].splitlines()[0])
    return traced


def _load_traced(path: Path, device: str) -> Any:
    """Reload a saved TorchScript file (a seam for tests that need a disagreeing file)."""
    import torch

    with _quiet_jit():
        module = torch.jit.load(str(path), map_location=device)
    module.eval()
    return module


def _forward(module: Any, x: Any, options: ExportOptions) -> Any:
    """The eager network as nnU-Net runs it: under CUDA autocast for fp16."""
    import torch

    with torch.inference_mode(), _autocast(options):
        return module(x)


def _forward_traced(module: Any, x: Any) -> Any:
    """The saved file as Triton's libtorch backend and the Python runner run it: no autocast (the fp16
    trace carries its casts), so the checks see what the server will compute."""
    import torch

    with torch.inference_mode():
        return module(x)


def _max_abs_diff(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max().item())


def _check_reloaded(eager: Any, reloaded: Any, sample_shape: tuple[int, ...], options: ExportOptions
                    ) -> tuple[tuple[tuple[int, float], ...], float, Any]:
    """Run reloaded vs eager at every batch size ``check_runs`` times; return the diffs and tolerance."""
    diffs = []
    tolerance = 0.0
    reference = None
    for batch_size in (options.trace_batch_size, *options.check_batch_sizes):
        x = _random_input(batch_size, sample_shape, seed=options.seed + batch_size, device=options.device)
        expected = _forward(eager, x, options)
        runs = [_forward_traced(reloaded, x) for _ in range(options.check_runs)]
        worst = max(_max_abs_diff(y, expected) for y in runs)
        tolerance = max(tolerance, options.relative_tolerance * max(1.0, float(expected.float().abs().max())))
        diffs.append((batch_size, worst))
        reference = reference if reference is not None else expected
    return tuple(diffs), tolerance, reference


def _batch_vs_single(module: Any, sample_shape: tuple[int, ...], options: ExportOptions) -> float:
    """Max |module(x)[i] - module(x[i:i+1])| over a batch of ``max(check_batch_sizes)`` samples."""
    import torch

    batch_size = max(options.trace_batch_size, *options.check_batch_sizes)
    x = _random_input(batch_size, sample_shape, seed=options.seed + 1000, device=options.device)
    batched = _forward_traced(module, x)
    singles = torch.cat([_forward_traced(module, x[i:i + 1]) for i in range(batch_size)])
    return _max_abs_diff(batched, singles)


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ExportError(f"export device {device!r} requested but CUDA is not available on this machine.")


def export_fold(
    model_dir: str | Path,
    fold: int | str,
    out_path: str | Path,
    *,
    options: ExportOptions | None = None,
) -> ExportResult:
    """Trace fold ``fold`` of the results folder ``model_dir`` into ``out_path`` (a ``model.pt``).

    The file is written next to ``out_path`` under a temporary name and only renamed into place
    after the reloaded file matched the eager network.

    Raises:
        ExportError: the reloaded file disagrees with the eager network beyond the tolerance, or the
            batch dimension is not dynamic, or the device is unavailable.
        PlansError / UnsupportedModelError: see :func:`load_fold_network`.
    """
    import torch

    options = options or ExportOptions()
    _check_device(options.device)
    start = time.perf_counter()
    fold_net = load_fold_network(model_dir, fold, checkpoint_name=options.checkpoint_name)
    eager = fold_net.network.to(options.device)
    sample_shape = (fold_net.num_input_channels, *fold_net.patch_size)
    check_shape = sample_shape
    if options.check_input == "smallest":
        check_shape = (fold_net.num_input_channels, *fold_net.check_spatial)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_name(f".{out_path.name}.partial")
    meta = {"fold": fold, "precision": options.precision, "torch_version": torch.__version__,
            "trainer_name": fold_net.trainer_name, "configuration": fold_net.configuration}
    try:
        try:
            diffs, tolerance, reference, batch_vs_single, reloaded = _trace_and_check(
                eager, check_shape, tmp_path, meta, options, fold)
            patch_diff = None
            if check_shape != sample_shape:
                patch_diff, reference = _check_patch(eager, reloaded, sample_shape, options, fold)
        except ExportError as exc:
            if check_shape == sample_shape:
                raise
            LOGGER.warning("fold %s: the trace on the smallest input %s did not pass (%s); tracing at the "
                           "patch size", fold, list(check_shape), exc)
            check_shape, patch_diff = sample_shape, None
            diffs, tolerance, reference, batch_vs_single, reloaded = _trace_and_check(
                eager, check_shape, tmp_path, meta, options, fold)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    tmp_path.replace(out_path)
    result = ExportResult(
        fold=fold,
        path=str(out_path),
        precision=options.precision,
        device=options.device,
        torch_version=torch.__version__,
        input_shape=sample_shape,
        output_shape=tuple(reference.shape[1:]),
        output_dtype=str(reference.dtype).removeprefix("torch."),
        max_abs_diff=diffs,
        tolerance_abs=tolerance,
        batch_vs_single_max_abs_diff=batch_vs_single,
        sha256=sha256_file(out_path),
        seconds=round(time.perf_counter() - start, 3),
        check_shape=check_shape,
        patch_max_abs_diff=patch_diff,
    )
    LOGGER.info("exported fold %s to %s: max |reloaded - eager| %s (tolerance %g), batch-vs-single %g",
                fold, out_path, dict(diffs), tolerance, batch_vs_single)
    return result


def _trace_and_check(eager: Any, check_shape: tuple[int, ...], tmp_path: Path, meta: dict[str, Any],
                     options: ExportOptions, fold: int | str) -> tuple[Any, float, Any, float, Any]:
    """Trace on ``check_shape``, save to ``tmp_path``, reload, and check reloaded against eager there."""
    import torch

    example = _random_input(options.trace_batch_size, check_shape, seed=options.seed, device=options.device)
    try:
        traced = _trace(eager, example, options)
    except RuntimeError as exc:
        raise ExportError(f"fold {fold}: tracing on input {list(check_shape)} failed: {exc}") from None
    with _quiet_jit():
        torch.jit.save(traced, str(tmp_path), _extra_files={EXTRA_FILE: json.dumps(meta)})
    reloaded = _load_traced(tmp_path, options.device)
    diffs, tolerance, reference = _check_with_errors(eager, reloaded, check_shape, options, fold)
    return diffs, tolerance, reference, _batch_vs_single(reloaded, check_shape, options), reloaded


def _check_patch(eager: Any, reloaded: Any, sample_shape: tuple[int, ...], options: ExportOptions,
                 fold: int | str) -> tuple[float, Any]:
    """One batch-1 forward at the full patch size: the trace made on a small input must generalise."""
    x = _random_input(1, sample_shape, seed=options.seed + 2000, device=options.device)
    expected = _forward(eager, x, options)
    try:
        got = _forward_traced(reloaded, x)
    except RuntimeError as exc:
        raise ExportError(f"fold {fold}: the traced network fails at the patch size {list(sample_shape)}: "
                          f"{exc}") from None
    diff = _max_abs_diff(got, expected)
    tolerance = options.relative_tolerance * max(1.0, float(expected.float().abs().max()))
    if diff > tolerance:
        raise ExportError(
            f"fold {fold}: at the patch size {list(sample_shape)} the reloaded TorchScript differs from the "
            f"eager network by {diff:g}, above the tolerance {tolerance:g}; refusing to write it.")
    return diff, expected


def _check_with_errors(eager: Any, reloaded: Any, sample_shape: tuple[int, ...], options: ExportOptions,
                       fold: int | str) -> tuple[tuple[tuple[int, float], ...], float, Any]:
    try:
        diffs, tolerance, reference = _check_reloaded(eager, reloaded, sample_shape, options)
    except RuntimeError as exc:
        raise ExportError(
            f"fold {fold}: the traced network failed at batch sizes {options.check_batch_sizes} "
            f"(traced at {options.trace_batch_size}); the batch dimension is not dynamic: {exc}"
        ) from None
    worst = max(d for _, d in diffs)
    if worst > tolerance:
        raise ExportError(
            f"fold {fold}: reloaded TorchScript differs from the eager network by {worst:g} (per batch size "
            f"{dict(diffs)}), above the tolerance {tolerance:g} for {options.precision} on {options.device}; "
            "refusing to write it."
        )
    return diffs, tolerance, reference


def export_fold_reusing(model_dir: str | Path, fold: int | str, out_path: str | Path, *,
                        options: ExportOptions | None = None,
                        exported: dict[str, ExportResult] | None = None) -> ExportResult:
    """:func:`export_fold`, except that a fold whose checkpoint has the same bytes as one already in
    ``exported`` (keyed by the checkpoint's sha256; updated here) gets a copy of that file, unchecked
    again: same architecture, same weights, same TorchScript."""
    import dataclasses
    import shutil

    options = options or ExportOptions()
    key = f"{sha256_file(Path(model_dir) / f'fold_{fold}' / options.checkpoint_name)}:{options}"
    if exported is not None and key in exported:
        earlier = exported[key]
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(earlier.path, out_path)
        LOGGER.info("fold %s has the weights of fold %s: reusing its export", fold, earlier.fold)
        return dataclasses.replace(earlier, fold=fold, path=str(out_path), reused_from=earlier.fold,
                                   seconds=0.0)
    result = export_fold(model_dir, fold, out_path, options=options)
    if exported is not None:
        exported[key] = result
    return result


def export_folds(
    model_dir: str | Path,
    folds: Sequence[int | str],
    out_dir: str | Path,
    *,
    options: ExportOptions | None = None,
    filename: str = "fold_{fold}.pt",
) -> list[ExportResult]:
    """Export every fold in ``folds`` to ``out_dir / filename.format(fold=k)`` (identical weights once)."""
    exported: dict[str, ExportResult] = {}
    return [
        export_fold_reusing(model_dir, fold, Path(out_dir) / filename.format(fold=fold), options=options,
                            exported=exported)
        for fold in folds
    ]
