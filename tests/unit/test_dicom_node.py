"""The DICOM node against the issue's reproductions, with real pynetdicom associations on loopback.

Each test plays an attacker or an unlucky operator: a zero-length SEG left in ``outgoing/``, failures
landing on existing ``failed/`` entries, a spool that disappears, a series paused mid-transfer or
completed late, a sender with the wrong AE titles or host, too many associations, SR and Deflate
contexts, an over-long instance, a quota, a destination that refuses or is down for longer than the old
retries lasted, non-conformant patient data. The sender and the destination are real DICOM peers
(:mod:`node_support`); the "model" is a threshold.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pydicom
import pytest

from nnunet_triton.client.dicom.access import AccessPolicy, Peer
from nnunet_triton.client.dicom.modality import ModalityRule
from nnunet_triton.client.dicom.node import NodeConfig, read_status, requeue
from nnunet_triton.client.dicom.spool import SpoolLimits
from nnunet_triton.errors import InputValidationError, PacsError

try:
    from . import dicom_support as support
    from . import node_support as peers
except ImportError:  # run from tests/unit without package context
    import dicom_support as support
    import node_support as peers

CT_STORAGE, SR_STORAGE = "1.2.840.10008.5.1.4.1.1.2", "1.2.840.10008.5.1.4.1.1.88.11"
EXPLICIT, DEFLATED = "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.1.99"
BIRTH_DATE, NAME = "1975-03-01", "Doe^Jane"


@pytest.fixture
def dest():
    destination = peers.Destination().start()
    yield destination
    destination.stop()


@pytest.fixture
def model():
    return peers.Threshold()


@pytest.fixture
def node_factory(tmp_path, dest, model):
    started = []

    def make(**overrides):
        node = peers.running(peers.node_config(tmp_path / "spool", dest, model, **overrides))
        started.append(node)
        return node

    yield make
    for node in started:
        node.stop()


def _series(tmp_path, name="ct", n=6, **kwargs):
    return support.write_ct_series(tmp_path / name, n_slices=n, **kwargs)


def _frames(seg: pydicom.Dataset) -> int:
    return int(seg.NumberOfFrames)


# --- 2. the worker cannot die silently ---------------------------------------------------------------
def test_node_sets_aside_a_zero_length_seg_left_in_outgoing_and_goes_on_with_new_series(
        tmp_path, node_factory, dest):
    left = "1.2.826.0.1.3680043.8.498.11"
    (tmp_path / "spool" / "outgoing").mkdir(parents=True)
    (tmp_path / "spool" / "outgoing" / f"{left}.dcm").write_bytes(b"")
    series = _series(tmp_path)
    node = node_factory()

    assert peers.send(node.config.port, series.files) == [0] * 6
    (seg,) = dest.wait(1)

    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid
    error = (tmp_path / "spool" / "failed" / left / "error.txt").read_text()
    assert "not a readable DICOM file" in error
    assert not (tmp_path / "spool" / "outgoing" / f"{left}.dcm").exists()


def test_node_fails_a_series_again_and_again_without_colliding_with_earlier_failed_entries(
        tmp_path, node_factory, dest, model):
    broken = _series(tmp_path, "broken", skip=(2,))  # a gap: set aside at once
    failed = tmp_path / "spool" / "failed"
    # the names the old node used for a series failing again: <uid>.<second>, for the next two minutes
    stamps = [time.strftime("%Y%m%dT%H%M%S", time.localtime(time.time() + s)) for s in range(-2, 120)]
    for name in [broken.series_uid] + [f"{broken.series_uid}.{stamp}" for stamp in stamps]:
        (failed / name).mkdir(parents=True)
        (failed / name / "error.txt").write_text("an earlier failure\n")
    good = _series(tmp_path, "good", seed=1)
    node = node_factory()

    peers.send(node.config.port, broken.files)
    peers.wait_for(lambda: any("DicomError" in outcome for _, outcome in node.processed), what="failure")
    peers.send(node.config.port, good.files)
    (seg,) = dest.wait(1)

    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == good.series_uid
    assert "gap (missing slices?)" in (failed / f"{broken.series_uid}_2" / "error.txt").read_text()


def test_node_that_loses_its_spool_refuses_new_associations_and_says_it_is_unhealthy(tmp_path,
                                                                                     node_factory):
    node = node_factory()
    assert peers.associate(node.config.port).is_established
    shutil.rmtree(tmp_path / "spool" / "incoming")

    reason = node.wait_fatal(timeout_s=10)

    assert reason is not None and "spool folders missing" in reason
    assert not peers.associate(node.config.port, timeout_s=2).is_established
    healthy, status = read_status(tmp_path / "spool")
    assert not healthy and status["state"] == "unhealthy" and "spool folders missing" in status["reason"]


def _mount_tmpfs(folder: Path, size: str) -> None:
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")


@pytest.fixture
def small_disk():
    import subprocess

    folder = Path(tempfile.mkdtemp(prefix="nnunet-small-disk-"))
    _mount_tmpfs(folder, "1m")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)
    folder.rmdir()


def test_node_on_a_full_disk_answers_out_of_resources_and_recovers_when_space_returns(
        small_disk, dest, model, tmp_path):
    first, second = _series(tmp_path, "a", n=4), _series(tmp_path, "b", n=4, seed=1)
    node = peers.running(peers.node_config(small_disk / "spool", dest, model, idle_timeout_s=1.0))
    try:
        assert peers.send(node.config.port, first.files) == [0] * 4
        filler = small_disk / "filler"
        try:  # fill the disk before the SEG (and the state file) are written
            with filler.open("wb") as handle:
                while True:
                    handle.write(b"\0" * 4096)
                    handle.flush()
        except OSError:
            pass
        statuses = peers.send(node.config.port, second.files)
        peers.wait_for(lambda: node.status()["state"] == "degraded", what="degraded by the full disk")
        degraded = node.status()
        filler.unlink()

        segs = dest.wait(1, timeout_s=30)
        assert peers.send(node.config.port, second.files) == [0] * 4
        segs = dest.wait(2, timeout_s=30)
    finally:
        node.stop()
    assert 0xA700 in statuses  # out of resources: the sender keeps the instance and sends it again
    assert degraded["state"] == "degraded" and degraded["reason"]
    assert {s.ReferencedSeriesSequence[0].SeriesInstanceUID for s in segs} == {first.series_uid,
                                                                               second.series_uid}
    assert node.fatal is None


def test_a_full_spool_disk_costs_no_inference_and_the_seg_follows_when_space_returns(
        small_disk, dest, model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nnunet_triton")
    series = _series(tmp_path, n=4)
    node = peers.running(peers.node_config(small_disk / "spool", dest, model, idle_timeout_s=1.0))
    try:
        assert peers.send(node.config.port, series.files) == [0] * 4
        filler = small_disk / "filler"
        try:  # fill the disk, then leave three pages: the state fits, the SEG (about 5 pages) does not
            with filler.open("wb") as handle:
                while True:
                    handle.write(b"\0" * 4096)
                    handle.flush()
        except OSError:
            pass
        os.truncate(filler, max(0, filler.stat().st_size - 3 * 4096))
        peers.wait_for(lambda: "attempt 3 failed" in caplog.text, what="three failed attempts")
        runs_while_full = len(model.calls)
        filler.unlink()
        (seg,) = dest.wait(1)
    finally:
        node.stop()
    assert runs_while_full == 0  # the old node ran the model on every attempt
    assert model.calls == [series.series_uid]
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid


# --- 3. one series, one SEG (completeness, late instances) ------------------------------------------
def test_node_waits_for_an_open_association_that_pauses_mid_series(node_factory, dest, tmp_path):
    series = _series(tmp_path)
    node = node_factory(idle_timeout_s=0.5)
    datasets = [pydicom.dcmread(p) for p in series.files]
    assoc = peers.associate(node.config.port, contexts=[(CT_STORAGE, EXPLICIT)])
    for ds in datasets[:3]:
        assert assoc.send_c_store(ds).Status == 0
    time.sleep(1.5)  # longer than the idle timeout, the association still open
    for ds in datasets[3:]:
        assert assoc.send_c_store(ds).Status == 0
    assoc.release()

    peers.wait_for(lambda: node.processed, what="the series finished")
    assert [_frames(s) for s in dest.received] == [6]


def test_instances_that_arrive_while_an_attempt_fails_are_tried_again_with_it_not_set_aside(tmp_path, dest):
    """A round that fails on its data (here the model refuses the half series it got, as read_series refuses
    a volume with a gap) while the rest of the series comes in (a PACS sending it again after a restart):
    the instances acknowledged meanwhile are not moved to failed/ with a verdict on data they were not part
    of; the series is tried again with them and gives one SEG. Before, the whole folder went to failed/."""
    series = _series(tmp_path)
    started, resume, sizes = threading.Event(), threading.Event(), []

    def segment(volume):
        sizes.append(len(volume.datasets))
        if len(sizes) == 1:
            started.set()
            resume.wait(10)
            raise InputValidationError("the volume has a gap (a partial series)")
        return (volume.data > 0).astype(np.uint8)

    node = peers.running(peers.node_config(tmp_path / "spool", dest, segment, idle_timeout_s=0.5))
    try:
        assert peers.send(node.config.port, series.files[:3]) == [0, 0, 0]
        assert started.wait(10), "the first attempt did not start"
        assert peers.send(node.config.port, series.files) == [0] * 6  # the whole series again
        resume.set()
        peers.wait_for(lambda: node.processed, what="the series finished")
    finally:
        resume.set()
        node.stop()
    assert [_frames(seg) for seg in dest.received] == [6]
    assert not list((tmp_path / "spool" / "failed").iterdir())
    assert sizes == [3, 6] and node.processed == [(series.series_uid, "sent")]


def test_late_instances_resegment_the_whole_series_as_the_next_instance_of_the_same_seg_series(
        node_factory, dest, model, tmp_path):
    series = _series(tmp_path)
    node = node_factory()

    peers.send(node.config.port, series.files[:3])
    dest.wait(1)
    peers.send(node.config.port, series.files[3:])  # 2 s later, in another association
    first, second = dest.wait(2)
    assert peers.send(node.config.port, series.files) == [0] * 6  # the whole series once more: nothing new
    assert node.status()["pending_series"] == 0  # acknowledged, not stored: no round to wait for

    assert [_frames(first), _frames(second)] == [3, 6]
    assert second.SeriesInstanceUID == first.SeriesInstanceUID
    assert (int(first.InstanceNumber), int(second.InstanceNumber)) == (1, 2)
    assert second.SOPInstanceUID != first.SOPInstanceUID
    assert len(dest.received) == 2 and len(model.calls) == 2


def test_a_late_localizer_of_a_segmented_series_gives_no_new_inference_and_no_new_seg(
        node_factory, dest, model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nnunet_triton")
    series = _series(tmp_path, n=4)
    scout = support.write_ct_series(tmp_path / "scout", n_slices=1, orientation=(0, 1, 0, 0, 0, -1), seed=2)
    localizer = pydicom.dcmread(scout.files[0])  # a sagittal slice of the same series: not in the volume
    localizer.SeriesInstanceUID = series.series_uid
    localizer.StudyInstanceUID = pydicom.dcmread(series.files[0]).StudyInstanceUID
    localizer.save_as(scout.files[0], enforce_file_format=True)
    node = node_factory()

    peers.send(node.config.port, series.files)
    dest.wait(1)
    assert peers.send(node.config.port, scout.files) == [0]
    peers.wait_for(lambda: "do not change the volume" in caplog.text, what="the late round")

    assert len(dest.received) == 1 and model.calls == [series.series_uid]
    assert "1 of its 5 instance(s) are not part of the volume" in caplog.text


def test_the_same_series_sent_again_after_its_instances_were_deleted_gives_no_second_seg(
        node_factory, dest, model, tmp_path):
    series = _series(tmp_path, n=3)
    node = node_factory(limits=SpoolLimits(done_retention_s=0.3), sweep_s=0.2)
    peers.send(node.config.port, series.files)
    peers.wait_for(lambda: node.processed, what="the first round")  # its instances are in done/ now
    peers.wait_for(lambda: not (tmp_path / "spool" / "done" / series.series_uid).exists(), what="retention")

    peers.send(node.config.port, series.files)  # e.g. a PACS routing rule that fired twice, a day apart
    peers.wait_for(lambda: len(node.processed) == 2, what="the second round")

    assert len(dest.received) == 1 and model.calls == [series.series_uid]


# --- 4. who may store --------------------------------------------------------------------------------
def test_node_refuses_a_wrong_called_ae_a_spoofed_calling_ae_and_a_known_ae_from_another_host(node_factory):
    access = AccessPolicy(peers=(Peer("PACS", ("127.0.0.1",)), Peer("REMOTE", ("10.9.9.0/24",))))
    node = node_factory(access=access)

    wrong_called = peers.associate(node.config.port, called="ORTHANC")
    spoofed = peers.associate(node.config.port, calling="EVIL")
    elsewhere = peers.associate(node.config.port, calling="REMOTE")
    allowed = peers.associate(node.config.port, calling="PACS")

    assert [a.is_rejected for a in (wrong_called, spoofed, elsewhere)] == [True, True, True]
    assert [a.acceptor.primitive.diagnostic for a in (wrong_called, spoofed, elsewhere)] == [7, 3, 3]
    assert allowed.is_established
    allowed.release()


def test_node_beyond_loopback_accepts_only_the_senders_it_was_told(tmp_path, dest, model):
    with pytest.raises(PacsError, match=r"beyond loopback\) the node accepts only known senders: name them "
                                        r"with --allow"):
        peers.node_config(tmp_path / "s1", dest, model, host="0.0.0.0")
    node = peers.running(peers.node_config(tmp_path / "s2", dest, model, host="0.0.0.0",
                                           access=AccessPolicy(peers=(Peer("PACS"),))))
    try:
        assert peers.associate(node.config.port, calling="ANYONE").is_rejected
        assert peers.associate(node.config.port, calling="PACS").is_established
    finally:
        node.stop()


def test_node_accepts_image_storage_in_uncompressed_syntaxes_only_by_default(node_factory):
    node = node_factory()
    assoc = peers.associate(node.config.port, contexts=[(CT_STORAGE, EXPLICIT), (SR_STORAGE, EXPLICIT),
                                                        (CT_STORAGE, DEFLATED)])
    try:
        accepted = sorted((cx.abstract_syntax, cx.transfer_syntax[0]) for cx in assoc.accepted_contexts)
    finally:
        assoc.release()
    assert accepted == [(CT_STORAGE, EXPLICIT)]


def test_node_limits_the_associations_of_one_host(node_factory):
    node = node_factory(access=AccessPolicy(max_associations_per_host=2))
    first, second = peers.associate(node.config.port), peers.associate(node.config.port)
    third = peers.associate(node.config.port)
    assert first.is_established and second.is_established
    rejection = third.acceptor.primitive
    assert third.is_rejected and (rejection.result, rejection.diagnostic) == (2, 2)  # transient: busy
    first.release()
    peers.wait_for(lambda: len(node._server.active_associations) < 2, what="the released association to end")
    fourth = peers.associate(node.config.port)
    assert fourth.is_established
    second.release()
    fourth.release()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return peers.make_certificates(tmp_path_factory.mktemp("tls"))


def test_node_over_tls_stores_only_for_clients_with_a_certificate_of_its_ca(
        certificates, node_factory, dest, tmp_path):
    import ssl

    from nnunet_triton.client.dicom.access import TlsConfig

    c = certificates
    tls = TlsConfig(c / "server.pem", c / "server.key", c / "ca.pem", require_client_cert=True)
    node = node_factory(access=AccessPolicy(tls=tls))
    series = _series(tmp_path, n=3)

    def client(with_cert: bool) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(c / "ca.pem"))
        if with_cert:
            context.load_cert_chain(str(c / "client.pem"), str(c / "client.key"))
        return context

    plain = peers.associate(node.config.port, timeout_s=3)
    no_cert = peers.associate(node.config.port, tls=(client(False), "127.0.0.1"), timeout_s=3)
    statuses = peers.send(node.config.port, series.files, tls=(client(True), "127.0.0.1"))

    assert not plain.is_established and not no_cert.is_established
    assert statuses == [0, 0, 0]
    assert dest.wait(1)[0].ReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid


# --- 5. limits -----------------------------------------------------------------------------------------
def test_node_refuses_instances_past_the_spool_quota_and_the_series_limit(node_factory, tmp_path):
    series = _series(tmp_path, n=4)
    size = series.files[0].stat().st_size
    quota = node_factory(limits=SpoolLimits(max_spool_bytes=int(2.5 * size) + 4096),
                         idle_timeout_s=60)
    assert peers.send(quota.config.port, series.files) == [0, 0, 0xA700, 0xA700]
    quota.stop()
    other = _series(tmp_path, "other", n=4, seed=2)
    capped = peers.running(peers.node_config(tmp_path / "spool2", peers.Destination(), peers.Threshold(),
                                             limits=SpoolLimits(max_instances_per_series=3),
                                             idle_timeout_s=60))
    try:
        assert peers.send(capped.config.port, other.files) == [0, 0, 0, 0xA700]
    finally:
        capped.stop()


def _big_instance(path: Path, rows: int) -> Path:
    ds = support.template()
    ds.Rows = ds.Columns = rows
    ds.PixelData = np.zeros((rows, rows), np.int16).tobytes()
    ds.SOPInstanceUID = pydicom.uid.generate_uid()
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    ds.save_as(path, enforce_file_format=True)
    return path


def test_node_aborts_an_association_whose_instance_grows_past_the_limit_and_keeps_nothing(
        node_factory, tmp_path):
    big = _big_instance(tmp_path / "big.dcm", 1024)  # 2 MiB of pixels
    node = node_factory(limits=SpoolLimits(max_instance_bytes=256 * 1024))
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("tmp*.dcm"))

    statuses = peers.send(node.config.port, [big])

    assert statuses == [-1] or statuses == [0xA700]
    peers.wait_for(lambda: not any((tmp_path / "spool" / "tmp").iterdir()),
                   what="pynetdicom's half-received file removed from the spool's tmp/")
    assert not any((tmp_path / "spool" / "incoming").iterdir())
    assert set(temp.glob("tmp*.dcm")) <= before  # nothing in the machine's TMPDIR either


def test_retention_deletes_failed_series_and_the_instances_of_sent_series(node_factory, dest, tmp_path):
    sent, broken = _series(tmp_path, "sent"), _series(tmp_path, "broken", skip=(1,), seed=4)
    node = node_factory(limits=SpoolLimits(done_retention_s=0.5, failed_retention_s=0.5), sweep_s=0.2)
    peers.send(node.config.port, sent.files)
    peers.send(node.config.port, broken.files)
    dest.wait(1)
    peers.wait_for(lambda: len(node.processed) == 2, what="both series")
    spool = tmp_path / "spool"

    def swept():
        return not any((spool / "failed").iterdir()) and not (spool / "done" / sent.series_uid).exists()

    peers.wait_for(swept, timeout_s=10, what="retention")

    assert sorted(p.name for p in (spool / "done").iterdir()) == [f"{sent.series_uid}.json"]  # UIDs only
    assert not list(spool.rglob("*.dcm"))  # no image (no patient data) is left


# --- 7. exactly once -------------------------------------------------------------------------------------
def test_a_retry_sends_the_same_seg_without_running_inference_again(node_factory, dest, model, tmp_path):
    series = _series(tmp_path, n=3)
    dest.status = 0xA700  # the PACS is out of resources for a while
    node = node_factory()
    peers.send(node.config.port, series.files)
    outgoing = tmp_path / "spool" / "outgoing" / f"{series.series_uid}.dcm"
    peers.wait_for(outgoing.exists, what="the SEG written")  # written whole (renamed into place)
    unsent = pydicom.dcmread(outgoing)
    dest.status = 0x0000

    (seg,) = dest.wait(1)

    assert seg.SOPInstanceUID == unsent.SOPInstanceUID and seg.SeriesInstanceUID == unsent.SeriesInstanceUID
    assert model.calls == [series.series_uid]


def test_node_outlasts_a_destination_outage_far_longer_than_its_retry_delays(tmp_path, model, caplog):
    caplog.set_level(logging.WARNING, logger="nnunet_triton")
    dest = peers.Destination()  # not started: the PACS is down
    series = _series(tmp_path, n=3)
    node = peers.running(peers.node_config(tmp_path / "spool", dest, model))
    try:
        peers.send(node.config.port, series.files)
        # the old node had given up after 3 attempts (0.7 s)
        peers.wait_for(lambda: "attempt 6 failed" in caplog.text, what="six failed attempts")
        dest.start()
        (seg,) = dest.wait(1)
    finally:
        node.stop()
        dest.stop()
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid
    assert not any((tmp_path / "spool" / "failed").iterdir())
    assert model.calls == [series.series_uid]


def test_after_the_retry_window_requeue_sends_the_unsent_seg_without_inference(node_factory, dest, model,
                                                                               tmp_path):
    series = _series(tmp_path, n=3)
    dest.status = 0xA700
    node = node_factory(retry_window_s=1.0)
    peers.send(node.config.port, series.files)
    peers.wait_for(lambda: node.processed, what="the series to fail")
    failed = tmp_path / "spool" / "failed" / series.series_uid
    error = (failed / "error.txt").read_text()
    unsent = pydicom.dcmread(failed / "nnunet_seg.dcm.unsent")
    dest.status = 0x0000

    assert requeue(tmp_path / "spool") == [series.series_uid]
    (seg,) = dest.wait(1)

    assert "failed with status 0xa700" in error and "s after the first failure" in error
    assert seg.SOPInstanceUID == unsent.SOPInstanceUID
    assert model.calls == [series.series_uid]
    assert not failed.exists()


# --- 8. no patient data in logs and error files ------------------------------------------------------------
def _with(files, **values):
    for path in files:
        ds = pydicom.dcmread(path)
        for keyword, value in values.items():
            if value is None:
                if keyword in ds:
                    delattr(ds, keyword)
            else:
                setattr(ds, keyword, value)
        ds.save_as(path, enforce_file_format=True)


def test_seg_of_sources_with_a_nonconformant_birth_date_or_missing_type2_data_is_sent(
        node_factory, dest, tmp_path, caplog):
    dated, bare = _series(tmp_path, "dated", n=3), _series(tmp_path, "bare", n=3, seed=5)
    _with(dated.files, PatientBirthDate=BIRTH_DATE, PatientName=NAME)
    _with(bare.files, **dict.fromkeys(["PatientName", "PatientID", "PatientBirthDate", "PatientSex",
                                       "StudyDate", "StudyTime", "ReferringPhysicianName", "StudyID",
                                       "AccessionNumber"]))
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.WARNING, logger="pynetdicom")  # the test's own peers dump datasets at DEBUG
    caplog.clear()  # pydicom warned while the test wrote the invalid value
    node = node_factory()

    peers.send(node.config.port, dated.files)
    peers.send(node.config.port, bare.files)
    segs = dest.wait(2)

    assert sorted(s.ReferencedSeriesSequence[0].SeriesInstanceUID for s in segs) == sorted(
        [dated.series_uid, bare.series_uid])
    by_series = {s.ReferencedSeriesSequence[0].SeriesInstanceUID: s for s in segs}
    dated_seg = by_series[dated.series_uid]
    assert (dated_seg.PatientName, dated_seg.PatientBirthDate) == (NAME, "")  # the invalid date is left empty
    assert by_series[bare.series_uid].PatientID == ""
    assert BIRTH_DATE not in caplog.text and "Doe" not in caplog.text


def test_exception_texts_with_patient_data_reach_neither_logs_nor_error_files(node_factory, tmp_path,
                                                                              caplog):
    series = _series(tmp_path, n=3)
    _with(series.files, PatientName=NAME, PatientID="MRN-4711", PatientBirthDate="19750301")

    def failing(volume):
        ds = volume.datasets[0]
        raise ValueError(f"Unable to convert '{ds.PatientBirthDate}' for patient {ds.PatientName} "
                         f"({ds.PatientID}), born \"1975-03-01\"")

    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.WARNING, logger="pynetdicom")  # the test's own peers dump datasets at DEBUG
    caplog.clear()
    node = node_factory(segment=failing)
    peers.send(node.config.port, series.files)
    peers.wait_for(lambda: node.processed, what="the failure")

    error = (tmp_path / "spool" / "failed" / series.series_uid / "error.txt").read_text()
    assert error.startswith("ValueError: Unable to convert '<withheld>' for patient <withheld>")
    for phi in ("19750301", "1975-03-01", "Doe", "Jane", "MRN-4711"):
        assert phi not in error and phi not in caplog.text


# --- 9. the model fits the series ------------------------------------------------------------------------
def test_node_refuses_a_series_whose_modality_does_not_fit_the_model(node_factory, dest, model, tmp_path):
    mr = _series(tmp_path, "mr", n=3, modality="MR")
    node = node_factory(modalities=ModalityRule(frozenset({"CT"})))
    peers.send(node.config.port, mr.files)
    peers.wait_for(lambda: node.processed, what="the refusal")

    error = (tmp_path / "spool" / "failed" / mr.series_uid / "error.txt").read_text()
    assert "Modality MR does not fit the model: the model's channel names expect CT" in error
    assert model.calls == [] and dest.received == []


def test_node_config_copies_are_independent_of_the_caller(tmp_path, dest, model):
    config = peers.node_config(tmp_path / "spool", dest, model)
    assert isinstance(copy.copy(config), NodeConfig) and config.retry_window_s == 3600.0
    assert config.retries is None  # an hour of outage is survived by default


# --- 10. each series to its model (routes) ---------------------------------------------------------------
LIVER_AE, LUNG_AE = "NNUNET_LIVER", "NNUNET_LUNG"
ROUTES = {"default": "nnunet", "called_ae_titles": {LIVER_AE: "liver", LUNG_AE: "lung"},
          "rules": [{"match": {"Modality": "MR"}, "model": "prostate"}]}


def _routes(**changes):
    from nnunet_triton.client.dicom.routing import Routes

    return Routes.from_json(json.dumps({**ROUTES, **changes}))


@pytest.fixture
def routed_factory(tmp_path, dest):
    """A node with the four models of ROUTES (thresholds that count their own calls)."""
    started = []

    def make(spool="spool", routes=None, models=None, **overrides):
        names = ("nnunet", "liver", "lung", "prostate")
        made, thresholds = peers.threshold_models(*names)
        node = peers.running(peers.node_config(tmp_path / spool, dest, None, routes=routes or _routes(),
                                               models=models or made, **overrides))
        started.append(node)
        return node, thresholds

    yield make
    for node in started:
        node.stop()


def _referenced(seg):
    return seg.ReferencedSeriesSequence[0].SeriesInstanceUID


def test_one_node_sends_each_series_to_the_model_of_its_called_ae_title_or_rule_or_the_default(
        routed_factory, dest, tmp_path):
    liver, lung = _series(tmp_path, "liver", n=3), _series(tmp_path, "lung", n=4, seed=1)
    mr, other = _series(tmp_path, "mr", n=3, seed=2, modality="MR"), _series(tmp_path, "ct", n=3, seed=3)
    node, models = routed_factory()

    assert peers.send(node.config.port, liver.files, called=LIVER_AE) == [0] * 3
    assert peers.send(node.config.port, lung.files, called=LUNG_AE) == [0] * 4
    assert peers.send(node.config.port, mr.files) == [0] * 3  # to the node's own AE title: the rule
    assert peers.send(node.config.port, other.files) == [0] * 3  # nothing matches: the default
    segs = dest.wait(4)

    assert {name: t.calls for name, t in models.items()} == {
        "liver": [liver.series_uid], "lung": [lung.series_uid], "prostate": [mr.series_uid],
        "nnunet": [other.series_uid]}
    assert sorted(_referenced(s) for s in segs) == sorted(
        s.series_uid for s in (liver, lung, mr, other))
    def status_of_four():
        healthy, status = read_status(tmp_path / "spool")
        return (healthy, status) if len(status.get("recent", [])) == 4 else None

    healthy, status = peers.wait_for(status_of_four, what="the four outcomes in status.json")
    shown = {r["series"]: (r["model"], r["outcome"]) for r in status["recent"]}
    assert healthy and shown == {liver.series_uid: ("liver", "sent"), lung.series_uid: ("lung", "sent"),
                                 mr.series_uid: ("prostate", "sent"), other.series_uid: ("nnunet", "sent")}
    record = json.loads((tmp_path / "spool" / "done" / f"{lung.series_uid}.json").read_text())
    assert (record["model"], record["route"], record["called_ae"]) == ("lung", f"called AE title {LUNG_AE}",
                                                                       LUNG_AE)
    assert status["models"] == ["nnunet", "liver", "lung", "prostate"]


def test_node_accepts_the_called_ae_titles_of_its_routes_and_still_rejects_unknown_ones(routed_factory):
    node, _ = routed_factory()

    unknown = peers.associate(node.config.port, called="NNUNET_BRAIN")
    mapped = [peers.associate(node.config.port, called=title) for title in (LIVER_AE, LUNG_AE, "NNUNET")]

    assert unknown.is_rejected and unknown.acceptor.primitive.diagnostic == 7  # called AE not recognised
    assert all(a.is_established for a in mapped)
    for assoc in mapped:
        assoc.release()


def test_a_series_keeps_the_route_of_its_first_instance_when_later_ones_come_to_another_called_ae(
        routed_factory, dest, tmp_path, caplog):
    series = _series(tmp_path, n=6)
    caplog.set_level(logging.INFO, logger="nnunet_triton")
    node, models = routed_factory(idle_timeout_s=1.0)

    peers.send(node.config.port, series.files[:3], called=LIVER_AE)
    peers.send(node.config.port, series.files[3:], called=LUNG_AE)  # the same series, within the idle time
    (seg,) = dest.wait(1)

    assert _frames(seg) == 6 and models["liver"].calls == [series.series_uid]
    assert models["lung"].calls == [] and models["nnunet"].calls == []
    assert f"came to called AE title '{LUNG_AE}'; the series follows the route of its first instance" in (
        caplog.text)


def test_the_route_is_recorded_before_the_c_store_is_answered_and_survives_a_restart(
        routed_factory, dest, tmp_path):
    series = _series(tmp_path, n=3)
    first, _ = routed_factory(idle_timeout_s=600)  # never complete while this node runs
    peers.send(first.config.port, series.files, called=LIVER_AE)
    state = json.loads((tmp_path / "spool" / "incoming" / series.series_uid / ".state.json").read_text())
    first.stop()

    second, models = routed_factory()  # the same spool; the called AE title is known from the state only
    (seg,) = dest.wait(1)

    assert (state["model"], state["called_ae"], state["route"]) == ("liver", LIVER_AE,
                                                                    f"called AE title {LIVER_AE}")
    assert _referenced(seg) == series.series_uid
    assert models["liver"].calls == [series.series_uid] and models["nnunet"].calls == []


def test_a_late_instance_under_another_called_ae_follows_the_model_of_the_seg_already_sent(
        routed_factory, dest, tmp_path):
    series = _series(tmp_path, n=4)
    node, models = routed_factory()

    peers.send(node.config.port, series.files[:2], called=LUNG_AE)
    dest.wait(1)
    peers.send(node.config.port, series.files[2:])  # later, to the node's own title (default: nnunet)
    first, second = dest.wait(2)

    assert [_frames(first), _frames(second)] == [2, 4]
    assert second.SeriesInstanceUID == first.SeriesInstanceUID
    assert models["lung"].calls == [series.series_uid] * 2 and models["nnunet"].calls == []


def test_a_series_nothing_routes_is_set_aside_with_the_reason_and_no_patient_data(
        routed_factory, dest, tmp_path, caplog):
    series = _series(tmp_path, n=3)
    _with(series.files, PatientName=NAME, SeriesDescription=f"portal {NAME}")
    caplog.set_level(logging.DEBUG, logger="nnunet_triton")
    node, models = routed_factory(routes=_routes(default=None))

    peers.send(node.config.port, series.files)  # CT to the node's own AE title: no rule, no default
    peers.wait_for(lambda: node.processed, what="the refusal")

    error = (tmp_path / "spool" / "failed" / series.series_uid / "error.txt").read_text()
    assert "no route: the called AE title NNUNET is not one of called_ae_titles, none of the 1 rule(s) " \
           "matches (Modality CT)" in error and "has no default model" in error
    assert not any(t.calls for t in models.values()) and dest.received == []
    assert "Doe" not in error and "Doe" not in caplog.text and "portal" not in caplog.text
    assert f"series {series.series_uid}: no route" in caplog.text


def test_a_series_of_an_earlier_node_without_a_recorded_route_is_routed_by_the_rules_when_processed(
        tmp_path, routed_factory, dest):
    mr = _series(tmp_path, "mr", n=3, modality="MR")
    folder = tmp_path / "spool" / "incoming" / mr.series_uid
    folder.mkdir(parents=True)
    for path, sop in zip(mr.files, mr.sop_uids, strict=True):  # what a node before routes left behind
        shutil.copyfile(path, folder / f"{sop}.dcm")

    node, models = routed_factory()
    dest.wait(1)

    assert models["prostate"].calls == [mr.series_uid] and models["nnunet"].calls == []


def test_each_model_checks_that_a_series_fits_it(tmp_path, routed_factory, dest):
    from nnunet_triton.client.dicom.node import NodeModel

    mr = _series(tmp_path, "mr", n=3, modality="MR")
    made, thresholds = peers.threshold_models("nnunet", "liver", "lung", "prostate")
    made["liver"] = NodeModel(thresholds["liver"], modalities=ModalityRule(frozenset({"CT"})))
    node, _ = routed_factory(models=made)

    peers.send(node.config.port, mr.files, called=LIVER_AE)  # an MR series sent to the liver (CT) model
    peers.wait_for(lambda: node.processed, what="the refusal")

    error = (tmp_path / "spool" / "failed" / mr.series_uid / "error.txt").read_text()
    assert "Modality MR does not fit the model: the model's channel names expect CT (model liver)" in error
    assert f"model: liver (called AE title {LIVER_AE})" in error
    assert not any(t.calls for t in thresholds.values())


def test_node_config_refuses_routes_to_a_model_it_does_not_have(tmp_path, dest, model):
    made, _ = peers.threshold_models("nnunet", "liver")
    with pytest.raises(PacsError, match=r"model 'lung' \(called_ae_titles\['NNUNET_LUNG'\] of routes\) but "
                                        r"the node has no such model"):
        peers.node_config(tmp_path / "s", dest, None, routes=_routes(rules=[]), models=made)
    with pytest.raises(PacsError, match=r"one segment callable is the routes' default model \(nnunet\) only"):
        peers.node_config(tmp_path / "s", dest, model, routes=_routes(rules=[]))
    with pytest.raises(PacsError, match=r"one model \(segment, labels, modalities\) or several"):
        NodeConfig(ae_title="NNUNET", port=1, spool=tmp_path, destination=dest.destination(), segment=model,
                   models=made)
