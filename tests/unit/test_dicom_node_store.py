"""Concurrent C-STOREs against the DICOM node: the same SOP instance from two associations at once, one
series from four associations against the per-series limit. Real pynetdicom associations; a barrier
lines the C-STOREs up."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import generate_uid

from nnunet_triton.client.dicom.access import AccessPolicy
from nnunet_triton.client.dicom.spool import SpoolLimits

try:
    from . import dicom_support as support
    from . import node_support as peers
except ImportError:  # run from tests/unit without package context
    import dicom_support as support
    import node_support as peers

TRIES = 20
PARALLEL = 4
HEADROOM = 4  # associations of the previous round that may still be closing


@pytest.fixture
def node(tmp_path, request):
    """A node keeping at most ``max_instances_per_series`` (an indirect parameter, else 5000)."""
    limit = getattr(request, "param", 5000)
    destination = peers.Destination().start()
    access = AccessPolicy(max_associations=PARALLEL * 2 + HEADROOM,
                          max_associations_per_host=PARALLEL + HEADROOM)
    # idle for an hour: the series are not processed while the test looks at incoming/
    config = peers.node_config(tmp_path / "spool", destination, peers.Threshold(), access=access,
                               idle_timeout_s=3600, limits=SpoolLimits(max_instances_per_series=limit))
    running = peers.running(config)
    yield running
    running.stop()
    destination.stop()


def _in_parallel(port: int, batches: list[list[pydicom.Dataset]]) -> list[list[int]]:
    """Each batch over its own association, the C-STOREs started together; the statuses per batch."""
    barrier = threading.Barrier(len(batches))
    results: list[list[int]] = [[] for _ in batches]

    def store(index: int) -> None:
        contexts = sorted({(str(ds.SOPClassUID), str(ds.file_meta.TransferSyntaxUID))
                           for ds in batches[index]})
        assoc = peers.associate(port, contexts=contexts)
        try:
            barrier.wait(timeout=30)
            for ds in batches[index]:
                status = assoc.send_c_store(ds)
                results[index].append(int(status.Status) if status else -1)
        finally:
            assoc.release()

    threads = [threading.Thread(target=store, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _twin(ds: pydicom.Dataset, sop: str, offset: int) -> pydicom.Dataset:
    copy = pydicom.dcmread(ds.filename)
    copy.SOPInstanceUID = copy.file_meta.MediaStorageSOPInstanceUID = sop
    copy.PixelData = (copy.pixel_array.astype(np.int16) + offset).tobytes()
    return copy


def test_the_same_instance_from_two_associations_at_once_is_stored_once_and_never_replaced(
        node, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nnunet_triton")
    series = support.write_ct_series(tmp_path / "ct", n_slices=1)
    source = pydicom.dcmread(series.files[0])
    answers = []
    for attempt in range(TRIES):  # the issue saw 20 of 20 tries both acknowledged
        sop = generate_uid()
        first, second = _twin(source, sop, 0), _twin(source, sop, 7)
        statuses = _in_parallel(node.config.port, [[first], [second]])
        answers.append(sorted(s for (s,) in statuses))
        kept = pydicom.dcmread(Path(node.config.spool, "incoming", series.series_uid, f"{sop}.dcm"))
        stored = [ds for ds, (s,) in zip((first, second), statuses, strict=True)
                  if s == 0 and ds.PixelData == kept.PixelData]
        # the file holds a version that was acknowledged; any other acknowledgement said "spooled already"
        said_known = caplog.text.count(f"instance {sop} is spooled already")
        assert len(stored) == 1 and sum(s == 0 for (s,) in statuses) == 1 + said_known, (attempt, statuses)
    assert all(a in ([0, 0], [0, 0xA700]) for a in answers)


@pytest.mark.parametrize("node", [5], indirect=True, ids=["max_instances_per_series=5"])
def test_four_parallel_associations_cannot_pass_the_per_series_limit(node, tmp_path):
    series = support.write_ct_series(tmp_path / "ct", n_slices=12)
    datasets = [pydicom.dcmread(p) for p in series.files]
    batches = [datasets[i::PARALLEL] for i in range(PARALLEL)]

    statuses = [s for batch in _in_parallel(node.config.port, batches) for s in batch]

    stored = list(Path(node.config.spool, "incoming", series.series_uid).glob("*.dcm"))
    assert (len(stored), statuses.count(0), statuses.count(0xA700)) == (5, 5, 7)


def test_a_dataset_being_received_lies_in_the_spools_tmp_not_in_the_machines_tmpdir(
        node, tmp_path, monkeypatch):
    import tempfile

    machine_tmp = tmp_path / "machine-tmp"
    machine_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(machine_tmp))
    series = support.write_ct_series(tmp_path / "ct", n_slices=1)
    big = pydicom.dcmread(series.files[0])
    big.Rows = big.Columns = 2048
    big.PixelData = np.zeros((2048, 2048), np.int16).tobytes()  # 8 MiB: received over many PDUs
    spool_tmp = Path(node.config.spool, "tmp")
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(f"spool/{p.name}" for p in spool_tmp.iterdir())
            seen.update(f"machine/{p.name}" for p in machine_tmp.iterdir())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        statuses = _in_parallel(node.config.port, [[big]])
    finally:
        done.set()
        watcher.join()

    assert statuses == [[0]]
    assert any(name.startswith("spool/pynetdicom-") for name in seen), sorted(seen)
    assert not [name for name in seen if name.startswith("machine/")]
    peers.wait_for(lambda: not any(spool_tmp.iterdir()), what="spool/tmp emptied")
