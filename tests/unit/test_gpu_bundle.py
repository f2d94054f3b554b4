"""The GPU bundle's pieces that need no build: the loader-output parser, the libpython choice on this
machine's real stub, the refusal of unsafe archives, the lock pins and the SimpleITK guard.
The built bundle itself is exercised by tests/triton/test_gpu_check_dry_run.py."""

from __future__ import annotations

import importlib.util
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tools import gpu_bundle, gpu_env

LDD = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibcudart-09529672.so.12.6.77 => /b/site/nvidia_pytriton.libs/libcudart-09529672.so.12.6.77 (0x00007f1)
\tlibpython3.12.so.1.0 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f3)
"""


def test_parse_ldd_reads_resolved_and_missing_libraries_and_skips_the_vdso_and_loader():
    assert gpu_bundle.parse_ldd(LDD) == {
        "libcudart-09529672.so.12.6.77": "/b/site/nvidia_pytriton.libs/libcudart-09529672.so.12.6.77",
        "libpython3.12.so.1.0": None, "libc.so.6": "/lib/x86_64-linux-gnu/libc.so.6"}


def _stub_root(tmp_path: Path, version: str) -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or shutil.which("ldd") is None:
        pytest.skip("nvidia-pytriton (make setup) and ldd are needed")
    source = Path(next(iter(spec.submodule_search_locations)))
    stub = source / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
    root = tmp_path / "bundle"
    target = root / "site" / "pytriton" / "tritonserver" / "python_backend_stubs" / version
    target.mkdir(parents=True)
    shutil.copy2(stub, target)
    shutil.copytree(source.parent / "nvidia_pytriton.libs", root / "site" / "nvidia_pytriton.libs")
    return root


def test_the_machines_own_libpython_is_taken_when_the_loader_finds_it(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    root = _stub_root(tmp_path, version)
    resolved = gpu_bundle.parse_ldd(subprocess.run(
        ["ldd", str(next(root.rglob("triton_python_backend_stub")))], capture_output=True, text=True).stdout)
    if not resolved.get(f"libpython{version}.so.1.0"):
        pytest.skip("this machine's loader finds no libpython for the running Python")
    plan = gpu_bundle.libpython_plan(root)
    assert plan.source == "machine" and plan.lib_dir is None


def test_without_one_on_the_machine_the_bundles_fallback_is_used_and_without_a_fallback_it_is_an_error(
        tmp_path):
    root = _stub_root(tmp_path, "3.12")  # this machine has no Python 3.12
    with pytest.raises(gpu_bundle.BundleError, match="no libpython3.12.so.1.0"):
        gpu_bundle.libpython_plan(root, version="3.12", python_libdir=str(tmp_path))
    fallback = root / "libpython" / "3.12" / "libpython3.12.so.1.0"
    fallback.parent.mkdir(parents=True)
    fallback.write_bytes(b"\x7fELF")
    plan = gpu_bundle.libpython_plan(root, version="3.12", python_libdir=str(tmp_path))
    assert (plan.source, plan.lib_dir) == ("bundle", str(fallback.parent))


def test_a_libpython_in_the_running_pythons_libdir_comes_before_the_fallback(tmp_path):
    root = _stub_root(tmp_path, "3.12")
    libdir = tmp_path / "prefix" / "lib"
    libdir.mkdir(parents=True)
    (libdir / "libpython3.12.so.1.0").write_bytes(b"\x7fELF")
    plan = gpu_bundle.libpython_plan(root, version="3.12", python_libdir=str(libdir))
    assert (plan.source, plan.lib_dir) == ("machine-libdir", str(libdir))


def _tar(tmp_path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    path = tmp_path / "evil.tar.xz"
    with tarfile.open(path, "w:xz") as tar:
        tar.addfile(member, io.BytesIO(data) if data else None)
    return path


@pytest.mark.parametrize("name", ["../escape.txt", "/etc/escape.txt", "nnunet-gpu-bundle/../../x"])
def test_unpack_refuses_members_that_leave_the_target_folder(tmp_path, name):
    info = tarfile.TarInfo(name)
    info.size = 1
    with pytest.raises(gpu_bundle.BundleError, match="refusing archive member"):
        gpu_bundle.unpack(_tar(tmp_path, info, b"x"), tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_unpack_refuses_links(tmp_path):
    info = tarfile.TarInfo("nnunet-gpu-bundle/link")
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(gpu_bundle.BundleError, match="neither a file nor a folder"):
        gpu_bundle.unpack(_tar(tmp_path, info), tmp_path / "out")


def test_every_carried_package_is_pinned_by_the_lock():
    pins = gpu_bundle.lock_versions((*gpu_bundle.DEVICE_PURE, *gpu_bundle.DEVICE_COMPILED))
    assert set(pins) == {*gpu_bundle.DEVICE_PURE, *gpu_bundle.DEVICE_COMPILED} and all(pins.values())
    assert not {gpu_bundle._normalise(n) for n in pins} & gpu_bundle.DEVICE_PACKAGES


def test_an_unpinned_package_names_itself_and_the_lock(tmp_path):
    lock = tmp_path / "constraints.txt"
    lock.write_text("numpy==2.4.6\n")
    with pytest.raises(gpu_bundle.BundleError, match=r"pins no version of \['nnunetv2'\]"):
        gpu_bundle.lock_versions(["numpy", "nnunetv2"], lock)



def test_the_bundle_takes_the_gpu_machines_package_list_from_its_data_file():
    machine = gpu_bundle.load_machine(gpu_bundle.MACHINE_FILE)
    assert gpu_bundle.MACHINE_FILE.name == "gpu_machine.toml"
    assert (gpu_bundle.DEVICE_PYTHON, gpu_bundle.DEVICE_ABI, gpu_bundle.DEVICE_SITE) == (
        "3.12", "cp312", "site-cp312")
    assert gpu_bundle.STUB_PYTHONS == ("3.12", "3.11")
    assert gpu_bundle.DEVICE_PACKAGES == machine.installed
    assert {"torch", "cupy-cuda13x", "numpy"} <= machine.installed and len(machine.installed) == 197
    assert (gpu_bundle.DEVICE_PURE, gpu_bundle.DEVICE_COMPILED) == (machine.pure, machine.compiled)
    assert gpu_bundle.DEVICE_OPTIONAL == machine.optional
    assert machine.notable == {"torch": "2.11+cu130", "cupy": "cupy-cuda13x", "numpy": "2.5"}


def test_another_gpu_machine_is_a_change_of_the_data_file_only(tmp_path):
    machine_file = tmp_path / "gpu_machine.toml"
    machine_file.write_text(
        gpu_bundle.MACHINE_FILE.read_text().replace('python = "3.12"', 'python = "3.13"')
        .replace('numpy = "2.5"', 'numpy = "2.6"').replace('"nibabel", ', ''))
    machine = gpu_bundle.load_machine(machine_file)
    assert (machine.python, machine.abi, machine.notable["numpy"]) == ("3.13", "cp313", "2.6")
    assert "nibabel" not in machine.pure and "nnunetv2" in machine.pure


def test_a_gpu_machine_file_without_a_section_names_the_file_and_the_section(tmp_path):
    machine_file = tmp_path / "gpu_machine.toml"
    machine_file.write_text('python = "3.12"\n[notable]\n')
    with pytest.raises(gpu_bundle.BundleError, match=r"gpu_machine.toml: cannot read .*'installed'"):
        gpu_bundle.load_machine(machine_file)


@pytest.fixture
def import_cache_restored(monkeypatch):
    """The emulation drops every module of a refused distribution from the import cache (pytest's own,
    protobuf's, torch's ...), the guard SimpleITK's: put the whole cache back, or later tests re-import
    C extensions."""
    saved = dict(sys.modules)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield
    sys.modules.clear()
    sys.modules.update(saved)


def test_the_simpleitk_guard_lets_imports_succeed_and_every_use_fail(import_cache_restored):
    assert gpu_env.guard_simpleitk(force=True).startswith("absent")
    import SimpleITK  # noqa: F401 - what nnU-Net's modules do at import

    with pytest.raises(ModuleNotFoundError, match=r"something used SimpleITK.ReadImage"):
        SimpleITK.ReadImage("x.nii.gz")


def test_the_device_emulation_refuses_a_distribution_the_gpu_machine_lacks(import_cache_restored):
    emulation = gpu_env.DeviceOnly({"numpy"}).install()
    assert "yaml" not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="emulating the GPU machine"):
        import yaml  # noqa: F401 - PyYAML is installed here, and not allowed in this emulation
    import numpy  # noqa: F401 - allowed

    assert any(name.startswith("yaml") for name in emulation.refused)
