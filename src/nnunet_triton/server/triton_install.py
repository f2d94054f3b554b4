"""Prepare a runnable copy of the ``tritonserver`` 2.51.0 binary shipped inside the nvidia-pytriton wheel.

PyTriton normally starts this binary for its own proxy models. We reuse only the binary, the Python
backend and the Python-backend stubs, the way ``pytriton/triton.py::_prepare_triton_inference_server`` and
``pytriton/server/triton_server.py::TritonServer._get_env`` do:

* copy ``pytriton/tritonserver/{bin,lib,caches,backends}`` into a server home (its binaries find their
  libraries through ``$ORIGIN``-relative RPATHs that break when copied, hence ``LD_LIBRARY_PATH``);
* put the stub built for the running Python at ``backends/python/triton_python_backend_stub``;
* ``LD_LIBRARY_PATH`` gets the wheel's ``nvidia_pytriton.libs`` (sibling of the ``pytriton`` package);
* ``PATH`` gets this environment's ``bin`` first: the stub embeds libpython and finds its ``sys.prefix``
  (hence this venv's numpy, torch, nnunet_triton ...) from ``python3`` on ``PATH``; ``PYTHONPATH`` is
  not passed to it.

Nothing from Triton or PyTriton is imported here; the package directory is located with
``importlib.util.find_spec``.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.errors import ServerError
from nnunet_triton.util.durable import write_text_atomic

__all__ = ["DEFAULT_HOME", "HOME_ENV", "TritonInstallation", "resolve_home", "prepare_home", "server_env"]

LOGGER = logging.getLogger(__name__)

HOME_ENV = "NNUNET_TRITON_HOME"
DEFAULT_HOME = Path("build/triton-home")


@dataclass(frozen=True)
class TritonInstallation:
    """A prepared server home: where the binary, backends and libraries are."""

    server_dir: Path
    lib_dirs: tuple[Path, ...]
    python_bin_dir: Path

    @property
    def server_bin(self) -> Path:
        return self.server_dir / "bin" / "tritonserver"

    @property
    def backend_dir(self) -> Path:
        return self.server_dir / "backends"

    @property
    def cache_dir(self) -> Path:
        return self.server_dir / "caches"


def resolve_home(home: str | Path | None = None) -> Path:
    """``home``, else ``$NNUNET_TRITON_HOME``, else ``build/triton-home`` (relative to the cwd), absolute."""
    return Path(home if home is not None else os.environ.get(HOME_ENV, DEFAULT_HOME)).absolute()


def _pytriton_dist_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("package 'pytriton' (nvidia-pytriton==0.7.0, the embedded tritonserver) is not "
                          "installed: run "
                          "`pip install --no-deps nvidia-pytriton==0.7.0` (a checkout: `make setup`).")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_home(home: str | Path | None = None) -> TritonInstallation:
    """Copy pytriton's server tree into ``<home>/server`` once (idempotent, safe across processes).

    Re-copies only when the pytriton installation or the Python minor version changed.
    """
    home = resolve_home(home)
    dist = _pytriton_dist_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"pytriton ships no Python-backend stub for Python {version} (looked for {stub}).")
    marker = json.dumps(
        {
            "source": str(dist),
            "pytriton": importlib.metadata.version("nvidia-pytriton"),
            "python": version,
            "binary_mtime_ns": (dist / "bin" / "tritonserver").stat().st_mtime_ns,
        },
        sort_keys=True,
    )
    server_dir = home / "server"
    with _locked(home / ".prepare.lock"):
        marker_file = server_dir / ".prepared.json"
        if not (marker_file.is_file() and marker_file.read_text() == marker):
            _copy_server_tree(dist, stub, server_dir, marker)
    return TritonInstallation(
        server_dir=server_dir,
        lib_dirs=(dist.parent.parent / "nvidia_pytriton.libs",),
        python_bin_dir=Path(sys.exec_prefix) / "bin",
    )


def _copy_server_tree(dist: Path, stub: Path, server_dir: Path, marker: str) -> None:
    staging = server_dir.with_name(f"{server_dir.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for part in ("bin", "lib", "caches", "backends"):
        if (dist / part).is_dir():
            shutil.copytree(dist / part, staging / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, staging / "backends" / "python" / "triton_python_backend_stub")
    write_text_atomic(staging / ".prepared.json", marker)
    shutil.rmtree(server_dir, ignore_errors=True)
    staging.rename(server_dir)
    LOGGER.info("prepared tritonserver home %s from %s", server_dir, dist)


def server_env(installation: TritonInstallation, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: bundled libraries first, this environment's ``bin`` first on PATH."""
    env = dict(os.environ if base is None else base)
    lib_path = [str(p) for p in installation.lib_dirs] + [
        p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p
    ]
    env["LD_LIBRARY_PATH"] = ":".join(lib_path)
    env["PATH"] = f"{installation.python_bin_dir}:{env.get('PATH', '')}".rstrip(":")
    return env
