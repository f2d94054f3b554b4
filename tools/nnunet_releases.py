"""Old nnU-Net releases' own code, cached beside the venv: the oracles of ``--numerics`` (docs/numerics.md).

``python -m tools.nnunet_releases`` (``make nnunet-releases``, part of ``make setup``) downloads the PyPI
sdist of each release in :data:`RELEASES`, checks its sha256, and unpacks only its ``nnunetv2`` package into
``<cache>/<release>/nnunetv2``. Nothing is installed and nothing else is unpacked: a test puts
``<cache>/<release>`` first on ``PYTHONPATH`` of a subprocess, so that release's ``nnunetv2`` runs on this
venv's torch, NumPy, SciPy and nnU-Net's other dependencies (``tools.release_oracle`` runs it). The suite
needs no network after ``make setup``.

The cache is keyed by release and checksum: a release already unpacked is kept, a download is
hash-pinned (pip refuses an archive whose sha256 differs before it runs anything from it, and it is checked
again here), and an unpack goes to a temporary folder that is renamed into place last, under a lock, so an
interrupted or concurrent run leaves no half-unpacked release.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from nnunet_triton.util.hashing import sha256_file

__all__ = ["DEFAULT_CACHE", "RELEASES", "ensure_release", "release_path"]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = ROOT / ".venv-releases"
CACHE_ENV = "NNUNET_RELEASES_CACHE"

RELEASES: dict[str, str] = {  # release -> sha256 of its PyPI sdist (nnunetv2-<release>.tar.gz)
    "2.0": "5d23f869ce69bbbf9229a6651cfac12ebbd77578fdc7bda65d9c41a4ee75b4fd",
    "2.1": "af0accf305929f2583fa206c73ce68da25deabdccb8609c4586f3445b7decf6b",
    "2.2": "2c4e53b5e435207a8093df1825577ff783d793d1d07d24a34e8e1c0b69aebc2b",
    "2.2.1": "da132afe786daccf9f48bf2473454b6c414dee92c9ffc36e24d5d5689016759d",
    "2.3.1": "a77aef24dcd22ea6478bfe62d1523c861808f797130320aeb34cb9c12b89e354",
    "2.4.1": "e39a6ca2d0c179950921758b4fc710f15ed34cffd65808925708fa54709e50e0",
    "2.5.1": "8dca9e6b49a443ad144774245340ada0c6fe84007930c3ba4c4467e12c510cdc",
}


def cache_dir() -> Path:
    """``$NNUNET_RELEASES_CACHE`` or ``.venv-releases`` beside the checkout's ``.venv``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def release_path(release: str, cache: Path | None = None) -> Path:
    """The folder to put first on ``PYTHONPATH`` for ``release`` (it holds that release's ``nnunetv2``)."""
    if release not in RELEASES:
        raise ValueError(f"release must be one of {list(RELEASES)}, got {release!r}.")
    return (cache or cache_dir()) / release


def _download(release: str, into: Path) -> Path:
    # hash-pinned: pip checks the archive's sha256 before it reads anything from it (an sdist's metadata is
    # prepared by running its build backend)
    requirement = into / "requirement.txt"
    requirement.write_text(f"nnunetv2=={release} --hash=sha256:{RELEASES[release]}\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    "--require-hashes", "--dest", str(into), "-r", str(requirement)], check=True)
    found = sorted(into.glob(f"nnunetv2-{release}.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download nnunetv2=={release} wrote no nnunetv2-{release}.tar.gz in {into}.")
    return found[0]


def ensure_release(release: str, cache: Path | None = None) -> Path:
    """Unpack ``release``'s ``nnunetv2`` into the cache unless it is there; return :func:`release_path`.

    Concurrent runs take turns (a lock file in the cache), so none removes a tree another is reading."""
    import fcntl

    target = release_path(release, cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_locked(release, target)


def _ensure_locked(release: str, target: Path) -> Path:
    marker = target / ".sha256"
    if marker.is_file() and marker.read_text().strip() == RELEASES[release]:
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{release}-") as tmp:
        sdist = _download(release, Path(tmp))
        actual = sha256_file(sdist)
        if actual != RELEASES[release]:
            raise RuntimeError(f"nnunetv2-{release}.tar.gz has sha256 {actual}, expected "
                               f"{RELEASES[release]}; refusing it.")
        staged = Path(tmp) / "staged"
        prefix = f"nnunetv2-{release}/nnunetv2/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers()
                       if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            if not members:
                raise RuntimeError(f"nnunetv2-{release}.tar.gz holds no {prefix}.")
            archive.extractall(staged, members=members, filter="data")
        (staged / f"nnunetv2-{release}" / ".sha256").write_text(RELEASES[release] + "\n")
        if target.exists():  # a stale or partial tree: moved aside first, so the rename below is atomic
            target.rename(Path(tmp) / "stale")
        (staged / f"nnunetv2-{release}").rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", default=list(RELEASES), help="default: all")
    parser.add_argument("--cache", type=Path, default=None, help=f"default: ${CACHE_ENV} or {DEFAULT_CACHE}")
    args = parser.parse_args(argv)
    for release in args.releases:
        path = ensure_release(release, args.cache)
        print(f"nnunetv2 {release}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
