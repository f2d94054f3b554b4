"""A container engine and the cpu image's inputs here: podman, a Debian base image, a wheel directory.

Used by ``nnunet-triton deploy --target docker|k8s`` and the container tests. Nothing here is needed on a
host with a working Docker engine; on a Debian host without one, as root:

* :func:`ensure_podman` installs ``podman runc debootstrap catatonit`` with apt when one is missing and,
  where root lacks CAP_SYS_RESOURCE (podman's default ulimits cannot be set) or the cgroup layout is
  hybrid (crun fails there), writes the drop-in :data:`CONF_DROPIN` (``default_ulimits`` at this host's
  own hard limits, ``runtime = "runc"``).
* :func:`ensure_base_image` makes ``localhost/debian:bookworm`` when it is missing: ``debootstrap
  --variant=minbase bookworm`` from the mirror apt uses, imported with ``podman import`` (there is no image
  registry here). It stays in podman's store; later calls cost nothing.
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
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nnunet_triton.errors import DeployError

SOURCE_ENV = "NNUNET_TRITON_SOURCE"
LOCAL_BASE_IMAGE = "localhost/debian:bookworm"
CONF_DROPIN = Path("/etc/containers/containers.conf.d/50-nnunet-triton.conf")
PACKAGES = ("podman", "runc", "debootstrap", "catatonit")  # catatonit: the pause process of kube play pods
REQUIREMENT_FILES = ("requirements/image-cpu.txt", "requirements/export.txt")  # in the source tree
_CAP_SYS_RESOURCE = 24


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


def _apt_install(packages: tuple[str, ...]) -> str | None:
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if _run(argv, timeout=900, env=env).returncode == 0:
        return None
    _run(["apt-get", "update", "-q"], timeout=600, env=env)  # a fresh machine's lists may be missing or old
    result = _run(argv, timeout=900, env=env)
    if result.returncode == 0:
        return None
    return f"apt-get install {' '.join(packages)} failed: {result.stderr[-500:]}"


def _lacks_cap_sys_resource() -> bool:
    status = Path("/proc/self/status").read_text()
    match = re.search(r"^CapEff:\s*([0-9a-f]+)$", status, flags=re.MULTILINE)
    return match is not None and not int(match.group(1), 16) & (1 << _CAP_SYS_RESOURCE)


def _hybrid_cgroups() -> bool:
    root = Path("/sys/fs/cgroup")
    v1 = (root / "memory").is_dir() and not (root / "cgroup.controllers").exists()
    return (root / "unified").is_dir() or v1


def engine_config() -> str | None:
    """The containers.conf drop-in this host needs, or None (a host where podman's defaults work)."""
    lines = []
    if _lacks_cap_sys_resource():
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
        nofile = 1048576 if nofile == resource.RLIM_INFINITY else nofile
        lines += ["[containers]", "# root lacks CAP_SYS_RESOURCE: podman's default ulimits exceed this host",
                  f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]']
    if _hybrid_cgroups() and shutil.which("runc"):
        lines += ["[engine]", "# crun fails on this hybrid cgroup layout", 'runtime = "runc"']
    return "\n".join(["# written by nnunet-triton (server.deploy.engine)", *lines, ""]) if lines else None


def ensure_podman() -> str | None:
    """Make podman usable here (installing it as root with apt); None when it works, else the reason."""
    if any(shutil.which(tool) is None for tool in ("podman", "debootstrap", "catatonit")):
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return "podman is not installed and cannot be installed here (needs root and apt-get)"
        failed = _apt_install(PACKAGES)
        if failed:
            return failed
    config = engine_config()
    if config is not None and os.geteuid() == 0:
        if not CONF_DROPIN.is_file() or CONF_DROPIN.read_text() != config:
            CONF_DROPIN.parent.mkdir(parents=True, exist_ok=True)
            CONF_DROPIN.write_text(config)
    if not engine_works("podman"):
        return "podman is installed but `podman info` fails: " + _run(["podman", "info"]).stderr[-500:]
    return None


def image_exists(engine: str, ref: str) -> bool:
    return _run([engine, "image", "exists" if engine == "podman" else "inspect", ref]).returncode == 0


def ensure_base_image(engine: str = "podman", ref: str = LOCAL_BASE_IMAGE) -> float:
    """Make ``ref`` (a minbase Debian bookworm) when it is missing; the seconds it took (0: it was there)."""
    if image_exists(engine, ref):
        return 0.0
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise RuntimeError(f"{ref} is missing and debootstrap cannot run here (needs root and debootstrap)")
    start = time.monotonic()
    state = state_dir()
    state.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=state, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        result = _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), _debian_mirror()],
                      timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"debootstrap failed: {result.stdout[-1000:]}{result.stderr[-1000:]}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run([engine, "import", "-", ref], stdin=tar.stdout, capture_output=True,
                                  text=True, timeout=900, check=False)
        tar.wait(60)
        if imported.returncode != 0:
            raise RuntimeError(f"{engine} import failed: {imported.stderr[-1000:]}")
    return time.monotonic() - start


def _debian_mirror() -> str:
    """The mirror apt already uses (deb822 ``URIs:`` or a ``deb`` line), else deb.debian.org."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        text = path.read_text(errors="replace") if path.is_file() else ""
        for match in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+)", text, flags=re.MULTILINE):
            uri = match.group(1)
            if "security" not in uri and uri.startswith("http"):
                return uri
    return "http://deb.debian.org/debian"


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
        raise RuntimeError(f"fill_wheels needs Python 3.11 (the cpu image's), not {sys.version.split()[0]}")
    # pip wheel: the wheels as they are, and the few sdist-only packages (acvl_utils, ...) built here once
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(staging),
            *(p for path in _requirements() for p in ("-r", str(path)))]
    result = _run(argv, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"pip wheel of the image's wheels failed: {result.stderr[-2000:]}")
    (staging / ".requirements.sha256").write_text(key)
    staging.rename(directory)
    return directory


def main() -> int:
    """``python -m nnunet_triton.server.deploy.engine``: podman, the base image and the wheels made."""
    problem = ensure_podman()
    if problem:
        sys.stderr.write(f"{problem}\n")
        return 1
    seconds = ensure_base_image()
    wheels = fill_wheels()
    summary = {"engine": "podman", "base_image": LOCAL_BASE_IMAGE, "base_image_s": round(seconds, 1),
               "wheels": str(wheels)}
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
