"""``make gpu-bundle``: one file with everything the GPU test machine lacks, and its use there.

The GPU test machine (Python 3.12, torch 2.11+cu130, cupy-cuda13x, numpy 2.5; no tritonserver, no
SimpleITK, no network, 64 MiB carried per call; its package list, and what the bundle carries for it,
are data: ``tools/gpu_machine.toml``, read by :func:`load_machine`) gets
``build/gpu-bundle/nnunet-gpu-bundle.tar.xz`` (<= 50 MiB), built here from registries only:

``site/`` (on ``sys.path`` and the stubs' ``PYTHONPATH``, both machines)
    ``pytriton/tritonserver/``: the tritonserver 2.51.0 binary, the Python backend, the local cache and
    the Python-backend stubs for 3.12 (the GPU machine) and 3.11 (the dry run here) from the installed
    ``nvidia-pytriton`` 0.7.0; ``nvidia_pytriton.libs/``: exactly the libraries ``ldd`` resolves for
    those binaries (the wheel's libpython 3.13 stays behind); the wheel's dist-info (without RECORD) and
    a ``pytriton/__init__.py`` saying that only the server tree is here. ``server.triton_install`` finds
    this tree as it finds the wheel's (``find_spec("pytriton")``), so nothing under ``src/`` changes.
    Then the pure-Python packages the GPU machine lacks, at the lock's versions (``DEVICE_PURE``).
``site-cp312/`` (only for a Python 3.12): the compiled packages it lacks (``DEVICE_COMPILED``), cp312
    manylinux wheels from PyPI.
``libpython/3.12/libpython3.12.so.1.0``: the stub's libpython, used only when the machine has none
    (:func:`libpython_plan`): CPython 3.12.2's shared library as vendored in PyPI's
    ``nvidia-pytriton==0.5.5`` wheel (``LIBPYTHON_SOURCE``; sha256 checked, symbols stripped). Debian
    has no Python 3.12 in any suite (bookworm: 3.11; trixie: 3.13; sid: 3.13 to 3.15).
``fixture/``: the held-out cases of the fixture dataset as ``.npy`` (no SimpleITK needed to read them).
``realistic/``: ``plans.json``, ``dataset.json``, ``dataset_fingerprint.json`` of the realistic model
    (``tools.perf.workloads``: nnU-Net's own planner on synthetic CT here); the weights are made on the
    device by :func:`materialize_realistic_model` (seeded He initialisation, as here).
``MANIFEST.json``: versions, sources, sha256 and sizes of all of the above and the inputs' digest.

Usage::

    python -m tools.gpu_bundle build            # make gpu-bundle (reused while its inputs are unchanged)
    python -m tools.gpu_bundle info             # print the manifest of the built bundle
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
LOGGER = logging.getLogger("gpu_bundle")

BUNDLE_DIR = REPO_ROOT / "build" / "gpu-bundle"  # only the bundle travels: `run(carry=["build/gpu-bundle"])`
BUNDLE_NAME = "nnunet-gpu-bundle.tar.xz"
CACHE_DIR = REPO_ROOT / "build" / "gpu-bundle-cache"  # downloads and staging, never carried
MAX_BUNDLE_BYTES = 50 * 2**20
FORMAT = 1
PYTRITON_VERSION = "0.7.0"
LOCK = REPO_ROOT / "requirements" / "constraints.txt"
FIXTURE_DATASET = "Dataset901_SynthCT"
MACHINE_FILE = Path(__file__).with_name("gpu_machine.toml")  # the GPU machine's package list


@dataclass(frozen=True)
class DeviceMachine:
    """The GPU test machine's package list (``gpu_machine.toml``): what it has, what the bundle carries."""

    python: str  # major.minor
    notable: dict[str, str]  # versions of note (torch, cupy, numpy), for the manifest
    installed: frozenset[str]  # normalised distribution names; never carried
    pure: tuple[str, ...]  # carried as wheels for any Python 3
    compiled: tuple[str, ...]  # carried as wheels for the machine's Python
    optional: dict[str, str]  # imported there inside try/except only: not carried, name -> why

    @property
    def abi(self) -> str:
        """``cp312`` for Python 3.12."""
        return "cp" + self.python.replace(".", "")


