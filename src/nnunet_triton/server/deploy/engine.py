"""A container engine and the cpu image's inputs here: which engine works, the base image, a wheel directory.

Used by ``nnunet-triton deploy --target docker|k8s``. This module only looks: :func:`require_engine` and
:func:`require_image` raise :class:`DeployError` saying how to get what is missing (console commands: install
Docker or podman; a checkout's ``python -m tools.container_host`` provisions a Debian host as root: podman
with apt, its host configuration, the debootstrapped base image). It makes only what the image build
reads from the source tree:

* :func:`fill_wheels` makes every wheel the cpu image installs (pip wheel) (requirements/image-cpu.txt and
  requirements/export.txt) with this machine's pip configuration into ``build/containers/wheels-cpu`` (the
  torch CPU build comes from local disk here), once per content of those files; docker/Dockerfile gets it as
  the named build context ``wheels`` and installs offline.

The image recipe (``docker/Dockerfile``, ``requirements/``, the package's ``src/``) is the project's source
tree: :func:`source_root` finds it (``$NNUNET_TRITON_SOURCE``, else the working directory or a folder above
it); a pip-installed package without that tree deploys ``--target embedded`` only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from nnunet_triton.errors import DeployError
from nnunet_triton.util.durable import write_text_atomic

SOURCE_ENV = "NNUNET_TRITON_SOURCE"
LOCAL_BASE_IMAGE = "localhost/debian:bookworm"
REQUIREMENT_FILES = ("requirements/image-cpu.txt", "requirements/export.txt")  # in the source tree
GET_ENGINE = ("install Docker Engine (https://docs.docker.com/engine/install/) or podman (`apt-get install "
              "podman`); on a Debian host, as root, a checkout of the project provisions podman with "
              "`python -m tools.container_host`")
GET_BASE_IMAGE = ("make it with `python -m tools.container_host` (as root, in a checkout of the project: "
                  "debootstrap + podman import), or pass `--base-image debian:bookworm` where a registry "
                  "is reachable")


def source_root(start: Path | None = None, env: dict[str, str] | None = None) -> Path:
    """The project's source tree holding the image recipe: ``$NNUNET_TRITON_SOURCE``, else ``start`` (the
    working directory) or the nearest folder above it with ``docker/Dockerfile`` and ``pyproject.toml``.

    Raises:
        DeployError: no such tree (a pip-installed package: build images from a checkout of the project).
    """
    env = dict(os.environ) if env is None else env
    if env.get(SOURCE_ENV):
        root = Path(env[SOURCE_ENV])
        if not (root / "docker" / "Dockerfile").is_file():
            raise DeployError(f"${SOURCE_ENV}={root} has no docker/Dockerfile (the project's image recipe).")
        return root
    here = (start or Path.cwd()).absolute()
    for folder in (here, *here.parents):
        if (folder / "docker" / "Dockerfile").is_file() and (folder / "pyproject.toml").is_file():
            return folder
    raise DeployError(f"no image recipe (docker/Dockerfile of the nnunet_triton source tree) in {here} or "
                      f"above; run from a checkout of the project or set ${SOURCE_ENV} (--target embedded "
                      "needs none).")


def state_dir() -> Path:
    """Where the cpu image's inputs are kept between runs: ``build/containers`` of the source tree."""
    return source_root() / "build" / "containers"


def _run(argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def engine_works(engine: str) -> bool:
    """``engine info`` answers (docker: a daemon is reachable; podman: the store and runtime are usable)."""
    if shutil.which(engine) is None:
        return False
    try:
        return _run([engine, "info"], timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_engine(preferred: str = "auto") -> str | None:
    """``docker`` when its daemon answers, else ``podman`` when it works (``preferred`` forces one)."""
    candidates = ("docker", "podman") if preferred == "auto" else (preferred,)
    return next((engine for engine in candidates if engine_works(engine)), None)


def require_engine(preferred: str = "auto", *, why: str = "") -> str:
    """The engine :func:`find_engine` finds.

    Raises:
        DeployError: none works here; the message says how to get one.
    """
    found = find_engine(preferred)
    if found is None:
        asked = "docker or podman" if preferred == "auto" else preferred
        raise DeployError(f"{why or 'this'} needs a working container engine ({asked}); none answers here "
                          f"(docker: is the daemon running? podman: `podman info`): {GET_ENGINE}.")
    return found


def image_exists(engine: str, ref: str) -> bool:
    return _run([engine, "image", "exists" if engine == "podman" else "inspect", ref]).returncode == 0


def require_image(engine: str, ref: str) -> None:
    """Raises DeployError when ``engine`` lacks the image ``ref`` (the local base image: how to make it)."""
    if not image_exists(engine, ref):
        how = GET_BASE_IMAGE if ref == LOCAL_BASE_IMAGE else f"`{engine} pull {ref}` or pass --base-image"
        raise DeployError(f"the base image {ref} is not in {engine}'s store: {how}.")


def _requirements() -> tuple[Path, ...]:
    root = source_root()
    return tuple(root / name for name in REQUIREMENT_FILES)


def _requirements_key() -> str:
    digest = hashlib.sha256()
    for path in _requirements():
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fill_wheels(directory: Path | None = None) -> Path:
    """Every wheel of the cpu image's requirement files in ``directory`` (default
    ``build/containers/wheels-cpu`` of the source tree; made once per their content)."""
    directory = directory or state_dir() / "wheels-cpu"
    stamp = directory / ".requirements.sha256"
    key = _requirements_key()
    if stamp.is_file() and stamp.read_text() == key:
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    staging = directory.with_name(directory.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if sys.version_info[:2] != (3, 11):  # the image's Python: this interpreter's wheels are the image's
        raise DeployError(f"fill_wheels needs Python 3.11 (the cpu image's), not {sys.version.split()[0]}")
    # pip wheel: the wheels as they are, and the few sdist-only packages (acvl_utils, ...) built here once
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(staging),
            *(p for path in _requirements() for p in ("-r", str(path)))]
    result = _run(argv, timeout=1800)
    if result.returncode != 0:
        raise DeployError(f"pip wheel of the image's wheels failed: {result.stderr[-2000:]}")
    write_text_atomic(staging / ".requirements.sha256", key)
    staging.rename(directory)
    return directory
