"""Honest health: can the endpoint answer right now? Triton's own checks cannot tell.

Triton 2.51 does not notice a dead Python-backend stub: after ``kill -9`` of a model's stub (what the
kernel's OOM killer does) every request to that model fails with "Stub process '...' is not healthy"
while ``/v2/health/ready`` and the model's ready endpoint still answer 200. So this check looks at
both sides:

* the server's and every model's ready endpoints (``/v2/health/ready``, ``/v2/models/<m>/ready``);
* for every Python-backend model, its stub processes: children of the tritonserver process running
  ``triton_python_backend_stub <repository>/<model>/<version>/model.py ... <instance name>``, as many
  alive (not zombie) as the model's config asks for (``instance_group`` counts, read once from
  ``/v2/models/<m>/config``).

The endpoint is healthy when the server is ready and every model is ready with all its processes. In a
repository of several endpoints and versions (``nnunet_triton.repository.registry``) the models that must be
loaded are the public endpoints and their promoted versions; another version may be loaded or not (it is
built, waiting to be validated or promoted, or kept for a rollback), but when it is loaded it must be whole.
Only the standard library is used (it runs as a Kubernetes exec probe every few seconds): one ``/proc`` scan
and two loopback HTTP requests per model, a few milliseconds (docs/reliability.md).

CLI (exit 0 healthy, 1 not healthy, 2 server unreachable)::

    python -m nnunet_triton.server.health --url 127.0.0.1:8000 --model-repository /models [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.parameters import DEFAULT_HTTP_PORT
from nnunet_triton.repository import ModelRepository
from nnunet_triton.util.process import pid_alive  # re-exported for the watchdog and the handle

__all__ = [
    "STUB_EXECUTABLE",
    "StubProcess",
    "ModelHealth",
    "HealthReport",
    "stub_processes",
    "find_server_pid",
    "pid_alive",
    "repository_models",
    "repository_expectations",
    "expected_instances",
    "check_health",
    "main",
]

STUB_EXECUTABLE = "triton_python_backend_stub"
_SERVER_EXECUTABLE = "tritonserver"
_PYTHON_BACKEND = "python"


@dataclass(frozen=True)
class StubProcess:
    """One live Python-backend stub: the process of one model instance."""

    pid: int
    parent_pid: int
    model: str
    instance: str
    shm_region: str  # its shared-memory region, /dev/shm/<shm_region>
    shm_default_bytes: int = 0  # the region's size at the start (shm-default-byte-size; 0: unknown)


def _proc_entries(proc: Path) -> Iterable[tuple[int, str, int, list[str]]]:
    """``(pid, state, parent pid, argv)`` of every process that can be read."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:  # exited while we looked
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        yield int(entry.name), state, int(ppid), argv


def stub_processes(server_pid: int | None = None, *, proc: str | Path = "/proc") -> list[StubProcess]:
    """The live (not zombie) Python-backend stubs, of ``server_pid`` only when given.

    A stub's argv is ``triton_python_backend_stub <repo>/<model>/<version>/model.py <shm region> <shm
    sizes> <parent pid> <backend dir> <ipc size> <instance name> ...`` (python_backend 2.51); the model
    name is the model.py's grandparent folder.
    """
    found = []
    for pid, state, ppid, argv in _proc_entries(Path(proc)):
        if state == "Z" or not argv or Path(argv[0]).name != STUB_EXECUTABLE or len(argv) < 9:
            continue
        if server_pid is not None and ppid != server_pid:
            continue
        found.append(StubProcess(pid=pid, parent_pid=ppid, model=Path(argv[1]).parent.parent.name,
                                 instance=argv[8], shm_region=argv[2],
                                 shm_default_bytes=int(argv[3]) if argv[3].isdigit() else 0))
    return sorted(found, key=lambda s: s.pid)


SHM_REGION_PREFIX = "triton_python_backend_shm_region_"


def remove_shm_regions(regions: Iterable[str], shm: str | Path = "/dev/shm") -> list[str]:
    """Unlink the named Python-backend shm regions that still exist; return those removed. Only the
    name goes: a process that still maps a region keeps its pages until it unmaps them."""
    removed = []
    for region in sorted(set(regions)):
        path = Path(shm) / region
        if region.startswith(SHM_REGION_PREFIX) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(region)
    return removed