def load_machine(path: Path = MACHINE_FILE) -> DeviceMachine:
    """Read the GPU machine's package list; BundleError naming the file for a missing or wrong entry."""
    import tomllib

    try:
        data = tomllib.loads(path.read_text())
        machine = DeviceMachine(
            python=str(data["python"]), notable=dict(data["notable"]),
            installed=frozenset(_normalise(n) for n in data["installed"]["packages"]),
            pure=tuple(data["carried"]["pure"]), compiled=tuple(data["carried"]["compiled"]),
            optional=dict(data["optional"]))
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as exc:
        raise BundleError(f"{path}: cannot read the GPU machine's package list ({exc!r}).") from exc
    if not re.fullmatch(r"3\.\d+", machine.python):
        raise BundleError(f"{path}: python must be major.minor like \"3.12\", got {machine.python!r}.")
    return machine


WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class WheelMember:
    """One file inside one PyPI wheel, pinned by the wheel's sha256."""

    project: str
    version: str
    wheel: str
    sha256: str
    member: str


LIBPYTHON_SOURCE = WheelMember(
    project="nvidia-pytriton", version="0.5.5",
    wheel="nvidia_pytriton-0.5.5-py3-none-manylinux_2_35_x86_64.whl",
    sha256="986ee75b8fb67bba9e3b0058bd5ff3981b17be3b88e178b0b60971d89ba42a63",
    member="nvidia_pytriton.libs/libpython3-dc182cf9.12.so.1.0")


class BundleError(RuntimeError):
    """The bundle cannot be built, read or used (the message names the file and the rule)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# The GPU machine's package list, read once from tools/gpu_machine.toml (the names below are its fields).
MACHINE = load_machine()
DEVICE_PYTHON = MACHINE.python
DEVICE_ABI = MACHINE.abi
DEVICE_SITE = f"site-{DEVICE_ABI}"  # the bundle's folder of compiled packages
STUB_PYTHONS = (DEVICE_PYTHON, "3.11")  # the GPU machine's, this machine's (the dry run)
DEVICE_PACKAGES = MACHINE.installed
DEVICE_PURE = MACHINE.pure
DEVICE_COMPILED = MACHINE.compiled
DEVICE_OPTIONAL = MACHINE.optional


# --- building ---------------------------------------------------------------------------------------------


def lock_versions(names: Iterable[str], lock: Path = LOCK) -> dict[str, str]:
    """``{name: version}`` for ``names`` from the lock file; BundleError for a name it does not pin."""
    pins = {}
    for line in lock.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip())
        if match:
            pins[_normalise(match.group(1))] = match.group(2)
    missing = [n for n in names if _normalise(n) not in pins]
    if missing:
        raise BundleError(f"{lock} pins no version of {missing}: run `make lock`.")
    return {n: pins[_normalise(n)] for n in names}


def _pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise BundleError("nvidia-pytriton is not installed here: run `make setup`.")
    return Path(next(iter(spec.submodule_search_locations)))


def _ldd(paths: Sequence[Path], lib_dir: Path) -> dict[str, str | None]:
    """``{library name: resolved path or None}`` of everything ``paths`` load (transitively)."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir)}
    found: dict[str, str | None] = {}
    for path in paths:
        out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env, check=True).stdout
        found.update(parse_ldd(out))
    return found


def parse_ldd(text: str) -> dict[str, str | None]:
    """``ldd`` output -> ``{name: path}``; ``None`` for "not found"; the vdso and the loader are skipped."""
    result: dict[str, str | None] = {}
    for line in text.splitlines():
        match = re.match(r"^\s*(\S+)\s+=>\s+(not found|\S+)", line)
        if match:
            result[match.group(1)] = None if match.group(2) == "not found" else match.group(2)
    return result


