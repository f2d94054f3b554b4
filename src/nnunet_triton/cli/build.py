"""``nnunet-triton build`` (and ``python -m repository.build``): build a Triton model repository from an
nnU-Net results folder (:mod:`nnunet_triton.builder.repository`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nnunet_triton.builder import torchscript as export
from nnunet_triton.builder.model_specs import BuildOptions, FoldRunner, Target
from nnunet_triton.builder.repository import VersionChoice, build_ensemble_repository, build_repository
from nnunet_triton.cli import run_command
from nnunet_triton.cli.common import (
    DeprecatedAlias,
    add_model_dir_argument,
    add_model_repository_argument,
    endpoint_name,
    endpoint_version,
)
from nnunet_triton.errors import PlansError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.io_names import ENDPOINT_MODEL
from nnunet_triton.numerics.model_folder import parse_fold, read_model_folder
from nnunet_triton.numerics.releases import DEFAULT_NUMERICS, numerics_names

__all__ = ["DEFAULT_OUT", "add_parsers", "add_arguments", "add_endpoint_arguments", "endpoint_choice", "run",
           "main"]

LOGGER = logging.getLogger(__name__)
DEFAULT_OUT = Path("build/model_repository")  # relative to the working directory, like the server home


def add_parsers(sub: Any) -> None:
    """Mount ``build`` on the ``nnunet-triton`` subparsers ``sub``."""
    p = sub.add_parser("build", help="build an nnU-Net model into a Triton model repository (one endpoint "
                                     "name and version; other names and versions stay as they are)")
    p.set_defaults(run=run)
    add_arguments(p)


def add_endpoint_arguments(p: Any) -> None:
    """``--endpoint``, ``--new-version`` | ``--endpoint-version N``, ``--promote``: the endpoint version a
    build writes (``--name`` / ``--version``: deprecated spellings, accepted with a warning)."""
    p.add_argument("--endpoint", type=endpoint_name, default=ENDPOINT_MODEL, dest="name",
                   help=f"endpoint name (default {ENDPOINT_MODEL}); other names in the repository are left "
                        "as they are")
    p.add_argument("--name", type=endpoint_name, dest="name", action=DeprecatedAlias,
                   replacement="--endpoint", help="deprecated spelling of --endpoint")
    versions = p.add_mutually_exclusive_group()
    versions.add_argument("--new-version", action="store_true",
                          help="add the next version of --endpoint; the public endpoint keeps its promoted "
                               "version (call the new one as <name>__v<N>; `nnunet-triton promote` switches)")
    versions.add_argument("--endpoint-version", type=endpoint_version, default=None, dest="endpoint_version",
                          help="build exactly this version (default: the name's latest, or 1)")
    versions.add_argument("--version", type=endpoint_version, dest="endpoint_version", action=DeprecatedAlias,
                          replacement="--endpoint-version", help="deprecated spelling of --endpoint-version")
    p.add_argument("--promote", action="store_true",
                   help="the public endpoint runs the version built (on a running server: nnunet-triton "
                        "promote)")


def endpoint_choice(args: argparse.Namespace) -> VersionChoice:
    """The :class:`VersionChoice` the flags of :func:`add_endpoint_arguments` ask for."""
    return VersionChoice(name=args.name, version=args.endpoint_version, new_version=args.new_version,
                         promote=args.promote)


def add_arguments(p: Any, *, model_required: bool = True, out: bool = True) -> None:
    """The builder's flags (``--model-dir``, ``--model-repository``, ``--target``, ...) on a parser or
    argument group (``--out``: the deprecated spelling of ``--model-repository``); ``serve`` has its own
    ``--model-repository`` (``out=False``)."""
    if model_required:
        add_model_dir_argument(p, required=True, nargs="+",
                               help="results folder with plans.json, dataset.json and "
                                    "fold_<k>/checkpoint_final.pth; "
                            "two or more folders build an ensemble of configurations (nnUNetv2_ensemble)")
    p.add_argument("--configuration", nargs="+", default=None,
                   help="check that the checkpoints use this configuration (one per --model-dir, or one "
                        "for all)")
    p.add_argument("--folds", nargs="+", type=parse_fold, default=None, help="default: all fold_<k> found")
    if out:
        add_model_repository_argument(p, old="--out", default=DEFAULT_OUT,
                                      help=f"the model repository to write into (default {DEFAULT_OUT}, "
                                           "relative to the working directory)")
    add_endpoint_arguments(p)
    p.add_argument("--target", choices=[t.value for t in Target], default=Target.CPU.value)
    p.add_argument("--tile-batch-size", type=int, default=BuildOptions.tile_batch_size,
                   help="tiles per fold request = fold models' max_batch_size")
    p.add_argument("--fold-runner", choices=[r.value for r in FoldRunner], default=None,
                   help="default: python on cpu, libtorch on gpu (on cpu: needs `nnunet-triton "
                        "install-backend pytorch`; a checkout: `make triton-backends`)")
    p.add_argument("--precision", choices=export.PRECISIONS, default="fp32", help="fold networks (fp16: gpu)")
    p.add_argument("--export-device", default=None, help="device to trace on (default cpu; cuda for fp16)")
    p.add_argument("--torch-threads", type=int, default=0, help="Python runner threads (0: torch default)")
    p.add_argument("--per-sample-forward", choices=("true", "false"), default=None,
                   help="one batch-1 forward per tile like nnU-Net (bit-identical on CPU; libtorch folds "
                        "then take one tile per request); false: one forward per dynamic batch, faster, "
                        "labelled 'batched' in info and validate; default true on cpu, false on gpu")
    p.add_argument("--serving-torch", default=None, metavar="X.Y",
                   help="torch/libtorch major.minor that loads the fold models where they are served "
                        "(default: 2.14, tritonserver 26.09's libtorch, for the libtorch runner on gpu; the "
                        "serving environment's torch otherwise: the embedded server's PyTorch backend is "
                        "built against it); a newer torch here refuses to export")
    p.add_argument("--numerics", choices=numerics_names(), default=DEFAULT_NUMERICS,
                   help="the nnU-Net release whose inference arithmetic to reproduce (default "
                        f"{DEFAULT_NUMERICS}: nnU-Net 2.6 to 2.8.1; docs/numerics.md lists what each "
                        "changes); "
                        "releases with an upstream bug (2.0, 2.1, 2.2, 2.2.1) are served as asked, with a "
                        "warning naming it")
    p.add_argument("--fold-instances", type=int, default=1)
    p.add_argument("--orchestrator-instances", type=int, default=None,
                   help="requests worked on at once (the expected concurrency; default 1 on cpu, 2 on gpu); "
                        "the fold models take batches of tile-batch-size x this, so tiles of concurrent "
                        "requests share forwards")
    p.add_argument("--max-inflight", type=int, default=BuildOptions.max_inflight)
    p.add_argument("--max-voxels", type=int, default=BuildOptions.max_voxels,
                   help="most voxels an IMAGE, the volume it resamples to, and any volume a direct request "
                        "to orchestrator_model or stitch_model carries or declares may have; larger requests "
                        "get INVALID_ARG (0: no limit; default 2**28 = 512x512x1024)")
    p.add_argument("--max-request-bytes", type=int, default=BuildOptions.max_request_bytes,
                   help="most bytes a request's float32 logits (preprocessed geometry) or probabilities "
                        "(original geometry) may take; larger requests get INVALID_ARG before anything is "
                        "allocated (0: no budget; default 8 GiB)")
    p.add_argument("--postprocessing", default="auto",
                   help="nnU-Net postprocessing.pkl to apply: 'auto' (<model>/crossval_results_folds_<folds>/"
                        "postprocessing.pkl if present), 'none', or a path")
    p.add_argument("--no-metrics", action="store_true",
                   help="no custom nnunet_* metrics in the Python models")
    p.add_argument("--previous-stage-model", type=Path, default=None,
                   help="cascade: the previous stage's results folder (default: nnU-Net's sibling folder)")
    p.add_argument("--seg-metadata", type=Path, default=None, metavar="FILE",
                   help="dcmqi segment metadata JSON (segmentAttributes: per labelID its coded category, "
                        "type, label text and colour; docs/clients.md), checked against the model's "
                        "labels and published with this endpoint version for its DICOM-SEG and RTSTRUCT; "
                        "default: private codes, no colours")
    p.add_argument("--folds-only", action="store_true", help="only the fold models")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")


def _configurations(models: Sequence[Path], given: Sequence[str] | None) -> list[str | None]:
    """``--configuration`` per model; with several models each is checked against its checkpoints here."""
    if not given:
        return [None] * len(models)
    if len(given) not in (1, len(models)):
        raise PlansError(
            f"--configuration takes one value or one per --model-dir ({len(models)}), got {list(given)}.")
    wanted = list(given) * len(models) if len(given) == 1 else list(given)
    if len(models) > 1:
        for model, configuration in zip(models, wanted, strict=True):
            found = read_model_folder(model).configuration
            if found != configuration:
                raise PlansError(f"--configuration {configuration!r} does not match the configuration "
                                 f"{found!r} the checkpoints in {str(model)!r} were trained with.")
    return wanted


def main(argv: list[str] | None = None) -> int:
    """``python -m repository.build``; returns 0 on success (built or up to date), 2 on a reported error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Build what ``args`` ask for; 0 on success (built or up to date), else the exit code of the error
    (``cli.exit_code``), logged in one line."""
    return run_command(_build, args, logger=LOGGER)


def _build(args: argparse.Namespace) -> int:
    options = BuildOptions(
        target=Target(args.target), tile_batch_size=args.tile_batch_size, fold_runner=args.fold_runner,
        fold_precision=args.precision, torch_threads=args.torch_threads,
        per_sample_forward=None if args.per_sample_forward is None else args.per_sample_forward == "true",
        fold_instances=args.fold_instances,
        orchestrator_instances=args.orchestrator_instances, max_inflight=args.max_inflight,
        max_voxels=args.max_voxels, max_request_bytes=args.max_request_bytes, metrics=not args.no_metrics,
        serving_torch=args.serving_torch, numerics=args.numerics,
    )
    configurations = _configurations(args.model, args.configuration)
    endpoint = endpoint_choice(args)
    if len(args.model) > 1:
        pp = None if args.postprocessing == "auto" else args.postprocessing
        result = build_ensemble_repository(args.model, args.model_repository, options=options,
                                           folds=args.folds, force=args.force,
                                           export_device=args.export_device,
                                           postprocessing=pp, endpoint=endpoint,
                                           seg_metadata=args.seg_metadata)
    else:
        result = build_repository(args.model[0], args.model_repository, options=options, folds=args.folds,
                                  configuration=configurations[0], force=args.force,
                                  folds_only=args.folds_only, export_device=args.export_device,
                                  postprocessing=args.postprocessing,
                                  previous_stage_model=args.previous_stage_model, endpoint=endpoint,
                                  seg_metadata=args.seg_metadata)
    sys.stdout.write(result.summary() + "\n")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
