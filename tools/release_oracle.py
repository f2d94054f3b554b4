"""Run an old nnU-Net release's own predictor on image files, on the CPU: the oracle of ``--numerics``.

Run in a subprocess whose ``PYTHONPATH`` starts with the release's cached package
(``tools.nnunet_releases.release_path``), so ``import nnunetv2`` is that release's code on this venv's
torch and libraries; :func:`run_release` does it::

    PYTHONPATH=.venv-releases/2.0:. python -m tools.release_oracle 2.0 MODEL_DIR OUT_DIR --folds 0 1 \\
        --images case_0000.nii.gz [--images other_0000.nii.gz ...]

It writes ``OUT_DIR/<case>.nii.gz`` as the release writes them (2.0 and 2.1 through their
``predict_from_raw_data`` function, later ones through ``nnUNetPredictor.predict_from_files``) and
``OUT_DIR/used_gaussian.npy``, the importance map the predictor computed for itself (recorded around its
own ``compute_gaussian`` call, with the arguments it passes), with nnU-Net's defaults (Gaussian, mirroring,
step 0.5), on one torch thread unless told otherwise. Releases before 2.3 read the flat plans format
(``tools.fixtures.old_plans`` writes a model folder in it). A run that imports another ``nnunetv2`` than
the one asked for stops with an error instead of answering for the wrong release.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_release"]

ROOT = Path(__file__).resolve().parent.parent


def run_release(release: str, model_dir: Path, out_dir: Path, cases: Sequence[Sequence[Path]], *,
                folds: Sequence[int | str], cache: Path | None = None, timeout_s: float = 900,
                gaussians: Sequence[Sequence[int]] = (), export: Path | None = None,
                threads: int | None = 1) -> None:
    """Predict ``cases`` (each a list of channel files) with ``release``'s own predictor into ``out_dir``;
    with ``gaussians`` also its importance maps (``out_dir/gaussians.npz``), with ``export`` its export of
    the logits in that npz (``out_dir/export.npy``). ``threads``: torch threads (oneDNN's rounding depends
    on them); None leaves torch's default, what a user of the release gets."""
    from tools.nnunet_releases import release_path

    package = release_path(release, cache)
    if not (package / "nnunetv2" / "__init__.py").is_file():
        raise FileNotFoundError(f"nnU-Net {release} is not cached at {package}: run `make nnunet-releases`.")
    argv = [sys.executable, "-m", "tools.release_oracle", release, str(model_dir), str(out_dir),
            "--folds", *map(str, folds), *(["--threads", str(threads)] if threads is not None else [])]
    for case in cases:
        argv += ["--images", *map(str, case)]
    if gaussians:
        argv += ["--gaussians", *("x".join(map(str, patch)) for patch in gaussians)]
    if export is not None:
        argv += ["--export", str(export)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), str(ROOT)]),
           "nnUNet_raw": str(out_dir), "nnUNet_preprocessed": str(out_dir), "nnUNet_results": str(out_dir)}
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"nnU-Net {release}'s predictor failed (exit {done.returncode}):\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _predict(release: str, model_dir: str, out_dir: str, folds: tuple[int | str, ...],
             cases: list[list[str]], threads: int | None) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    if threads is not None:
        torch.set_num_threads(threads)
    import nnunetv2
    import nnunetv2.inference.predict_from_raw_data as predict_module

    expected = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    if not Path(nnunetv2.__file__).resolve().is_relative_to(Path(expected).resolve()):
        raise SystemExit(f"nnunetv2 came from {nnunetv2.__file__}, not from nnU-Net {release} at {expected}.")
    from nnunet_triton.options import DEFAULT_TILE_STEP_SIZE

    used: list[Any] = []  # the importance map the predictor itself computes (its own arguments)
    compute = predict_module.compute_gaussian

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = compute(*args, **kwargs)
        used.append(result)
        return result

    if hasattr(compute, "cache_clear"):  # 2.2 and later cache it (functools.lru_cache) and clear the cache
        recording.cache_clear = compute.cache_clear  # type: ignore[attr-defined]
    predict_module.compute_gaussian = recording
    common = dict(tile_step_size=DEFAULT_TILE_STEP_SIZE, use_gaussian=True, use_mirroring=True, verbose=False)
    if hasattr(predict_module, "nnUNetPredictor"):
        predictor_class = predict_module.nnUNetPredictor
        parameters = inspect.signature(predictor_class.__init__).parameters
        on_device = ("perform_everything_on_device" if "perform_everything_on_device" in parameters
                     else "perform_everything_on_gpu")
        extra = {"allow_tqdm": False} if "allow_tqdm" in parameters else {}
        predictor = predictor_class(**common, **{on_device: False}, device=torch.device("cpu"), **extra)
        predictor.initialize_from_trained_model_folder(model_dir, use_folds=folds,
                                                       checkpoint_name="checkpoint_final.pth")
        # 2.4.x adds a fold's logits to the previous folds' outside inference mode, which this torch
        # refuses for its inference tensors ("Inplace update to inference tensor outside InferenceMode"):
        # the whole prediction runs inside inference mode instead (no arithmetic changes)
        with torch.inference_mode():
            predictor.predict_from_files(cases, out_dir, save_probabilities=False, overwrite=True,
                                         num_processes_preprocessing=1, num_processes_segmentation_export=1)
    else:  # 2.0, 2.1: a function
        predict_module.predict_from_raw_data(cases, out_dir, model_dir, use_folds=folds, **common,
                                             perform_everything_on_gpu=False, save_probabilities=False,
                                             overwrite=True, num_processes_preprocessing=1,
                                             num_processes_segmentation_export=1, device=torch.device("cpu"))
    if used:
        import numpy as np

        first = used[0]
        np.save(os.path.join(out_dir, "used_gaussian.npy"),
                first.cpu().half().numpy() if isinstance(first, torch.Tensor) else np.asarray(first))