def _copy_triton(site: Path) -> dict[str, Any]:
    """The server tree, both stubs and exactly the wheel libraries they load, into ``site``."""
    package = _pytriton_dir()
    tree, libs = package / "tritonserver", package.parent / "nvidia_pytriton.libs"
    version = importlib.metadata.version("nvidia-pytriton")
    if version != PYTRITON_VERSION:
        raise BundleError(f"nvidia-pytriton {version} is installed, the bundle needs {PYTRITON_VERSION}.")
    binaries = [tree / "bin" / "tritonserver", tree / "backends" / "python" / "libtriton_python.so",
                *sorted((tree / "caches").glob("*/*.so")),
                *(tree / "python_backend_stubs" / v / "triton_python_backend_stub" for v in STUB_PYTHONS)]
    out = site / "pytriton" / "tritonserver"
    for part in ("bin", "backends", "caches"):
        shutil.copytree(tree / part, out / part, ignore=shutil.ignore_patterns("__pycache__"))
    for version_ in STUB_PYTHONS:
        stub = out / "python_backend_stubs" / version_
        stub.mkdir(parents=True)
        shutil.copy2(tree / "python_backend_stubs" / version_ / "triton_python_backend_stub", stub)
    resolved = _ldd(binaries, libs)
    closure = sorted({Path(p).name for p in resolved.values()
                      if p and Path(p).resolve().parent == libs.resolve()})
    (site / "nvidia_pytriton.libs").mkdir()
    for name in closure:
        shutil.copy2(libs / name, site / "nvidia_pytriton.libs" / name)
    dist_info = package.parent / f"nvidia_pytriton-{PYTRITON_VERSION}.dist-info"
    shutil.copytree(dist_info, site / dist_info.name, ignore=shutil.ignore_patterns("RECORD", "INSTALLER",
                                                                                    "REQUESTED"))
    (site / "pytriton" / "__init__.py").write_text(
        '"""nvidia-pytriton 0.7.0\'s tritonserver tree only (tools/gpu_bundle.py): no PyTriton API."""\n')
    return {"pytriton": version, "tritonserver": "2.51.0", "stubs": list(STUB_PYTHONS), "libraries": closure,
            "binaries": [str(p.relative_to(package.parent)) for p in binaries]}


def _pip_download(requirements: Sequence[str], dest: Path, *, pure: bool) -> None:
    """Pure packages: ``pip wheel`` (several are sdists only on PyPI; their wheels are py3-none-any);
    compiled ones: the cp312 manylinux wheels PyPI has (``pip download`` for another Python)."""
    dest.mkdir(parents=True, exist_ok=True)
    if pure:
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dest),
                   *requirements]
    else:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--python-version", DEVICE_PYTHON, "--implementation", "cp", "--abi", DEVICE_ABI, "--abi",
                   "abi3", *(f"--platform={p}" for p in WHEEL_PLATFORMS), "-d", str(dest), *requirements]
    LOGGER.info("pip %s %s", command[3], " ".join(requirements))
    subprocess.run(command, check=True, timeout=1800)


