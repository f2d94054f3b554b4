"""``nnunet-triton export`` (and ``python -m network_models.export``): export folds to TorchScript, checked
against the eager nnU-Net network, and write ``export_metadata.json``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from nnunet_triton.builder.torchscript import PRECISIONS, ExportOptions, export_folds
from nnunet_triton.cli import run_command
from nnunet_triton.cli.common import add_model_dir_argument
from nnunet_triton.errors import ExportError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.numerics.model_folder import CHECKPOINT_NAME, detect_folds, parse_fold
from nnunet_triton.util.durable import write_text_atomic

__all__ = ["add_parsers", "add_arguments", "run", "main"]

LOGGER = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    """Mount ``export`` on the ``nnunet-triton`` subparsers ``sub``."""
    parser = sub.add_parser("export", help="export folds to TorchScript (checked against the eager network)")
    parser.set_defaults(run=run)
    add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_dir_argument(parser, required=True, nargs="+",
                           help="nnU-Net results folder(s) (plans.json, dataset.json, fold_k/); several: "
                                "each goes to <out>/<folder name>/")
    parser.add_argument("--folds", nargs="+", type=parse_fold, default=None,
                        help="folds to export (default: every fold_k with a checkpoint)")
    parser.add_argument("--out", required=True, type=Path, help="output folder for fold_<k>.pt")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (fp16 needs cuda)")
    parser.add_argument("--checkpoint-name", default=CHECKPOINT_NAME)
    parser.add_argument("--tolerance", type=float, default=None,
                        help="relative tolerance (default: 0 on cpu fp32, 1e-3 cuda fp32, 1e-2 fp16)")


def main(argv: list[str] | None = None) -> int:
    """``python -m network_models.export``: export folds and write ``export_metadata.json`` next to them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Export what ``args`` ask for; 0 on success, else the exit code of the error (``cli.exit_code``),
    logged in one line."""
    return run_command(_export, args, logger=LOGGER)


def _export(args: argparse.Namespace) -> int:
    options = ExportOptions(precision=args.precision, device=args.device, tolerance=args.tolerance,
                            checkpoint_name=args.checkpoint_name)
    for model in args.model:
        out = args.out / model.name if len(args.model) > 1 else args.out
        folds = args.folds or detect_folds(model, args.checkpoint_name)
        if not folds:
            raise ExportError(f"{model} has no fold_<N>/{args.checkpoint_name}: not a trained nnU-Net "
                              "results folder.")
        results = export_folds(model, folds, out, options=options)
        write_text_atomic(out / "export_metadata.json",
                          json.dumps([r.to_dict() for r in results], indent=2, sort_keys=True))
    return ExitCode.OK

if __name__ == "__main__":
    sys.exit(main())
