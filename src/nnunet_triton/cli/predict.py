"""``nnunet-triton predict`` and ``info``: segment cases or DICOM series on a Triton ``nnunet`` endpoint.

    nnunet-triton predict -i IN -o OUT [--url HOST:PORT] [--protocol http|grpc] [--no-mirroring]
        [--tile-step-size 0.5] [-f 0 1] [--save-probabilities] [--continue-prediction]
        [--output-format nifti|nrrd|mha|dicom-seg|dicom-rtstruct|dicom-seg+rtstruct] [--concurrency N]
    nnunet-triton predict -i dicomweb://HOST/ROOT --study UID [--series UID] -o dicomweb://HOST/ROOT|OUT ...
        (DICOMweb: nnunet_triton.cli.dicomweb)
    nnunet-triton info [--url HOST:PORT] [--protocol http|grpc] [--json]

IN is an image file (its ``_0001``.. channel siblings are found), a folder of cases in nnU-Net naming
(``case_0000.nii.gz``, ``case_0001.nii.gz``), or a folder of DICOM files (one or many series, searched
recursively; one case per SeriesInstanceUID: ``nnunet_triton.client.jobs``). Flags mean what they mean for
``nnUNetv2_predict`` (the nnU-Net spellings ``--disable_tta``, ``-step_size``, ``--save_probabilities``,
``--continue_prediction`` work too). ``--concurrency N`` requests are in flight at once (default: the
deployed orchestrator instances + 1): worker threads read and send cases while the main thread writes
finished ones, so reading, sending and writing overlap with inference; the files are identical to a
sequential run. Outputs are written atomically; a failed case is reported at the end and the exit code is 2
(:mod:`nnunet_triton.exit_codes`; 3: no server at ``--url``).
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton.cli.common import (
    DeprecatedAlias,
    add_connection_arguments,
    add_endpoint_selection,
    add_model_repository_argument,
    add_request_option_arguments,
    connection_tls,
    endpoint_model,
    positive_int,
    request_options,
    say,
    url,
)
from nnunet_triton.cli.dicomweb import add_dicomweb_arguments, predict_over_dicomweb
from nnunet_triton.client import imageio
from nnunet_triton.client.dicom import volume as dicom
from nnunet_triton.client.dicom.uids import child_path
from nnunet_triton.client.dicom.web import is_dicomweb
from nnunet_triton.client.jobs import CASE_ERRORS, Job, collect_jobs
from nnunet_triton.errors import InputValidationError
from nnunet_triton.exit_codes import ExitCode

__all__ = ["add_parsers", "predict", "info", "default_concurrency"]

LOGGER = logging.getLogger(__name__)
# DICOM outputs: the objects each format writes (<case>.dcm: the SEG, <case>_rtstruct.dcm: the RTSTRUCT)
DICOM_FORMATS = {"dicom-seg": "seg", "dicom-rtstruct": "rtstruct", "dicom-seg+rtstruct": "both"}
RTSTRUCT_SUFFIX = "_rtstruct"
OUTPUT_FORMATS = (*imageio.OUTPUT_ENDINGS, *DICOM_FORMATS)


def add_parsers(sub: Any) -> None:
    """Mount ``predict`` and ``info`` on the ``nnunet-triton`` subparsers ``sub``."""
    predict_parser = sub.add_parser("predict", help="segment a file, a folder of cases or a DICOM folder")
    predict_parser.set_defaults(run=lambda args: predict(args))
    predict_parser.add_argument("-i", "--input", required=True,
                                help="file, case folder, DICOM folder or dicomweb://HOST[:PORT]/ROOT (with "
                                     "--study)")
    predict_parser.add_argument("-o", "--output", required=True,
                                help="output folder, or dicomweb://HOST[:PORT]/ROOT (STOW-RS of the "
                                     "DICOM-SEG)")
    add_request_option_arguments(predict_parser)
    predict_parser.add_argument("--save-probabilities", "--save_probabilities", action="store_true",
                                dest="probabilities",
                                help="also write <case>.npz (key 'probabilities') + .pkl")
    predict_parser.add_argument("--continue-prediction", "--continue_prediction", action="store_true",
                                dest="continue_prediction", help="skip cases whose outputs already exist")
    predict_parser.add_argument("--output-format", choices=OUTPUT_FORMATS, default="nifti")
    predict_parser.add_argument("--dataset-json", type=Path, default=None,
                                help="dataset.json naming the DICOM-SEG segments when the server does not "
                                     "publish labels")
    predict_parser.add_argument("--retries", type=int, default=3,
                                help="retries on UNAVAILABLE (with backoff)")
    predict_parser.add_argument("--concurrency", type=positive_int, default=None,
                                help="requests in flight (default: the deployed orchestrator instances + 1); "
                                     "outputs are identical to a sequential run")
    add_dicomweb_arguments(predict_parser)
    add_endpoint_selection(predict_parser)
    add_connection_arguments(predict_parser)
    info_parser = sub.add_parser("info", help="describe the served models: every endpoint, its versions, the "
                                              "server's thread and memory split")
    info_parser.set_defaults(run=lambda args: info(args))
    info_parser.add_argument("--json", action="store_true", help="print the description as JSON")
    info_parser.add_argument("--endpoint", dest="only", default=None,
                             help="describe only this endpoint (default: every endpoint served)")
    info_parser.add_argument("--model", dest="only", action=DeprecatedAlias, replacement="--endpoint",
                             help="deprecated spelling of --endpoint")
    add_model_repository_argument(info_parser, default=None,
                                  help="the served repository (default: the one the server of --home serves)")
    info_parser.add_argument("--home", default=None, help="server home of `nnunet-triton serve`")
    add_connection_arguments(info_parser)


def _outputs(out: Path, job: Job, args: argparse.Namespace) -> list[Path]:
    """The files of ``job`` in ``out``; a name that would leave ``out`` is refused (names of DICOM cases come
    from the data: :func:`~nnunet_triton.client.dicom.uids.child_path`)."""
    if args.output_format in DICOM_FORMATS:
        kind = DICOM_FORMATS[args.output_format]
        paths = ([child_path(out, f"{job.name}.dcm")] if kind != "rtstruct" else []) + (
            [child_path(out, f"{job.name}{RTSTRUCT_SUFFIX}.dcm")] if kind != "seg" else [])
    else:
        paths = [child_path(out, f"{job.name}{imageio.OUTPUT_ENDINGS[args.output_format]}")]
    if args.probabilities:
        paths.append(child_path(out, f"{job.name}.npz"))
    return paths


@dataclass(frozen=True)
class _Inferred:
    """A case read and segmented by a worker, waiting to be written by the main thread."""

    job: Job
    case: imageio.ImageCase | None = None
    volume: dicom.DicomVolume | None = None
    result: Any = None
    error: BaseException | None = None
    started: float = 0.0


def _infer(job: Job, client: Any, description: Any, args: argparse.Namespace) -> _Inferred:
    from nnunet_triton.client.endpoint import segment_with_retry

    started = time.perf_counter()
    case, volume = job.load()
    if description.num_channels > 0 and case.data.shape[0] != description.num_channels:
        raise InputValidationError(
            f"case {job.name!r} has {case.data.shape[0]} channel(s), the model expects "
            f"{description.num_channels}."
        )
    result = segment_with_retry(client, case.data, case.spacing, request_options(args), retries=args.retries)
    return _Inferred(job, case, volume, result, started=started)


def _write(done: _Inferred, description: Any, args: argparse.Namespace) -> None:
    job, case, result = done.job, done.case, done.result
    if args.probabilities:
        imageio.write_probabilities(result.probabilities, child_path(args.output, job.name),
                                    case.properties())
    if args.output_format in DICOM_FORMATS:
        from nnunet_triton.client.dicom.outputs import DicomOutput, write_dicom_outputs
        from nnunet_triton.client.dicom.seg import generic_segment_labels, model_segment_labels

        labels = model_segment_labels(description, args.dataset_json) or generic_segment_labels(
            result.segmentation)
        kind = DicomOutput(DICOM_FORMATS[args.output_format])
        paths = _outputs(args.output, job, args)
        write_dicom_outputs(result.segmentation, done.volume, labels, kind,
                            seg_path=paths[0] if kind.seg else None,
                            rtstruct_path=paths[1 if kind.seg else 0] if kind.rtstruct else None)
    else:
        imageio.write_segmentation(result.segmentation, _outputs(args.output, job, args)[0], case.geometry)


def default_concurrency(description: Any) -> int:
    """Requests kept in flight: one per orchestrator instance (each holds one request) plus one being
    read or written, so the server never waits for the client's disk."""
    return max(1, description.orchestrator_instances) + 1


