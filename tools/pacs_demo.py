"""PACS demo: a real Orthanc, the served fixture model and ``nnunet-triton listen`` on this machine.

    python -m tools.pacs_demo [--out build/pacs-demo] [--keep]

Steps: build the fixture model's repository and start the embedded server (as ``make demo``); start Orthanc
(installed with apt when missing) from a config in ``<out>/orthanc``; write a fixture test case as a CT
series in a new study and upload it to Orthanc (REST); start the DICOM node (``nnunet-triton listen``,
AE ``NNUNET``, storing only for Orthanc's AE title ``ORTHANC`` from loopback) and ask Orthanc to route
the series to it (C-STORE); wait until the node has sent the DICOM-SEG back (C-STORE to ``ORTHANC``)
and print what arrived; then segment the same study over DICOMweb (``predict -i dicomweb://... -o
dicomweb://...``, loopback). ``--keep`` leaves everything running (Orthanc's
explorer URL is printed) until Ctrl-C. The series writer comes from the test helpers
(``tests/unit/dicom_support.py``): the demo runs from a checkout.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.orthanc import NODE_AE, PASSWORD, USER, ensure_orthanc, start_orthanc, stop_orthanc

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = REPO_ROOT / "tests/fixtures/Dataset901_SynthCT/nnUNetTrainer__nnUNetPlans__3d_tiny"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "pacs-demo")
    parser.add_argument("--keep", action="store_true",
                        help="leave Orthanc, the node and the server running")
    return parser


def _series(folder: Path) -> tuple[str, str]:
    """The first SynthCT test case as a CT series in a new study: (study UID, series UID)."""
    import SimpleITK as sitk
    from pydicom.uid import generate_uid

    from tests.unit.dicom_support import write_volume_as_ct

    image_path = sorted((MODEL.parent / "imagesTs").glob("*_0000.nii.gz"))[0]
    image = sitk.ReadImage(str(image_path))
    spacing = tuple(float(s) for s in reversed(image.GetSpacing()))
    study = generate_uid()
    built = write_volume_as_ct(folder, np.round(sitk.GetArrayFromImage(image)), spacing, study_uid=study)
    return study, built.series_uid


def _describe(seg: bytes) -> str:
    import pydicom

    ds = pydicom.dcmread(io.BytesIO(seg))
    names = ", ".join(s.SegmentLabel for s in ds.SegmentSequence)
    return f"DICOM-SEG {ds.SOPInstanceUID}: {ds.NumberOfFrames} frames, segments [{names}]"


def run(args: argparse.Namespace) -> int:
    from nnunet_triton.builder.repository import build_repository
    from nnunet_triton.server import embedded

    binary = ensure_orthanc()
    if binary is None:
        print("pacs-demo: Orthanc is not installed and cannot be installed here (apt-get orthanc "
              "orthanc-dicomweb as root)", file=sys.stderr)
        return 1
    out = args.out.resolve()
    built = build_repository(MODEL, out / "model_repository")
    print(f"repository: {built.out} ({'built' if built.rebuilt else 'up to date'})")
    env = {**os.environ, "NNUNET_TRITON_DICOMWEB_USER": USER, "NNUNET_TRITON_DICOMWEB_PASSWORD": PASSWORD}
    with embedded.start(out / "model_repository", home=REPO_ROOT / "build" / "triton-home",
                        log_file=out / "tritonserver.log") as server:
        print(f"server: {server.http_url}")
        orthanc = start_orthanc(Path(tempfile.mkdtemp(prefix="orthanc-", dir=out)), binary)
        node = None
        try:
            print(f"orthanc: explorer {orthanc.rest}/app/explorer.html (user {USER}, password {PASSWORD}),"
                  f" DICOM {orthanc.store_destination}, DICOMweb {orthanc.dicomweb}")
            folder = out / "dicom" / str(time.time_ns())
            study, series = _series(folder)
            orthanc_series = orthanc.upload(sorted(folder.glob("*.dcm")))
            print(f"uploaded study {study}, series {series}")
            node = subprocess.Popen(
                [sys.executable, "-m", "nnunet_triton", "listen", "--url", server.http_url,
                 "--ae-title", NODE_AE, "--port", str(orthanc.node_port), "--spool", str(out / "spool"),
                 "--allow", "ORTHANC@127.0.0.1", "--destination", orthanc.store_destination,
                 "--idle-timeout", "2", "--disable-tta", "-v"],
                env=env)
            time.sleep(3)
            orthanc.request("POST", "/modalities/nnunet/store",
                            json.dumps({"Resources": orthanc_series, "Synchronous": True}).encode())
            print("routed the series to the node (C-STORE ORTHANC -> NNUNET); waiting for the SEG ...")
            (seg,) = orthanc.wait_for_seg(study)
            print(f"arrived in Orthanc by C-STORE: {_describe(seg)}")
            web = subprocess.run([sys.executable, "-m", "nnunet_triton", "predict", "--url", server.http_url,
                                  "-i", orthanc.dicomweb, "--study", study, "-o", orthanc.dicomweb,
                                  "--disable-tta"], env=env, check=False)
            segs = orthanc.seg_series(study)
            print(f"after predict over DICOMweb (exit {web.returncode}): {len(segs)} SEG series in the study")
            if args.keep:
                print("running; Ctrl-C stops Orthanc, the node and the server")
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            if node is not None:
                node.terminate()
                node.wait(timeout=120)
            stop_orthanc(orthanc)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
