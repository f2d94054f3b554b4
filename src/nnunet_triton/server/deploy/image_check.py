"""The serving image's build-time check (docker/Dockerfile, stage ``serving``): ``python3 -m`` this module.

1. **Every import, for real.** Each ``model.py`` adapter is loaded as the Python backend loads it, and then
   every module it or the ``nnunet_triton`` modules it loaded import *inside functions* is imported too: the
   adapters import torch and ``triton_python_backend_utils`` in ``initialize``, the array code imports
   ``scipy.ndimage`` (and on GPU ``cupy``) when it first runs. A module that only the other variant needs
   (``cupy`` on cpu) is allowed to be missing; nothing else is. numpy must be 2 or newer (tensors cross the
   stub by DLPack), torch must be there whatever the fold runner (the orchestrator imports it).
2. **The fixture repository, initialized** (``--fixture DIR`` with a built repository; the cpu image builds
   the SynthCT fixture in its ``fixture`` stage): the container's own server start
   (``thread_budget exec --watchdog --preload LIB -- tritonserver ...``: the command read once by
   ``server_config.from_args``, the budget and the restricted APIs added to that config, rendered once, as
   behind :func:`.docker.server_command`'s entry point) starts on it, on loopback ports, and the check waits
   until :func:`nnunet_triton.server.health.check_health` finds every model ready with its Python-backend
   processes alive. Then the image's preload library is checked at work: tritonserver's
   ``/proc/<pid>/cmdline`` holds the placeholder, not the token, the token opens the model-repository API
   (it reached Triton through the library), and every stub's /dev/shm region is owner-only. Then the
   server is stopped.

Exit status 0 when all passed, 1 with one line per failure otherwise. Runs on the image's Python (3.10 on
the NGC base), so it needs nothing beyond the runtime packages.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["OPTIONAL", "imported_modules", "check_imports", "check_fixture", "main"]

# modules only the other variant has
OPTIONAL = {"cpu": ("cupy", "cupyx"), "gpu": ()}
REQUIRED = ("numpy", "torch", "scipy.ndimage", "triton_python_backend_utils")
BACKEND_UTILS_DIR = Path("/opt/tritonserver/backends/python")  # triton_python_backend_utils.py (NGC, cpu)


def imported_modules(path: Path, *, nested_only: bool = False) -> set[str]:
    """Absolute module names imported by ``path`` (``from a.b import c``: ``a.b``); with ``nested_only``
    only the imports inside function bodies (the lazy ones). An import inside ``try:`` whose ``except``
    catches ImportError has a fallback (``repository.config`` reads config.pbtxt without protobuf, which
    the images lack), so it is not wanted."""
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    scopes: Iterable[ast.AST] = (
        [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if nested_only else [tree]
    )
    fallbacks = [node for node in ast.walk(tree) if isinstance(node, ast.Try) and _catches_import_error(node)]
    guarded = {id(node) for try_node in fallbacks for stmt in try_node.body for node in ast.walk(stmt)}
    names: set[str] = set()
    for scope in scopes:
        for node in ast.walk(scope):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    names.discard("__future__")
    return names


def _catches_import_error(node: ast.Try) -> bool:
    """``try: import x`` ``except ImportError:`` (or ModuleNotFoundError, alone or in a tuple): a fallback."""

    def names(handler_type: ast.expr | None) -> set[str]:
        if isinstance(handler_type, ast.Tuple):
            return {n for element in handler_type.elts for n in names(element)}
        return {handler_type.id} if isinstance(handler_type, ast.Name) else set()

    return any(names(handler.type) & {"ImportError", "ModuleNotFoundError"} for handler in node.handlers)


def _optional(name: str, variant: str) -> bool:
    return any(name == root or name.startswith(f"{root}.") for root in OPTIONAL[variant])


def _load_adapter(path: Path) -> None:
    name = "adapter_" + "_".join(path.parts[-3:]).replace(".py", "").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _load_backend_utils() -> None:
    """``triton_python_backend_utils`` as the stub provides it (a file of the Python backend), by location."""
    path = BACKEND_UTILS_DIR / "triton_python_backend_utils.py"
    if "triton_python_backend_utils" in sys.modules or not path.is_file():
        return
    spec = importlib.util.spec_from_file_location("triton_python_backend_utils", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["triton_python_backend_utils"] = module
        spec.loader.exec_module(module)


def check_imports(adapters: Sequence[Path], variant: str) -> list[str]:
    """Load every adapter and import everything it and the package modules it loaded import; failures."""
    _load_backend_utils()
    failures: list[str] = []
    wanted: set[str] = set(REQUIRED)
    for path in adapters:
        try:
            _load_adapter(path)
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            failures.append(f"adapter {path}: {type(exc).__name__}: {exc}")
            continue
        wanted |= imported_modules(path)
    # the package modules the adapters loaded (not this check's own deploy package, which the stubs never run)
    package_files = {Path(module.__file__) for name, module in list(sys.modules.items())
                     if name.startswith("nnunet_triton") and not name.startswith(__package__ or "-")
                     and getattr(module, "__file__", None)}
    for file in sorted(package_files):
        wanted |= imported_modules(file, nested_only=True)
    for name in sorted(wanted):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if not _optional(name, variant):
                failures.append(f"import {name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a module that raises while importing is broken
            failures.append(f"import {name}: {type(exc).__name__}: {exc}")
    failures += _version_failures(variant)
    return failures


def _version_failures(variant: str) -> list[str]:
    failures = []
    numpy = sys.modules.get("numpy")
    if numpy is not None and int(numpy.__version__.split(".")[0]) < 2:
        failures.append(f"numpy {numpy.__version__}: the stubs need numpy 2 (DLPack; serving/tensors.py)")
    if variant == "gpu" and importlib.util.find_spec("cupy") is None:
        failures.append("cupy is missing: the gpu image's adapters compute with CuPy")
    return failures


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def fixture_command(repository: Path, ports: Sequence[int], preload: Path | None = None) -> list[str]:
    """The container's entry point on ``repository``, loopback only, small shm regions (a build's /dev/shm
    is 64 MiB; the fixture's tensors are small)."""
    from nnunet_triton.server import health
    from nnunet_triton.server.deploy.entrypoint import PRELOAD_LIBRARY
    from nnunet_triton.server.server_config import IMAGE_CHECK, server_config

    http, grpc, metrics = ports
    config = server_config(str(repository), IMAGE_CHECK, load_models=health.repository_models(repository),
                           ports={"http": http, "grpc": grpc, "metrics": metrics}, allow_gpu_metrics=False)
    return [
        sys.executable, "-m", "nnunet_triton.server.thread_budget", "exec", "--watchdog",
        "--preload", str(preload or PRELOAD_LIBRARY), "--model-repository", str(repository), "--",
        *config.to_args(),
    ]


