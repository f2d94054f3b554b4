"""The DICOMweb side of ``nnunet-triton predict``: a study from a PACS in, DICOM-SEGs back by STOW-RS.

    nnunet-triton predict -i dicomweb://HOST[:PORT]/ROOT --study UID [--series UID] [--modality CT]
        -o dicomweb://HOST[:PORT]/ROOT | OUT_FOLDER [--dicomweb-user U] [--dicomweb-password-file F]
        [--dicomweb-token-file F] [--dicomweb-ca FILE] [--dicomweb-allow-http] ...

Secrets come from files (``--dicomweb-password-file``, ``--dicomweb-token-file``) or the environment
(``NNUNET_TRITON_DICOMWEB_PASSWORD`` / ``_TOKEN``), never from the command line (``--dicomweb-password``
is refused with a message saying so); they are never logged. Plain http (``dicomweb://``) is refused for
hosts other than loopback unless ``--dicomweb-allow-http``. The study's series are chosen from their
metadata (the model's Modality, image series only) and fetched into a temporary folder, then segmented
as a DICOM folder; with ``-o dicomweb://`` the DICOM-SEGs are written to a local folder first and stored
by STOW-RS; a SEG that could not be stored stays there and its path is printed. The DICOM node
(``nnunet-triton listen``) is :mod:`nnunet_triton.cli.listen`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from nnunet_triton.client.dicom.uids import require_uid
from nnunet_triton.client.dicom.web import (
    DicomWebAuth,
    DicomWebLocation,
    fetch_study,
    is_dicomweb,
    store_files,
)
from nnunet_triton.errors import InputValidationError, PacsError
from nnunet_triton.exit_codes import ExitCode

__all__ = ["add_dicomweb_arguments", "add_auth_arguments", "auth_from_args", "predict_over_dicomweb"]

LOGGER = logging.getLogger(__name__)

def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dicomweb-user", default=None,
                        help="HTTP basic user ($NNUNET_TRITON_DICOMWEB_USER)")
    parser.add_argument("--dicomweb-password-file", default=None, type=Path,
                        help="file holding the HTTP basic password (else $NNUNET_TRITON_DICOMWEB_PASSWORD)")
    parser.add_argument("--dicomweb-token-file", default=None, type=Path,
                        help="file holding a bearer token (else $NNUNET_TRITON_DICOMWEB_TOKEN)")
    parser.add_argument("--dicomweb-ca", default=None, type=Path,
                        help="CA bundle for https (dicomwebs://) ($NNUNET_TRITON_DICOMWEB_CA)")
    parser.add_argument("--dicomweb-allow-http", action="store_true",
                        help="allow plain http (dicomweb://) to a host other than loopback (unencrypted)")
    # secrets on a command line are visible to every user (ps) and kept in shell histories: refused
    for flag in ("--dicomweb-password", "--dicomweb-token"):
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS)


def add_dicomweb_arguments(parser: argparse.ArgumentParser) -> None:
    """``--study``/``--series``, ``--modality`` and the DICOMweb authentication flags."""
    parser.add_argument("--study", default=None, help="StudyInstanceUID to fetch with -i dicomweb://...")
    parser.add_argument("--series", default=None, help="only this SeriesInstanceUID of --study")
    add_modality_argument(parser)
    add_auth_arguments(parser)


def add_modality_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modality", nargs="+", default=None,
                        help="DICOM Modality values the model takes (default: from the model's channel "
                             "names, e.g. CT for a CT channel)")


def auth_from_args(args: argparse.Namespace) -> DicomWebAuth:
    """The DICOMweb credentials of the flags and the environment; a secret on the command line is refused."""
    for flag in ("dicomweb_password", "dicomweb_token"):
        if getattr(args, flag, None):
            name = flag.split("_", 1)[1]
            raise InputValidationError(
                f"--dicomweb-{name} on the command line is visible to every user of this machine and kept "
                f"in shell histories; use $NNUNET_TRITON_DICOMWEB_{name.upper()} or --dicomweb-{name}-file.")
    return DicomWebAuth.from_env(user=args.dicomweb_user, password_file=args.dicomweb_password_file,
                                 token_file=args.dicomweb_token_file, ca_file=args.dicomweb_ca)


def _location(text: str, args: argparse.Namespace, auth: DicomWebAuth) -> DicomWebLocation:
    return DicomWebLocation.parse(text, auth, allow_http=args.dicomweb_allow_http)


def predict_over_dicomweb(args: argparse.Namespace, run_predict: Any, describe: Any = None) -> int:
    """``predict`` with a DICOMweb source and/or destination around the folder-based ``run_predict``;
    ``describe()`` returns the endpoint's description (the model's channels choose the series to fetch)."""
    from nnunet_triton.client.dicom.modality import modality_rule

    auth = auth_from_args(args)
    source = str(args.input)
    destination = str(args.output)
    if is_dicomweb(destination):
        if args.output_format == "nifti":  # the default, not asked for: the SEG
            args.output_format = "dicom-seg"
        if not args.output_format.startswith("dicom-"):
            raise InputValidationError(
                "-o dicomweb://... stores DICOM objects; --output-format must be dicom-seg, dicom-rtstruct "
                "or dicom-seg+rtstruct.")
    # both locations are checked (scheme, plain http, UIDs) before anything is asked of a server
    target = _location(destination, args, auth) if is_dicomweb(destination) else None
    origin = _location(source, args, auth) if is_dicomweb(source) else None
    if origin is not None:
        if not args.study:
            raise InputValidationError("-i dicomweb://... needs --study StudyInstanceUID.")
        require_uid(args.study, what="--study (StudyInstanceUID)")
        if args.series is not None:
            require_uid(args.series, what="--series (SeriesInstanceUID)")
    with tempfile.TemporaryDirectory(prefix="nnunet-triton-dicomweb-") as work:
        if origin is not None:
            rule = modality_rule(describe() if describe is not None else None, args.modality)
            if rule.allowed is None:
                LOGGER.warning("the model's channel names do not say which Modality it takes; every image "
                               "series of the study is fetched (--modality CT restricts it)")
            fetch_study(origin, args.study, Path(work) / "study", series_uid=args.series, rule=rule)
            _check_eligible(Path(work) / "study", args.study)
            args.input = Path(work) / "study"
        elif args.study or args.series:
            raise InputValidationError("--study/--series select what to fetch from a dicomweb:// input.")
        else:
            args.input = Path(source)
        if target is None:
            args.output = Path(destination)
            return run_predict(args)
        args.output = Path(tempfile.mkdtemp(prefix="nnunet-triton-seg-"))
        code = run_predict(args)
        return max(code, _store_all(target, args.output))


def _check_eligible(folder: Path, study_uid: str) -> None:
    from nnunet_triton.client.dicom.files import scan_folder

    scan = scan_folder(folder)
    if not scan.series:
        reasons = sorted({reason for _, reason in scan.skipped})
        raise PacsError(f"study {study_uid}: no eligible image series ({len(scan.skipped)} instance(s): "
                        f"{'; '.join(reasons)}).")


def _store_all(location: DicomWebLocation, folder: Path) -> int:
    failed = 0
    for path in sorted(folder.glob("*.dcm")):
        rtstruct = path.stem.endswith("_rtstruct")  # predict's <series>_rtstruct.dcm beside <series>.dcm
        kind, series = ("RTSTRUCT", path.stem.removesuffix("_rtstruct")) if rtstruct else ("SEG", path.stem)
        try:
            store_files(location, [path], what=f"the {'DICOM-' * (not rtstruct)}{kind} of series {series}")
        except PacsError as exc:
            failed += 1
            sys.stderr.write(f"nnunet-triton: {exc} The {kind} is kept in {path}.\n")
        else:
            path.unlink()
    if failed == 0:
        for leftover in folder.iterdir():  # probabilities (.npz/.pkl) have no DICOMweb home
            sys.stderr.write(f"nnunet-triton: kept {leftover} (not a DICOM-SEG or RTSTRUCT)\n")
        if not any(folder.iterdir()):
            folder.rmdir()
    return ExitCode.USAGE if failed else ExitCode.OK
