"""``nnunet-triton install-backend pytorch [--source DIR] [--out DIR]``: build Triton's PyTorch backend.

Builds ``libtriton_pytorch.so`` for the embedded tritonserver against this environment's libtorch
(``server.backend_build``; cached, so a second call returns at once) into ``build/triton-backends``, where
``serve`` and ``deploy`` find it. ``make triton-backends`` runs this.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nnunet_triton.cli.common import say
from nnunet_triton.exit_codes import ExitCode

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    """Mount ``install-backend`` on the ``nnunet-triton`` subparsers ``sub``."""
    from nnunet_triton.server.backend_build import DEFAULT_OUT, SOURCE_ENV

    p = sub.add_parser("install-backend", help="build Triton's PyTorch backend for the embedded server "
                                               "(libtorch fold models)")
    p.set_defaults(run=_run)
    p.add_argument("backend", choices=("pytorch",))
    p.add_argument("--source", type=Path, default=None,
                   help=f"folder with the r24.10 trees pytorch_backend, backend, core, common (default: "
                        f"${SOURCE_ENV}, else shared/triton-src beside this checkout or an ancestor)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the CPUs)")


def _run(args: argparse.Namespace) -> int:
    from nnunet_triton.server.backend_build import build_pytorch_backend

    built = build_pytorch_backend(args.source, args.out, jobs=args.jobs)
    say(f"{'built' if built.compiled else 'cached'} {built.library} in {built.seconds:.0f} s "
        f"(key {built.key}); serve and deploy find it under {args.out}")
    return ExitCode.OK
