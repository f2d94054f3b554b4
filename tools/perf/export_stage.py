"""The export stage alone, side by side in one run: nnU-Net's export against ours, whole and by rows.

The export is what nnU-Net's maintainers call the RAM hog of inference: the fold-averaged ``(K, z, y, x)``
logits are resampled whole to the original geometry, one class after another on one core, then arg-maxed.
Here each case is a CT geometry (``512 x 512 x N`` at 0.8 x 0.8 x 1.5 mm, no crop) exported with a
fixture model's plans (its spacing, order-1 resampling, labels): float16 logits of the preprocessed shape
(seeded noise, so the arg-max picks every class) go through

* ``nnunet``: nnU-Net's ``convert_predicted_logits_to_segmentation_with_correct_shape`` on a CPU tensor,
  as ``nnUNetPredictor`` calls it;
* ``whole``: our ``prediction_export.convert_logits_to_segmentation`` (the whole-volume path the GPU runs);
* ``rows-1`` and ``rows-N``: ``slab_export.export_logits`` (the stitch model's host path) on one thread and
  on every CPU (N, the stitch model's default).

Each variant runs in its own fresh process, so its memory is its own: the peak resident set during the call
above the resident set before it (``VmHWM`` reset through ``/proc/self/clear_refs`` just before the call;
one process, nothing shared, so RSS is its PSS). The label maps are compared with nnU-Net's byte for byte.

Usage::

    python -m tools.perf.export_stage [--cases manyclass:100 synthct:100] [--out results.json] [--no-markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
WORK_ROOT = REPO_ROOT / "build" / "perf" / "export-stage"
RESULTS = REPO_ROOT / "benchmarks" / "results" / "export_stage.json"
BLOCK = "perf-export"
SPACING = (1.5, 0.8, 0.8)  # reader order (z, y, x), mm
PLANE = (512, 512)
VARIANTS = ("nnunet", "whole", "rows-1", "rows-N")
DEFAULT_CASES = ("manyclass:100", "synthct:100")

__all__ = ["case_geometry", "main", "markdown", "parse_case"]


def _model_dir(model: str) -> Path:
    from tools.fixtures.specs import MANY_CLASS, SYNTH_CT

    spec = {"synthct": SYNTH_CT, "manyclass": MANY_CLASS}[model]
    return REPO_ROOT / "tests" / "fixtures" / spec.dataset_name / spec.model_folder_name


def parse_case(text: str) -> tuple[str, int]:
    """``model:slices`` (``manyclass:40``) as ``(model, slices)``; refuses an unknown model or a bad count."""
    model, _, slices = text.partition(":")
    if model not in ("synthct", "manyclass") or not slices.isdigit() or int(slices) < 1:
        raise argparse.ArgumentTypeError(f"a case is synthct:N or manyclass:N with N >= 1 slices, "
                                         f"got {text!r}")
    return model, int(slices)


def case_geometry(config: Any, slices: int) -> tuple[Any, tuple[int, ...]]:
    """The case properties of a ``512 x 512 x slices`` CT (no crop) and the logits' preprocessed shape."""
    from nnunet_triton.numerics.preprocess import CaseProperties
    from nnunet_triton.numerics.resampling import compute_new_shape

    shape = tuple((slices, *PLANE)[i] for i in config.transpose_forward)
    spacing_t = [SPACING[i] for i in config.transpose_forward]
    props = CaseProperties(spacing=SPACING, shape_before_cropping=shape, bbox=tuple((0, s) for s in shape),
                           shape_after_cropping_and_before_resampling=shape)
    return props, tuple(int(s) for s in compute_new_shape(shape, spacing_t, config.spacing))


