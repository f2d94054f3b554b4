"""The cases of an input: an image file, a folder of cases in nnU-Net naming, or a folder of DICOM series.

``collect_jobs(source)`` returns one :class:`Job` per case (one per SeriesInstanceUID for DICOM); a job
reads its case only when ``load()`` is called, so a batch holds one case at a time per worker.
Used by ``nnunet-triton predict`` and ``validate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.client import imageio
from nnunet_triton.client.dicom import volume as dicom
from nnunet_triton.errors import InputValidationError, NnunetTritonError

__all__ = ["CASE_ERRORS", "Job", "collect_jobs"]

CASE_ERRORS = (NnunetTritonError, OSError, ValueError, RuntimeError)  # SimpleITK raises RuntimeError


@dataclass(frozen=True)
class Job:
    """One case: ``load()`` returns the image and, for DICOM input, the source volume."""

    name: str
    load: Callable[[], tuple[imageio.ImageCase, dicom.DicomVolume | None]]
    is_dicom: bool


def _image_job(name: str, files: list[Path]) -> Job:
    return Job(name, lambda: (imageio.read_images(files, native_dtype=True), None), is_dicom=False)


def _dicom_job(series: dicom.SeriesFiles, options: dicom.DicomOptions) -> Job:
    def load() -> tuple[imageio.ImageCase, dicom.DicomVolume]:
        volume = dicom.read_series(series, options)
        return volume.image_case(), volume

    return Job(dicom.case_name(series), load, is_dicom=True)


def collect_jobs(source: Path, options: dicom.DicomOptions = dicom.DEFAULT_OPTIONS) -> list[Job]:
    """The cases of ``source``: a file (its ``_0001``.. channel siblings are found), a folder of cases in
    nnU-Net naming, or a folder of DICOM files (searched recursively; one case per SeriesInstanceUID).

    Raises:
        InputValidationError: the input does not exist or holds no case.
    """
    if source.is_file():
        ending = imageio.file_ending(source)
        if ending is None:
            raise InputValidationError(
                f"{source}: not a supported image ({imageio.SUPPORTED_ENDINGS}); for "
                "DICOM pass the folder of the series."
            )
        case = imageio.case_of(source)
        return [_image_job(case, imageio.find_cases(source.parent, ending, case=case)[case])]
    if not source.is_dir():
        raise InputValidationError(f"input {source} does not exist.")
    cases = imageio.find_cases(source)
    if cases:
        return [_image_job(name, files) for name, files in cases.items()]
    scan = dicom.scan_folder(source, options)
    if not scan.series:
        raise InputValidationError(
            f"{source}: no images ({imageio.SUPPORTED_ENDINGS}) and no DICOM image series "
            f"({len(scan.skipped)} other files)."
        )
    return [_dicom_job(series, options) for series in scan.series]
