"""The image build's copy of ``server.preload``'s library (docker/Dockerfile, stage ``preload``).

    python3 -m nnunet_triton.server.deploy.image_preload /opt/nnunet_triton/lib/nnunet_triton_preload.so

Compiles the library with the build stage's ``cc`` (the same source and flags as the embedded launcher) and
writes it to the path given, mode 0755 (root's; the server preloads it). The serving stage copies only the
``.so``: the compiler stays out of the image. Exit status 1 with the reason when no library could be made,
so the image build fails instead of producing an image whose entry point refuses to start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_library", "main"]


def build_library(out: Path) -> Path:
    """Compile the preload library and place it at ``out`` (its folder made 0755); RuntimeError when the
    compiler is missing or fails."""
    from nnunet_triton.server import preload

    with tempfile.TemporaryDirectory(prefix="nnunet-preload-") as tmp:
        built = preload.library(tmp)
        if built is None:
            raise RuntimeError("the preload library could not be compiled (is gcc installed? the log above "
                               "says why)")
        out.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.{os.getpid()}")
        shutil.copyfile(built, partial)
        partial.chmod(0o755)
        partial.replace(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m nnunet_triton.server.deploy.image_preload",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the library goes in the image")
    args = parser.parse_args(argv)
    try:
        out = build_library(args.out)
    except (RuntimeError, OSError) as exc:
        sys.stderr.write(f"image preload: {exc}\n")
        return 1
    sys.stdout.write(f"image preload: {out} ({out.stat().st_size} bytes)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