def _logits(heads: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty((heads, *shape), dtype=np.float16)
    for k in range(heads):  # one channel at a time: no float64 volume of every class
        out[k] = (rng.standard_normal(shape, dtype=np.float32) * 3).astype(np.float16)
    return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(variant: str, model: str, slices: int, out: Path) -> dict[str, Any]:
    """Run one variant in this process; the label map goes to ``out``, the figures are returned."""
    from nnunet_triton.numerics.model_folder import read_model_folder
    from nnunet_triton.numerics.slab_export import export_logits
    from nnunet_triton.pipeline.threads import available_cpus

    model_dir = _model_dir(model)
    config = read_model_folder(model_dir, folds=(0,))
    props, shape = case_geometry(config, slices)
    logits = _logits(config.labels.num_segmentation_heads, shape)
    threads = available_cpus().cpus if variant == "rows-N" else 1
    if variant == "nnunet":
        import torch
        from nnunetv2.inference.export_prediction import (
            convert_predicted_logits_to_segmentation_with_correct_shape,
        )
        from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

        plans = PlansManager(str(model_dir / "plans.json"))
        dataset_json = json.loads((model_dir / "dataset.json").read_text())
        tensor = torch.from_numpy(logits)

        def run() -> Any:
            return convert_predicted_logits_to_segmentation_with_correct_shape(
                tensor, plans, plans.get_configuration(config.configuration),
                plans.get_label_manager(dataset_json), props.to_nnunet_dict())
    elif variant == "whole":
        from nnunet_triton.numerics.prediction_export import convert_logits_to_segmentation

        def run() -> Any:
            return convert_logits_to_segmentation(logits, props, config)
    else:
        def run() -> Any:
            return export_logits(logits, props, config, workers=threads)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak from here on
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    seg = run()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    np.save(out, np.asarray(seg))
    return {"variant": variant, "threads": threads, "seconds": round(seconds, 2),
            "peak_above_before_mib": round((peak - before) / 1024, 1),
            "logits_mib": round(logits.nbytes / 2**20, 1), "heads": int(logits.shape[0]),
            "logits_shape": list(shape), "output_shape": [int(s) for s in props.shape_before_cropping]}


def _run_case(model: str, slices: int, work: Path) -> dict[str, Any]:
    rows = []
    for variant in VARIANTS:
        out = work / f"{model}-{slices}-{variant}.npy"
        command = [sys.executable, "-m", "tools.perf.export_stage", "--child", variant, "--cases",
                   f"{model}:{slices}", "--child-out", str(out)]
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"export_stage {variant} on {model}:{slices} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    reference = np.load(work / f"{model}-{slices}-nnunet.npy")
    for row in rows:
        labels = np.load(work / f"{model}-{slices}-{row['variant']}.npy")
        same = labels.dtype == reference.dtype and labels.tobytes() == reference.tobytes()
        row["labels_equal_nnunet"] = bool(same)
        row["speedup_vs_nnunet"] = round(rows[0]["seconds"] / row["seconds"], 2)
        row["memory_vs_nnunet"] = round(row["peak_above_before_mib"] / rows[0]["peak_above_before_mib"], 3)
    return {"model": model, "slices": slices, "rows": rows}


def _threads(row: dict[str, Any]) -> str:
    # nnU-Net's export resamples on one core (SciPy) and sets torch's threads for its argmax itself
    return "its own" if row["variant"] == "nnunet" else str(row["threads"])


def markdown(result: dict[str, Any]) -> str:
    """The BENCHMARKS.md block of one run."""
    lines = [f"Run {result['date']} on {result['cpu']} ({result['cpus']} CPUs), load average "
             f"{result['load_before'][0]:.2f} before and {result['load_after'][0]:.2f} after "
             "(1 min). Each variant in its own process; memory is the peak resident set during the call "
             "above the one before it.", "",
             "| model, CT 512x512xN | heads | logits (MiB) | variant | threads | time (s) | "
             "speed-up vs nnU-Net | peak above before (MiB) | memory vs nnU-Net | labels = nnU-Net's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        for row in case["rows"]:
            lines.append(f"| {case['model']}, N={case['slices']} | {row['heads']} | {row['logits_mib']} | "
                         f"{row['variant']} | {_threads(row)} | {row['seconds']} | "
                         f"{row['speedup_vs_nnunet']}x | {row['peak_above_before_mib']} | "
                         f"{row['memory_vs_nnunet']}x | {'yes' if row['labels_equal_nnunet'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", type=parse_case, default=[parse_case(c) for c in DEFAULT_CASES])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-markdown", action="store_true", help="leave BENCHMARKS.md as it is")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        (model, slices), = args.cases
        print(json.dumps(_child(args.child, model, slices, args.child_out)))
        return 0
    import platform

    from tools.perf.benchmarks_md import replace_block

    WORK_ROOT.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    cases = [_run_case(model, slices, WORK_ROOT) for model, slices in args.cases]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu,
              "cpus": len(os.sched_getaffinity(0)), "load_before": load_before, "load_after": os.getloadavg(),
              "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    print(text)
    if not args.no_markdown:
        replace_block(REPO_ROOT / "BENCHMARKS.md", BLOCK, text)
    return 0 if all(r["labels_equal_nnunet"] for c in cases for r in c["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
