"""What the ``nnunet`` endpoint serves (read through Triton's model metadata/config API) and retried calls.

The builder can publish the model's description as the ensemble config parameter ``nnunet_description``
(JSON, :func:`nnunet_triton.parameters.description_parameters`); Triton serves config parameters of
ensembles through
``GET /v2/models/nnunet/config`` and gRPC ``ModelConfig`` (checked on the embedded 2.51 server). Without it,
the description falls back to what the tensor shapes tell: channels (``IMAGE`` dims[0]) and segmentation heads
(``PROBABILITIES`` dims[0]); label names are then generic.

``tritonclient`` is imported inside the functions that talk to a server.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.client.deprecation import renamed_keyword
from nnunet_triton.client.tls import ClientTls, triton_client
from nnunet_triton.errors import ClientError, ServerNotRunningError
from nnunet_triton.parameters import DESCRIPTION_PARAMETER, PARAM_FOLD_MODELS
from nnunet_triton.util.retry import RetryPolicy, is_retryable_error

__all__ = [
    "EndpointDescription",
    "describe_endpoint",
    "format_description",
    "segment_with_retry",
    "is_unavailable",
]

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointDescription:
    """The deployed model as the server describes it; ``published`` is the builder's JSON ({} if absent)."""

    url: str
    model_name: str
    server_version: str
    num_channels: int
    num_heads: int
    segmentation_dtype: str
    composing_models: tuple[str, ...]
    fold_models: tuple[str, ...]
    published: Mapping[str, Any] = field(default_factory=dict)
    orchestrator_instances: int = 1  # requests the server computes at once (each instance holds one)

    @property
    def labels(self) -> dict[str, Any]:
        """dataset.json ``labels``; generic ``label_<k>`` names when the server does not publish them."""
        if self.published.get("labels"):
            return dict(self.published["labels"])
        return {"background": 0, **{f"label_{k}": k for k in range(1, self.num_heads)}}

    @property
    def file_ending(self) -> str:
        return str(self.published.get("file_ending") or ".nii.gz")

    @property
    def endpoint(self) -> str:
        """The endpoint name (``liver``) the server published; the model name when it published none."""
        return str(self.published.get("endpoint") or self.model_name)

    @property
    def version(self) -> int | None:
        """The endpoint version answering (the promoted one for a public endpoint), None when unpublished."""
        version = self.published.get("version")
        return int(version) if isinstance(version, int) else None


def _model_config(client: Any, name: str, protocol: str) -> dict[str, Any]:
    if protocol == "grpc":
        return client.get_model_config(name, as_json=True).get("config", {})
    return client.get_model_config(name)


def _metadata(client: Any, name: str, protocol: str) -> dict[str, Any]:
    return (
        client.get_model_metadata(name, as_json=True)
        if protocol == "grpc"
        else client.get_model_metadata(name)
    )


def _first_dim(metadata: Mapping[str, Any], key: str, tensor: str) -> int:
    for item in metadata.get(key, []):
        if item["name"] == tensor:
            return int(item["shape"][0])
    return -1


def _namespace(published: Mapping[str, Any]) -> str:
    """The composing models' namespace of the endpoint version the description publishes (``""`` for a
    repository built before endpoint names, whose description names none)."""
    try:
        version = io_names.check_version(published["version"])
        return io_names.model_namespace(str(published["endpoint"]), version)
    except (KeyError, ValueError, TypeError):
        return ""