def _worker(jobs: queue.Queue, done: queue.Queue, stop: threading.Event, client: Any,
            description: Any, args: argparse.Namespace) -> None:
    """Read and segment jobs until none is left; every outcome goes to ``done`` (the main thread writes)."""
    with client:
        while not stop.is_set():
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                done.put(_infer(job, client, description, args))
            except BaseException as exc:  # reported by the main thread; the other cases go on
                done.put(_Inferred(job, error=exc))


def _run_all(
    todo: list[Job], make_client: Callable[[], Any], description: Any, args: argparse.Namespace
) -> list[tuple[str, str]]:
    """Run every job with ``args.concurrency`` requests in flight; a failing case is recorded and the
    batch goes on. Workers (daemon threads, one client each) read and send; this thread writes every
    output (atomically), so a signal here never leaves a partial file."""
    from tqdm import tqdm

    jobs: queue.Queue = queue.Queue()
    for job in todo:
        jobs.put(job)
    workers = min(args.concurrency, len(todo))
    done: queue.Queue = queue.Queue(maxsize=max(1, workers))  # bounds the results held in memory
    stop = threading.Event()
    # clients are made here, so a failure to make one is raised here, not lost in a thread
    clients = [make_client() for _ in range(workers)]
    threads = [threading.Thread(target=_worker, args=(jobs, done, stop, client, description, args),
                                name=f"nnunet-triton-worker-{i}", daemon=True)
               for i, client in enumerate(clients)]
    for thread in threads:
        thread.start()
    failures: list[tuple[str, str]] = []
    bar = tqdm(total=len(todo), unit="case", desc="nnunet-triton", file=sys.stderr, disable=len(todo) < 2)
    try:
        for _ in range(len(todo)):
            item = done.get()
            try:
                if item.error is not None:
                    raise item.error
                _write(item, description, args)
            except CASE_ERRORS as exc:
                failures.append((item.job.name, str(exc)))
                bar.write(f"{item.job.name}: FAILED ({type(exc).__name__}): {exc}", file=sys.stderr)
            else:
                elapsed = time.perf_counter() - item.started
                bar.write(f"{item.job.name}: {elapsed:.1f} s (inference {item.result.elapsed_s:.1f} s)",
                          file=sys.stderr)
            bar.update()
    finally:
        stop.set()
        bar.close()
    return failures


