"""``make validate``: build MODEL's repository, serve it, validate INPUT against nnU-Net, stop.

    python -m tools.validate --model-dir RESULTS_FOLDER --input CASES [--folds 0 1] [--out build/validate]
        [-- validate options, e.g. --exact --disable-tta --record DIR]

The repository goes to ``<out>/model_repository`` (a no-op rebuild when up to date), the server starts on
free loopback ports (``nnunet_triton.server.embedded``), the report goes to ``<out>/report``; the server is
stopped also when something fails. The exit code is ``nnunet-triton validate``'s.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from nnunet_triton.numerics.model_folder import parse_fold

LOGGER = logging.getLogger("validate")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", "--model", dest="model", type=Path, required=True,
                   help="nnU-Net results folder")
    p.add_argument("--input", type=Path, required=True, help="cases (nnU-Net naming) or a DICOM folder")
    p.add_argument("--folds", nargs="+", type=parse_fold, default=None,
                   help="folds to serve and compare (default: all found)")
    p.add_argument("--out", type=Path, default=Path("build/validate"), help="repository and report folder")
    p.add_argument("validate_args", nargs=argparse.REMAINDER, help="-- options of nnunet-triton validate")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from nnunet_triton import cli
    from nnunet_triton.builder.repository import build_repository
    from nnunet_triton.errors import NnunetTritonError
    from nnunet_triton.server import embedded as embedded_server

    extra = args.validate_args[1:] if args.validate_args[:1] == ["--"] else args.validate_args
    try:
        built = build_repository(args.model, args.out / "model_repository", folds=args.folds)
        run = {name: args.out / name for name in ("tritonserver.log", "tritonserver.pid", "server.json")}
        with embedded_server.start(built.out, log_file=run["tritonserver.log"],
                                   pid_file=run["tritonserver.pid"], state_file=run["server.json"],
                                   ready_timeout_s=900) as server:
            return cli.main(["validate", "--url", server.http_url, "--model-dir", str(args.model), "-i",
                             str(args.input), "--report", str(args.out / "report"),
                             *(["-f", *map(str, args.folds)] if args.folds else []), *extra])
    except NnunetTritonError as exc:
        LOGGER.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
