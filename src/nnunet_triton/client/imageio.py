"""Image files in and out, with nnU-Net's SimpleITK conventions and atomic writes.

Reading follows ``SimpleITKIO.read_images`` (nnunetv2/imageio/simpleitk_reader_writer.py): one file
per channel, arrays in SimpleITK's ``(z, y, x)`` order stacked to ``(C, z, y, x)`` float32, the spacing
reversed to ``(z, y, x)`` (absolute values), 2D files as ``(C, 1, y, x)`` with a dummy spacing of
``999 * max`` on the first axis, and the geometry (SimpleITK spacing, origin, direction) kept for the
writers. Cases use nnU-Net's naming (``case_0000.nii.gz``, ``case_0001.nii.gz``, ...).

Every writer writes to a hidden temporary file next to the target (``.<name>.partial-<pid>-<token><ext>``)
and renames it into place, so a reader never sees a half-written output; :func:`remove_stale_partials` clears
temporaries left by a killed process.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import SimpleITK as sitk

from nnunet_triton import io_names
from nnunet_triton.dtypes import numpy_dtype
from nnunet_triton.errors import InputValidationError
from nnunet_triton.util.durable import durable_output, remove_stale_temporaries

__all__ = [
    "SUPPORTED_ENDINGS",
    "OUTPUT_ENDINGS",
    "ImageGeometry",
    "ImageCase",
    "file_ending",
    "find_cases",
    "case_of",
    "read_images",
    "write_segmentation",
    "write_probabilities",
    "atomic_output",
    "remove_stale_partials",
]

LOGGER = logging.getLogger(__name__)

SUPPORTED_ENDINGS = (".nii.gz", ".nii", ".nrrd", ".mha", ".gipl")  # SimpleITKIO's list, plus plain .nii
OUTPUT_ENDINGS = {"nifti": ".nii.gz", "nrrd": ".nrrd", "mha": ".mha"}
_CHANNEL = re.compile(r"^(?P<case>.+)_(?P<channel>\d{4})$")


@dataclass(frozen=True)
class ImageGeometry:
    """SimpleITK geometry of an image (x, y, z order): nnU-Net's ``properties['sitk_stuff']``."""

    spacing: tuple[float, ...]
    origin: tuple[float, ...]
    direction: tuple[float, ...]

    @classmethod
    def of(cls, image: sitk.Image) -> ImageGeometry:
        return cls(tuple(image.GetSpacing()), tuple(image.GetOrigin()), tuple(image.GetDirection()))

    def apply(self, image: sitk.Image) -> sitk.Image:
        image.SetSpacing(self.spacing)
        image.SetOrigin(self.origin)
        image.SetDirection(self.direction)
        return image


@dataclass(frozen=True)
class ImageCase:
    """One case as nnU-Net reads it: ``data`` float32 ``(C, z, y, x)``, ``spacing`` ``(z, y, x)``."""

    data: np.ndarray
    spacing: tuple[float, ...]
    geometry: ImageGeometry

    def properties(self) -> dict[str, Any]:
        """nnU-Net's ``data_properties`` of a read image (what ``write_seg`` and ensembling use)."""
        g = self.geometry
        return {
            "sitk_stuff": {"spacing": g.spacing, "origin": g.origin, "direction": g.direction},
            "spacing": list(self.spacing),
        }


def file_ending(path: str | Path) -> str | None:
    """The supported image ending of ``path`` (``.nii.gz`` before ``.gz``-less ones), else None."""
    name = Path(path).name.lower()
    return next((e for e in SUPPORTED_ENDINGS if name.endswith(e)), None)


def _split(path: Path) -> tuple[str, int | None, str]:
    ending = file_ending(path) or ""
    stem = path.name[: len(path.name) - len(ending)]
    match = _CHANNEL.match(stem)
    return (match["case"], int(match["channel"]), ending) if match else (stem, None, ending)


def find_cases(
    folder: str | Path, ending: str | None = None, *, case: str | None = None
) -> dict[str, list[Path]]:
    """Cases of a folder in nnU-Net naming: ``{case: [channel 0 file, channel 1 file, ...]}``, sorted.

    A file without the ``_XXXX`` channel suffix is a one-channel case; ``case`` keeps only that case. Raises
    when a case's channels are not ``0000 .. C-1`` or mix file endings.
    """
    groups: dict[str, dict[int, Path]] = {}
    endings: dict[str, set[str]] = {}
    for path in sorted(Path(folder).iterdir()):
        if path.name.startswith(".") or not path.is_file() or file_ending(path) is None:
            continue
        if ending is not None and not path.name.endswith(ending):
            continue
        name, channel, found = _split(path)
        if case is not None and name != case:
            continue
        groups.setdefault(name, {})[0 if channel is None else channel] = path
        endings.setdefault(name, set()).add(found)
    for name, channels in groups.items():
        if sorted(channels) != list(range(len(channels))):
            raise InputValidationError(
                f"case {name!r} in {folder}: channel files must be numbered _0000.._{len(channels) - 1:04d}, "
                f"got {[p.name for _, p in sorted(channels.items())]}."
            )
        if len(endings[name]) > 1:
            raise InputValidationError(
                f"case {name!r} in {folder} mixes file endings {sorted(endings[name])}."
            )
    return {name: [p for _, p in sorted(ch.items())] for name, ch in sorted(groups.items())}


def case_of(path: str | Path) -> str:
    """The case name of an image file (``case_0000.nii.gz`` -> ``case``)."""
    return _split(Path(path))[0]


