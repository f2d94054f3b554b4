"""perf_analyzer ``--input-data`` JSON for the ``nnunet`` endpoint (IMAGE + SPACING of one real case).

perf_analyzer's "Real Input Data" format (perf_analyzer docs/input_data.md): one entry per request
in ``data``, each input as ``{"content": ..., "shape": [...]}``; ``content`` is either the row-major
numbers or ``{"b64": <little-endian bytes, base64>}``. Explicit shapes are required here because
every dimension of IMAGE is variable ([C, -1, -1, -1]). Base64 keeps a 30 MB float32 volume a 40 MB
file instead of a ~300 MB list of decimal numbers; ``--encoding content`` writes numbers (small
cases, or to read the file).

Usage::

    python -m tools.perf.input_data --case case.npz --out input.json [--encoding b64|content]
        [--dtype FP32|FP16|INT16|UINT16|UINT8]   # other than FP32: perf_analyzer -m nnunet_int16 ...
    python -m tools.perf.input_data --image img_0000.nii.gz [--image img_0001.nii.gz] --out input.json
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton import io_names
from nnunet_triton.dtypes import numpy_dtype

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ENCODINGS", "InputDataFile", "tensor_entry", "input_data_document", "write_input_data", "main"]

ENCODINGS = ("b64", "content")


@dataclass(frozen=True)
class InputDataFile:
    """A written input-data file and the shapes it declares (for the report)."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    encoding: str
    nbytes: int


def tensor_entry(array: np.ndarray, encoding: str) -> dict[str, Any]:
    """``{"content": ..., "shape": [...]}`` for one tensor of one request."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}.")
    array = np.ascontiguousarray(array)
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    content: Any
    if encoding == "b64":
        content = {"b64": base64.b64encode(little.tobytes()).decode("ascii")}
    else:
        content = little.reshape(-1).tolist()
    return {"content": content, "shape": [int(d) for d in array.shape]}


_WIRE = {wire: numpy_dtype(wire) for wire in io_names.IMAGE_DTYPES}


def input_data_document(image: np.ndarray, spacing: np.ndarray, *, encoding: str = "b64",
                        dtype: str = "FP32") -> dict[str, Any]:
    """The whole JSON document: one request with IMAGE (``dtype`` [C, z, y, x]; the typed endpoint
    ``io_names.typed_endpoint(dtype)`` takes it) and SPACING (FP64 [3])."""
    if dtype not in _WIRE:
        raise ValueError(f"dtype must be one of {tuple(_WIRE)}, got {dtype!r}.")
    source = np.asarray(image)
    image = source.astype(_WIRE[dtype])
    if dtype != "FP32" and not np.array_equal(image.astype(np.float64), source.astype(np.float64)):
        raise ValueError(f"the image's values do not fit {dtype} exactly; send it as FP32.")
    spacing = np.asarray(spacing, dtype=np.float64).reshape(-1)
    if image.ndim != spacing.size + 1:
        raise ValueError(
            f"image must be (C, *spatial) with one spatial axis per spacing value, got image shape "
            f"{image.shape} and spacing {spacing.tolist()}."
        )
    return {"data": [{io_names.IMAGE: tensor_entry(image, encoding),
                      io_names.SPACING: tensor_entry(spacing, encoding)}]}


def write_input_data(image: np.ndarray, spacing: np.ndarray, path: Path, *, encoding: str = "b64",
                     dtype: str = "FP32") -> InputDataFile:
    """Write the input-data JSON for one case and return what it declares."""
    document = input_data_document(image, spacing, encoding=encoding, dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    entry = document["data"][0]
    return InputDataFile(
        path=path,
        shapes={name: tuple(value["shape"]) for name, value in entry.items()},
        dtypes={io_names.IMAGE: dtype, io_names.SPACING: "FP64"},
        encoding=encoding,
        nbytes=path.stat().st_size,
    )


def main(argv: list[str] | None = None) -> int:
    """Write the input-data JSON for a saved case (``--case``) or for image files (``--image``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--case", type=Path, help=".npz written by tools.perf (image, spacing)")
    source.add_argument("--image", type=Path, action="append", help="one file per channel (SimpleITK)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--encoding", choices=ENCODINGS, default="b64")
    parser.add_argument("--dtype", choices=tuple(_WIRE), default="FP32",
                        help="IMAGE dtype (perf_analyzer -m nnunet_<dtype> for other than FP32)")
    args = parser.parse_args(argv)
    from tools.perf.workloads import Case, read_image

    case = Case.load(args.case) if args.case else read_image(args.image, args.image[0].name)
    written = write_input_data(case.image, np.asarray(case.spacing), args.out, encoding=args.encoding,
                               dtype=args.dtype)
    print(f"wrote {written.path} ({written.nbytes / 2**20:.1f} MiB): {written.shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
