"""Running a DICOM node's spool from outside: its health (:func:`read_status`, ``nnunet-triton
node-status``) and failed series back to work (:func:`requeue`, ``nnunet-triton requeue``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nnunet_triton.client.dicom.spool import Spool, SpoolLimits, durable_json, read_json
from nnunet_triton.client.dicom.uids import shown, valid_uid
from nnunet_triton.util.process import pid_alive

__all__ = ["read_status", "requeue"]


def read_status(spool: Path, *, max_age_s: float | None = None) -> tuple[bool, dict[str, Any]]:
    """(healthy, status) of the node on ``spool``: unhealthy when it says so, when its worker is stuck (one
    series in progress for longer than its ``max_busy_s``), when its process is gone, or when the status is
    older than ``max_age_s`` (default: 3 heartbeats plus 10 s), i.e. the node hangs."""
    status = read_json(Path(spool) / "status.json")
    if not status:
        return False, {"state": "unhealthy", "reason": f"no node status in {spool} (not started?)"}
    age = time.time() - float(status.get("updated", 0))
    limit = max_age_s if max_age_s is not None else 3 * float(status.get("heartbeat_s", 2.0)) + 10.0
    pid = int(status.get("pid", 0))
    alive = pid > 0 and pid_alive(pid)
    if status.get("state") == "unhealthy" or status.get("worker_stuck"):
        return False, status
    if not alive:
        return False, {**status, "state": "unhealthy", "reason": f"the node (pid {pid}) is not running"}
    if age > limit:
        return False, {**status, "state": "unhealthy", "reason": f"no heartbeat for {age:.0f} s (hung?)"}
    return True, status


def requeue(spool: Path, series: Sequence[str] = ()) -> list[str]:
    """Move series from ``failed/`` back to ``incoming/`` (all, or those of ``series``); a running node picks
    them up within its rescan interval. The unsent SEG goes back to ``outgoing/`` and the series' state is
    kept (its SEG UIDs), with the attempts reset: a SEG that covers the same instances is sent as it is."""
    store = Spool(Path(spool), SpoolLimits())
    wanted = {valid_uid(s) or shown(s) for s in series}
    moved = []
    for entry in sorted(p for p in store.failed.iterdir() if p.is_dir()):
        uid = valid_uid(entry.name.split("_")[0])
        if uid is None or (wanted and uid not in wanted):
            continue
        state = read_json(entry / ".state.json")
        for key in ("attempts", "first_failure", "last_error"):
            state.pop(key, None)
        unsent = entry / "nnunet_seg.dcm.unsent"
        folder = store.series_dir(uid)
        if unsent.exists() and not folder.exists():
            store.move(unsent, store.seg_file(uid))  # before the series appears to the node
        (entry / "error.txt").unlink(missing_ok=True)
        unsent.unlink(missing_ok=True)
        if folder.exists():  # a new round is waiting there: the instances join it, its state stays
            store.merge_into(entry, folder)
            store.remove_tree(entry)
        else:
            durable_json(entry / ".state.json", state)
            store.move(entry, folder)
        if uid not in moved:
            moved.append(uid)
    return moved