def predict(args: argparse.Namespace) -> int:
    if is_dicomweb(args.input) or is_dicomweb(args.output) or args.study or args.series:
        from nnunet_triton.client.endpoint import describe_endpoint

        def describe() -> Any:
            return describe_endpoint(url(args), args.protocol, endpoint=endpoint_model(args),
                                     timeout_s=min(args.timeout, 60.0), tls=connection_tls(args))

        return predict_over_dicomweb(args, _predict_folders, describe)
    args.input, args.output = Path(args.input), Path(args.output)
    return _predict_folders(args)


def _predict_folders(args: argparse.Namespace) -> int:
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.client.endpoint import describe_endpoint

    jobs = collect_jobs(args.input)
    if args.output_format in DICOM_FORMATS and not all(j.is_dicom for j in jobs):
        raise InputValidationError(
            f"--output-format {args.output_format} needs DICOM input (it references the source series)."
        )
    args.output.mkdir(parents=True, exist_ok=True)
    for stale in imageio.remove_stale_partials(args.output):
        LOGGER.info("removed %s left by an interrupted run", stale.name)
    finished = [
        args.continue_prediction and all(p.is_file() for p in _outputs(args.output, j, args)) for j in jobs
    ]
    todo = [j for j, done in zip(jobs, finished, strict=True) if not done]
    model = endpoint_model(args)
    description = describe_endpoint(url(args), args.protocol, endpoint=model,
                                    timeout_s=min(args.timeout, 60.0), tls=connection_tls(args))
    if args.concurrency is None:
        args.concurrency = default_concurrency(description)

    def make_client() -> NnunetClient:
        return NnunetClient(url(args), protocol=args.protocol, timeout_s=args.timeout, endpoint=model,
                            tls=connection_tls(args))

    with make_client() as client:
        client.check_ready()

    failures = _run_all(todo, make_client, description, args)
    written, skipped, failed = len(todo) - len(failures), sum(finished), len(failures)
    say(f"{written} case(s) written to {args.output}, {skipped} skipped (done before), {failed} failed.")
    for name, message in failures:
        say(f"  failed {name}: {message}")
    return ExitCode.USAGE if failures else ExitCode.OK


