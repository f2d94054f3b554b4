"""Hospital integration against a real Orthanc PACS: DICOMweb in and out, and the DICOM node (C-STORE).

The SynthCT fixture's first test case becomes a CT series in its own study (plus a localizer in the same
series, which must be left out), is uploaded to Orthanc over its REST API and segmented through the served
endpoint over DICOMweb (``predict -i dicomweb://... -o dicomweb://...``) and over DIMSE (Orthanc routes the
series to ``nnunet-triton listen``, which sends the SEG back by C-STORE). The SEG fetched back from Orthanc
must decode (highdicom) to the label map the client gets for the same volume. The failure paths check that
each problem is reported with the study or series UID and that nothing is dropped.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
import pydicom
import pytest
from pacs_support import NODE_AE, PASSWORD, USER, free_port, start_orthanc, stop_orthanc
from pipeline_support import REPO_ROOT, SYNTHCT, cases, shared_server
from pydicom.uid import generate_uid

from nnunet_triton.client.client import NnunetClient
from nnunet_triton.client.dicom import volume as dicom
from nnunet_triton.client.dicom.node import DicomNode, NodeConfig, parse_destination
from nnunet_triton.client.dicom.web import DicomWebAuth, DicomWebLocation, fetch_study
from nnunet_triton.client.endpoint import segment_with_retry
from nnunet_triton.errors import PacsError
from tests.unit import dicom_support

pytestmark = pytest.mark.triton
PATIENT_NAME = str(dicom_support.template().PatientName)  # must never reach a log line


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


@pytest.fixture(scope="module")
def orthanc(tmp_path_factory):
    pacs = start_orthanc(tmp_path_factory.mktemp("orthanc"))
    yield pacs
    stop_orthanc(pacs)


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "NNUNET_TRITON_DICOMWEB_USER": USER,
            "NNUNET_TRITON_DICOMWEB_PASSWORD": PASSWORD}


def _cli(server, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "nnunet_triton", *args[:1], "--url", server.http_url, *args[1:]]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(), check=False)


def _cli_plain(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "nnunet_triton", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=_env(), check=False)


def _listen(server, spool: Path, port: int, destination: str, *extra: str) -> subprocess.Popen:
    """``nnunet-triton listen`` started and listening (its stderr is the pipe the test reads at the end)."""
    command = [sys.executable, "-m", "nnunet_triton", "listen", "--url", server.http_url, "--ae-title",
               NODE_AE, "--port", str(port), "--spool", str(spool), "--destination", destination,
               "--idle-timeout", "1", "--disable-tta", "-v", *extra]
    node = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 60
    while "listening as" not in (line := node.stderr.readline()):
        assert node.poll() is None and time.monotonic() < deadline, line
    return node


def _associate(port: int, *, calling: str) -> Any:
    from pynetdicom import AE

    ae = AE(ae_title=calling)
    ae.add_requested_context("1.2.840.10008.5.1.4.1.1.2")
    assoc = ae.associate("127.0.0.1", port, ae_title=NODE_AE)
    if assoc.is_established:
        assoc.release()
    return assoc


def _study(folder: Path) -> tuple[dicom_support.BuiltSeries, str]:
    """A CT series (+ a localizer in it) of the first SynthCT test case, in a new study."""
    case = cases(SYNTHCT)[0]
    study = generate_uid()
    series = dicom_support.write_volume_as_ct(folder, np.round(case.image[0]), case.spacing, study_uid=study)
    dicom_support.write_localizer(folder, series.series_uid)
    localizer = pydicom.dcmread(folder / "SCOUT.dcm")
    localizer.StudyInstanceUID = study
    localizer.save_as(folder / "SCOUT.dcm", enforce_file_format=True)
    return series, study


def _expected(server, folder: Path) -> np.ndarray:
    volume = dicom.read_dicom_folder(folder)
    with NnunetClient(server.http_url, timeout_s=300) as client:
        return client.segment(volume.data[None], volume.spacing, mirroring=False).segmentation


def _decoded(seg_file: bytes, series: dicom_support.BuiltSeries) -> np.ndarray:
    document = hd.seg.segread(io.BytesIO(seg_file))
    assert document.ReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid
    return document.get_pixels_by_source_instance(list(series.sop_uids), combine_segments=True,
                                                  assert_missing_frames_are_empty=True)


def _auth() -> DicomWebAuth:
    return DicomWebAuth(user=USER, password=PASSWORD)


def _rtstruct_matches(rt_file: bytes, folder: Path, expected: np.ndarray, kept: Path) -> dict[str, float]:
    """The RTSTRUCT fetched from the PACS, its contours filled by the even-odd rule on the source grid:
    Dice per ROI against the label map the client gets (kept under ``kept`` for dciodvfy at teardown)."""
    from nnunet_triton.client.dicom.rtstruct import rasterize_roi

    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(rt_file)
    ds, volume = pydicom.dcmread(kept), dicom.read_dicom_folder(folder)
    uids = [f.sop_instance_uid for f in volume.frames]
    names = {r.ROINumber: r.ROIName for r in ds.StructureSetROISequence}
    labels = dict(zip(names.values(), (1, 2), strict=True))  # SynthCT: organ 1, lesion 2 (value order)
    dice = {}
    for roi in ds.ROIContourSequence:
        contours = [(uids.index(c.ContourImageSequence[0].ReferencedSOPInstanceUID),
                     np.asarray([float(v) for v in c.ContourData]).reshape(-1, 3))
                    for c in roi.get("ContourSequence", [])]
        name = names[roi.ReferencedROINumber]
        mask, truth = rasterize_roi(contours, volume), expected == labels[name]
        total = mask.sum() + truth.sum()
        dice[name] = 1.0 if total == 0 else 2.0 * (mask & truth).sum() / total
    return dice


def test_predict_fetches_a_study_over_dicomweb_and_stores_its_seg_and_rtstruct_back_by_stow_rs(
        server, orthanc, tmp_path):
    series, study = _study(tmp_path / "dicom")
    orthanc.upload(sorted((tmp_path / "dicom").iterdir()))

    run = _cli(server, "predict", "-i", orthanc.dicomweb, "--study", study, "-o", orthanc.dicomweb,
               "--output-format", "dicom-seg+rtstruct", "--disable-tta", "-v")

    assert run.returncode == 0, run.stderr
    assert "1 case(s) written" in run.stderr
    assert PATIENT_NAME not in run.stderr and PASSWORD not in run.stderr
    (seg,) = orthanc.wait_for_seg(study, timeout_s=30)
    expected = _expected(server, tmp_path / "dicom")
    np.testing.assert_array_equal(_decoded(seg, series), expected)
    names = [s.SegmentLabel for s in pydicom.dcmread(io.BytesIO(seg)).SegmentSequence]
    assert names and not any(n.startswith("label_") for n in names)  # the names the endpoint publishes
    (rt,) = orthanc.wait_for_modality(study, "RTSTRUCT", timeout_s=30)
    dice = _rtstruct_matches(rt, tmp_path / "dicom", expected, tmp_path / "pacs" / "rtstruct.dcm")
    assert list(dice) == names and all(d >= 0.99 for d in dice.values()), dice


def test_listen_segments_a_series_routed_by_c_store_and_sends_the_seg_and_rtstruct_to_the_pacs(
        server, orthanc, tmp_path):
    series, study = _study(tmp_path / "dicom")
    orthanc_series = orthanc.upload(sorted((tmp_path / "dicom").iterdir()))
    spool = tmp_path / "spool"
    node = _listen(server, spool, orthanc.node_port, orthanc.store_destination,
                   "--allow", "ORTHANC@127.0.0.1", "--output", "both")
    try:
        spoofed = _associate(orthanc.node_port, calling="EVIL")  # only Orthanc's AE title may store
        orthanc.request("POST", "/modalities/nnunet/store",
                        json.dumps({"Resources": orthanc_series, "Synchronous": True}).encode())
        (seg,) = orthanc.wait_for_seg(study)
        (rt,) = orthanc.wait_for_modality(study, "RTSTRUCT")
        probe = _cli_plain("node-status", "--spool", str(spool))
    finally:
        node.terminate()
        _, log = node.communicate(timeout=120)
    assert node.returncode == 0, log
    assert spoofed.is_rejected and "calling AE title 'EVIL' is not an allowed sender" in log
    assert probe.returncode == 0 and json.loads(probe.stdout)["state"] == "ok", probe.stdout
    expected = _expected(server, tmp_path / "dicom")
    np.testing.assert_array_equal(_decoded(seg, series), expected)
    dice = _rtstruct_matches(rt, tmp_path / "dicom", expected, tmp_path / "pacs" / "rtstruct.dcm")
    assert len(dice) == 2 and all(d >= 0.99 for d in dice.values()), dice
    assert f"series {series.series_uid}: DICOM-SEG sent" in log
    assert PATIENT_NAME not in log
    assert not any((spool / "incoming").iterdir()) and not any((spool / "outgoing").iterdir())


def _node(server, spool: Path, destination: str, **overrides) -> DicomNode:
    client = NnunetClient(server.http_url, timeout_s=300)

    def segment(volume):
        case = volume.image_case()
        return segment_with_retry(client, case.data, case.spacing, mirroring=False).segmentation

    config = dict(ae_title=NODE_AE, port=free_port(), spool=spool,
                  destination=parse_destination(destination), segment=segment, idle_timeout_s=0.5,
                  retries=1, retry_delay_s=0.2)
    return DicomNode(NodeConfig(**{**config, **overrides}))


def _send(node: DicomNode, files: list[Path]) -> None:
    from pynetdicom import AE

    ae = AE(ae_title="SENDER")
    datasets = [pydicom.dcmread(p) for p in files]
    for ds in datasets:
        ae.add_requested_context(ds.SOPClassUID, ds.file_meta.TransferSyntaxUID)
    assoc = ae.associate("127.0.0.1", node.config.port, ae_title=node.config.ae_title)
    assert assoc.is_established
    for ds in datasets:
        assert assoc.send_c_store(ds).Status == 0
    assoc.release()


def _wait(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_node_resumes_its_spool_after_a_restart_and_sends_the_seg(server, orthanc, tmp_path):
    series, study = _study(tmp_path / "dicom")
    spool = tmp_path / "spool"
    first = _node(server, spool, orthanc.store_destination, idle_timeout_s=3600)  # never completes a series
    first.start()
    try:
        _send(first, sorted((tmp_path / "dicom").iterdir()))
    finally:
        first.stop()  # the process "dies" with the series received but not segmented
    assert len(list((spool / "incoming" / series.series_uid).glob("*.dcm"))) == len(series.files) + 1

    second = _node(server, spool, orthanc.store_destination, port=first.config.port)
    second.start()
    try:
        (seg,) = orthanc.wait_for_seg(study)
        _wait(lambda: second.processed)
    finally:
        second.stop()
    assert second.processed == [(series.series_uid, "sent")]
    np.testing.assert_array_equal(_decoded(seg, series), _expected(server, tmp_path / "dicom"))


def test_node_moves_a_series_aside_with_its_error_when_the_destination_refuses_the_association(
        server, orthanc, tmp_path):
    series, _ = _study(tmp_path / "dicom")
    spool = tmp_path / "spool"
    node = _node(server, spool, f"WRONG_AE@127.0.0.1:{orthanc.dicom_port}")  # Orthanc checks the called AE
    node.start()
    try:
        _send(node, sorted((tmp_path / "dicom").iterdir()))
        _wait(lambda: node.processed)
    finally:
        node.stop()
    ((uid, outcome),) = node.processed
    assert uid == series.series_uid and outcome.startswith("failed: PacsError")
    failed = spool / "failed" / series.series_uid
    error = (failed / "error.txt").read_text()
    assert "association was refused" in error and "after 2 attempts" in error and series.series_uid in error
    assert len(list(failed.glob("*.dcm"))) == len(series.files) + 1  # every received instance kept
    assert (failed / "nnunet_seg.dcm.unsent").is_file()  # and the SEG that could not be sent


def test_node_sets_aside_a_series_with_a_missing_slice_at_once_naming_the_series(server, orthanc, tmp_path):
    series, _ = _study(tmp_path / "dicom")
    files = [p for p in series.files if p != series.files[len(series.files) // 2]]  # a gap in the middle
    spool = tmp_path / "spool"
    node = _node(server, spool, orthanc.store_destination, retries=5)
    node.start()
    try:
        _send(node, files)
        _wait(lambda: node.processed)
    finally:
        node.stop()
    ((uid, outcome),) = node.processed
    assert uid == series.series_uid and "DicomError" in outcome
    assert "attempts" not in outcome  # not retried: the series itself is wrong
    assert len(list((spool / "failed" / uid).glob("*.dcm"))) == len(files)


def test_dicomweb_errors_name_the_study_the_series_and_the_reason(orthanc, tmp_path):
    closed = DicomWebLocation.parse(f"dicomweb://127.0.0.1:{free_port()}/dicom-web", _auth())
    with pytest.raises(PacsError, match=r"searching study 1\.2\.3 failed \(ConnectionError"):
        fetch_study(closed, "1.2.3", tmp_path / "a")
    pacs = DicomWebLocation.parse(orthanc.dicomweb, _auth())
    with pytest.raises(PacsError, match=r"study 1\.2\.3\.4 was not found or has no series"):
        fetch_study(pacs, "1.2.3.4", tmp_path / "b")
    wrong = DicomWebLocation.parse(orthanc.dicomweb, DicomWebAuth(user=USER, password="wrong"))
    with pytest.raises(PacsError, match=r"HTTP 401") as info:
        fetch_study(wrong, "1.2.3.4", tmp_path / "c")
    assert "wrong" not in str(info.value)
    with pytest.raises(PacsError, match="must not hold credentials"):
        DicomWebLocation.parse(f"dicomweb://{USER}:{PASSWORD}@127.0.0.1:1/dicom-web")


def test_predict_reports_a_study_without_an_eligible_series_and_a_rejected_stow(server, orthanc, tmp_path):
    localizer_only = tmp_path / "scout"
    series, study = _study(tmp_path / "dicom")
    localizer_only.mkdir()
    (tmp_path / "dicom" / "SCOUT.dcm").rename(localizer_only / "SCOUT.dcm")
    scout = pydicom.dcmread(localizer_only / "SCOUT.dcm")
    scout.StudyInstanceUID, scout.SeriesInstanceUID = generate_uid(), generate_uid()
    scout.save_as(localizer_only / "SCOUT.dcm", enforce_file_format=True)
    orthanc.upload([localizer_only / "SCOUT.dcm", *series.files])

    empty = _cli(server, "predict", "-i", orthanc.dicomweb, "--study", str(scout.StudyInstanceUID),
                 "-o", str(tmp_path / "out"))
    assert empty.returncode == 2
    assert f"study {scout.StudyInstanceUID}" in empty.stderr and "no eligible image series" in empty.stderr

    rejected = _cli(server, "predict", "-i", orthanc.dicomweb, "--study", study, "--disable-tta", "-o",
                    orthanc.dicomweb.replace("/dicom-web", "/no-such-dicomweb-root"))
    assert rejected.returncode == 2, rejected.stderr
    assert f"STOW-RS of the DICOM-SEG of series {series.series_uid} was rejected (HTTP 404" in rejected.stderr
    kept = Path(rejected.stderr.split("The SEG is kept in ")[1].split()[0].rstrip("."))
    assert kept.is_file() and pydicom.dcmread(kept).Modality == "SEG"


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


class HoldingProxy:
    """Between the node and Orthanc: forwards all the node sends, and Orthanc's A-ASSOCIATE-AC; then holds
    back what Orthanc answers. Orthanc stores the SEG and answers; the node never hears it (``held``)."""

    def __init__(self, target_port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.held = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._forward, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _forward(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)

    def _answers(self, source: socket.socket, sink: socket.socket) -> None:
        accepted = False
        with contextlib.suppress(OSError):
            while header := _read_exactly(source, 6):  # one PDU: type, reserved, length
                body = _read_exactly(source, struct.unpack(">L", header[2:6])[0])
                if not accepted:
                    sink.sendall(header + body)
                    accepted = header[0] == 0x02  # A-ASSOCIATE-AC
                else:
                    self.held.set()  # the C-STORE-RSP: swallowed

    def close(self) -> None:
        self.listener.close()


def _wait_for_line(node: subprocess.Popen, text: str, timeout_s: float = 180.0) -> list[str]:
    """The node's stderr lines up to the one containing ``text``."""
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([node.stderr], [], [], 1.0)
        if ready:
            line = node.stderr.readline()
            lines.append(line)
            if text in line:
                return lines
            if not line and node.poll() is not None:
                break
    raise AssertionError(f"no line with {text!r} from the node:\n{''.join(lines)[-3000:]}")


