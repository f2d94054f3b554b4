"""Build the one-model baseline repository ``nnunet_monolith`` (its model.py: ``monolith_step.py`` here).

Its config is generated like every other one (``nnunet_triton.builder.config_gen``), with the endpoint's
tensors taken from ``model_specs.ensemble_spec`` so the two cannot drift apart. The results folder
(plans, dataset.json, the deployed folds' checkpoints) is hard-linked (copied across file systems)
into ``1/nnunet_model`` so the repository is self-contained.

Usage::

    python -m tools.perf.monolith --model-dir <results folder> --out build/perf/repos/monolith [--folds 0 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from nnunet_triton.builder import (
    config_gen,
    model_specs,
)
from nnunet_triton.numerics.model_folder import CHECKPOINT_NAME, parse_fold, read_model_folder
from nnunet_triton.numerics.plans import InferenceConfig
from nnunet_triton.parameters import FORCE_CPU_ONLY_INPUT_TENSORS, PARAM_TORCH_NUM_THREADS
from tools.perf.monolith_step import MODEL_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["MONOLITH_MODEL", "STEP_FILE", "monolith_spec", "build_monolith_repository", "main"]

MONOLITH_MODEL = "nnunet_monolith"
STEP_FILE = Path(__file__).with_name("monolith_step.py")  # copied whole as the model's model.py


def monolith_spec(config: InferenceConfig, *, instances: int = 1, torch_threads: int = 0, device: str = "cpu"
                  ) -> config_gen.ModelSpec:
    """``nnunet_monolith``: the ``nnunet`` endpoint's inputs and outputs, one Python model.

    ``device`` ``cuda`` puts the instances on the GPU (KIND_GPU; nnUNetPredictor with everything on
    the device); inputs always arrive on the host, since nnU-Net's preprocessing takes NumPy arrays.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}.")
    endpoint = model_specs.ensemble_spec(config)
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    return config_gen.ModelSpec(
        name=MONOLITH_MODEL,
        backend="python",
        max_batch_size=0,
        inputs=endpoint.inputs,
        outputs=endpoint.outputs,
        instance_groups=(config_gen.InstanceGroup(count=instances, kind=kind),),
        parameters={FORCE_CPU_ONLY_INPUT_TENSORS: "yes", PARAM_TORCH_NUM_THREADS: str(torch_threads)},
    )


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def build_monolith_repository(model_dir: Path, out: Path, *, folds: Sequence[int | str] | None = None,
                              instances: int = 1, torch_threads: int = 0, device: str = "cpu") -> Path:
    """(Re)write ``out`` with the single model ``nnunet_monolith`` and return ``out``."""
    config = read_model_folder(model_dir, folds=folds)
    if out.exists():
        shutil.rmtree(out)
    model_root = out / MONOLITH_MODEL
    spec = monolith_spec(config, instances=instances, torch_threads=torch_threads, device=device)
    config_gen.write_config(spec, model_root)
    version = model_root / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(STEP_FILE, version / "model.py")
    config.save(version)
    for name in ("plans.json", "dataset.json"):
        _link_or_copy(model_dir / name, version / MODEL_DIR / name)
    for fold in config.folds:
        relative = Path(f"fold_{fold}") / CHECKPOINT_NAME
        _link_or_copy(model_dir / relative, version / MODEL_DIR / relative)
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the monolith repository; exit 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", "--model", dest="model", type=Path, required=True,
                        help="nnU-Net results folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folds", nargs="+", type=parse_fold, default=None)
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--torch-threads", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    out = build_monolith_repository(args.model, args.out, folds=args.folds, instances=args.instances,
                                    torch_threads=args.torch_threads, device=args.device)
    print(f"built: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
