"""``nnunet-triton validate``: does the endpoint answer what nnU-Net answers, on these cases?

    nnunet-triton validate --model-dir RESULTS_FOLDER -i CASES [--record DIR] [--url ...]
        [--min-dice 0.999 | --exact]
    nnunet-triton validate --against DIR -i CASES [--url ...]
    nnunet-triton validate --against DIR_OF_V1 --endpoint liver --endpoint-version 2 -i CASES   (a new version
        before it is promoted: its pinned endpoint liver__v2 against the answers recorded from version 1)
    nnunet-triton validate --detect-release --model-dir RESULTS_FOLDER -i IMAGES_TR   (no server: which
        nnU-Net release's numerics reproduce the folder's fold_<k>/validation/ predictions; docs/numerics.md)

With ``--model-dir`` every case goes through nnU-Net's own ``nnUNetPredictor`` here (CPU) and through the
endpoint, with the same folds (default: every deployed fold), step size and mirroring; ``--record DIR``
also stores the endpoint's answers as a reference set (only when every case passed). ``--against DIR``
compares with a reference set instead, without nnU-Net. The report (``validation.md``, ``.html``,
``.json``) goes to ``--report``. Exit code: 0 every case passed, 1 a case failed or the run was
interrupted, 2 refused (bad input, another model, other options).
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from nnunet_triton import __version__, io_names
from nnunet_triton.cli.common import (
    add_connection_arguments,
    add_endpoint_selection,
    add_model_dir_argument,
    add_request_option_arguments,
    connection_tls,
    endpoint_model,
    request_options,
    say,
    url,
)
from nnunet_triton.errors import InputValidationError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.numerics.releases import DEFAULT_NUMERICS
from nnunet_triton.validate.compare import segmentation_labels
from nnunet_triton.validate.references import IDENTITY_KEYS, RecordedReference, ReferenceWriter
from nnunet_triton.validate.report import write_report
from nnunet_triton.validate.run import (
    NnunetReference,
    Thresholds,
    ValidationResult,
    deployment_mismatch,
    run_validation,
)

__all__ = ["add_parsers", "validate"]

LOGGER = logging.getLogger("nnunet_triton.validate")


def add_parsers(sub: Any) -> None:
    """Mount ``validate`` on the ``nnunet-triton`` subparsers ``sub``."""
    p = sub.add_parser("validate", help="compare the endpoint with nnU-Net (or a recorded reference set)")
    p.set_defaults(run=lambda args: validate(args, url(args)))
    source = p.add_mutually_exclusive_group(required=True)
    add_model_dir_argument(source, help="the nnU-Net results folder the endpoint was built from")
    source.add_argument("--against", type=Path, help="a reference set recorded earlier (--record)")
    p.add_argument("-i", "--input", required=True, type=Path, help="file, case folder or DICOM folder")
    p.add_argument("--record", type=Path, default=None,
                   help="with --model-dir: store the endpoint's answers here")
    p.add_argument("--report", type=Path, default=Path("validation_report"), help="report folder")
    add_request_option_arguments(p, probabilities="also compare the probabilities")
    p.add_argument("--min-dice", type=float, default=0.999, help="per label (default 0.999)")
    p.add_argument("--exact", action="store_true", help="every voxel must be equal (the CPU path)")
    p.add_argument("--detect-release", action="store_true",
                   help="with --model-dir: no server; re-predict the folder's fold_<k>/validation/ cases "
                        "(their images in --input, e.g. imagesTr) under every nnU-Net release's numerics and "
                        "name the releases that reproduce them exactly (docs/numerics.md); report: --report")
    p.add_argument("--allow-model-change", action="store_true",
                   help="with --against: the endpoint may serve another training of the same labels (a new "
                        "version, other plans or trainer); the differences are listed in the report")
    add_endpoint_selection(p, model_aliases=False)
    add_connection_arguments(p)


def _versions(description: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"nnunet_triton": __version__, "triton_server": description.server_version}
    for package in ("nnunetv2", "torch", "numpy"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def _progress(jobs: list[Any]) -> Any:
    from tqdm import tqdm

    return tqdm(jobs, total=len(jobs), unit="case", file=sys.stderr, disable=None)


def validate(args: argparse.Namespace, server_url: str) -> int:
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.client.endpoint import describe_endpoint
    from nnunet_triton.client.jobs import collect_jobs

    if getattr(args, "detect_release", False):
        return _detect_release(args)
    if args.record is not None and args.model is None:
        raise InputValidationError("--record needs --model-dir: a reference set is recorded from a validated "
                                   "run.")
    thresholds = Thresholds(min_dice=args.min_dice, exact=args.exact)
    jobs = collect_jobs(args.input)
    if not jobs:
        raise InputValidationError(f"--input {args.input}: no cases found (nnU-Net naming or DICOM series).")
    model = endpoint_model(args)
    description = describe_endpoint(server_url, args.protocol, endpoint=model,
                                    timeout_s=min(args.timeout, 60.0), tls=connection_tls(args))
    published = dict(description.published)
    folds = tuple(args.folds or published.get("folds") or ()) or None
    options = request_options(args, folds=folds)
    identity = {k: published.get(k) for k in IDENTITY_KEYS}
    if args.against is not None:
        reference: Any = RecordedReference.open(args.against)
        changes = reference.check_compatible(identity, options.to_dict(),
                                             allow_model_change=args.allow_model_change)
        kind = f"reference set {args.against} (recorded {reference.manifest.get('created')})"
    else:
        from nnunet_triton.numerics.model_folder import read_model_folder

        changes = []
        config = read_model_folder(args.model, folds=folds)
        if io_names.COMBINE_MODEL in description.composing_models or config.previous_stage is not None:
            raise InputValidationError(
                "validate --model-dir compares with one nnU-Net configuration; the endpoint is an "
                "ensemble of "
                "configurations or a cascade, which validate does not reproduce yet.")
        mismatch = deployment_mismatch(published, config)
        if mismatch:
            raise InputValidationError(f"the server at {server_url} serves another model than --model-dir "
                                       f"{args.model} (" + "; ".join(mismatch) + ").")
        reference = NnunetReference(args.model, options, postprocessing=published.get("postprocessing"))
        kind = "nnU-Net (nnUNetPredictor, CPU)"
        if _numerics(published) != DEFAULT_NUMERICS:  # the installed nnU-Net is the reference
            LOGGER.warning("the endpoint reproduces nnU-Net %s's numerics (build --numerics) but the "
                           "reference is the installed nnU-Net %s: labels may differ where those releases "
                           "differ (docs/numerics.md)", _numerics(published), metadata.version("nnunetv2"))
            kind += f"; the endpoint reproduces nnU-Net {_numerics(published)}"
    versions = {**_versions(description), "reference_device": "cpu" if args.model else None}
    writer = ReferenceWriter(args.record, identity, options.to_dict(), versions) \
        if args.record is not None else None
    title = f"Validation of {published.get('dataset_name', 'the endpoint')} ({model}) at {server_url}"
    result = ValidationResult(title=title,
                              options=options, thresholds=thresholds, reference_kind=kind,
                              deployment={**identity, "url": server_url, "endpoint": model, **versions,
                                          "fold_forward": published.get("fold_forward", "unknown"),
                                          "numerics": _numerics(published),
                                          **({"model_changes": changes} if changes else {})},
                              total=len(jobs))
    with NnunetClient(server_url, protocol=args.protocol, timeout_s=args.timeout, endpoint=model,
                      tls=connection_tls(args)) as client:
        def segment(image: Any, spacing: Any) -> tuple[Any, Any]:
            answer = client.segment(image, spacing, options)
            return answer.segmentation, answer.probabilities

        labels = segmentation_labels(list((published.get("labels") or description.labels).items()),
                                     published.get("regions_class_order"))
        run_validation(_progress(jobs), segment, reference, labels, result,
                       num_channels=description.num_channels, record=writer.add if writer else None)
    written = write_report(result, args.report)
    _finish_record(writer, result)
    verdict = "PASS" if result.passed else ("INTERRUPTED" if result.interrupted else "FAIL")
    sys.stderr.write(f"{verdict}: {sum(c.passed for c in result.cases)} of {result.total} case(s) passed; "
                     f"report {written['validation.html']}\n")
    return ExitCode.OK if result.passed else ExitCode.CHECK_FAILED


def _finish_record(writer: ReferenceWriter | None, result: ValidationResult) -> None:
    if writer is None:
        return
    if result.passed:
        sys.stderr.write(f"reference set recorded: {writer.close()}\n")
    else:
        writer.discard()
        sys.stderr.write("reference set NOT recorded: not every case passed.\n")


def _numerics(published: dict) -> str:
    """The release arithmetic the endpoint reproduces (``build --numerics``; 2.8 before it was one)."""
    return str((published.get("numerics") or {}).get("numerics", DEFAULT_NUMERICS))


def _detect_release(args: argparse.Namespace) -> int:
    """``--detect-release``: 0 when some release's numerics reproduce every validation case, else 1."""
    from nnunet_triton.builder.fold_network import load_fold_network
    from nnunet_triton.util.durable import write_json_atomic
    from nnunet_triton.validate.release_detection import detect_release

    if args.model is None:
        raise InputValidationError("--detect-release needs --model-dir (the results folder whose "
                                   "fold_<k>/validation/ predictions to reproduce).")
    if not args.input.is_dir():
        raise InputValidationError(f"--input {args.input}: --detect-release needs the folder holding the "
                                   "validation cases' images (nnU-Net naming, e.g. imagesTr).")
    detection = detect_release(args.model, args.input,
                               load_network=lambda folder, fold: load_fold_network(folder, fold).network,
                               progress=lambda line: LOGGER.info("%s", line))
    args.report.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.report / "release_detection.json", detection.to_dict(), indent=2)
    say(detection.summary(), sys.stdout)
    return ExitCode.OK if detection.reproducing else ExitCode.CHECK_FAILED