def unmapped_shm_regions(shm: str | Path = "/dev/shm", *, proc: str | Path = "/proc") -> list[str]:
    """Python-backend shm regions in ``shm`` that no visible process maps (left by a server that died)."""
    present = {p.name for p in Path(shm).glob(f"{SHM_REGION_PREFIX}*")}
    for entry in Path(proc).iterdir():
        if not present:
            break
        if entry.name.isdigit():
            try:
                maps = (entry / "maps").read_text(errors="replace")
            except OSError:
                continue
            present = {r for r in present if r not in maps}
    return sorted(present)


def find_server_pid(*, proc: str | Path = "/proc") -> int | None:
    """The pid of the one running ``tritonserver`` (a container's PID 1); None when there is none."""
    pids = [pid for pid, state, _, argv in _proc_entries(Path(proc))
            if state != "Z" and argv and Path(argv[0]).name == _SERVER_EXECUTABLE]
    return min(pids) if pids else None


def repository_models(repository: str | Path) -> list[str]:
    """Model names of a repository folder: its sub-folders holding a ``config.pbtxt``."""
    return ModelRepository(repository).model_folders()


def repository_expectations(repository: str | Path) -> tuple[list[str], list[str]]:
    """(models that must be loaded, models that may be) of a repository: with a registry, the public
    endpoints and their promoted versions, then every other version's models; without one, every model
    folder must be loaded."""
    return ModelRepository(repository).expected_models()


def expected_instances(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Instance names Triton gives a model's instances (``<group name>_<index>``; the group name is
    ``<model>_<group index>`` unless the config names it). A ``KIND_GPU`` group without ``gpus`` counts
    once (a lower bound: Triton makes ``count`` instances per visible GPU)."""
    names = []
    model = str(config.get("name", ""))
    for index, group in enumerate(config.get("instance_group") or [{"count": 1}]):
        group_name = group.get("name") or f"{model}_{index}"
        count = int(group.get("count", 1)) * max(1, len(group.get("gpus") or []))
        names.extend(f"{group_name}_{i}" for i in range(count))
    return tuple(names)


@dataclass(frozen=True)
class ModelHealth:
    """One model: Triton's ready flag and, for Python-backend models, its processes."""

    name: str
    ready: bool
    backend: str | None = None
    expected: tuple[str, ...] = ()  # instance names needing a stub (Python backend only)
    alive: tuple[str, ...] = ()  # instance names with a live stub
    required: bool = True  # False: a version that may be unloaded (not promoted)

    @property
    def missing_processes(self) -> int:
        return max(0, len(self.expected) - len(self.alive))

    @property
    def broken(self) -> bool:
        """Triton calls it ready, but a stub is gone: every request it gets fails."""
        return self.ready and self.missing_processes > 0

    @property
    def ok(self) -> bool:
        return (self.ready or not self.required) and not self.broken

    def problem(self) -> str | None:
        if not self.ready:
            return None if not self.required else f"model {self.name!r} is not ready"
        if self.broken:
            dead = sorted(set(self.expected) - set(self.alive)) or [f"{self.missing_processes} instance(s)"]
            return (f"model {self.name!r}: {len(self.alive)} of {len(self.expected)} Python-backend "
                    f"processes alive (dead: {', '.join(dead)}); Triton still reports it ready")
        return None


@dataclass(frozen=True)
class HealthReport:
    """The verdict: ``healthy`` when the server is ready and every model is ready with its processes."""

    url: str
    server_live: bool
    server_ready: bool
    server_pid: int | None
    models: tuple[ModelHealth, ...] = ()
    errors: tuple[str, ...] = field(default=())

    @property
    def healthy(self) -> bool:
        return self.server_ready and not self.errors and all(m.ok for m in self.models)

    @property
    def broken_models(self) -> list[str]:
        return [m.name for m in self.models if m.broken]

    def problems(self) -> list[str]:
        found = list(self.errors)
        if not self.server_live:
            found.append(f"tritonserver at {self.url} is not live")
        elif not self.server_ready:
            found.append(f"tritonserver at {self.url} is not ready")
        found.extend(p for m in self.models if (p := m.problem()) is not None)
        return found

    def to_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "url": self.url, "server_live": self.server_live,
                "server_ready": self.server_ready, "server_pid": self.server_pid,
                "problems": self.problems(),
                "models": {m.name: {**asdict(m), "ok": m.ok} for m in self.models}}


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never via a proxy
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _model_config(base: str, model: str, timeout_s: float) -> dict[str, Any]:
    status, body = _get(f"{base}/v2/models/{urllib.parse.quote(model)}/config", timeout_s)
    return json.loads(body) if status == 200 else {}


