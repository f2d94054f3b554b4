"""Make this host a container host for the cpu image: podman, its containers.conf drop-in, a Debian base.

Developer tooling (``make container-engine``, the container tests); the package never runs it: ``nnunet-triton
deploy`` only checks that an engine works and that the base image is there, and says how to get them. On a
Debian host without Docker, as root:

* :func:`ensure_podman` installs ``podman runc debootstrap catatonit`` with apt when one is missing and,
  where root lacks CAP_SYS_RESOURCE (podman's default ulimits cannot be set) or the cgroup layout is
  hybrid (crun fails there), writes the drop-in :data:`CONF_DROPIN` (``default_ulimits`` at this host's
  own hard limits, ``runtime = "runc"``).
* :func:`ensure_base_image` makes ``localhost/debian:bookworm`` when it is missing: ``debootstrap
  --variant=minbase bookworm`` from the mirror apt uses, imported with ``podman import`` (there is no image
  registry here). It stays in podman's store; later calls cost nothing.
* the cpu image's wheels (``server.deploy.engine.fill_wheels``, which ``deploy`` also calls).

    python -m tools.container_host
"""

from __future__ import annotations

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

from nnunet_triton.server.deploy import engine

CONF_DROPIN = Path("/etc/containers/containers.conf.d/50-nnunet-triton.conf")
PACKAGES = ("podman", "runc", "debootstrap", "catatonit")  # catatonit: the pause process of kube play pods
_CAP_SYS_RESOURCE = 24


def _run(argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


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
    return "\n".join(["# written by nnunet-triton (tools.container_host)", *lines, ""]) if lines else None


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
    if not engine.engine_works("podman"):
        return "podman is installed but `podman info` fails: " + _run(["podman", "info"]).stderr[-500:]
    return None


def ensure_base_image(container_engine: str = "podman", ref: str = engine.LOCAL_BASE_IMAGE) -> float:
    """Make ``ref`` (a minbase Debian bookworm) when it is missing; the seconds it took (0: it was there)."""
    if engine.image_exists(container_engine, ref):
        return 0.0
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise RuntimeError(f"{ref} is missing and debootstrap cannot run here (needs root and debootstrap)")
    start = time.monotonic()
    state = engine.state_dir()
    state.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=state, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        result = _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror()],
                      timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"debootstrap failed: {result.stdout[-1000:]}{result.stderr[-1000:]}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run([container_engine, "import", "-", ref], stdin=tar.stdout,
                                  capture_output=True, text=True, timeout=900, check=False)
        tar.wait(60)
        if imported.returncode != 0:
            raise RuntimeError(f"{container_engine} import failed: {imported.stderr[-1000:]}")
    return time.monotonic() - start


def debian_mirror(sources: list[Path] | None = None) -> str:
    """The mirror apt already uses (deb822 ``URIs:`` or a ``deb`` line), else deb.debian.org."""
    if sources is None:
        sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        text = path.read_text(errors="replace") if path.is_file() else ""
        for match in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+)", text, flags=re.MULTILINE):
            uri = match.group(1)
            if "security" not in uri and uri.startswith("http"):
                return uri
    return "http://deb.debian.org/debian"


def main(argv: list[str] | None = None) -> int:
    """podman, the base image and the cpu image's wheels made; one JSON line, or the reason on stderr."""
    del argv  # no options
    problem = ensure_podman()
    if problem:
        sys.stderr.write(f"{problem}\n")
        return 1
    seconds = ensure_base_image()
    wheels = engine.fill_wheels()
    summary = {"engine": "podman", "base_image": engine.LOCAL_BASE_IMAGE, "base_image_s": round(seconds, 1),
               "wheels": str(wheels)}
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
