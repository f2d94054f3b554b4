"""The GPU check's environment: running without SimpleITK, emulating the GPU machine's package set in the
dry run, and reading which binaries and libraries the running server and its stubs really loaded.

* :func:`guard_simpleitk`: nnU-Net imports SimpleITK at module level (``default_preprocessor.py``,
  ``simpleitk_reader_writer.py``) but calls it only inside functions that read or write image files, which
  the check never does (its cases are arrays). Where SimpleITK is not installed (the GPU machine) the
  import resolves to a module whose every attribute raises ``ModuleNotFoundError`` naming the attribute, so
  a use is an error that says what happened, never a silent stand-in.
* :class:`DeviceOnly` (``--emulate-device``, the dry run): imports of distributions that the GPU machine
  lacks (``tools.gpu_bundle.DEVICE_PACKAGES``) and the bundle does not carry fail as they would there, so
  a package missing from the bundle fails the dry run here instead of the first command there. It covers
  the check's own process; the stubs are covered by :func:`process_provenance` (no SimpleITK mapped).
* :func:`process_provenance`: tritonserver's and its stub processes' executables and mapped libpython,
  libtritonserver and SimpleITK libraries, from ``/proc``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["AbsentModule", "guard_simpleitk", "DeviceOnly", "process_provenance"]


class AbsentModule(types.ModuleType):
    """A module that is not installed: importing works, using any attribute raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(
            f"{self.__name__} is not installed on this machine (the GPU check runs without it, see "
            f"tools/gpu_env.py); something used {self.__name__}.{name}.", name=self.__name__)


class _AbsentLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return AbsentModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _AbsentFinder(importlib.abc.MetaPathFinder):
    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, name: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name in self.names:
            return importlib.machinery.ModuleSpec(name, _AbsentLoader())
        return None


def guard_simpleitk(*, force: bool = False) -> str:
    """Install the SimpleITK guard where SimpleITK is missing (or always with ``force``); says what it did."""
    if not force and importlib.util.find_spec("SimpleITK") is not None:
        return "installed"
    for name in [m for m in sys.modules if m == "SimpleITK" or m.startswith("SimpleITK.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _AbsentFinder({"SimpleITK"}))
    return "absent (import guard: nnU-Net's module-level imports succeed, any use raises)"


def _normalise(name: str) -> str:
    return name.replace("_", "-").replace(".", "-").lower()


class DeviceOnly(importlib.abc.MetaPathFinder):
    """Refuse top-level imports whose distributions are neither in ``allowed`` nor part of this project."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = {_normalise(n) for n in allowed}
        self.owners = importlib.metadata.packages_distributions()
        self.refused: set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if path is not None or name in sys.stdlib_module_names:
            return None
        owners = self.owners.get(name)
        if not owners or any(_normalise(o) in self.allowed for o in owners):
            return None  # this checkout's modules (tools, repository ...) or an allowed distribution
        self.refused.add(f"{name} ({', '.join(sorted(set(owners)))})")
        raise ModuleNotFoundError(f"No module named {name!r} (dry run emulating the GPU machine, which "
                                  f"lacks {sorted(set(owners))})", name=name)

    def install(self) -> DeviceOnly:
        sys.meta_path.insert(0, self)
        for name in [m for m in sys.modules if m.split(".")[0] in self.owners
                     and not any(_normalise(o) in self.allowed for o in self.owners[m.split(".")[0]])]:
            sys.modules.pop(name, None)  # re-imports go through the emulation too
        return self


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def process_provenance(server_pid: int) -> list[dict[str, Any]]:
    """For tritonserver and every process under it: executable, model (stubs), mapped libraries of note."""
    rows = []
    for pid in _descendants(server_pid):
        proc = Path("/proc") / str(pid)
        try:
            exe = os.readlink(proc / "exe")
            maps = (proc / "maps").read_text()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        libraries = {line.split()[-1] for line in maps.splitlines() if len(line.split()) >= 6}
        rows.append({
            "pid": pid, "exe": exe,
            "model": _stub_model(argv) if exe.endswith("triton_python_backend_stub") else "",
            "libpython": sorted(p for p in libraries if "/libpython3" in p),
            "libtritonserver": sorted(p for p in libraries if "libtritonserver" in p),
            "simpleitk": sorted(p for p in libraries if "simpleitk" in p.lower()),
        })
    return rows


def _stub_model(argv: list[bytes]) -> str:
    """The model a Python-backend stub serves (its first argument: ``<repo>/<model>/<version>/model.py``)."""
    for arg in argv[1:]:
        text = arg.decode(errors="replace")
        if text.endswith(".py"):
            return Path(text).parent.parent.name
    return "?"