def _gaussians(release: str, patches: list[tuple[int, ...]], out: str) -> None:
    """The float16 map the release's predictor weights tiles with, for each patch, into ``out`` (npz)."""
    import numpy as np
    import torch
    from nnunetv2.inference import sliding_window_prediction as module

    maps = {}
    for patch in patches:
        if "device" in inspect.signature(module.compute_gaussian).parameters:  # 2.2 and later: torch
            scale = 1000 if release == "2.2" else 10  # what their predictors pass (2.2.1 lowered it)
            maps["x".join(map(str, patch))] = module.compute_gaussian(
                patch, sigma_scale=1.0 / 8, value_scaling_factor=scale, device=torch.device("cpu")).numpy()
        else:  # 2.0, 2.1: NumPy, turned into a half tensor by the predictor
            maps["x".join(map(str, patch))] = torch.from_numpy(module.compute_gaussian(patch)).half().numpy()
    np.savez(out, **maps)


def _export(case: str, out: str) -> None:
    """The release's own ``convert_predicted_logits_to_segmentation_with_correct_shape`` (2.2 and later) on
    the logits and properties in ``case`` (npz written by the test), labels into ``out`` (npy)."""
    import json

    import numpy as np
    import torch
    from nnunetv2.inference.export_prediction import (
        convert_predicted_logits_to_segmentation_with_correct_shape,
    )
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    data = np.load(case)
    plans = PlansManager(json.loads(str(data["plans"])))
    configuration = plans.get_configuration(str(data["configuration"]))
    labels = plans.get_label_manager(json.loads(str(data["dataset"])))
    properties = json.loads(str(data["properties"]))
    segmentation = convert_predicted_logits_to_segmentation_with_correct_shape(
        torch.from_numpy(data["logits"]), plans, configuration, labels, properties)
    np.save(out, np.asarray(segmentation))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release")
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--folds", nargs="+", required=True)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--images", nargs="+", action="append", default=[],
                        help="one case's channel files; repeat for more cases")
    parser.add_argument("--gaussians", nargs="+", default=[], metavar="PATCH",
                        help="also write OUT_DIR/gaussians.npz: the release's map per patch (e.g. 8x8x8)")
    parser.add_argument("--export", default=None, metavar="NPZ",
                        help="also run the release's export on these logits into OUT_DIR/export.npy")
    args = parser.parse_args(argv)
    folds = tuple(int(f) if f.isdigit() else f for f in args.folds)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.images:
        _predict(args.release, args.model_dir, args.out_dir, folds, [list(c) for c in args.images],
                 args.threads)
    if args.gaussians:
        patches = [tuple(int(p) for p in patch.split("x")) for patch in args.gaussians]
        _gaussians(args.release, patches, os.path.join(args.out_dir, "gaussians.npz"))
    if args.export:
        _export(args.export, os.path.join(args.out_dir, "export.npy"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
