"""What a DICOM node (:mod:`.node`) is configured with: :class:`NodeConfig` (listening, access, spool,
destination, retries, limits, routes) and :class:`NodeModel` (a model it segments with)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from nnunet_triton.client.dicom.access import AccessPolicy
from nnunet_triton.client.dicom.destination import DicomWebDestination, StoreDestination
from nnunet_triton.client.dicom.modality import ModalityRule
from nnunet_triton.client.dicom.outputs import DicomOutput
from nnunet_triton.client.dicom.routing import Routes
from nnunet_triton.client.dicom.seg import SegmentLabel
from nnunet_triton.client.dicom.spool import SpoolLimits
from nnunet_triton.client.dicom.volume import DicomOptions
from nnunet_triton.errors import PacsError
from nnunet_triton.util.retry import RetryPolicy

__all__ = ["NodeConfig", "NodeModel"]


@dataclass(frozen=True)
class NodeModel:
    """A model (endpoint) the node segments with: ``segment(volume)`` returns the label map of a
    :class:`~.volume.DicomVolume`; ``labels`` name the DICOM-SEG segments (None: ``label_<v>`` for the values
    present); ``modalities`` says which series fit it; ``ready()`` raises when the endpoint is not ready (the
    monitor calls it every ``endpoint_check_s``; None: not checked); ``output``: the DICOM objects its
    results become (SEG, RTSTRUCT or both, sent together)."""

    segment: Callable[[Any], Any]
    labels: Sequence[SegmentLabel] | None = None
    modalities: ModalityRule = field(default_factory=lambda: ModalityRule(None))
    ready: Callable[[], Any] | None = None
    output: DicomOutput = DicomOutput.SEG


@dataclass(frozen=True)
class NodeConfig:
    """What the node listens on, who may store, where it spools and sends, how it retries and its limits.

    One model: ``segment(volume)`` returns the label map for a :class:`~.volume.DicomVolume`, ``labels``
    names the DICOM-SEG segments (None: ``label_<v>`` for the values present), ``modalities`` the series that
    fit; it is the ``routes``' default model (``Routes()``: everything to ``nnunet``). Several models:
    ``models`` maps every endpoint name the ``routes`` name to its :class:`NodeModel` (``segment`` None).
    Times are seconds.
    """

    ae_title: str
    port: int
    spool: Path
    destination: StoreDestination | DicomWebDestination
    segment: Callable[[Any], Any] | None = None
    labels: Sequence[SegmentLabel] | None = None
    host: str = "127.0.0.1"
    idle_timeout_s: float = 10.0
    max_open_wait_s: float = 120.0
    retries: int | None = None
    retry_delay_s: float = 5.0
    max_retry_delay_s: float = 300.0
    retry_window_s: float = 3600.0
    access: AccessPolicy = field(default_factory=AccessPolicy)
    limits: SpoolLimits = field(default_factory=SpoolLimits)
    modalities: ModalityRule = field(default_factory=lambda: ModalityRule(None))
    dicom_options: DicomOptions = field(default_factory=DicomOptions)
    network_timeout_s: float = 60.0
    max_busy_s: float = 900.0
    endpoint_check_s: float = 30.0
    poll_s: float = 0.2
    heartbeat_s: float = 2.0
    rescan_s: float = 5.0
    sweep_s: float = 60.0
    routes: Routes = field(default_factory=Routes)
    models: Mapping[str, NodeModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= len(self.ae_title) <= 16:
            raise PacsError(f"AE title must have 1 to 16 characters, got {self.ae_title!r}.")
        bad_retries = self.retries is not None and self.retries < 0
        if self.idle_timeout_s <= 0 or bad_retries or self.retry_delay_s < 0:
            raise PacsError("idle timeout must be > 0, retries and retry delay >= 0, got "
                            f"{self.idle_timeout_s}, {self.retries}, {self.retry_delay_s}.")
        if min(self.retry_window_s, self.max_retry_delay_s, self.max_open_wait_s) < 0 or min(
                self.network_timeout_s, self.poll_s, self.heartbeat_s, self.rescan_s, self.sweep_s,
                self.max_busy_s, self.endpoint_check_s) <= 0:
            raise PacsError("retry window, delays and waits must be >= 0 and the node's intervals > 0.")
        self.access.check_listening(self.host)
        self._check_models()

    @property
    def retry_policy(self) -> RetryPolicy:
        """The backoff between a series' attempts: ``retry_delay_s`` doubling up to ``max_retry_delay_s``
        (how many attempts: ``retries`` and ``retry_window_s``, which the node applies)."""
        return RetryPolicy(retries=self.retries or 0, backoff_s=self.retry_delay_s,
                           max_delay_s=self.max_retry_delay_s)

    def _check_models(self) -> None:
        routes = self.routes
        if self.models:
            if self.segment is not None or self.labels is not None or self.modalities != ModalityRule(None):
                raise PacsError("give the node one model (segment, labels, modalities) or several (models), "
                                "not both.")
            missing = [name for name in routes.models if name not in self.models]
            if missing:
                raise PacsError(f"the routes send series to model {missing[0]!r} "
                                f"({routes.where(missing[0])}) but the node has no such model (it has "
                                f"{sorted(self.models)}).")
            object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        elif self.segment is None:
            raise PacsError("the node needs a model: segment (one) or models (one per endpoint name).")
        elif routes.models != (routes.default,):
            others = [name for name in routes.models if name != routes.default]
            raise PacsError(f"one segment callable is the routes' default model ({routes.default}) only; the "
                            f"routes also name {others}: give models, one per endpoint name.")

    @property
    def served(self) -> tuple[str, ...]:
        """The endpoint names the node segments with."""
        return tuple(self.models) if self.models else (str(self.routes.default),)

    def model_for(self, name: object) -> NodeModel | None:
        """The model the node segments with for endpoint ``name``; None when it serves no such model."""
        if self.models:
            return self.models.get(name) if isinstance(name, str) else None
        if self.segment is None or name != self.routes.default:
            return None
        return NodeModel(self.segment, self.labels, self.modalities)
