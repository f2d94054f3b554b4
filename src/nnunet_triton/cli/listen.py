"""``nnunet-triton listen`` (the DICOM node), ``requeue`` and ``node-status``.

    nnunet-triton listen --ae-title NNUNET --port 11112 --spool DIR --destination AET@HOST:PORT|dicomweb://...
        [--host 127.0.0.1] [--allow AET[@HOST[,HOST]] ...] [--accept-unknown-callers]
        [--tls-cert F --tls-key F [--tls-ca F] [--tls-require-client-cert]]
        [--idle-timeout 10] [--retry-window 3600] [--retries N] [--retry-delay 5] [--max-retry-delay 300]
        [--max-spool-bytes 50G] [--max-instance-bytes 1G] [--max-instances-per-series 5000]
        [--done-retention 24h] [--failed-retention 7d] [--modality CT] [--url HOST:PORT] ...
        [--endpoint NAME] [--routes FILE]
    nnunet-triton requeue --spool DIR [SERIES_UID ...]
    nnunet-triton node-status --spool DIR [--strict] [--max-age S]

Which model (endpoint) segments a series: without ``--routes`` every series goes to ``--endpoint``
(default ``nnunet``; ``--model`` is its deprecated spelling). ``--routes FILE`` (JSON,
:mod:`nnunet_triton.client.dicom.routing`) routes a series by the called AE title it was sent to (the node
also answers to those titles), else by the first rule its Modality/BodyPartExamined/SeriesDescription/...
match (``re.fullmatch``), else to the file's ``default`` (``--endpoint`` when the file
names none; ``null``: none, and such a series is set aside)::

    {"default": "nnunet",
     "called_ae_titles": {"NNUNET_LIVER": "liver", "NNUNET_LUNG": "lung"},
     "rules": [{"match": {"Modality": "CT", "BodyPartExamined": "LIVER|ABDOMEN"}, "model": "liver"}],
     "models": {"liver": {"version": 2, "modality": ["CT"], "dataset_json": "liver/dataset.json"}}}

Every model the routes name must be served: ``listen`` describes each at start and stops, naming the model,
when one is missing. ``--modality`` and ``--dataset-json`` are the default model's; the other models' are
in the file's ``models``.

``listen`` exits 0 on SIGTERM/Ctrl-C and 3 when the node cannot go on (its spool gone, its worker dead:
it is not running any more); ``node-status`` prints the node's status as JSON and exits 0 when it is
healthy (``ok``, or ``degraded`` without ``--strict``), 1 when it runs but is not (also when its worker has
been on one series for longer than ``--max-busy``), 3 when no node runs on the spool: a probe for systemd
or Kubernetes (``exec: nnunet-triton node-status --spool /var/spool/nnunet``).
See docs/clients.md, "Security of the DICOM node".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.cli.common import (
    DeprecatedAlias,
    add_connection_arguments,
    connection_tls,
    endpoint_name,
    url,
)
from nnunet_triton.cli.dicomweb import add_auth_arguments, add_modality_argument, auth_from_args
from nnunet_triton.errors import ClientError, InputValidationError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.options import RequestOptions
from nnunet_triton.util.defaults import field_default

__all__ = ["add_parsers", "listen", "run_spool_command", "parse_bytes", "parse_duration"]

LOGGER = logging.getLogger(__name__)
EXIT_FATAL = ExitCode.NOT_RUNNING  # the node stopped itself: it cannot go on
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_bytes(text: str) -> int:
    """``1048576``, ``512M``, ``50G`` (binary units) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"a size such as 1048576, 512M or 50G, got {text!r}")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``24h``, ``7d`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"a duration such as 90, 30m, 24h or 7d, got {text!r}")
    return float(match[1]) * _SECONDS[match[2]]


def add_parsers(sub: Any) -> None:
    """Mount ``listen``, ``requeue`` and ``node-status`` on the ``nnunet-triton`` subparsers ``sub``."""
    from nnunet_triton.client.dicom.access import AccessPolicy
    from nnunet_triton.client.dicom.spool import SpoolLimits

    def access_default(name: str) -> Any:
        return field_default(AccessPolicy, name)

    def spool_default(name: str) -> Any:
        return field_default(SpoolLimits, name)

    p = sub.add_parser("listen", help="a DICOM node: receive series (C-STORE), segment them, send the SEG on")
    p.set_defaults(run=lambda args: listen(args, url(args)))
    p.add_argument("--ae-title", default="NNUNET", help="this node's AE title (default NNUNET)")
    p.add_argument("--port", type=int, default=11112, help="DICOM port to listen on (11112)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback; 0.0.0.0 for the network, with --allow)")
    p.add_argument("--spool", type=Path, required=True, help="folder for received and unsent files")
    p.add_argument("--destination", required=True,
                   help="where SEGs go: AET@HOST:PORT (C-STORE) or dicomweb://HOST[:PORT]/ROOT")
    who = p.add_argument_group("who may store")
    who.add_argument("--allow", action="append", default=[], metavar="AET[@HOST[,HOST]]",
                     help="a sender: its AE title, optionally the hosts/networks it calls from (repeatable)")
    who.add_argument("--accept-unknown-callers", action="store_true",
                     help="accept calling AE titles not given with --allow (the default on loopback only)")
    associations = access_default("max_associations")
    who.add_argument("--max-associations", type=int, default=associations,
                     help=f"associations at once ({associations})")
    per_host = access_default("max_associations_per_host")
    who.add_argument("--max-associations-per-host", type=int, default=per_host,
                     help=f"connections from one host, counted from accept ({per_host})")
    who.add_argument("--max-busy", type=parse_duration, default=None,
                     help="seconds one series may be in progress (inference and sending) before the node "
                          "reports itself degraded, node-status exits 1 and new series are refused "
                          "(default 900)")
    request_timeout = access_default("association_request_timeout_s")
    who.add_argument("--association-request-timeout", type=parse_duration, default=request_timeout,
                     help=f"seconds from accept to a complete A-ASSOCIATE-RQ, TLS handshake included "
                          f"({request_timeout:g})")
    who.add_argument("--accept-all-storage", action="store_true",
                     help="accept every storage SOP class (default: image storage only)")
    who.add_argument("--accept-deflate", action="store_true",
                     help="accept Deflated Explicit VR Little Endian (inflated with --max-instance-bytes)")
    who.add_argument("--tls-cert", type=Path, default=None, help="DICOM TLS: the node's certificate (PEM)")
    who.add_argument("--tls-key", type=Path, default=None, help="DICOM TLS: its private key (PEM)")
    who.add_argument("--tls-ca", type=Path, default=None, help="DICOM TLS: CA bundle for client certificates")
    who.add_argument("--tls-require-client-cert", action="store_true",
                     help="DICOM TLS: refuse clients without a certificate signed by --tls-ca")
    limits = p.add_argument_group("limits and retention")
    limits.add_argument("--max-spool-bytes", type=parse_bytes, default=spool_default("max_spool_bytes"))
    limits.add_argument("--max-instance-bytes", type=parse_bytes, default=spool_default("max_instance_bytes"))
    limits.add_argument("--max-instances-per-series", type=int,
                        default=spool_default("max_instances_per_series"))
    done = spool_default("done_retention_s")
    limits.add_argument("--done-retention", type=parse_duration, default=done,
                        help=f"keep a sent series' instances this long, for late instances "
                             f"({done / 3600:g}h)")
    failed = spool_default("failed_retention_s")
    limits.add_argument("--failed-retention", type=parse_duration, default=failed,
                        help=f"keep failed series this long, then delete them ({failed / 86400:g}d)")
    timing = p.add_argument_group("completeness and retries")
    # the node's timings are NodeConfig's (client.dicom.node, not imported here: it loads pydicom); a flag
    # left out keeps the node's default
    timing.add_argument("--idle-timeout", type=parse_duration, default=None,
                        help="seconds without a new instance of the study after which a series is complete "
                             "(default 10)")
    timing.add_argument("--retry-window", type=parse_duration, default=None,
                        help="keep retrying a series this long after its first failure (default 1h)")
    timing.add_argument("--retries", type=int, default=None, help="at most this many retries (default: none)")
    timing.add_argument("--retry-delay", type=float, default=None,
                        help="first retry delay, doubling (default 5)")
    timing.add_argument("--max-retry-delay", type=float, default=None,
                        help="longest retry delay (default 300)")
    p.add_argument("--no-mirroring", "--disable-tta", action="store_false", dest="mirroring",
                   help="no test-time mirroring")
    p.add_argument("--output", choices=("seg", "rtstruct", "both"), default="seg",
                   help="the DICOM objects a segmented series becomes and is sent as: a DICOM-SEG, an "
                        "RTSTRUCT (one ROI per label, planar contours per slice) or both; per model: "
                        "\"output\" in the routes file's \"models\" (default seg)")
    p.add_argument("--dataset-json", type=Path, default=None,
                   help="dataset.json naming the default model's segments (when the server does not publish "
                        "labels)")
    routing = p.add_argument_group("which model (endpoint) segments a series")
    routing.add_argument("--endpoint", dest="model", type=endpoint_name, default=None, metavar="NAME",
                         help=f"the endpoint every series goes to (default {io_names.ENDPOINT_MODEL}); with "
                              "--routes, the default model when the file names none")
    routing.add_argument("--model", dest="model", type=endpoint_name, action=DeprecatedAlias,
                         replacement="--endpoint", metavar="NAME", help="deprecated spelling of --endpoint")
    routing.add_argument("--routes", type=Path, default=None, metavar="FILE",
                         help="JSON routes: called AE titles and rules on the series' attributes -> models "
                              "(docs/clients.md, 'Routing series to models')")
    add_modality_argument(p)
    add_auth_arguments(p)
    add_connection_arguments(p)
    requeue = sub.add_parser("requeue", help="move failed series of a node's spool back to incoming/")
    requeue.set_defaults(run=run_spool_command)
    requeue.add_argument("--spool", type=Path, required=True)
    requeue.add_argument("series", nargs="*", help="SeriesInstanceUIDs (default: every failed series)")
    status = sub.add_parser("node-status", help="the DICOM node's health (exit 0 healthy, 1 not, 3 no node "
                                                 "running on the spool)")
    status.set_defaults(run=run_spool_command)
    status.add_argument("--spool", type=Path, required=True)
    status.add_argument("--strict", action="store_true", help="'degraded' counts as unhealthy (readiness)")
    status.add_argument("--max-age", type=float, default=None, help="seconds a status may be old")


def run_spool_command(args: argparse.Namespace) -> int:
    """``requeue`` and ``node-status``."""
    from nnunet_triton.client.dicom.node import read_status, requeue
    from nnunet_triton.util.process import pid_alive

    if args.command == "requeue":
        if not (args.spool / "failed").is_dir():
            raise InputValidationError(f"{args.spool} is not a node spool (no failed/ folder).")
        moved = requeue(args.spool, args.series)
        sys.stderr.write(f"nnunet-triton: requeued {len(moved)} series\n")
        for uid in moved:
            sys.stdout.write(uid + "\n")
        return ExitCode.OK
    healthy, status = read_status(args.spool, max_age_s=args.max_age)
    if args.strict and status.get("state") == "degraded":
        healthy = False
    sys.stdout.write(json.dumps(status, indent=1, sort_keys=True) + "\n")
    if healthy:
        return ExitCode.OK
    pid = int(status.get("pid") or 0)  # none: the node never wrote a status
    return ExitCode.CHECK_FAILED if pid > 0 and pid_alive(pid) else ExitCode.NOT_RUNNING


def _redact_logs() -> None:
    """Route warnings through logging and mask patient data in every record of pydicom and friends."""
    from nnunet_triton.client.dicom.phi import RedactingFilter

    logging.captureWarnings(True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    logging.getLogger("pynetdicom").setLevel(logging.WARNING)  # its INFO/DEBUG output dumps datasets


def _access(args: argparse.Namespace) -> Any:
    from nnunet_triton.client.dicom.access import (
        DEFLATED,
        UNCOMPRESSED,
        AccessPolicy,
        TlsConfig,
        parse_peer,
    )

    storage: tuple[str, ...] | None = None
    if args.accept_all_storage:
        from pynetdicom.sop_class import _STORAGE_CLASSES

        storage = tuple(_STORAGE_CLASSES.values())
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise InputValidationError("DICOM TLS needs both --tls-cert and --tls-key.")
        tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_require_client_cert)
    extra = {"storage_classes": storage} if storage else {}
    return AccessPolicy(
        peers=tuple(parse_peer(p) for p in args.allow),
        accept_unknown=True if args.accept_unknown_callers else None, tls=tls,
        transfer_syntaxes=(*UNCOMPRESSED, DEFLATED) if args.accept_deflate else UNCOMPRESSED,
        max_associations=args.max_associations, max_associations_per_host=args.max_associations_per_host,
        association_request_timeout_s=args.association_request_timeout, **extra)


def _routes(args: argparse.Namespace) -> Any:
    """The node's routes: ``--routes FILE`` (checked here, before anything else), else all to
    ``--endpoint``."""
    from nnunet_triton.client.dicom.routing import Routes

    if args.routes is None:
        return Routes(default=args.model or io_names.ENDPOINT_MODEL, source="--endpoint")
    routes = Routes.load(args.routes, model=args.model)
    if routes.default is None and (args.modality or args.dataset_json):
        raise InputValidationError(
            f"--modality and --dataset-json are the default model's, and {routes.source} has none: set them "
            'per model in its "models" section.')
    return routes


def _node_models(args: argparse.Namespace, server_url: str, routes: Any) -> tuple[dict[str, Any], list[Any]]:
    """One :class:`~nnunet_triton.client.dicom.node.NodeModel` per model the routes name (its description
    asked of the server: a model it does not serve stops ``listen`` here, named), and their clients."""
    from nnunet_triton.client.client import NnunetClient, endpoint_model
    from nnunet_triton.client.dicom.modality import modality_rule
    from nnunet_triton.client.dicom.node import NodeModel
    from nnunet_triton.client.dicom.outputs import DicomOutput
    from nnunet_triton.client.endpoint import describe_endpoint

    options = RequestOptions(mirroring=args.mirroring)
    models: dict[str, Any] = {}
    clients: list[Any] = []
    try:
        for name in routes.models:
            settings = routes.settings_of(name)
            pinned = endpoint_model(name, settings.version)
            try:
                description = describe_endpoint(server_url, args.protocol, endpoint=pinned,
                                                timeout_s=min(args.timeout, 60.0), tls=connection_tls(args))
            except ClientError as exc:
                raise type(exc)(f"model {pinned!r} ({routes.where(name)}) cannot be used: {exc}",
                                status=exc.status) from None
            default = name == routes.default
            rule = modality_rule(description, settings.modality or (args.modality if default else None))
            if rule.allowed is None:
                LOGGER.warning("model %s: its channel names do not say which Modality it takes: every image "
                               "series routed to it is segmented (--modality CT, or \"modality\" in the "
                               "routes file's \"models\", restricts it)", name)
            if rule.channels > 1:
                LOGGER.warning("model %s takes %d channels and a DICOM series is one: every series routed to "
                               "it is refused", name, rule.channels)
            labels = _labels(description, settings.dataset_json or (args.dataset_json if default else None),
                             name)
            client = NnunetClient(server_url, protocol=args.protocol, timeout_s=args.timeout, endpoint=name,
                                  version=settings.version,  # one per model; the node has one worker
                                  tls=connection_tls(args))
            # the monitor's own client: it asks for readiness while the worker's may be inside a request
            probe = NnunetClient(server_url, protocol=args.protocol, timeout_s=min(args.timeout, 10.0),
                                 endpoint=name, version=settings.version, tls=connection_tls(args))
            clients.extend((client, probe))
            models[name] = NodeModel(_segmenter(client, options), labels or None, rule,
                                     ready=probe.check_ready,
                                     output=settings.output or DicomOutput(args.output))
    except BaseException:
        for client in clients:
            client.close()
        raise
    return models, clients


def _labels(description: Any, dataset_json: Path | None, name: str) -> Any:
    from nnunet_triton.client.dicom.seg import model_segment_labels

    try:
        return model_segment_labels(description, dataset_json)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputValidationError(f"dataset.json {dataset_json} of model {name}: cannot be read "
                                   f"({type(exc).__name__}: {exc}).") from None


def _segmenter(client: Any, options: RequestOptions) -> Any:
    from nnunet_triton.client.endpoint import segment_with_retry

    def segment(volume: Any) -> Any:
        case = volume.image_case()
        return segment_with_retry(client, case.data, case.spacing, options).segmentation

    return segment


def listen(args: argparse.Namespace, server_url: str) -> int:
    """Run the DICOM node until SIGTERM or Ctrl-C (0), or until it cannot go on (3)."""
    from nnunet_triton.client.dicom.node import DicomNode, NodeConfig, parse_destination
    from nnunet_triton.client.dicom.spool import SpoolLimits

    _redact_logs()
    routes = _routes(args)
    access = _access(args)
    access.check_listening(args.host)  # before anything is asked of the endpoint
    destination = parse_destination(args.destination, calling_ae=args.ae_title, auth=auth_from_args(args),
                                     allow_http=args.dicomweb_allow_http)
    models, clients = _node_models(args, server_url, routes)
    limits = SpoolLimits(max_spool_bytes=args.max_spool_bytes, max_instance_bytes=args.max_instance_bytes,
                         max_instances_per_series=args.max_instances_per_series,
                         done_retention_s=args.done_retention, failed_retention_s=args.failed_retention)
    # private by default: the spool holds patients' images and names; files 0600 and folders 0700 for as long
    # as the node runs (restored after, for a caller that runs the node inside a longer process)
    previous_umask = os.umask(0o077)
    try:
        timings = {name: value for name, value in (
            ("idle_timeout_s", args.idle_timeout), ("retry_delay_s", args.retry_delay),
            ("max_retry_delay_s", args.max_retry_delay), ("retry_window_s", args.retry_window),
            ("max_busy_s", args.max_busy)) if value is not None}  # left out: NodeConfig's default
        node = DicomNode(NodeConfig(
            ae_title=args.ae_title, port=args.port, host=args.host, spool=args.spool, destination=destination,
            routes=routes, models=models, retries=args.retries, access=access, limits=limits, **timings))
    except BaseException:
        os.umask(previous_umask)
        for client in clients:
            client.close()
        raise
    stopped = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    node.start()
    titles = "".join(f", {title} -> {model}" for title, model in routes.called_ae_titles.items())
    sys.stderr.write(f"nnunet-triton: listening as {args.ae_title}{titles} on {args.host}:{args.port}"
                     f"{' (TLS)' if access.tls else ''}, spool {args.spool}, sending to {args.destination}; "
                     f"models {', '.join(models)}\n")
    sys.stderr.flush()
    try:
        while not stopped.wait(0.5) and node.fatal is None:
            pass
    except KeyboardInterrupt:
        pass
    finally:
        node.stop()
        for client in clients:
            client.close()
        signal.signal(signal.SIGTERM, previous)
        os.umask(previous_umask)
    if node.fatal is not None:
        sys.stderr.write(f"nnunet-triton: the DICOM node stopped: {node.fatal}\n")
        return EXIT_FATAL
    return ExitCode.OK
