"""What a DICOM node reports about itself: what is wrong now but may pass (degraded), its endpoints, the
series in progress and the outcomes of the last series. The receiving side and the series worker write
here; the node's monitor reads it into ``status.json`` (:meth:`.node.DicomNode.status`)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from nnunet_triton.client.dicom.node_config import NodeConfig
from nnunet_triton.client.dicom.phi import describe

__all__ = ["NodeHealth", "PROCESSED_KEPT", "RECENT_SHOWN"]

PROCESSED_KEPT = 1000  # outcomes kept in memory (DicomNode.processed)
RECENT_SHOWN = 20  # outcomes shown in status.json, with their model


class NodeHealth:
    """The node's health as its parts report it; ``lock`` is the series queue's (one lock for the node)."""

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.lock = lock or threading.Lock()
        self.degraded: dict[str, str] = {}  # what is wrong now but may pass: disk full, destination down
        self.endpoints: dict[str, str] = {}  # model -> "ready" | "not ready: why" (the monitor's last check)
        self.busy: tuple[str, float] | None = None  # the series in progress, since when (time.time())
        self.processed: collections.deque[tuple[str, str]] = collections.deque(maxlen=PROCESSED_KEPT)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_SHOWN)

    def set_degraded(self, key: str, reason: str | None) -> None:
        """Say what is wrong about ``key`` now (None: it passed)."""
        with self.lock:
            if reason is None:
                self.degraded.pop(key, None)
            else:
                self.degraded[key] = reason

    def outcome(self, uid: str, outcome: str, model: object) -> None:
        """A series ended: ``"sent"`` or ``"failed: why"``, with the model it was routed to."""
        self.processed.append((uid, outcome))
        self.recent.append({"series": uid, "model": model if isinstance(model, str) else None,
                            "outcome": outcome.split(":")[0], "at": time.time()})

    def stuck(self, max_busy_s: float) -> str | None:
        """Why the worker counts as stuck (one series in progress for longer than ``max_busy_s``), or None."""
        busy = self.busy
        if busy is None:
            return None
        elapsed = time.time() - busy[1]
        if elapsed <= max_busy_s:
            return None
        return (f"the worker has been busy with series {busy[0]} for {elapsed:.0f} s, more than "
                f"max_busy_s={max_busy_s:g} (endpoint or destination hung?)")

    def check_endpoints(self, config: NodeConfig) -> None:
        """Ask every served model's endpoint whether it is ready; one that is not makes the node degraded."""
        for name in config.served:
            model = config.model_for(name)
            if model is None or model.ready is None:
                continue
            try:
                model.ready()
            except Exception as exc:  # noqa: BLE001 - any failure means not ready
                self.endpoints[name] = f"not ready: {describe(exc)}"
                self.set_degraded(f"endpoint {name}", f"endpoint {name} is not ready ({describe(exc)})")
            else:
                self.endpoints[name] = "ready"
                self.set_degraded(f"endpoint {name}", None)