def info(args: argparse.Namespace) -> int:
    """``nnunet-triton info``: every endpoint the server serves (dataset, configuration, channels, labels,
    folds, versions) and, for a server started here, how its threads and memory are split between them."""
    from dataclasses import asdict

    from nnunet_triton.client.endpoint import describe_endpoint, format_description

    server_url = url(args)
    local = _local_server(args.home, server_url)
    repository = args.model_repository or (Path(local.model_repository) if local is not None else None)
    registry = _registry(repository)
    names = [args.only] if args.only else (sorted(registry.endpoints) if registry is not None else
                                           _served_endpoints(server_url, local))
    descriptions = [describe_endpoint(server_url, args.protocol, endpoint=name,
                                      timeout_s=min(args.timeout, 60.0), tls=connection_tls(args))
                    for name in names]
    rows = _version_rows(repository, registry, server_url, local)
    split = _split(local, repository, registry)
    if args.json:
        endpoints = [{**asdict(d), "versions": [r for r in rows if r["endpoint"] == d.endpoint]}
                     for d in descriptions]
        say(json.dumps({"url": server_url, "model_repository": str(repository) if repository else None,
                        **split, "endpoints": endpoints}, indent=2, default=str), sys.stdout)
        return ExitCode.OK
    served = ", ".join(d.model_name for d in descriptions)
    lines = [f"{len(descriptions)} endpoint(s) on {server_url}: {served}"]
    lines += _split_lines(split)
    for d in descriptions:
        mine = [r for r in rows if r["endpoint"] == d.endpoint]
        lines += ["", f"--- {d.model_name}", format_description(d)]
        if mine:
            listed = ", ".join(f"{r['version']}{' (promoted)' if r['promoted'] else ''}"
                               f"{'' if r['loaded'] in (True, None) else ' (not loaded)'}" for r in mine)
            lines.append(f"{'versions':<15} {listed}; pinned: {d.endpoint}__v<N>")
    say("\n".join(lines), sys.stdout)
    return ExitCode.OK


def _local_server(home: str | None, server_url: str) -> Any:
    """The server ``nnunet-triton serve`` recorded in ``home`` when it runs at ``server_url``, else None."""
    from nnunet_triton.server.handle import recorded_server

    handle = recorded_server(home)
    urls = (handle.http_url, handle.grpc_url, handle.proxy_url) if handle is not None else ()
    if handle is None or not handle.is_running() or server_url not in urls:  # proxy_url: its TLS proxy
        return None
    return handle


