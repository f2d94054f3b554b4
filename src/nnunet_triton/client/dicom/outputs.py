"""Which DICOM objects a segmentation becomes: a DICOM-SEG, an RTSTRUCT or both (``--output`` of the node
and its routes, ``predict --output-format dicom-seg|dicom-rtstruct|dicom-seg+rtstruct``), written by
:func:`write_dicom_outputs` from the same label map and the same segment labels (names, codes, colours)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.errors import InputValidationError

__all__ = ["DicomOutput", "write_dicom_outputs"]


class DicomOutput(StrEnum):
    SEG = "seg"
    RTSTRUCT = "rtstruct"
    BOTH = "both"

    @property
    def seg(self) -> bool:
        return self in (DicomOutput.SEG, DicomOutput.BOTH)

    @property
    def rtstruct(self) -> bool:
        return self in (DicomOutput.RTSTRUCT, DicomOutput.BOTH)

    @classmethod
    def parse(cls, value: object, *, where: str = "--output") -> DicomOutput:
        """The output kind ``value`` names; InputValidationError naming ``where`` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise InputValidationError(f"{where}: one of {[k.value for k in cls]}, got {ascii(value)[:40]}."
                                       ) from None


def write_dicom_outputs(
    segmentation: np.ndarray,
    volume: Any,
    labels: Sequence[Any],
    output: DicomOutput,
    *,
    seg_path: Path | None,
    rtstruct_path: Path | None,
    seg_uids: tuple[str, str] | None = None,
    rtstruct_uids: tuple[str, str] | None = None,
    instance_number: int = 1,
    durable: bool = False,
) -> list[Path]:
    """Write the objects ``output`` asks for; ``*_uids``: (SeriesInstanceUID, SOPInstanceUID) of each
    (new ones by default). Returns the files written, SEG first."""
    from nnunet_triton.client.dicom.rtstruct import write_rtstruct
    from nnunet_triton.client.dicom.seg import write_dicom_seg

    written = []
    if output.seg:
        if seg_path is None:
            raise ValueError("a DICOM-SEG needs seg_path")
        series, sop = seg_uids or (None, None)
        written.append(write_dicom_seg(segmentation, volume, labels, seg_path, series_instance_uid=series,
                                       sop_instance_uid=sop, instance_number=instance_number,
                                       durable=durable))
    if output.rtstruct:
        if rtstruct_path is None:
            raise ValueError("an RTSTRUCT needs rtstruct_path")
        series, sop = rtstruct_uids or (None, None)
        written.append(write_rtstruct(segmentation, volume, labels, rtstruct_path, series_instance_uid=series,
                                      sop_instance_uid=sop, instance_number=instance_number,
                                      durable=durable))
    return written
