"""One round of a series in a DICOM node's spool: assemble its instances, segment them, write the DICOM-SEG
(and RTSTRUCT) durably to ``outgoing/`` and send them (see :mod:`.node`, 4. to 6.).

A round reads the spool only: the instances in ``incoming/<series>/`` (with those of an earlier round
brought back from ``done/``), the series' state (its route, the UIDs of the SEG of this round) and its
record (what was sent before). It decides whether inference is needed at all (the SEG of these instances
was sent or written already, late instances that leave the volume as it is) and mints the SEG's UIDs
once, in the state, before the file exists. What happens after the round (recorded, retried, set aside)
is the series worker's (:mod:`.series_worker`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pydicom

from nnunet_triton.client.dicom.node_config import NodeConfig, NodeModel
from nnunet_triton.client.dicom.node_health import NodeHealth
from nnunet_triton.client.dicom.outputs import DicomOutput, write_dicom_outputs
from nnunet_triton.client.dicom.routing import NoRoute
from nnunet_triton.client.dicom.seg import generic_segment_labels
from nnunet_triton.client.dicom.series_queue import PendingSeries, SeriesQueue, route_entry
from nnunet_triton.client.dicom.spool import Spool
from nnunet_triton.client.dicom.uids import shown, valid_uid
from nnunet_triton.client.dicom.volume import read_series, scan_folder
from nnunet_triton.errors import InputValidationError

__all__ = ["SeriesRound", "RoundResult", "seg_sop", "SEG_HEADER_BYTES"]

LOGGER = logging.getLogger("nnunet_triton.client.dicom.node")  # one logger for the node's story
SEG_HEADER_BYTES = 64 * 1024  # a SEG's attributes and per-frame groups, on top of its pixels


@dataclass(frozen=True)
class RoundResult:
    """What a round sent: ``seg`` (the SEG's UIDs and instance number, the instances it covers) for
    ``names`` (the instances of the round); ``seg`` None: a SEG left alone in ``outgoing/`` was sent."""

    seg: dict[str, Any] | None
    names: tuple[str, ...] = ()


class SeriesRound:
    """Rounds of the series in ``spool``, segmented with the models of ``config``; ``kept`` holds a label map
    whose SEG could not be written yet (a full disk), so the next attempt needs no inference."""

    def __init__(self, config: NodeConfig, spool: Spool, queue: SeriesQueue, health: NodeHealth) -> None:
        self.config, self.spool, self.queue, self.health = config, spool, queue, health
        self.kept: dict[str, tuple[list[str], Any]] = {}  # series -> (instances, label map) not yet written

    # --- assemble ------------------------------------------------------------------------------------
    def run(self, uid: str, entry: PendingSeries) -> RoundResult:
        """Assemble, segment, write and send series ``uid`` (``entry.round``: the instances it works on)."""
        folder = self.spool.series_dir(uid)
        seg_path = self.spool.seg_file(uid)
        if not folder.is_dir():  # a SEG on its own in outgoing/ (left by an earlier run)
            self.send(uid, seg_path)
            return RoundResult(None)
        state, record = self.spool.state(uid), self.spool.record(uid)
        done_dir = self.spool.done_dir(uid)
        if done_dir.is_dir():  # a late instance: the earlier ones come back, the SEG covers the whole series
            self.spool.merge_into(done_dir, folder)
            with contextlib.suppress(OSError):
                done_dir.rmdir()
        names = [p.name for p in self.spool.instances(folder)]
        entry.round = frozenset(names)
        missing = set(record.get("covers", [])) - set(names)
        if missing:
            raise InputValidationError(
                f"series {uid}: {len(names)} late instance(s) arrived after the {len(missing)} instances of "
                f"its earlier SEG were deleted (done_retention_s={self.config.limits.done_retention_s}); "
                "send the whole series again.")
        seg = state.get("seg") if isinstance(state.get("seg"), dict) else None
        sent = {"series_uid": record.get("seg_series_uid"), "sop_uid": record.get("sop_uid"),
                "instance_number": record.get("instance_number"), "covers": record.get("covers"),
                "volume": record.get("volume")}
        if record.get("sop_uid") and record.get("covers") == names and (
                seg is None or seg.get("sop_uid") == record.get("sop_uid")):
            # sent already (a crash before the cleanup), or the very instances of the SEG sent before
            # arrived again after done_retention_s: nothing new to segment
            LOGGER.info("series %s: its DICOM-SEG of these %d instance(s) was sent already", uid, len(names))
            seg = sent
        else:
            if seg is not None and seg.get("covers") == names and self._written(uid, seg):
                LOGGER.info("series %s: sending the DICOM-SEG written before (no inference)", uid)
            else:
                seg = self._segment(uid, entry, folder, state, record, names, seg)
            if not seg.get("unchanged"):
                self.send(uid, seg_path, seg)
        return RoundResult(seg, tuple(names))

    # --- segment and write ---------------------------------------------------------------------------
    def _segment(self, uid: str, entry: PendingSeries, folder: Path, state: dict[str, Any],
                 record: dict[str, Any], names: list[str], seg: dict[str, Any] | None) -> dict[str, Any]:
        from pydicom.uid import generate_uid

        scan = scan_folder(folder, self.config.dicom_options)
        eligible = [s for s in scan.series if s.uid == uid]
        if not eligible:
            reasons = sorted({reason for _, reason in scan.skipped}) or ["no instances"]
            raise InputValidationError(f"series {uid}: no image volume to segment ({'; '.join(reasons)}).")
        name, model = self._model_of(uid, entry, state, eligible[0].first)
        refusal = model.modalities.refusal(str(eligible[0].first.get("Modality", "")))
        if refusal:
            raise InputValidationError(f"series {uid}: {refusal} (model {name}); it is not segmented.")
        volume = read_series(eligible[0], self.config.dicom_options)
        used = sorted(f"{ds.get('SOPInstanceUID')}.dcm" for ds in volume.datasets)
        if len(used) < len(names):
            reasons = sorted({reason for _, reason in scan.skipped}) or ["not slices of the volume"]
            LOGGER.info("series %s: %d of its %d instance(s) are not part of the volume and cannot change "
                        "the segmentation (%s)", uid, len(names) - len(used), len(names), "; ".join(reasons))
        if record.get("sop_uid") and record.get("volume") == used:
            LOGGER.info("series %s: its late instance(s) do not change the volume; the DICOM-SEG sent before "
                        "stands (no inference, no new SEG)", uid)
            return {"series_uid": record.get("seg_series_uid"), "sop_uid": record.get("sop_uid"),
                    "instance_number": record.get("instance_number"), "covers": names, "volume": used,
                    "unchanged": True}
        LOGGER.info("series %s: segmenting %d instance(s) with model %s", uid, len(used), name)
        if seg is None or seg.get("covers") != names:  # a new round: new SOP instance, same SEG series
            series_uid = state.get("seg_series_uid") or record.get("seg_series_uid") or generate_uid()
            seg = {"series_uid": series_uid, "sop_uid": generate_uid(),
                   "instance_number": int(record.get("instance_number", 0)) + 1, "covers": names}
        if model.output.rtstruct and not seg.get("rt_sop_uid"):  # the RTSTRUCT's own series, kept likewise
            rt_series = state.get("rt_series_uid") or record.get("rt_series_uid") or generate_uid()
            seg.update(rt_series_uid=rt_series, rt_sop_uid=generate_uid())
        seg["output"] = str(model.output)
        seg["volume"] = used
        state.update(seg=seg, seg_series_uid=seg["series_uid"], study=entry.study,
                     **({"rt_series_uid": seg["rt_series_uid"]} if seg.get("rt_series_uid") else {}))
        self.spool.write_state(uid, state)  # the UIDs exist before the file does
        kept = self.kept.get(uid)
        if kept is not None and kept[0] == names:
            LOGGER.info("series %s: writing the label map kept from the attempt before (no inference)", uid)
            segmentation = kept[1]
        else:
            self._check_seg_space(uid, volume, model)  # a full disk costs no inference
            segmentation = model.segment(volume)
            self.kept[uid] = (names, segmentation)
        labels = model.labels or generic_segment_labels(segmentation)
        paths = write_dicom_outputs(
            segmentation, volume, labels, model.output, seg_path=self.spool.seg_file(uid),
            rtstruct_path=self.spool.rtstruct_file(uid), seg_uids=(seg["series_uid"], seg["sop_uid"]),
            rtstruct_uids=(seg.get("rt_series_uid"), seg.get("rt_sop_uid")),
            instance_number=int(seg["instance_number"]), durable=True)
        self.kept.pop(uid, None)
        self.spool.add(sum(path.stat().st_size for path in paths))
        return seg

    def _outputs(self, uid: str, seg: Mapping[str, Any]) -> list[tuple[Path, str | None]]:
        """(file, its SOP Instance UID) of every object of the round ``seg`` (the SEG, the RTSTRUCT)."""
        output = DicomOutput(seg.get("output") or DicomOutput.SEG)
        return ([(self.spool.seg_file(uid), seg.get("sop_uid"))] if output.seg else []) + (
            [(self.spool.rtstruct_file(uid), seg.get("rt_sop_uid"))] if output.rtstruct else [])

    def _written(self, uid: str, seg: Mapping[str, Any]) -> bool:
        """Whether every object of the round ``seg`` is in outgoing/ as written (sent again, no inference)."""
        return all(seg_sop(path) == sop for path, sop in self._outputs(uid, seg))

    def _check_seg_space(self, uid: str, volume: Any, model: NodeModel) -> None:
        """Raise ENOSPC before inference when the SEG would not fit: on the spool's disk or in its quota
        (a binary SEG: one bit per voxel and segment, plus its header)."""
        segments = max(1, len(model.labels or ()))
        needed = int(np.prod(np.shape(volume.data))) // 8 * segments + SEG_HEADER_BYTES
        free = shutil.disk_usage(self.spool.outgoing).free
        quota_left = self.config.limits.max_spool_bytes - self.spool.used
        if min(free, quota_left) < needed:
            where = "free on the spool's disk" if free < needed else "left in max_spool_bytes"
            raise OSError(errno.ENOSPC, f"series {uid}: its DICOM-SEG needs about {needed} bytes, "
                                        f"{min(free, quota_left)} {where}; not segmented until there is room")

    def _model_of(self, uid: str, entry: PendingSeries, state: dict[str, Any],
                  header: Any) -> tuple[str, NodeModel]:
        """The model of the series' recorded route; routed now (and recorded with the state) when it has
        none (a spool of an earlier node, a crash before the route was written) or when the node no longer
        serves its model (the routes changed). A series nothing routes cannot be segmented."""
        recorded = state.get("model")
        model = self.config.model_for(recorded)
        if model is None:
            called = state.get("called_ae") if isinstance(state.get("called_ae"), str) else None
            try:
                route = self.config.routes.decide(called, header)
            except NoRoute as exc:
                raise InputValidationError(f"series {uid}: {exc}; it is not segmented.") from None
            if isinstance(recorded, str):
                LOGGER.warning("series %s: its model %s is not served by this node now; routed again to "
                               "model %s (%s)", uid, shown(recorded, 48), route.model, route.reason)
            else:
                LOGGER.info("series %s: routed to model %s (%s)", uid, route.model, route.reason)
            state.update(called_ae=called, model=route.model, route=route.reason)
            recorded, model = route.model, self.config.model_for(route.model)
            if model is None:  # NodeConfig checks that every routed model is served
                raise InputValidationError(f"series {uid}: model {route.model} is not served by this node.")
        with self.queue.lock:
            route_entry(entry, state)
        return str(recorded), model

    # --- send ----------------------------------------------------------------------------------------
    def send(self, uid: str, seg_path: Path, seg: Mapping[str, Any] | None = None) -> None:
        """Send the objects of the round ``seg`` (None: the SEG at ``seg_path`` alone) to the destination."""
        files = [path for path, _ in self._outputs(uid, seg)] if seg is not None else [seg_path]
        what = "the DICOM-SEG" if files == [seg_path] else (
            f"the {'DICOM-SEG and ' * (seg_path in files)}RTSTRUCT")
        self.config.destination.send(files, what=f"{what} of series {uid}")
        self.health.set_degraded("destination", None)


def seg_sop(path: Path) -> str | None:
    """The SOPInstanceUID of a readable DICOM file at ``path``, else None (missing, empty, damaged)."""
    try:
        if path.stat().st_size == 0:
            return None
        return valid_uid(pydicom.dcmread(path, stop_before_pixels=True).get("SOPInstanceUID"))
    except Exception:  # noqa: BLE001 - any reason it cannot be read means it cannot be sent
        return None
