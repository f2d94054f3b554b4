"""The DICOM node's series worker on its own: built from a spool folder and a segmenter, with no listener.

The seam between the node's receiving side and its worker is the spool (and the series queue the worker
rebuilds from it): instances placed in ``incoming/<series>/`` the way the receiving side places them are
segmented, written and sent by a :class:`SeriesWorker` that nothing else started. The destination is a
real DICOM peer (:mod:`node_support`); the "model" is a threshold.
"""

from __future__ import annotations

import socket
import time

import pydicom
import pytest

from nnunet_triton.client.dicom.series_worker import SeriesWorker
from nnunet_triton.client.dicom.spool import Spool

try:
    from . import dicom_support as support
    from . import node_support as peers
except ImportError:  # run from tests/unit without package context
    import dicom_support as support
    import node_support as peers


@pytest.fixture
def dest():
    destination = peers.Destination().start()
    yield destination
    destination.stop()


def _spooled_worker(tmp_path, destination, model, n=5):
    """A worker over a spool holding one CT series of ``n`` instances in ``incoming/``, as received."""
    series = support.write_ct_series(tmp_path / "ct", n_slices=n)
    config = peers.node_config(tmp_path / "spool", destination, model)
    spool = Spool(config.spool, config.limits)
    for path in series.files:
        sop = str(pydicom.dcmread(path, stop_before_pixels=True).SOPInstanceUID)
        assert spool.place(path, spool.instance(series.series_uid, sop))
    worker = SeriesWorker(config, spool)
    worker.resume()
    return series, config, worker


def _work_until(worker: SeriesWorker, condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the worker did not get there in time"
        worker.step()
        time.sleep(worker.config.poll_s)


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_series_worker_segments_and_sends_a_spooled_series_with_no_listener(tmp_path, dest):
    model = peers.Threshold()
    series, config, worker = _spooled_worker(tmp_path, dest, model)

    _work_until(worker, lambda: worker.health.processed)

    assert _refused(config.port)  # nothing listens: the worker alone did it
    assert list(worker.health.processed) == [(series.series_uid, "sent")]
    assert model.calls == [series.series_uid]
    seg = dest.wait(1)[0]
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid
    spool = worker.spool
    assert not spool.incoming_series() and not spool.seg_file(series.series_uid).exists()
    assert len(spool.record(series.series_uid)["covers"]) == 5
    assert len(spool.instances(spool.done_dir(series.series_uid))) == 5


def test_series_worker_retries_a_failed_send_with_the_written_seg_and_no_second_inference(tmp_path, dest):
    model = peers.Threshold()
    dest.stop()  # the destination is down for the first attempts
    series, _config, worker = _spooled_worker(tmp_path, dest, model)
    spool = worker.spool

    _work_until(worker, lambda: spool.state(series.series_uid).get("attempts", 0) >= 2)
    assert spool.seg_file(series.series_uid).exists() and not worker.health.processed
    assert "destination" in worker.health.degraded

    dest.start()
    _work_until(worker, lambda: worker.health.processed)

    assert list(worker.health.processed) == [(series.series_uid, "sent")]
    assert model.calls == [series.series_uid]  # the retries sent the SEG written once
    assert str(dest.wait(1)[0].SOPInstanceUID) == spool.record(series.series_uid)["sop_uid"]
    assert "destination" not in worker.health.degraded