def preload_failures(server_pid: int, url: str, token: str, shm: Path = Path("/dev/shm")) -> list[str]:
    """What the preload library failed to do for the running server: the token on its command line, the
    token not reaching Triton (the model-repository API refuses it), a stub's region readable by others."""
    from nnunet_triton.errors import NnunetTritonError
    from nnunet_triton.server import health
    from nnunet_triton.server.model_control import ModelControl

    failures = []
    if token.encode() in Path(f"/proc/{server_pid}/cmdline").read_bytes():
        failures.append("the control token is on tritonserver's command line (the preload library did not "
                        "take it)")
    try:
        ModelControl(url, token, timeout_s=30).index()
    except NnunetTritonError as exc:
        failures.append(f"the token did not reach tritonserver through the preload library: {exc}")
    for stub in health.stub_processes(server_pid):
        region = shm / stub.shm_region
        if region.exists() and region.stat().st_mode & 0o077:
            failures.append(f"the /dev/shm region {region} is {oct(region.stat().st_mode & 0o777)}, "
                            "not owner-only")
    return failures


def check_fixture(repository: Path, timeout_s: float = 600.0) -> list[str]:
    """Start the entry point on ``repository`` and wait until every model is healthy; failures."""
    from nnunet_triton.server import health
    from nnunet_triton.util.process import terminate

    models = health.repository_models(repository)
    ports = _free_ports(3)
    with tempfile.TemporaryDirectory() as tmp:
        token = secrets.token_urlsafe(24)  # known here, so the check can look for it
        env = {**os.environ, "NNUNET_TRITON_CACHE_DIR": tmp,  # the thread check's cache: not in the image
               "NNUNET_TRITON_CONTROL_TOKEN": token}
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(fixture_command(repository, ports), stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
        start, report = time.monotonic(), None
        try:
            while time.monotonic() - start < timeout_s and process.poll() is None:
                report = health.check_health(f"127.0.0.1:{ports[0]}", models, server_pid=process.pid)
                if report.healthy:
                    sys.stdout.write(f"image check: fixture repository {repository} healthy after "
                                     f"{time.monotonic() - start:.1f} s ({', '.join(models)})\n")
                    failures = preload_failures(process.pid, f"127.0.0.1:{ports[0]}", token)
                    if not failures:
                        sys.stdout.write("image check: the preload library keeps the token off "
                                         "tritonserver's command line and its /dev/shm regions owner-only\n")
                    return failures
                time.sleep(1)
        finally:
            if process.poll() is None:
                terminate(process.pid, 60.0, group=True, alive=lambda: process.poll() is None,
                          kill_wait_s=10.0)
        tail = log_path.read_text(errors="replace")[-4000:]
    why = "exited" if process.returncode is not None else f"not healthy after {timeout_s:.0f} s"
    problems = "; ".join(report.problems()) if report is not None else "no health report"
    return [f"fixture repository {repository}: the server {why} ({problems}); its log ends:\n{tail}"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m nnunet_triton.server.deploy.image_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=tuple(OPTIONAL), required=True)
    parser.add_argument("--adapters", type=Path, nargs="+", required=True, help="model.py files to load")
    parser.add_argument("--fixture", type=Path, default=None,
                        help="a built repository to serve (an empty or missing directory: skipped)")
    parser.add_argument("--timeout", type=float, default=600.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    failures = check_imports(args.adapters, args.variant)
    if not failures:
        sys.stdout.write(f"image check: {len(args.adapters)} adapters and everything they import load "
                         f"({args.variant}; numpy {sys.modules['numpy'].__version__}, "
                         f"torch {sys.modules['torch'].__version__})\n")
    fixture = args.fixture
    if not failures and fixture is not None and fixture.is_dir() and any(fixture.iterdir()):
        failures += check_fixture(fixture, args.timeout)
    elif not failures:
        sys.stdout.write("image check: no fixture repository to serve here\n")
    for failure in failures:
        sys.stderr.write(f"image check FAILED: {failure}\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
