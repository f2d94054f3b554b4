"""End-to-end demo: committed fixture model -> Triton repository -> embedded server -> one segmentation.

    python tools/demo.py [--model-dir tests/fixtures/Dataset901_SynthCT/nnUNetTrainer__nnUNetPlans__3d_tiny]
        [--image <case>_0000.nii.gz] [--out build/demo] [--protocol http|grpc] [--no-mirroring]

Steps: build the model repository with ``repository/build.py`` (a no-op when it is up to date), start
the embedded ``tritonserver`` (``nnunet_triton.server.embedded``) on free loopback ports, read the image
with SimpleITK, segment it with ONE call of the ``nnunet`` endpoint through ``NnunetClient``, write the
label map as NIfTI with the input's spacing, origin and direction, print labels, voxel counts and
timings, and stop the server (also when something fails).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.options import DEFAULT_CLIENT_TIMEOUT_S

REPO_ROOT = Path(__file__).resolve().parents[1]

LOGGER = logging.getLogger("demo")
DEFAULT_MODEL = Path("tests/fixtures/Dataset901_SynthCT/nnUNetTrainer__nnUNetPlans__3d_tiny")
DEFAULT_OUT = Path("build/demo")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", "--model", dest="model", type=Path, nargs="+", default=[DEFAULT_MODEL],
                   help="nnU-Net results folder; several folders: an ensemble of configurations")
    p.add_argument("--folds", nargs="+", default=None, help="folds to serve (default: all found)")
    p.add_argument("--image", type=Path, default=None,
                   help="first channel file <case>_0000.<ext> (default: first case in <dataset>/imagesTs)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for repository, segmentation, log")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--no-mirroring", action="store_true", help="disable test-time mirroring")
    p.add_argument("--timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT_S,
                   help="seconds for the inference call")
    return p


def _resolve(path: Path) -> Path:
    return path if path.is_absolute() else REPO_ROOT / path


def _default_image(model_dir: Path) -> Path:
    images = sorted((model_dir.parent / "imagesTs").glob("*_0000.*"))
    if not images:
        raise FileNotFoundError(f"no <case>_0000.* image in {model_dir.parent / 'imagesTs'}; pass --image.")
    return images[0]


def _channel_files(first: Path) -> list[Path]:
    """``<case>_0000.nii.gz`` -> all existing ``<case>_XXXX.nii.gz`` files, in channel order."""
    name = first.name
    stem, sep, rest = name.partition("_0000")
    if not sep:
        return [first]
    files = [first]
    while (candidate := first.with_name(f"{stem}_{len(files):04d}{rest}")).is_file():
        files.append(candidate)
    return files


def _read_case(first: Path):  # -> (sitk.Image, image (C, z, y, x), spacing (z, y, x))
    import SimpleITK as sitk

    images = [sitk.ReadImage(str(f)) for f in _channel_files(first)]
    data = np.stack([sitk.GetArrayFromImage(image) for image in images])
    spacing = tuple(float(s) for s in reversed(images[0].GetSpacing()))  # SimpleITK x, y, z -> z, y, x
    return images[0], data, spacing


def _write_segmentation(segmentation: np.ndarray, reference, path: Path) -> None:
    import SimpleITK as sitk

    image = sitk.GetImageFromArray(segmentation)
    image.CopyInformation(reference)  # spacing, origin, direction of the input
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(image, str(path), useCompression=True)


def _case_name(first: Path) -> str:
    return first.name.partition("_0000")[0] if "_0000" in first.name else first.name.split(".")[0]


def run(args: argparse.Namespace) -> int:
    from nnunet_triton.builder.repository import build_ensemble_repository, build_repository
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.server import embedded as embedded_server

    model_dirs = [_resolve(m) for m in args.model]
    folds = [f if f == "all" else int(f) for f in args.folds] if args.folds else None
    out = _resolve(args.out)
    image_path = _resolve(args.image) if args.image else _default_image(model_dirs[0])
    start = time.perf_counter()
    if len(model_dirs) > 1:
        built = build_ensemble_repository(model_dirs, out / "model_repository", folds=folds)
    else:
        built = build_repository(model_dirs[0], out / "model_repository", folds=folds)
    print(f"repository: {built.out} ({'built' if built.rebuilt else 'up to date'}, {built.seconds:.1f} s)")
    reference, image, spacing = _read_case(image_path)
    print(f"image: {image_path.name} shape (C, z, y, x) {image.shape} spacing (z, y, x) {spacing}")
    server_start = time.perf_counter()
    with embedded_server.start(out / "model_repository", home=REPO_ROOT / "build" / "triton-home",
                               log_file=out / "tritonserver.log") as server:
        print(f"server: ready in {time.perf_counter() - server_start:.1f} s at http {server.http_url}, "
              f"grpc {server.grpc_url} (log: {out / 'tritonserver.log'})")
        url = server.http_url if args.protocol == "http" else server.grpc_url
        with NnunetClient(url, protocol=args.protocol, timeout_s=args.timeout) as client:
            result = client.segment(image, spacing, mirroring=not args.no_mirroring)
    seg_path = out / f"{_case_name(image_path)}.nii.gz"
    _write_segmentation(result.segmentation, reference, seg_path)
    labels, counts = np.unique(result.segmentation, return_counts=True)
    print(f"segmentation: {seg_path} {result.segmentation.dtype} shape {result.segmentation.shape}")
    for label, count in zip(labels.tolist(), counts.tolist(), strict=True):
        print(f"  label {label}: {count} voxels")
    print(f"inference (one {args.protocol} call): {result.elapsed_s:.2f} s; "
          f"demo total {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 on success, 1 on a reported error (the server is stopped either way)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (NnunetTritonError, FileNotFoundError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
