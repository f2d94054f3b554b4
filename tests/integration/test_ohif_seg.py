"""Our DICOM-SEG in the OHIF viewer, as a clinician would open it: Orthanc (with its DICOMweb plugin) holds
a CT series and the SEG; OHIF's prebuilt ``@ohif/app`` (npm) is served by nginx with its data source on
Orthanc's DICOMweb (``tools/ohif.py``); headless Chromium opens the study, double-clicks the SEG, answers
"Yes" to OHIF's "open this Segmentation?", and the test reads the viewer's own segmentation state: the
segments' names and colours (from ``--seg-metadata``) and the labelmap voxels OHIF decoded, per source
instance, against the label map written. A screenshot lands in ``build/ohif/screenshots/``.

Needs Orthanc, nginx, chromium (installed with apt as root when missing) and npm (the viewer is fetched
once into ``build/ohif/``); skipped, saying which, where one cannot be had. About a minute.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import generate_uid

from nnunet_triton import segment_metadata as sm
from nnunet_triton.client.dicom import seg as dicom_seg
from nnunet_triton.client.dicom import volume as dicom
from tests.fixture_paths import FIXTURES_DIR, REPO_ROOT
from tests.unit import dicom_support
from tools.ohif import Browser, chromium, ensure_ohif, start_viewer
from tools.orthanc import ensure_orthanc, start_orthanc, stop_orthanc

pytestmark = pytest.mark.slow
SCREENSHOT = REPO_ROOT / "build" / "ohif" / "screenshots" / "seg_over_ct.png"
AXIAL = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)  # OHIF 3.13 loads a SEG only in the plane of the first image

# the viewer's labelmap, per source instance: {SOPInstanceUID: [rows of segment indices]}
LABELMAP_JS = """(() => {
  const seg = window.services.segmentationService.getSegmentations()[0];
  const map = seg.representationData.Labelmap;
  const out = {};
  map.imageIds.forEach((id, k) => {
    const uid = /instances\\/([0-9.]+)/.exec(map.referencedImageIds[k])[1];
    const image = window.cornerstone.cache.getImage(id);
    out[uid] = Array.from(image.getPixelData());
  });
  return JSON.stringify(out);
})()"""


def _requirements(build: Path) -> tuple[str, str, Path]:
    orthanc = ensure_orthanc()
    browser = chromium()
    dist = ensure_ohif(build) if shutil.which("nginx") else None
    missing = [name for name, found in (("orthanc + orthanc-dicomweb", orthanc), ("chromium", browser),
                                        ("nginx and npm (@ohif/app)", dist)) if found is None]
    if missing:
        pytest.skip(f"the viewer test needs {', '.join(missing)} (installed with apt as root)")
    return orthanc, browser, dist


def _study(folder: Path) -> tuple[dicom_support.BuiltSeries, np.ndarray, Path, sm.SegmentMetadata]:
    """An axial CT series (a body block in air) and its coded SEG: an organ with a lesion inside."""
    ct = np.full((8, 64, 64), -1000, np.int16)
    ct[:, 8:56, 8:56] = 40
    built = dicom_support.write_volume_as_ct(folder / "ct", ct, (2.0, 1.0, 1.0), study_uid=generate_uid(),
                                             orientation=AXIAL)
    volume = dicom.read_dicom_folder(built.folder)
    label_map = np.zeros(volume.data.shape, np.uint8)
    label_map[2:6, 16:40, 12:44] = 1
    label_map[3:5, 24:32, 20:30] = 2
    metadata = sm.read_segment_metadata(FIXTURES_DIR / "seg_metadata" / "organ_lesion.json")
    labels = dicom_seg.with_metadata(dicom_seg.segment_labels({"background": 0, "organ": 1, "lesion": 2}),
                                     metadata)
    path = dicom_seg.write_dicom_seg(label_map, volume, labels, folder / "seg" / "seg.dcm")
    return built, label_map, path, metadata


def test_ohif_shows_our_seg_over_the_ct_with_its_names_colours_and_voxels(tmp_path):
    binary, browser_binary, dist = _requirements(REPO_ROOT / "build")
    built, label_map, seg_path, metadata = _study(tmp_path / "dicom")
    study = str(pydicom.dcmread(built.files[0]).StudyInstanceUID)
    orthanc = start_orthanc(tmp_path / "orthanc", binary)
    viewer = browser = None
    try:
        orthanc.upload([*built.files, seg_path])
        viewer = start_viewer(dist, orthanc, tmp_path / "nginx")
        browser = Browser(browser_binary, tmp_path / "browser")
        browser.navigate(f"{viewer.url}/viewer?StudyInstanceUIDs={study}")
        browser.wait_for("!!(window.services && window.services.displaySetService"
                         ".getActiveDisplaySets().some(d => d.Modality === 'SEG'))", timeout_s=240,
                         what="the study's display sets (CT and SEG)")
        for overlay in ("Skip all", "Confirm and hide"):  # OHIF's tour and its investigational-use notice
            browser.wait_for(f"Array.from(document.querySelectorAll('button, span')).some(b => "
                             f"b.textContent.trim() === {json.dumps(overlay)})", timeout_s=60, what=overlay)
            browser.click("button, span", text=overlay)
        browser.click('[data-cy="study-browser-thumbnail-no-image"]', count=2, text="SEG")
        browser.wait_for("Array.from(document.querySelectorAll('button')).some(b => b.textContent.trim()"
                         " === 'Yes')", timeout_s=120, what="OHIF's 'open this Segmentation?' prompt")
        browser.click("button", text="Yes")
        browser.wait_for("window.services.segmentationService.getSegmentationRepresentations('default')"
                         ".length > 0", timeout_s=180, what="the SEG shown in the viewport")
        browser.wait_for("window.services.segmentationService.getSegmentations().length > 0 && "
                         "window.services.segmentationService.getSegmentations()[0].representationData"
                         ".Labelmap.imageIds.every(id => window.cornerstone.cache.getImage(id))",
                         timeout_s=180, what="the SEG decoded into a labelmap")
        segments = json.loads(browser.evaluate(
            "JSON.stringify((() => { const s = window.services.segmentationService.getSegmentations()[0];"
            " return Object.values(s.segments).filter(v => v).map(v => [v.segmentIndex, v.label,"
            " window.services.segmentationService.getSegmentColor('default', s.segmentationId,"
            " v.segmentIndex)]); })())"))
        labelmap = json.loads(browser.evaluate(LABELMAP_JS))
        browser.evaluate("new Promise(done => setTimeout(done, 2000))")  # let it paint
        browser.screenshot(SCREENSHOT)
    finally:
        if browser is not None:
            browser.close()
        if viewer is not None:
            viewer.stop()
        stop_orthanc(orthanc)

    assert [(index, name) for index, name, _ in segments] == [(1, "Organ"), (2, "Lesion")]
    for index, _, colour in segments:  # the metadata's RGB, through DICOM's CIELab and back
        assert all(abs(a - b) <= 2 for a, b in zip(colour[:3], metadata.coding(index).rgb, strict=True)), (
            index, colour)
    assert sorted(labelmap) == sorted(built.sop_uids)
    shown = np.stack([np.asarray(labelmap[uid]).reshape(label_map.shape[1:]) for uid in built.sop_uids])
    np.testing.assert_array_equal(shown, label_map)  # every voxel where the label map says
    from PIL import Image

    pixels = np.asarray(Image.open(SCREENSHOT).convert("RGB")).astype(int)
    organ = np.asarray(metadata.coding(1).rgb)
    # the organ drawn over the CT: a large block tinted toward its colour (red above blue, as 221/130/101)
    tinted = (pixels[..., 0] - pixels[..., 2] > 40) & (pixels[..., 0] > 150)
    assert tinted.sum() > 10_000, (tinted.sum(), organ)