def _registry(repository: Path | None) -> Any:
    from nnunet_triton.errors import RepositoryError
    from nnunet_triton.repository import ModelRepository

    if repository is None:
        return None
    try:
        return ModelRepository(repository).registry()
    except RepositoryError as exc:
        LOGGER.warning("%s", exc)
        return None


def _served_endpoints(server_url: str, local: Any) -> list[str]:
    """Public endpoints the server has loaded (Triton's repository index needs the model-control token: the
    local server's or ``$NNUNET_TRITON_CONTROL_TOKEN``); ``nnunet`` when the index cannot be read."""
    from nnunet_triton import io_names
    from nnunet_triton.errors import ServerError
    from nnunet_triton.server.model_control import ModelControl

    control = ModelControl(local.http_url, local.control_token) if local is not None else \
        ModelControl.from_env(server_url)
    if not control.token:
        return [io_names.ENDPOINT_MODEL]
    try:
        index = control.index()
    except (ServerError, ValueError):
        return [io_names.ENDPOINT_MODEL]
    names = sorted({m["name"] for m in index if m.get("state") == "READY"
                    and io_names.endpoint_of_model(m["name"]) == (m["name"], 0)})
    return names or [io_names.ENDPOINT_MODEL]


def _version_rows(repository: Path | None, registry: Any, server_url: str,
                  local: Any) -> list[dict[str, Any]]:
    if registry is None or repository is None:
        return []
    from nnunet_triton.server import rollout
    from nnunet_triton.server.model_control import ModelControl

    return rollout.versions(repository, ModelControl(local.http_url if local is not None else server_url))


def _split(local: Any, repository: Path | None, registry: Any) -> dict[str, Any]:
    """The thread budget the launcher chose and the memory plan of every endpoint version (a server started
    here; nothing otherwise)."""
    split: dict[str, Any] = {"thread_budget": local.thread_budget if local is not None else None,
                             "memory": None}
    if registry is None or repository is None:
        return split
    from nnunet_triton.errors import DeployError
    from nnunet_triton.server.deploy.repository_info import RepositoryInfo
    from nnunet_triton.server.deploy.sizing import VolumeSpec, plan_memory

    try:
        repo_info = RepositoryInfo.from_repository(repository)
        volume = VolumeSpec()
        plan = plan_memory(repo_info, volume)
    except DeployError as exc:
        LOGGER.warning("no memory plan: %s", exc)
        return split
    split["memory"] = {**plan.summary(), "volume": list(volume.shape),
                       "fold_models": {p.label: len(p.fold_models) * p.fold_instances
                                       for p in repo_info.pipelines}}
    return split


def _split_lines(split: dict[str, Any]) -> list[str]:
    lines = []
    budget = split.get("thread_budget")
    memory = split.get("memory")
    if budget:
        threads = budget.get("fold_threads") or f"nnU-Net's count (<= {budget.get('cpus')})"
        lines.append(f"{'threads':<15} {budget.get('cpus')} CPU(s) for {budget.get('fold_instances')} fold "
                     f"instance(s) of every endpoint: {threads} thread(s) per fold execution, "
                     f"{budget.get('fold_slots')} fold execution(s) at once, shared "
                     f"({budget.get('policy')}; exact: {budget.get('exact')})")
    if memory:
        lines.append(f"{'memory':<15} shm {memory['shm_mib']} MiB, host {memory['host_memory_mib']} MiB "
                     f"(upper bound for volumes up to {'x'.join(map(str, memory['volume']))}), of which:")
        for label, share in memory["per_endpoint_version"].items():
            folds = memory["fold_models"].get(label, 0)
            lines.append(f"{'':<15}   {label}: {folds} fold instance(s), shm {share['shm_mib']} MiB, stubs "
                         f"{share['stub_mib']} MiB, working {share['working_mib']} MiB")
            if "device_one_fold_mib" in share:
                lines.append(f"{'':<15}     GPU memory per orchestrator instance (fold accumulators): "
                             f"{share['device_all_folds_mib']} MiB with all folds at once, at least "
                             f"{share['device_one_fold_mib']} MiB (one fold at a time)")
    return lines