def _read_one(path: Path) -> tuple[np.ndarray, ImageGeometry, list[float]]:
    try:
        image = sitk.ReadImage(str(path))
    except RuntimeError as exc:
        raise InputValidationError(
            f"{path}: SimpleITK cannot read this image ({str(exc).strip()[-200:]})."
        ) from None
    geometry = ImageGeometry.of(image)
    array = sitk.GetArrayFromImage(image)
    if array.ndim == 2:  # nnU-Net's 2D convention: (1, 1, y, x) and a huge dummy spacing on the first axis
        return array[None, None], geometry, [max(geometry.spacing) * 999, *geometry.spacing[::-1]]
    if array.ndim == 3:
        return array[None], geometry, list(geometry.spacing[::-1])
    if array.ndim == 4:  # several channels in one file
        return array, geometry, list(geometry.spacing[::-1][1:])
    raise InputValidationError(f"{path}: expected a 2D, 3D or 4D image, got {array.ndim} dimensions.")


_NATIVE_DTYPES = tuple(numpy_dtype(name) for name in io_names.IMAGE_DTYPES)


def read_images(files: Sequence[str | Path], *, native_dtype: bool = False) -> ImageCase:
    """Read one case (one file per channel) like ``SimpleITKIO.read_images``; errors name the files.

    ``native_dtype``: keep the files' dtype when every channel has the same one and the endpoint takes it
    as it is (float32, float16, int16, uint16, uint8; an int16 CT is half the bytes); otherwise float32,
    as nnU-Net reads. The endpoint casts to float32 exactly, so the answer is the same.
    """
    if not files:
        raise InputValidationError("read_images needs at least one file, got none.")
    paths = [Path(f) for f in files]
    arrays, geometries, spacings = zip(*(_read_one(p) for p in paths), strict=True)
    names = [p.name for p in paths]
    if len({a.shape for a in arrays}) > 1:
        raise InputValidationError(f"channels {names} differ in shape: {[a.shape for a in arrays]}.")
    if len({g.spacing for g in geometries}) > 1:
        raise InputValidationError(f"channels {names} differ in spacing: {[g.spacing for g in geometries]}.")
    for attribute in ("origin", "direction"):  # nnU-Net only warns about these
        if len({getattr(g, attribute) for g in geometries}) > 1:
            LOGGER.warning("channels %s differ in %s; the first channel's is used", names, attribute)
    dtypes = {a.dtype.newbyteorder("=") for a in arrays}
    keep = native_dtype and len(dtypes) == 1 and next(iter(dtypes)) in _NATIVE_DTYPES
    data = np.vstack(arrays, dtype=next(iter(dtypes)) if keep else np.float32, casting="unsafe")
    spacing = tuple(float(abs(s)) for s in spacings[0])
    return ImageCase(data=data, spacing=spacing, geometry=geometries[0])


@contextlib.contextmanager
def atomic_output(path: str | Path, ending: str = "") -> Iterator[Path]:
    """Yield a hidden temporary path next to ``path`` (ending ``ending``), renamed onto ``path`` on success
    (:func:`nnunet_triton.util.durable.durable_output`: fsync-ed file and folder).

    On any exception (including KeyboardInterrupt/SystemExit) the temporary file is removed and ``path``
    is left untouched.
    """
    with durable_output(path, suffix=ending) as temp:
        yield temp


def remove_stale_partials(folder: str | Path) -> list[Path]:
    """Delete temporaries of :func:`atomic_output` whose writing process is gone; returns what was removed."""
    return remove_stale_temporaries(folder)


def write_segmentation(segmentation: np.ndarray, path: str | Path, geometry: ImageGeometry) -> Path:
    """Write a label map with the input's geometry, like ``SimpleITKIO.write_seg`` (uint8, uint16 if > 254).

    ``segmentation`` is ``(z, y, x)``; for a 2D input (geometry of 2 axes) nnU-Net's ``(1, y, x)``.
    """
    path = Path(path)
    ending = file_ending(path)
    if ending is None:
        raise InputValidationError(f"{path}: output ending must be one of {SUPPORTED_ENDINGS}.")
    seg = np.asarray(segmentation)
    if seg.ndim != 3:
        raise InputValidationError(f"{path}: segmentation must be 3D (z, y, x), got shape {seg.shape}.")
    if len(geometry.spacing) == 2:
        seg = seg[0]
    dtype = np.uint8 if seg.size == 0 or int(seg.max()) < 255 else np.uint16
    image = geometry.apply(sitk.GetImageFromArray(seg.astype(dtype, copy=False)))
    with atomic_output(path, ending) as temp:
        sitk.WriteImage(image, str(temp), True)
    return path


def write_probabilities(
    probabilities: np.ndarray, path_truncated: str | Path, properties: dict[str, Any] | None = None
) -> Path:
    """Write ``<path_truncated>.npz`` (key ``probabilities``, like nnU-Net) and ``.pkl`` (``properties``)."""
    npz = Path(f"{path_truncated}.npz")
    with atomic_output(npz, ".npz") as temp, open(temp, "wb") as handle:
        np.savez_compressed(handle, probabilities=np.asarray(probabilities, dtype=np.float32))
    if properties is not None:
        with atomic_output(Path(f"{path_truncated}.pkl"), ".pkl") as temp, open(temp, "wb") as handle:
            pickle.dump(properties, handle)
    return npz
