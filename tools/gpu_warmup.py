"""Warm a GPU endpoint up over the scan shapes it will see, before real traffic.

Why: on the GPU, resampling runs on ``cupyx.scipy.ndimage.zoom``, and CuPy compiles a zoom kernel for every
output shape (the shape is part of the kernel's source; NVRTC, then CuPy's kernel cache). A request with a
new scan shape therefore pays those compiles in preprocessing (image to target spacing) and in stitching
(probabilities back to the image's shape) once per server process and shape. Their cost has not been
measured yet (no GPU lent; the GPU check's stage (c) reports it: "unseen case shape, first/second request").
Until it is, this tool sends one synthetic request per expected (shape, spacing) so that the first patient
does not pay it.

Usage::

    python -m tools.gpu_warmup --url localhost:8001 --protocol grpc \
        --case 300x512x512@2.5,0.8,0.8 --case 96x512x512@5,0.7,0.7

``--case`` is ``ZxYxX@sz,sy,sx``: the shape and spacing (mm) in the reader's axis order (SimpleITK: z, y,
x), as the client sends images. The image is nonzero everywhere, so nnU-Net's crop to the nonzero region
keeps its whole extent and the resampled shapes are those of a real scan with that shape and spacing.
Each orchestrator and stitch instance is its own process with its own kernel cache: ``--repeat`` sends
each case that many times concurrently (default: 1), to reach more than one instance.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

__all__ = ["WarmupCase", "parse_case", "warmup_image", "main"]

LOGGER = logging.getLogger("gpu_warmup")


@dataclass(frozen=True)
class WarmupCase:
    """One expected scan: ``shape`` (voxels) and ``spacing`` (mm), both in the reader's axis order."""

    shape: tuple[int, ...]
    spacing: tuple[float, ...]


def parse_case(text: str) -> WarmupCase:
    """``"300x512x512@2.5,0.8,0.8"`` -> ``WarmupCase``.

    Raises:
        ValueError: naming the argument, the rule and the value.
    """
    rule = "expected ZxYxX@sz,sy,sx with 3 positive integers and 3 positive spacings in mm"
    shape_text, at, spacing_text = text.partition("@")
    try:
        shape = tuple(int(v) for v in shape_text.lower().split("x"))
        spacing = tuple(float(v) for v in spacing_text.split(","))
    except ValueError:
        raise ValueError(f"--case {text!r}: {rule}.") from None
    if not at or len(shape) != 3 or len(spacing) != 3 or min(shape) < 1 or not min(spacing) > 0:
        raise ValueError(f"--case {text!r}: {rule}.")
    return WarmupCase(shape, spacing)


def warmup_image(case: WarmupCase, *, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A CT-like image, shape (channels, *case.shape), float32, nonzero in every voxel (so nnU-Net's crop
    to the nonzero region keeps the whole extent)."""
    rng = np.random.default_rng(seed)
    image = rng.normal(40.0, 200.0, size=(channels, *case.shape)).astype(np.float32)
    image[image == 0] = 1.0
    return image


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server's host:port for --protocol")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="default grpc")
    p.add_argument("--endpoint", "--model", dest="model", default=None,
                   help="the endpoint name (default: the client's, nnunet)")
    p.add_argument("--case", dest="cases", action="append", type=_case_arg, required=True,
                   help="ZxYxX@sz,sy,sx: one expected scan shape and spacing (repeat the flag for more)")
    p.add_argument("--channels", type=int, default=1, help="input channels of the model (default 1)")
    p.add_argument("--repeat", type=int, default=1,
                   help="concurrent requests per case, to reach several orchestrator/stitch instances")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per request")
    return p


def _case_arg(text: str) -> WarmupCase:
    try:
        return parse_case(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from nnunet_triton.client.client import NnunetClient

    options = {} if args.model is None else {"model": args.model}

    def send(case: WarmupCase) -> float:
        start = time.perf_counter()
        with NnunetClient(args.url, protocol=args.protocol, timeout_s=args.timeout_s, **options) as client:
            client.segment(warmup_image(case, channels=args.channels), case.spacing, mirroring=False)
        return time.perf_counter() - start

    for case in args.cases:
        with ThreadPoolExecutor(max_workers=max(1, args.repeat)) as pool:
            seconds = list(pool.map(send, [case] * max(1, args.repeat)))
        LOGGER.info("warmed shape %s spacing %s: %s s", "x".join(map(str, case.shape)),
                    ",".join(f"{s:g}" for s in case.spacing), ", ".join(f"{s:.2f}" for s in seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
