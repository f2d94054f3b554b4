"""Build Triton's PyTorch backend (``libtriton_pytorch.so``) for the embedded tritonserver, CPU only.

The ``nvidia-pytriton`` wheel's tritonserver 2.51.0 (Triton r24.10, backend API 1.19) ships only the
Python backend, so the ``pytorch_libtorch`` fold models need the backend built from Triton's public r24.10
sources against this environment's libtorch (the ``torch`` wheel's ``include/`` and ``lib/``). The sources
are four folders side by side (``pytorch_backend``, ``backend``, ``core``, ``common``), found in this order:
``--source DIR``, ``$NNUNET_TRITON_BACKEND_SOURCE``, a ``shared/triton-src`` folder beside the checkout
or one of its ancestors (CI and our machines: no network); otherwise clone them (docs/deploy.md).

The build follows the facts of ``shared/triton-src/README.md``: CMake with FetchContent pointed at the
local folders, C++20 (torch >= 2.10 headers need it), googletest from Debian (common r24.10 always builds
its unit tests), GPU, torchvision and Torch-TRT off. The result must depend on the wheel's renamed
``libtritonserver-<hash>.so`` (``patchelf --replace-needed``) and finds torch's libraries through its
RUNPATH. It is cached under ``<out>/pytorch-<key>`` where the key hashes the source trees, the torch
version and build, the compiler and this recipe; ``<out>/pytorch`` points at the current one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from nnunet_triton.errors import ServerError

__all__ = ["BACKEND_LIBRARY", "DEFAULT_OUT", "SOURCE_ENV", "SOURCE_FOLDERS", "APT_PACKAGES", "BuiltBackend",
           "build_pytorch_backend", "find_source", "cache_key"]

LOGGER = logging.getLogger(__name__)

SOURCE_ENV = "NNUNET_TRITON_BACKEND_SOURCE"
DEFAULT_OUT = Path("build/triton-backends")
SOURCE_FOLDERS = ("pytorch_backend", "backend", "core", "common")
BACKEND_LIBRARY = "libtriton_pytorch.so"
# Debian packages the build needs (shared/triton-src/README.md); googletest: common r24.10 builds its tests.
APT_PACKAGES = ("cmake", "ninja-build", "g++", "rapidjson-dev", "googletest", "libgtest-dev", "patchelf",
                "python3-dev")
_RECIPE_VERSION = "1"  # bump when the CMake flags or the patching below change
_GTEST_SOURCE = Path("/usr/src/googletest")


@dataclass(frozen=True)
class BuiltBackend:
    """A built backend folder (``<folder>/libtriton_pytorch.so``) and whether this call compiled it."""

    folder: Path
    key: str
    compiled: bool
    seconds: float

    @property
    def library(self) -> Path:
        return self.folder / BACKEND_LIBRARY


def find_source(source: str | Path | None = None, start: Path | None = None) -> Path:
    """The folder holding the four r24.10 source trees; ServerError naming where it looked otherwise."""
    looked: list[str] = []
    candidates: list[Path] = []
    if source is not None:
        candidates.append(Path(source))
    elif os.environ.get(SOURCE_ENV):
        candidates.append(Path(os.environ[SOURCE_ENV]))
    else:
        here = (start or Path.cwd()).absolute()
        candidates += [parent / "shared" / "triton-src" for parent in (here, *here.parents)]
    for candidate in candidates:
        if all((candidate / name / "CMakeLists.txt").is_file() for name in SOURCE_FOLDERS):
            return candidate.absolute()
        looked.append(str(candidate))
    raise ServerError(
        f"no Triton r24.10 source folder with {', '.join(SOURCE_FOLDERS)} found (looked in "
        f"{', '.join(looked[:3])}{' ...' if len(looked) > 3 else ''}); clone them into one folder with "
        f"`git clone --depth 1 --branch r24.10 https://github.com/triton-inference-server/<name>` for each "
        f"name and pass --source FOLDER (or set ${SOURCE_ENV}).")


def _tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and ".git" not in p.parts):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _torch_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ServerError("package 'torch' is not installed: the PyTorch backend is built against its "
                          "libtorch.")
    return Path(spec.origin).parent


def _torch_build() -> str:
    import importlib.metadata

    torch_dir = _torch_dir()
    libs = sorted(p.name + ":" + str(p.stat().st_size) for p in (torch_dir / "lib").glob("libtorch*.so"))
    return f"{importlib.metadata.version('torch')} {' '.join(libs)}"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    found = shutil.which(cxx)
    if found is None:
        raise ServerError(f"no C++ compiler {cxx!r} on PATH: apt-get install {' '.join(APT_PACKAGES)}")
    version = subprocess.run([found, "--version"], capture_output=True, text=True, check=False).stdout
    return version.split("\n")[0]


def cache_key(source: Path) -> str:
    """Hash of the four source trees, the torch version and build, the compiler and this recipe."""
    digest = hashlib.sha256(_RECIPE_VERSION.encode())
    for name in SOURCE_FOLDERS:
        digest.update(name.encode() + _tree_hash(source / name).encode())
    digest.update(_torch_build().encode() + _compiler().encode() + sys.version.encode())
    return digest.hexdigest()[:16]


def _tritonserver_library() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("package 'pytriton' (nvidia-pytriton==0.7.0) is not installed: the backend must "
                          "link the libtritonserver of its tritonserver.")
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "nvidia_pytriton.libs"
    found = sorted(libs.glob("libtritonserver-*.so"))
    if len(found) != 1:
        raise ServerError(f"expected one libtritonserver-<hash>.so in {libs}, found "
                          f"{[p.name for p in found]}.")
    return found[0]


def _missing_tools() -> list[str]:
    missing = [tool for tool in ("cmake", "ninja", "patchelf") if shutil.which(tool) is None]
    if not Path("/usr/include/rapidjson/document.h").is_file():
        missing.append("rapidjson-dev")
    if not (_GTEST_SOURCE / "CMakeLists.txt").is_file():
        missing.append("googletest")
    return missing


def _apt_install() -> bool:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    LOGGER.info("installing %s", " ".join(APT_PACKAGES))
    if subprocess.run(argv, capture_output=True, env=env, check=False).returncode == 0:
        return True
    subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, check=False)
    return subprocess.run(argv, capture_output=True, env=env, check=False).returncode == 0


def _cmake_args(source: Path, build_dir: Path) -> list[str]:
    torch_dir = _torch_dir()
    include = sysconfig.get_paths()["include"]
    return [
        "cmake", "-S", str(source / "pytorch_backend"), "-B", str(build_dir), "-G", "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DTRITON_MIN_CXX_STANDARD=20",  # torch >= 2.10 headers need C++20
        "-DTRITON_ENABLE_GPU=OFF",
        "-DTRITON_PYTORCH_ENABLE_TORCHVISION=OFF",
        "-DTRITON_PYTORCH_ENABLE_TORCHTRT=OFF",
        f"-DTRITON_PYTORCH_INCLUDE_PATHS={torch_dir / 'include'};"
        f"{torch_dir / 'include/torch/csrc/api/include'}",
        f"-DTRITON_PYTORCH_LIB_PATHS={torch_dir / 'lib'}",
        "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",
        f"-DFETCHCONTENT_SOURCE_DIR_REPO-COMMON={source / 'common'}",
        f"-DFETCHCONTENT_SOURCE_DIR_REPO-CORE={source / 'core'}",
        f"-DFETCHCONTENT_SOURCE_DIR_REPO-BACKEND={source / 'backend'}",
        f"-DFETCHCONTENT_SOURCE_DIR_GOOGLETEST={_GTEST_SOURCE}",
        f"-DPython3_INCLUDE_DIR={include}",
        f"-DPython3_EXECUTABLE={sys.executable}",
    ]


def _run(argv: list[str], log: Path) -> None:
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise ServerError(f"building the PyTorch backend failed at `{argv[0]} {argv[1]}` (exit "
                          f"{result.returncode}); full log {log}, last lines:\n{tail}")


def build_pytorch_backend(source: str | Path | None = None, out: str | Path = DEFAULT_OUT, *,
                          jobs: int | None = None, install_packages: bool = True) -> BuiltBackend:
    """Build (or reuse the cached) ``libtriton_pytorch.so``; ``<out>/pytorch`` then points at it.

    Args:
        source: the folder with the four r24.10 trees (default: :func:`find_source`).
        out: where built backends are cached (default ``build/triton-backends``).
        jobs: parallel compile jobs (default: the CPUs this process may use).
        install_packages: as root with apt-get, install the missing :data:`APT_PACKAGES` (refreshing the
            package lists when the first try fails, as on a fresh machine) before compiling.

    Raises:
        ServerError: sources, tools or torch missing (the message names the package), or the build failed.
    """
    started = time.monotonic()
    source = find_source(source)
    out = Path(out).absolute()
    key = cache_key(source)
    folder = out / f"pytorch-{key}"
    if not (folder / BACKEND_LIBRARY).is_file():
        missing = _missing_tools()
        if missing and install_packages and _apt_install():
            missing = _missing_tools()
        if missing:
            raise ServerError(f"building the PyTorch backend needs {', '.join(missing)}: apt-get install "
                              f"{' '.join(APT_PACKAGES)}")
        _compile(source, folder, jobs or len(os.sched_getaffinity(0)))
        compiled = True
    else:
        compiled = False
    _point_current(out, folder)
    seconds = time.monotonic() - started
    LOGGER.info("PyTorch backend %s in %s (%.0f s)", "built" if compiled else "cached", folder, seconds)
    return BuiltBackend(folder=folder, key=key, compiled=compiled, seconds=seconds)


def _compile(source: Path, folder: Path, jobs: int) -> None:
    build_dir = folder.with_name(folder.name + ".work")
    build_dir.mkdir(parents=True, exist_ok=True)
    log = build_dir / "build.log"
    _run(_cmake_args(source, build_dir), log)
    _run(["cmake", "--build", str(build_dir), "--target", "triton-pytorch-backend", "-j", str(jobs)], log)
    staging = folder.with_name(folder.name + f".staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    library = staging / BACKEND_LIBRARY
    shutil.copy2(build_dir / BACKEND_LIBRARY, library)
    # the wheel's tritonserver carries the auditwheel-renamed libtritonserver-<hash>.so; torch's libraries
    # are found through the RUNPATH (the backend is loaded by a tritonserver whose LD_LIBRARY_PATH lacks them)
    renamed = _tritonserver_library().name
    _run(["patchelf", "--replace-needed", "libtritonserver.so", renamed, str(library)], log)
    _run(["patchelf", "--set-rpath", f"$ORIGIN:{_torch_dir() / 'lib'}", str(library)], log)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    shutil.rmtree(build_dir, ignore_errors=True)


def _point_current(out: Path, folder: Path) -> None:
    current = out / "pytorch"
    temporary = out / f".pytorch.link-{os.getpid()}"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(folder.name)
    temporary.replace(current)  # atomic: a running server's merged folder never sees a missing backend
