"""The DICOM node in a process of its own, watched from outside: its memory under a deflate bomb, the order
of its system calls before it answers a C-STORE (strace), its exit status when it cannot go on, a restart
after SIGKILL mid-series with the PACS sending the whole series again slowly, and SIGTERM with an idle
association open.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pydicom
import pytest
from pydicom.filewriter import write_dataset, write_file_meta_info

try:
    from . import dicom_support as support
    from . import node_support as peers
except ImportError:  # run from tests/unit without package context
    import dicom_support as support
    import node_support as peers

REPO = Path(__file__).resolve().parents[2]
CT_STORAGE, DEFLATED = "1.2.840.10008.5.1.4.1.1.2", "1.2.840.10008.1.2.1.99"
EXPLICIT = "1.2.840.10008.1.2.1"
BOMB_SIDE = 12_000  # 12000 x 12000 int16 zeros: 288 MB inflated, about 280 KB deflated


def _start(spool: Path, *, settings: str = "{}", wrapper: list[str] | None = None
           ) -> tuple[subprocess.Popen, int]:
    port = peers.free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO),
                                                        os.environ.get("PYTHONPATH", "")])}
    command = [*(wrapper or []), sys.executable, "-m", "tests.unit.node_process", "--spool", str(spool),
               "--port", str(port), "--destination", f"DEST@127.0.0.1:{peers.free_port()}",
               "--settings", settings]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    line = process.stdout.readline()
    if "listening" not in line:
        process.kill()
        raise AssertionError(f"the node did not start: {line!r} {process.stderr.read()[-2000:]}")
    process.node_pid = int(line.split()[1])  # under strace, the node is strace's child
    return process, port


def _stop(process: subprocess.Popen) -> str:
    os.kill(process.node_pid, signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate(timeout=30)
    return err


def _peak_rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text)[1]) / 1024


def _deflate_bomb(path: Path, side: int) -> Path:
    """A CT instance with ``side`` x ``side`` zero pixels in Deflated Explicit VR Little Endian, written in
    chunks (the inflated dataset never exists, here or on disk)."""
    ds = support.template()
    del ds.PixelData
    ds.Rows = ds.Columns = side
    ds.SOPInstanceUID = pydicom.uid.generate_uid()
    meta = pydicom.dataset.FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = ds.SOPClassUID, ds.SOPInstanceUID
    meta.TransferSyntaxUID = DEFLATED
    header = pydicom.filebase.DicomBytesIO()
    header.is_little_endian, header.is_implicit_VR = True, False
    write_dataset(header, ds)
    pixels = side * side * 2
    element = b"\xe0\x7f\x10\x00OW\x00\x00" + pixels.to_bytes(4, "little")
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    with path.open("wb") as out:
        out.write(b"\0" * 128 + b"DICM")
        write_file_meta_info(out, meta, enforce_standard=True)
        out.write(deflater.compress(header.getvalue() + element))
        zeros = b"\0" * (1 << 20)
        for _ in range(pixels // len(zeros)):
            out.write(deflater.compress(zeros))
        out.write(deflater.compress(b"\0" * (pixels % len(zeros))) + deflater.flush())
    return path


def _send_raw(port: int, path: Path, syntax: str) -> int:
    """C-STORE a file as it is on disk (no decoding, no re-encoding: pynetdicom's chunked sending)."""
    from pynetdicom import _config

    previous = _config.STORE_SEND_CHUNKED_DATASET
    _config.STORE_SEND_CHUNKED_DATASET = True
    try:
        assoc = peers.associate(port, contexts=[(CT_STORAGE, syntax)], timeout_s=60)
        assert assoc.is_established
        status = assoc.send_c_store(path)
        code = int(status.Status) if status else -1
        if assoc.is_established:
            assoc.release()
        return code
    finally:
        _config.STORE_SEND_CHUNKED_DATASET = previous


def test_a_deflate_bomb_is_refused_without_inflating_it_in_memory(tmp_path):
    bomb = _deflate_bomb(tmp_path / "bomb.dcm", BOMB_SIDE)
    settings = '{"accept_deflate": true, "limits": {"max_instance_bytes": 33554432}}'  # 32 MiB
    process, port = _start(tmp_path / "spool", settings=settings)
    try:
        before = _peak_rss_mb(process.node_pid)
        status = _send_raw(port, bomb, DEFLATED)
        after = _peak_rss_mb(process.node_pid)
    finally:
        err = _stop(process)
    print(f"deflate bomb of {bomb.stat().st_size / 1024:.0f} KB ({BOMB_SIDE ** 2 * 2 / 2 ** 20:.0f} MiB "
          f"inflated): node peak RSS {before:.0f} MB -> {after:.0f} MB, status {status:#06x}")
    assert status == 0xA700, err[-2000:]
    assert after - before < 64, f"peak RSS grew from {before:.0f} MB to {after:.0f} MB"
    assert not list((tmp_path / "spool").rglob("*.dcm"))


def test_an_instance_is_fsynced_and_its_folder_too_before_the_c_store_is_answered(tmp_path):
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    trace = tmp_path / "trace.txt"
    calls = "trace=fsync,fdatasync,rename,renameat,renameat2,link,linkat,sendto"
    wrapper = ["strace", "-f", "-qq", "-yy", "-e", calls, "-o", str(trace)]
    try:
        process, port = _start(tmp_path / "spool", wrapper=wrapper, settings='{"idle_timeout_s": 600}')
    except AssertionError as exc:
        if "ptrace" in str(exc) or "Operation not permitted" in str(exc):
            pytest.skip(f"strace cannot trace here: {exc}")
        raise
    series = support.write_ct_series(tmp_path / "ct", n_slices=1)
    try:
        statuses = peers.send(port, series.files)
        time.sleep(0.5)
    finally:
        _stop(process)
    assert statuses == [0]
    lines = trace.read_text().splitlines()
    final = f"incoming/{series.series_uid}/{series.sop_uids[0]}.dcm"
    renamed = next(i for i, line in enumerate(lines) if re.search(r"rename|link", line) and final in line)
    answered = next(i for i, line in enumerate(lines[renamed:], renamed)
                    if "sendto(" in line and "TCP" in line)
    received = str(tmp_path / "spool" / "tmp" / "rx-")  # the spool's receive file, before its link
    synced_file = [i for i, line in enumerate(lines[:renamed]) if line.split()[1].startswith("fsync(")
                   and received in line]
    synced_dirs = {re.search(r"fsync\(\d+<([^>]+)>", line)[1] for line in lines[renamed:answered]
                   if "fsync(" in line}
    assert synced_file, "the instance's data were not fsynced before it was linked into place"
    assert str(tmp_path / "spool" / "incoming" / series.series_uid) in synced_dirs
    assert answered > renamed


def test_a_node_that_loses_its_spool_exits_with_status_3(tmp_path):
    process, port = _start(tmp_path / "spool")
    shutil.rmtree(tmp_path / "spool" / "incoming")
    try:
        code = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 3
    assert "spool folders missing" in process.stderr.read()


def test_deflate_bomb_helper_writes_a_small_file_that_inflates_to_the_stated_size(tmp_path):
    bomb = _deflate_bomb(tmp_path / "small-bomb.dcm", 512)
    data = bomb.read_bytes()
    meta_end = 144 + int.from_bytes(data[140:144], "little")
    inflated = zlib.decompress(data[meta_end:], -zlib.MAX_WBITS)
    body = pydicom.filebase.DicomBytesIO(inflated)
    ds = pydicom.filereader.read_dataset(body, is_implicit_VR=False, is_little_endian=True)
    assert (ds.Rows, ds.Columns, len(ds.PixelData)) == (512, 512, 512 * 512 * 2)
    assert len(data) < 10_000


@pytest.mark.parametrize("associations", ["one", "one_per_instance"])
def test_a_slow_resend_after_a_restart_keeps_the_series_open_and_yields_one_seg(tmp_path, associations):
    """The finding: a node killed mid-series, a new one on the same spool, and the PACS sending the whole
    series again, each instance a little sooner than the idle timeout, so that the re-send lasts several
    idle timeouts. The instances the spool has already (acknowledged as known) must keep the series open
    as the new ones do: one SEG of the whole series, nothing in failed/. Before, the series was cut while
    the known instances came in (a SEG of the half the spool had, or failed/, then another round)."""
    series = support.write_ct_series(tmp_path / "ct", n_slices=8)
    datasets = [pydicom.dcmread(path) for path in series.files]
    spool = tmp_path / "spool"
    first, port = _start(spool, settings='{"idle_timeout_s": 600}')
    try:
        killed_mid_series = peers.associate(port, contexts=[(CT_STORAGE, EXPLICIT)])
        assert [int(killed_mid_series.send_c_store(ds).Status) for ds in datasets[:4]] == [0] * 4
    finally:
        os.kill(first.node_pid, signal.SIGKILL)
        first.communicate(timeout=30)
    killed_mid_series.abort()

    # one instance every 0.6 s (0.9 s left for an association on a loaded machine): the re-send takes
    # 4.8 s, 3.2 idle timeouts, and its known half alone (2.4 s) outlasts the idle timeout
    idle, gap = 1.5, 0.6
    dest = peers.Destination().start()
    node = peers.running(peers.node_config(spool, dest, peers.Threshold(), idle_timeout_s=idle))
    try:
        statuses = []
        if associations == "one":
            assoc = peers.associate(node.config.port, contexts=[(CT_STORAGE, EXPLICIT)])
            for ds in datasets:
                statuses.append(int(assoc.send_c_store(ds).Status))
                time.sleep(gap)
            assoc.release()
        else:  # a sender that opens an association per instance: only the instances keep the series open
            for path in series.files:
                statuses += peers.send(node.config.port, [path])
                time.sleep(gap)
        # a second round (the series cut during the re-send) would still be pending here
        peers.wait_for(lambda: node.processed and not node.status()["pending_series"], timeout_s=30,
                       what="the series segmented and sent")
        failed = list((spool / "failed").iterdir())
    finally:
        node.stop()
        dest.stop()
    assert statuses == [0] * 8
    assert [int(seg.NumberOfFrames) for seg in dest.received] == [8]  # one SEG, of the whole series
    assert failed == []
    assert node.processed == [(series.series_uid, "sent")]


def test_sigterm_with_an_idle_open_association_exits_within_seconds(tmp_path):
    """An association left open and idle (a PACS between two series) used to keep a node on SIGTERM for
    network_timeout_s (60 s by default): pynetdicom's reader thread waited for it. The node aborts it and
    exits at once; what it acknowledged is in the spool, and the sender is told (A-ABORT)."""
    series = support.write_ct_series(tmp_path / "ct", n_slices=2)
    datasets = [pydicom.dcmread(path) for path in series.files]
    spool = tmp_path / "spool"
    process, port = _start(spool, settings='{"idle_timeout_s": 600, "network_timeout_s": 60}')
    try:
        assoc = peers.associate(port, contexts=[(CT_STORAGE, EXPLICIT)], timeout_s=60)
        assert [int(assoc.send_c_store(ds).Status) for ds in datasets] == [0, 0]
        time.sleep(0.5)  # the association stays open, idle
        sent = time.monotonic()
        os.kill(process.node_pid, signal.SIGTERM)
        try:
            _, err = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate(timeout=30)
            pytest.fail("the node did not exit within 5 s of SIGTERM with an idle association open")
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
    print(f"SIGTERM with an idle association open: the node exited after {took:.2f} s")
    assert process.returncode == 0, err[-2000:]
    peers.wait_for(lambda: assoc.is_aborted, timeout_s=5, what="the sender told by an A-ABORT")
    spooled = sorted(path.name for path in (spool / "incoming" / series.series_uid).glob("*.dcm"))
    assert spooled == sorted(f"{sop}.dcm" for sop in series.sop_uids)
    assert not list((spool / "tmp").iterdir())