def test_listen_killed_after_the_pacs_stored_the_seg_but_before_it_answered_sends_that_seg_once_more(
        server, orthanc, tmp_path):
    series, study = _study(tmp_path / "dicom")
    orthanc_series = orthanc.upload(sorted((tmp_path / "dicom").iterdir()))
    proxy = HoldingProxy(orthanc.dicom_port)
    spool = tmp_path / "spool"
    node = _listen(server, spool, orthanc.node_port, f"ORTHANC@127.0.0.1:{proxy.port}")
    try:
        orthanc.request("POST", "/modalities/nnunet/store",
                        json.dumps({"Resources": orthanc_series, "Synchronous": True}).encode())
        assert proxy.held.wait(180), "Orthanc never answered the node's C-STORE"
        (stored,) = orthanc.wait_for_seg(study, timeout_s=30)  # Orthanc has it; the node does not know
    finally:
        node.kill()  # SIGKILL: no cleanup, no goodbye
        _, first_log = node.communicate(timeout=60)
        proxy.close()

    restarted = _listen(server, spool, orthanc.node_port, orthanc.store_destination)
    try:
        second_log = "".join(_wait_for_line(restarted, f"series {series.series_uid}: DICOM-SEG sent"))
    finally:
        restarted.terminate()
        _, rest = restarted.communicate(timeout=120)
    second_log += rest

    segs = orthanc.seg_series(study)
    assert [len(s["Instances"]) for s in segs] == [1], segs  # one SEG in the PACS, not two
    resent = pydicom.dcmread(io.BytesIO(orthanc.wait_for_seg(study)[0]))
    assert resent.SOPInstanceUID == pydicom.dcmread(io.BytesIO(stored)).SOPInstanceUID
    assert node.returncode == -signal.SIGKILL and "segmenting" in first_log
    assert "sending the DICOM-SEG written before (no inference)" in second_log
    assert "segmenting" not in second_log and restarted.returncode == 0, second_log
    assert PATIENT_NAME not in first_log + second_log