def check_health(
    url: str,
    models: Sequence[str],
    *,
    server_pid: int | None = None,
    timeout_s: float = 2.0,
    config_cache: MutableMapping[str, dict[str, Any]] | None = None,
    stubs: Sequence[StubProcess] | None = None,
    proc: str | Path = "/proc",
    optional: Sequence[str] = (),
) -> HealthReport:
    """Check the server at ``url`` (``host:port`` of HTTP) and ``models`` (and ``optional``: models that may
    be unloaded, but must be whole when loaded).

    ``server_pid`` limits the stubs to that server's children (None: any stub on the machine, right in
    a container). ``config_cache`` keeps model configs between calls (the watchdog's loop); ``stubs``
    is a ``stub_processes`` scan the caller already made.
    """
    base = f"http://{url}"
    cache: MutableMapping[str, dict[str, Any]] = {} if config_cache is None else config_cache
    try:
        live = _get(f"{base}/v2/health/live", timeout_s)[0] == 200
        ready = live and _get(f"{base}/v2/health/ready", timeout_s)[0] == 200
    except (urllib.error.URLError, OSError) as exc:
        return HealthReport(url=url, server_live=False, server_ready=False, server_pid=server_pid,
                            errors=(f"tritonserver at {url} is not reachable ({exc})",))
    stubs = stub_processes(server_pid, proc=proc) if stubs is None else stubs
    report: list[ModelHealth] = []
    errors: list[str] = []
    maybe = set(optional)
    for model in [*models, *(m for m in optional if m not in set(models))]:
        try:
            model_ready = _get(f"{base}/v2/models/{urllib.parse.quote(model)}/ready", timeout_s)[0] == 200
            if not model_ready:
                report.append(ModelHealth(name=model, ready=False, required=model not in maybe))
                continue
            if model not in cache:
                cache[model] = _model_config(base, model, timeout_s)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            errors.append(f"could not check model {model!r}: {exc}")
            continue
        config = cache[model]
        backend = config.get("backend") or config.get("platform") or None
        if backend != _PYTHON_BACKEND:
            report.append(ModelHealth(name=model, ready=True, backend=backend, required=model not in maybe))
            continue
        alive = tuple(sorted(s.instance for s in stubs if s.model == model))
        report.append(ModelHealth(name=model, ready=True, backend=backend, required=model not in maybe,
                                  expected=expected_instances({"name": model, **config}), alive=alive))
    return HealthReport(url=url, server_live=live, server_ready=ready, server_pid=server_pid,
                        models=tuple(report), errors=tuple(errors))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nnunet_triton.server.health",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=f"127.0.0.1:{DEFAULT_HTTP_PORT}",
                        help="host:port of the HTTP endpoint")
    parser.add_argument("--model-repository", required=True, type=Path, help="the served repository folder")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="tritonserver's pid (default: the one tritonserver process found)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per HTTP request (default 2)")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        models, optional = repository_expectations(args.model_repository)
    except OSError as exc:
        sys.stderr.write(f"health: cannot list --model-repository {str(args.model_repository)!r}: {exc}\n")
        return ExitCode.USAGE
    server_pid = args.server_pid if args.server_pid is not None else find_server_pid()
    report = check_health(args.url, models, server_pid=server_pid, timeout_s=args.timeout, optional=optional)
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        problems = report.problems()
        sys.stdout.write("healthy\n" if report.healthy else "not healthy: " + "; ".join(problems) + "\n")
    if not report.server_live:  # 2, as documented for this probe since before the common policy
        return ExitCode.USAGE
    return ExitCode.OK if report.healthy else ExitCode.CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
