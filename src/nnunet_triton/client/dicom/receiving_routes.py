"""The receiving side of a DICOM node with routes: every association's called AE title is kept, and the
first instance kept of a series decides its route (:mod:`.routing`) and records it in the series' state
before the C-STORE is answered (see :mod:`.node`, 4.)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pydicom

from nnunet_triton.client.dicom.receiving import STATUS_SUCCESS, Receiving
from nnunet_triton.client.dicom.routing import NoRoute, Route
from nnunet_triton.client.dicom.series_queue import route_entry
from nnunet_triton.client.dicom.uids import shown

__all__ = ["RoutedReceiving"]

LOGGER = logging.getLogger("nnunet_triton.client.dicom.node")  # one logger for the node's story


class RoutedReceiving(Receiving):
    """:class:`~.receiving.Receiving` that routes: a called AE title the routes map to a model is the node's
    own too, and the route of a series is decided and recorded when its first instance is kept."""

    _called_ae: dict[int, str]  # association -> its called AE title (for the routes)

    def _own_ae_title(self, called: str) -> str:
        """The called AE titles the routes map to a model are the node's own too."""
        return called if called in self.config.routes.called_ae_titles else self.config.ae_title

    def _accepted(self, assoc: Any, called: str) -> None:
        """Keep the called AE title of an accepted association: it routes the series it stores."""
        self._called_ae[id(assoc)] = called

    def _on_closed(self, event: Any) -> None:
        self._called_ae.pop(id(event.assoc), None)
        super()._on_closed(event)

    def _keep(self, staged: Path, study: str, series: str, sop: str, *, assoc_key: int) -> int:
        """Keep the instance (:meth:`.receiving.Receiving._keep`); the first one kept of a series decides
        and records its route before the C-STORE is answered."""
        called = self._called_ae.get(assoc_key)
        with self.queue.lock:
            entry = self.queue.pending.get(series)
            routed = entry is not None and entry.routed
        decision = None if routed else self._decide(staged, called)
        status = super()._keep(staged, study, series, sop, assoc_key=assoc_key)
        if status != STATUS_SUCCESS:
            return status
        try:
            self._note_route(series, sop, called, decision, study=study)
        except OSError as exc:  # the instance is kept; the sender sends it again and the route is recorded
            return self._spool_error(f"recording the route of series {series}", exc)
        return status

    def _decide(self, path: Path, called: str | None) -> Route | NoRoute:
        """The route of a series whose instance ``path`` came to ``called`` (only the attributes the rules
        read are read), or the :class:`NoRoute` saying why there is none."""
        routes = self.config.routes
        header: Any = {}
        if routes.keywords and not (called and called in routes.called_ae_titles):
            header = pydicom.dcmread(path, stop_before_pixels=True, defer_size=1 << 16,
                                     specific_tags=list(routes.keywords))
        try:
            return routes.decide(called, header)
        except NoRoute as exc:
            return exc

    def _note_route(self, series: str, sop: str, called: str | None,
                    decision: Route | NoRoute | None, *, study: str) -> None:
        """Record the route of a series in its state unless it has one (a later instance follows it, and so
        does a series whose earlier SEG was sent: its record keeps the route), with its study (a restart
        keeps the series with the other series of its study)."""
        with self.queue.lock:
            entry = self.queue.pending.get(series)
            if entry is None:  # a known instance of a sent series: nothing waits for a route
                return
            routed, first, model = entry.routed, entry.called_ae, entry.model
            other = routed and called is not None and called != first and called not in entry.other_called
            if other:
                entry.other_called.add(str(called))
        if other:
            LOGGER.warning("series %s: an instance came to called AE title %s; the series follows the route "
                           "of its first instance (called AE title %s): model %s", series, shown(called, 16),
                           shown(first, 16), model or "(none)")
        if routed:
            return
        with self.queue.series_lock(series):
            if not self.spool.series_dir(series).is_dir():  # its instances are in done/ only: no new round
                return
            state = self.spool.state(series)
            new = "called_ae" not in state
            if new:
                if decision is None:
                    decision = self._decide(self.spool.instance(series, sop), called)
                state.update(self._route_keys(series, called, decision), study=study)
                self.spool.write_state(series, state)
        with self.queue.lock:
            route_entry(entry, state)
        if new and state.get("model"):
            LOGGER.info("series %s: routed to model %s (%s)", series, state["model"], state.get("route"))
        elif new:
            LOGGER.warning("series %s: %s; it will be set aside", series, state.get("route"))

    def _route_keys(self, series: str, called: str | None, decision: Route | NoRoute) -> dict[str, Any]:
        record = self.spool.record(series)
        if isinstance(record.get("model"), str):  # an earlier round was sent: the SEG series keeps its model
            return {"called_ae": record.get("called_ae"), "model": record["model"],
                    "route": f"{record.get('route') or 'recorded'}, as its earlier DICOM-SEG"}
        if isinstance(decision, Route):
            return {"called_ae": called, "model": decision.model, "route": decision.reason}
        return {"called_ae": called, "route": str(decision)}