def describe_endpoint(
    url: str, protocol: str = "http", *, endpoint: str | None = None, timeout_s: float = 30.0,
    tls: ClientTls | None = None, model_name: str | None = None,
) -> EndpointDescription:
    """Ask the server for the endpoint's metadata and config (and the orchestrator's fold models).

    Args:
        endpoint: the endpoint name (default ``nnunet``), or any Triton model of the server by its full name
            (the pinned ``liver__v2``), as ``NnunetClient``'s.
        tls: as ``NnunetClient``'s.
        model_name: deprecated spelling of ``endpoint`` (kept for one release, with a DeprecationWarning).

    Raises:
        ServerNotRunningError: the server was not reached.
        ClientError: it answered with an error.
    """
    endpoint = renamed_keyword("describe_endpoint", "model_name", model_name, "endpoint", endpoint)
    model_name = io_names.ENDPOINT_MODEL if endpoint is None else endpoint
    client = triton_client(url, protocol, timeout_s, tls)
    where = f"{protocol}://{url}"
    try:
        client.is_server_live()
    except Exception as exc:  # connection refused, DNS, timeouts (as NnunetClient.check_ready decides)
        client.close()
        raise ServerNotRunningError(f"cannot describe model {model_name!r} on {where}: the server is not "
                                    f"reachable ({type(exc).__name__}: {exc}); is it running?") from None
    try:
        server = (
            client.get_server_metadata(as_json=True) if protocol == "grpc" else client.get_server_metadata()
        )
        metadata = _metadata(client, model_name, protocol)
        config = _model_config(client, model_name, protocol)
    except Exception as exc:
        message = exc.message() if hasattr(exc, "message") else f"{type(exc).__name__}: {exc}"
        raise ClientError(f"cannot describe model {model_name!r} on {where}: {message}") from None
    steps = tuple(s["model_name"] for s in config.get("ensemble_scheduling", {}).get("step", []))
    raw = config.get("parameters", {}).get(DESCRIPTION_PARAMETER, {}).get("string_value")
    published = json.loads(raw) if raw else {}
    fold_models: tuple[str, ...] = ()
    orchestrators = 1
    orchestrator_name = _namespace(published) + io_names.ORCHESTRATOR_MODEL
    if orchestrator_name in steps:
        try:
            orchestrator = _model_config(client, orchestrator_name, protocol)
            orchestrators = sum(int(g.get("count", 1)) for g in orchestrator.get("instance_group", [])) or 1
            params = orchestrator.get("parameters", {})
            fold_models = tuple(
                filter(None, params.get(PARAM_FOLD_MODELS, {}).get("string_value", "").split(","))
            )
        except Exception:  # an older repository or a locked-down config API: folds stay unknown
            LOGGER.debug("no orchestrator config on %s", where)
    seg_dtype = next(
        (o["datatype"] for o in metadata.get("outputs", []) if o["name"] == io_names.SEGMENTATION), ""
    )
    client.close()
    return EndpointDescription(
        url=where,
        model_name=model_name,
        server_version=str(server.get("version", "")),
        num_channels=_first_dim(metadata, "inputs", io_names.IMAGE),
        num_heads=_first_dim(metadata, "outputs", io_names.PROBABILITIES),
        segmentation_dtype=seg_dtype,
        composing_models=steps,
        fold_models=fold_models,
        published=published,
        orchestrator_instances=orchestrators,
    )


def format_description(d: EndpointDescription) -> str:
    """Human-readable lines for ``nnunet-triton info``."""
    version = f", version {d.version}" if d.version is not None else ""
    lines = [
        f"endpoint        {d.model_name} on {d.url} (Triton {d.server_version}{version})",
        f"pipeline        {' -> '.join(d.composing_models) or '(not an ensemble)'}",
        f"fold models     {', '.join(d.fold_models) or '(unknown)'}",
        f"orchestrators   {d.orchestrator_instances} instance(s) (requests computed at once)",
        f"input IMAGE     FP32 [C={d.num_channels}, z, y, x] (FP16/INT16/UINT16/UINT8: "
        f"{d.model_name}_<dtype>) + SPACING FP64 [3] (z, y, x: SimpleITK order)",
        f"output          SEGMENTATION {d.segmentation_dtype} [z, y, x], "
        f"PROBABILITIES FP32 [K={d.num_heads}, z, y, x]",
        f"labels          {json.dumps(d.labels)}" + ("" if d.published.get("labels") else " (generic)"),
    ]
    for key in sorted(set(d.published) - {"labels", "endpoint", "version"}):
        value = d.published[key]
        if key == "segment_metadata" and isinstance(value, dict):  # one line per segment, not one long line
            segments = [s for group in value.get("segmentAttributes", []) for s in group]
            lines.append(f"{key:<15} {len(segments)} coded segment(s)")
            lines.extend(f"{'':<15}   {s.get('labelID')}: {s.get('SegmentLabel', '')} "
                         f"({s.get('SegmentedPropertyTypeCodeSequence', {}).get('CodingSchemeDesignator')} "
                         f"{s.get('SegmentedPropertyTypeCodeSequence', {}).get('CodeValue')})"
                         for s in segments)
            continue
        lines.append(f"{key:<15} {json.dumps(value)}")
    if not d.published:
        lines.append(
            f"(the repository does not publish '{DESCRIPTION_PARAMETER}': dataset, labels and "
            "channel names are unknown)"
        )
    return "\n".join(lines)


def is_unavailable(exc: ClientError) -> bool:
    """True for the server's UNAVAILABLE answers (overloaded, model reloading, out of memory), Triton's
    not-running answers included (decided by :mod:`nnunet_triton.util.retry`)."""
    return is_retryable_error(exc)


def segment_with_retry(
    client: Any,
    image: Any,
    spacing: Any,
    options: Any = None,
    *,
    retries: int = 3,
    backoff_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    **overrides: Any,
) -> Any:
    """``client.segment(image, spacing, options, **overrides)`` retried up to ``retries`` times with
    exponential backoff on UNAVAILABLE only (``options``: a ``RequestOptions``, None for nnU-Net's)."""
    policy = RetryPolicy(retries=retries, backoff_s=backoff_s)
    return policy.call(lambda: client.segment(image, spacing, options, **overrides), sleep=sleep)