def _wheel_for(cache: Path, project: str, version: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", project).lower()
    matches = [w for w in cache.glob("*.whl")
               if w.name.lower().startswith(f"{stem}-{version}-".lower())]
    if len(matches) != 1:
        raise BundleError(f"expected one wheel of {project}=={version} in {cache}, found {matches}.")
    return matches[0]


def _safe_member(name: str) -> Path:
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not name or "\\" in name:
        raise BundleError(f"refusing archive member {name!r}: absolute or leaving the target folder.")
    return path


def _install_wheel(wheel: Path, target: Path) -> None:
    """Unpack a wheel like ``pip install --target`` (``*.data/purelib|platlib`` into the root)."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            relative = _safe_member(info.filename)
            parts = relative.parts
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts, headers, data: not needed on the device
                relative = Path(*parts[2:])
            if "__pycache__" in relative.parts or info.is_dir() or relative.name == "RECORD":
                continue
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, destination.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                destination.chmod(mode)


def _packages(stage: Path, cache: Path) -> dict[str, Any]:
    pins = lock_versions((*DEVICE_PURE, *DEVICE_COMPILED))
    wheels = cache / "wheels"
    wanted = {name: version for name, version in pins.items()}
    for pure in (True, False):
        missing = [f"{n}=={v}" for n, v in wanted.items()
                   if (n in DEVICE_PURE) == pure and not _has_wheel(wheels, n, v)]
        if missing:
            _pip_download(missing, wheels, pure=pure)
    record = {}
    for name, version in wanted.items():
        wheel = _wheel_for(wheels, name, version)
        pure = "-py3-none-" in wheel.name or "-py2.py3-none-" in wheel.name  # any Python 3 (3.11 and 3.12)
        if pure != (name in DEVICE_PURE):
            kind = "py3-none" if name in DEVICE_PURE else DEVICE_ABI
            raise BundleError(f"{wheel.name}: expected a {kind} wheel.")
        _install_wheel(wheel, stage / ("site" if pure else DEVICE_SITE))
        if not pure:  # their debug symbols are half the bundle's compiled packages
            for library in sorted((stage / DEVICE_SITE).rglob("*.so*")):
                subprocess.run(["strip", "--strip-unneeded", str(library)], check=True)
        record[name] = {"version": version, "wheel": wheel.name, "sha256": _sha256(wheel),
                        "folder": "site" if pure else DEVICE_SITE, "stripped": not pure}
    return record


def _has_wheel(wheels: Path, name: str, version: str) -> bool:
    try:
        _wheel_for(wheels, name, version)
    except BundleError:
        return False
    return True


def _libpython(stage: Path, cache: Path) -> dict[str, Any]:
    source = LIBPYTHON_SOURCE
    wheel = cache / "libpython" / source.wheel
    if not wheel.is_file() or _sha256(wheel) != source.sha256:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", "--platform", "manylinux_2_35_x86_64", "--python-version",
                        DEVICE_PYTHON, "-d", str(wheel.parent), f"{source.project}=={source.version}"],
                       check=True, timeout=1800)
    if _sha256(wheel) != source.sha256:
        raise BundleError(f"{wheel}: sha256 {_sha256(wheel)} is not the pinned {source.sha256}.")
    out = stage / "libpython" / DEVICE_PYTHON / f"libpython{DEVICE_PYTHON}.so.1.0"
    out.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src, \
            tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as raw:
        shutil.copyfileobj(src, raw)
    subprocess.run(["strip", "--strip-unneeded", "-o", str(out), raw.name], check=True)
    os.unlink(raw.name)
    return {**asdict(source), "python": DEVICE_PYTHON, "file": str(out.relative_to(stage)),
            "sha256": _sha256(out), "stripped": True, "cpython": "3.12.2"}


def _fixture_cases(stage: Path) -> list[dict[str, Any]]:
    from tools.perf import workloads

    images = workloads.fixture_model_dir().parent / "imagesTs"
    out = stage / "fixture" / FIXTURE_DATASET
    out.mkdir(parents=True)
    cases = []
    for first in sorted(images.glob("*_0000.nii.gz")):
        case_id = first.name[: -len("_0000.nii.gz")]
        files = sorted(images.glob(f"{case_id}_[0-9][0-9][0-9][0-9].nii.gz"))
        case = workloads.read_image(files, f"fixture-{case_id}")
        np.save(out / f"{case_id}.npy", case.image)
        cases.append({"case": case_id, "name": case.name, "file": f"{case_id}.npy",
                      "spacing": list(case.spacing), "shape": list(case.image.shape),
                      "sources": {f.name: _sha256(f) for f in files}})
    (out / "cases.json").write_text(json.dumps(cases, indent=2))
    return cases


def _realistic(stage: Path) -> dict[str, Any]:
    from tools.perf import workloads

    model_dir = workloads.ensure_realistic_model()
    out = stage / "realistic" / workloads.RECIPE.dataset_name
    out.mkdir(parents=True)
    for name in ("plans.json", "dataset.json", "dataset_fingerprint.json", workloads.RECIPE_FILE):
        shutil.copy2(model_dir / name, out / name)
    return json.loads((model_dir / workloads.RECIPE_FILE).read_text())


def inputs_digest() -> str:
    """sha256 over everything the bundle is made from (this file, pins, pytriton, fixture, recipe)."""
    from tools.perf import workloads

    package = _pytriton_dir()
    record = package.parent / f"nvidia_pytriton-{PYTRITON_VERSION}.dist-info" / "RECORD"
    images = workloads.fixture_model_dir().parent / "imagesTs"
    parts = {
        "format": FORMAT, "tool": _sha256(Path(__file__)), "machine": _sha256(MACHINE_FILE),
        "pins": lock_versions((*DEVICE_PURE, *DEVICE_COMPILED)), "libpython": asdict(LIBPYTHON_SOURCE),
        "pytriton_record": _sha256(record) if record.is_file()
        else importlib.metadata.version("nvidia-pytriton"),
        "fixture": {f.name: _sha256(f) for f in sorted(images.glob("*.nii.gz"))},
        "realistic": workloads.RECIPE.digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _tar_xz(source: Path, out: Path) -> None:
    """A reproducible tar (sorted, mtime 0, root-owned) of ``source`` compressed with ``xz -6`` (-9 takes
    longer on two cores for about 1 MiB less)."""
    tar_path = out.with_suffix("")  # .tar
    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(source.rglob("*")):
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                raise BundleError(f"{path}: only plain files and folders go into the bundle.")
            tar.add(path, arcname=str(Path(source.name) / path.relative_to(source)), recursive=False,
                    filter=normalise)
    out.unlink(missing_ok=True)
    subprocess.run(["xz", "-6", "-T2", "--keep", "--force", str(tar_path)], check=True)
    tar_path.with_name(tar_path.name + ".xz").rename(out)
    tar_path.unlink()


def build(out_dir: Path = BUNDLE_DIR, cache: Path = CACHE_DIR, *, force: bool = False) -> Path:
    """Build the bundle into ``out_dir`` (kept while :func:`inputs_digest` is unchanged); returns its path."""
    missing = [f"{tool} (Debian package {package})" for tool, package in
               (("ldd", "libc-bin"), ("strip", "binutils"), ("xz", "xz-utils")) if shutil.which(tool) is None]
    if missing:
        raise BundleError(f"building the bundle needs {', '.join(missing)}.")
    out = out_dir / BUNDLE_NAME
    manifest_file = out_dir / "MANIFEST.json"
    digest = inputs_digest()
    if not force and out.is_file() and manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("inputs_digest") == digest and manifest.get("bundle_sha256") == _sha256(out):
            LOGGER.info("up to date: %s (%.1f MiB)", out, out.stat().st_size / 2**20)
            return out
    staging = cache / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    stage = staging / "nnunet-gpu-bundle"
    (stage / "site").mkdir(parents=True)
    manifest = {"format": FORMAT, "inputs_digest": digest, "device_python": DEVICE_PYTHON,
                "device_notable": MACHINE.notable,
                "triton": _copy_triton(stage / "site"), "packages": _packages(stage, cache),
                "device_optional": DEVICE_OPTIONAL, "libpython_fallback": _libpython(stage, cache),
                "fixture": {"dataset": FIXTURE_DATASET, "cases": _fixture_cases(stage)},
                "realistic": _realistic(stage)}
    manifest["unpacked_bytes"] = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
    (stage / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
    out_dir.mkdir(parents=True, exist_ok=True)
    _tar_xz(stage, out)
    size = out.stat().st_size
    if size > MAX_BUNDLE_BYTES:
        out.unlink()
        raise BundleError(f"{out}: {size / 2**20:.1f} MiB is over the "
                          f"{MAX_BUNDLE_BYTES / 2**20:.0f} MiB limit.")
    manifest_file.write_text(json.dumps({**manifest, "bundle": out.name, "bundle_bytes": size,
                                         "bundle_sha256": _sha256(out)}, indent=2))
    shutil.rmtree(staging, ignore_errors=True)
    LOGGER.info("built %s: %.1f MiB (%.1f MiB unpacked)", out, size / 2**20,
                manifest["unpacked_bytes"] / 2**20)
    return out


# --- using it ---------------------------------------------------------------------------------------------


def unpack(bundle: Path, dest: Path) -> Path:
    """Extract ``bundle`` into ``dest`` (plain files and folders only, nothing outside); returns the root."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle, "r:xz") as tar:
        members = tar.getmembers()
        for member in members:
            _safe_member(member.name)
            if not (member.isfile() or member.isdir()):
                raise BundleError(f"{bundle}: member {member.name!r} is neither a file nor a folder.")
        tar.extractall(dest, members=members, filter="tar")  # keeps exec bits, refuses escapes
    roots = {Path(m.name).parts[0] for m in members}
    if len(roots) != 1:
        raise BundleError(f"{bundle}: expected one top folder, found {sorted(roots)}.")
    root = dest / roots.pop()
    manifest = json.loads((root / "MANIFEST.json").read_text())
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{bundle}: bundle format {manifest.get('format')}, this checkout reads {FORMAT}.")
    return root


@dataclass(frozen=True)
class LibpythonPlan:
    """Where the running Python's stub finds its libpython: ``source`` machine | machine-libdir | bundle."""

    python: str
    source: str
    path: str
    lib_dir: str | None  # prepended to LD_LIBRARY_PATH (None: the loader finds it already)


def libpython_plan(root: Path, *, force: str = "auto", python_libdir: str | None = None,
                   version: str | None = None) -> LibpythonPlan:
    """How the Python-backend stub of this Python will load its libpython (the bundle's only when needed).

    In order: what the loader already resolves for the stub (``ldd``); the running Python's own shared
    library (``sysconfig`` LIBDIR/INSTSONAME, e.g. a relocatable CPython off the loader's path); the
    bundle's fallback (3.12 only). ``force="bundle"`` takes the fallback whatever the machine has.
    ``version`` (default: the running Python's) and ``python_libdir`` (default: its LIBDIR) are for tests.
    """
    version = version or f"{sys.version_info.major}.{sys.version_info.minor}"
    soname = f"libpython{version}.so.1.0"
    stub = root / "site" / "pytriton" / "tritonserver" / "python_backend_stubs" / version / \
        "triton_python_backend_stub"
    fallback = root / "libpython" / version / soname
    if force not in ("auto", "bundle"):
        raise ValueError(f"libpython must be 'auto' or 'bundle', got {force!r}.")
    if force == "auto":
        resolved = _ldd([stub], root / "site" / "nvidia_pytriton.libs").get(soname)
        if resolved:
            return LibpythonPlan(version, "machine", resolved, None)
        libdir = python_libdir if python_libdir is not None else sysconfig.get_config_var("LIBDIR")
        if libdir and (Path(libdir) / soname).is_file():
            return LibpythonPlan(version, "machine-libdir", str(Path(libdir) / soname), libdir)
    if fallback.is_file():
        return LibpythonPlan(version, "bundle", str(fallback), str(fallback.parent))
    raise BundleError(f"no {soname} for the Python {version} stub: the loader finds none, the running Python "
                      f"has none in its LIBDIR, and the bundle carries a fallback for {DEVICE_PYTHON} only.")


@dataclass(frozen=True)
class Activation:
    """The environment :func:`activation_env` made for a process running from the bundle."""

    root: str
    python_paths: tuple[str, ...]
    libpython: LibpythonPlan
    env: dict[str, str]


ACTIVE_ENV = "NNUNET_TRITON_GPU_BUNDLE"  # the unpacked bundle a process runs from


def activation_env(root: Path, *, libpython: str = "auto", base: dict[str, str] | None = None) -> Activation:
    """The environment of a process (and the stubs it starts) that runs from the unpacked bundle ``root``:
    its packages first on ``PYTHONPATH``, then this checkout's ``src/`` and root, and its libpython fallback,
    when needed, on ``LD_LIBRARY_PATH``. A new process gets it (nothing of the running one's paths is
    changed): :func:`check_active` in that process confirms it."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    paths = [root / "site"] + ([root / DEVICE_SITE] if version == DEVICE_PYTHON else [])
    paths += [REPO_ROOT / "src", REPO_ROOT]
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [env.get("PYTHONPATH")])])
    plan = libpython_plan(root, force=libpython)
    if plan.lib_dir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([plan.lib_dir, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    env[ACTIVE_ENV] = str(root)
    return Activation(str(root), tuple(map(str, paths)), plan, env)


def check_active(root: Path) -> Path:
    """In a process started with :func:`activation_env`: pytriton (the tritonserver tree) is the bundle's.

    Raises:
        BundleError: it resolves elsewhere (the process was not started from the bundle).
    """
    tree = _pytriton_dir() / "tritonserver"
    if not tree.is_relative_to(root):
        raise BundleError(f"pytriton resolves to {tree}, not to the bundle in {root}.")
    LOGGER.info("running from the bundle %s (tritonserver tree %s)", root, tree)
    return tree


def fixture_cases(root: Path) -> list[Any]:
    """The fixture's held-out cases from the bundle's ``.npy`` files (``tools.perf.workloads.Case``)."""
    from tools.perf.workloads import Case

    folder = root / "fixture" / FIXTURE_DATASET
    cases = []
    for entry in json.loads((folder / "cases.json").read_text()):
        image = np.load(folder / _safe_member(entry["file"]), allow_pickle=False)
        if list(image.shape) != entry["shape"] or image.dtype != np.float32:
            raise BundleError(f"{folder / entry['file']}: {image.dtype} {list(image.shape)}, "
                              f"expected float32 {entry['shape']}.")
        cases.append(Case(name=entry["name"], image=image, spacing=tuple(float(s) for s in entry["spacing"])))
    return cases


def materialize_realistic_model(root: Path, models_root: Path | None = None) -> Path:
    """The realistic results folder from the bundle's plans, weights made here (what
    ``workloads.build_realistic_model`` writes after planning); reused when its recipe matches."""
    import torch

    from tools.perf import workloads

    models_root = models_root or workloads.PERF_BUILD / "models"
    recipe = workloads.RECIPE
    model_dir = workloads.realistic_model_dir(models_root, recipe)
    source = root / "realistic" / recipe.dataset_name
    record = json.loads((source / workloads.RECIPE_FILE).read_text())
    if record.get("digest") != recipe.digest():
        raise BundleError(f"{source}: realistic recipe {record.get('digest')} is not this checkout's "
                          f"{recipe.digest()} (nnunetv2 {importlib.metadata.version('nnunetv2')}): "
                          "rebuild it.")
    if workloads._recipe_matches(model_dir, recipe):
        return model_dir
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir(parents=True)
    for name in ("plans.json", "dataset.json", "dataset_fingerprint.json"):
        shutil.copy2(source / name, model_dir / name)
    plans = json.loads((model_dir / "plans.json").read_text())
    dataset_json = json.loads((model_dir / "dataset.json").read_text())
    first = model_dir / f"fold_{recipe.folds[0]}" / "checkpoint_final.pth"
    first.parent.mkdir()
    torch.save(workloads._random_checkpoint(plans, dataset_json, recipe.folds[0], recipe.seed), first)
    for fold in recipe.folds[1:]:
        (model_dir / f"fold_{fold}").mkdir()
        os.link(first, model_dir / f"fold_{fold}" / "checkpoint_final.pth")
    shutil.copy2(source / workloads.RECIPE_FILE, model_dir / workloads.RECIPE_FILE)  # last: marks it complete
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="build build/gpu-bundle/nnunet-gpu-bundle.tar.xz")
    make.add_argument("--out", type=Path, default=BUNDLE_DIR)
    make.add_argument("--force", action="store_true", help="rebuild even when the inputs are unchanged")
    commands.add_parser("info", help="print the built bundle's manifest")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "info":
        print((BUNDLE_DIR / "MANIFEST.json").read_text())
        return 0
    try:
        out = build(args.out, force=args.force)
    except (BundleError, subprocess.CalledProcessError) as exc:
        LOGGER.error("%s", exc)
        return 1
    print(f"{out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