def test_listen_that_loses_its_spool_exits_3_and_its_status_says_unhealthy(server, orthanc, tmp_path):
    spool = tmp_path / "spool"
    node = _listen(server, spool, free_port(), orthanc.store_destination)
    shutil.rmtree(spool / "incoming")
    try:
        code = node.wait(timeout=60)
    finally:
        if node.poll() is None:
            node.kill()
    log = node.stderr.read()
    probe = _cli_plain("node-status", "--spool", str(spool))

    assert code == 3 and "the DICOM node stopped: spool folders missing" in log
    assert probe.returncode == 3 and json.loads(probe.stdout)["state"] == "unhealthy"  # no node runs


def test_predict_never_writes_outside_its_output_folder_for_a_traversal_series_uid(server, tmp_path):
    case = cases(SYNTHCT)[0]
    good = dicom_support.write_volume_as_ct(tmp_path / "in" / "good", np.round(case.image[0]), case.spacing)
    evil = dicom_support.write_volume_as_ct(tmp_path / "in" / "evil", np.round(case.image[0]), case.spacing,
                                            seed=1)
    for path in evil.files:
        ds = pydicom.dcmread(path)
        ds.SeriesInstanceUID = "../../x"
        ds.save_as(path, enforce_file_format=True)
    out = tmp_path / "a" / "b" / "out"

    run = _cli(server, "predict", "-i", str(tmp_path / "in"), "-o", str(out), "--disable-tta")

    assert run.returncode == 0, run.stderr
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.nii.gz"))
    assert written == [f"a/b/out/{good.series_uid}.nii.gz"]
