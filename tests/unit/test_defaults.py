"""Every default and policy is defined once: ``src/`` and ``tools/`` hold no second literal of the tile step,
the tile batch and batches in flight, the ports, the client timeout, the registry file name or the ready
deadline; ``src/`` returns no exit code as a bare number (``nnunet_triton.exit_codes``), sends SIGKILL only
through ``util.process`` and, in ``server/`` and ``cli/``, writes no file but through ``util.durable``.

The source is read with ``ast`` (docstrings and comments may name a value; code may not). A literal counts
when the name it is given says what it is: the keyword, parameter, assigned name or command-line option it
sits in (``tile_step_size=0.5``, ``timeout_s: float = 600.0``, ``--timeout ... default=600.0``). Ports and
the file name count wherever they appear. An exit code counts where a command's ``main``/``run`` returns it,
in ``sys.exit``/``SystemExit`` and in a name ``EXIT_*``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("src", "tools")

# (rule, file) other work owns at the time of writing: to be switched to the owners when that work is merged.
# An entry whose file no longer holds such a literal fails test_pending_names_only_files_that_still_hold_...
PENDING: dict[tuple[str, str], str] = {
    ("tile step 0.5", "tools/gpu_timings.py"): "tile step 0.5 of the GPU timings",
    ("client timeout 600 s", "tools/gpu_timings.py"): "client_timeout=600 of the GPU timings",
    ("tile batch / in flight 4", "tools/gpu_parity.py"): "tiles per fold batch 4 of the GPU parity check",
}


def _is_number(node: ast.AST, value: float) -> bool:
    return (isinstance(node, ast.Constant) and type(node.value) in (int, float)
            and node.value == value)


def _label_of_call_argument(call: ast.Call, keyword: str | None, position: int | None) -> str:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "?")
    if keyword == "default" and call.args and isinstance(call.args[0], ast.Constant):
        return str(call.args[0].value)  # add_argument("--tile-step-size", default=...)
    return keyword if keyword is not None else f"{name}[{position}]"


def _call_labels(node: ast.Call) -> Iterator[tuple[str, ast.AST]]:
    for i, arg in enumerate(node.args):
        yield _label_of_call_argument(node, None, i), arg
    for kw in node.keywords:
        yield _label_of_call_argument(node, kw.arg, None), kw.value


Function = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def _default_labels(node: Function) -> Iterator[tuple[str, ast.AST]]:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    yield from ((arg.arg, default) for arg, default in
                zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True))
    yield from ((arg.arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                if default is not None)


def _assign_labels(node: ast.Assign | ast.AnnAssign) -> Iterator[tuple[str, ast.AST]]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        if node.value is not None:
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "?")
            yield name, node.value


def labelled_constants(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(label, value) for every value with a name that says what it is (see the module docstring)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield from _call_labels(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _default_labels(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            yield from _assign_labels(node)
        elif isinstance(node, ast.Dict):
            yield from ((str(key.value), value) for key, value in zip(node.keys, node.values, strict=True)
                        if isinstance(key, ast.Constant))


def _strings(tree: ast.AST) -> Iterator[ast.Constant]:
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def _trees() -> Iterator[tuple[str, ast.AST]]:
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            yield relative, ast.parse(path.read_text(), filename=relative)


def _labelled_any(label: Callable[[str], bool]) -> Callable[[ast.AST], list[str]]:
    """Every number whose name ``label`` accepts, whatever its value."""
    def find(tree: ast.AST) -> list[str]:
        return [f"{name}={node.value}" for name, node in labelled_constants(tree)  # type: ignore[attr-defined]
                if isinstance(node, ast.Constant) and type(node.value) in (int, float) and label(name)]
    return find


def _labelled(value: float, label: Callable[[str], bool]) -> Callable[[ast.AST], list[str]]:
    def find(tree: ast.AST) -> list[str]:
        return [name for name, node in labelled_constants(tree) if _is_number(node, value) and label(name)]
    return find


def _ports(tree: ast.AST) -> list[str]:
    found = {f"{node.lineno}:{node.value}" for node in ast.walk(tree)
             if any(_is_number(node, port) for port in (8000, 8001, 8002))}
    found |= {f"{node.lineno}:{node.value}" for node in _strings(tree)
              if re.search(r":800[012]\b", node.value)}
    return sorted(found)


def _metadata_file(tree: ast.AST) -> list[str]:
    literal = [f"{node.lineno}" for node in _strings(tree) if node.value == "repository_metadata.json"]
    aliases = [name for name, node in labelled_constants(tree)
               if isinstance(node, ast.Attribute) and node.attr == "REPOSITORY_METADATA_FILE"]
    return literal + [f"alias {name}" for name in aliases]


STEP_FUNCTIONS = {"compute_steps_for_sliding_window", "tile_slicers"}  # step is their 3rd argument


def _step(name: str) -> bool:
    return "step" in name.lower() or name.split("[")[0] in STEP_FUNCTIONS


def _ready_deadline(name: str) -> bool:
    return "ready" in name.lower() and "timeout" in name.lower()


EXIT_FUNCTIONS = re.compile(r"^(main|run|run_\w+|_run\w*|_cmd_\w+)$")  # what a command's exit status is


def _int_constant(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _exit_codes(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ExitCode":  # the owner's members
            found += [f"{node.name}.{item.targets[0].id}" for item in node.body  # type: ignore[attr-defined]
                      if isinstance(item, ast.Assign) and _int_constant(item.value)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and EXIT_FUNCTIONS.match(node.name):
            found += [f"{node.lineno}:return {ret.value.value} in {node.name}"  # type: ignore[union-attr]
                      for ret in ast.walk(node) if isinstance(ret, ast.Return) and _int_constant(ret.value)]
        elif isinstance(node, ast.Call) and node.args and _int_constant(node.args[0]):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("exit", "SystemExit", "_exit"):
                found.append(f"{node.lineno}:{name}({node.args[0].value})")  # type: ignore[attr-defined]
    found += [f"{name}" for name, node in labelled_constants(tree)
              if name.upper().startswith("EXIT_") and _int_constant(node) and "TIMEOUT" not in name.upper()]
    return sorted(set(found))


def _sigkill(tree: ast.AST) -> list[str]:
    """SIGKILL named, or a process object's ``.kill()`` / ``.terminate()`` (no arguments)."""
    found = [f"{node.lineno}:SIGKILL" for node in ast.walk(tree)
             if (isinstance(node, ast.Attribute) and node.attr == "SIGKILL")
             or (isinstance(node, ast.Name) and node.id == "SIGKILL")]
    found += [f"{node.lineno}:.{node.func.attr}()" for node in ast.walk(tree)  # type: ignore[attr-defined]
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("kill", "terminate") and not node.args and not node.keywords]
    return sorted(found)


def _plain_writes(tree: ast.AST) -> list[str]:
    """``.write_text(...)`` / ``.write_bytes(...)``: a file written in place, not through util.durable."""
    return [f"{node.lineno}:.{node.func.attr}" for node in ast.walk(tree)  # type: ignore[attr-defined]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("write_text", "write_bytes")]


# rule: (finder, {owner file: the literals it holds})
RULES = {
    "tile step 0.5": (_labelled(0.5, _step), {"src/nnunet_triton/options.py": 1}),
    "tile batch / in flight 4": (
        _labelled(4, lambda name: re.search(r"batch_size|inflight|in_flight", name.lower()) is not None),
        {"src/nnunet_triton/parameters.py": 2}),
    "ports 8000/8001/8002": (_ports, {"src/nnunet_triton/parameters.py": 3}),
    "client timeout 600 s": (_labelled(600, lambda name: "timeout" in name.lower()),
                             {"src/nnunet_triton/options.py": 1}),
    "repository_metadata.json": (_metadata_file, {"src/nnunet_triton/io_names.py": 1}),
    "ready deadline": (_labelled_any(_ready_deadline), {"src/nnunet_triton/server/readiness.py": 1}),
    "exit code literal": (_exit_codes, {"src/nnunet_triton/exit_codes.py": 5}),
    "SIGKILL outside util.process": (_sigkill, {"src/nnunet_triton/util/process.py": 2}),
    "state file written in place": (_plain_writes, {}),
}
# where a rule looks (default: all of SOURCES)
SCOPE = {
    "exit code literal": ("src/",),
    "SIGKILL outside util.process": ("src/",),
    "state file written in place": ("src/nnunet_triton/server/", "src/nnunet_triton/cli/"),
}

# Literals of the same value that are not the same default, each with its reason.
TIMEOUT = "client timeout 600 s"
ALLOWED = {
    (TIMEOUT, "src/nnunet_triton/repository/registry.py"): "waiting for the repository lock, not a request",
    (TIMEOUT, "tools/container_host.py"): "apt-get update's time limit",
    (TIMEOUT, "src/nnunet_triton/server/deploy/image_check.py"):
        "how long the image check waits for the fixture's models to load",
    (TIMEOUT, "src/nnunet_triton/server/deploy/service.py"):
        "--ready-timeout (the server's start) and podman volume import's time limit",
    (TIMEOUT, "src/nnunet_triton/client/dicom/node.py"): "joining the node's worker at shutdown",
    (TIMEOUT, "tools/orthanc.py"): "installing Orthanc with apt-get",
    (TIMEOUT, "src/nnunet_triton/server/readiness.py"): "READY_TIMEOUT_S: the server's start, not a request",
    # tools that load more than one server start does get a longer deadline of their own
    ("ready deadline", "tools/validate.py"): "a whole trained model (every fold), not a test fixture",
    ("ready deadline", "tools/gpu_check.py"): "the GPU bundle: every fold model of the GPU machine's check",
    ("ready deadline", "tools/perf/run.py"): "benchmarks: several repositories served by one server",
    ("ready deadline", "tools/perf/defaults.py"): "benchmarks: repositories of every tile batch and runner",
    ("ready deadline", "tools/perf/fold_runners.py"): "benchmarks: the libtorch and Python fold runners",
    ("SIGKILL outside util.process", "src/nnunet_triton/client/dicom/receiving.py"):
        "assoc.kill(): a pynetdicom association's abort, not a process",
    ("state file written in place", "src/nnunet_triton/server/preload.py"):
        "the C source compiled once, in the build's own temporary folder",
    ("state file written in place", "src/nnunet_triton/server/exactness.py"):
        "the child's spec and result, in the check's own temporary folder",
}


def found_literals() -> dict[str, dict[str, list[str]]]:
    """{rule: {file: [where]}} over src/ and tools/."""
    found: dict[str, dict[str, list[str]]] = {rule: {} for rule in RULES}
    for relative, tree in _trees():
        for rule, (find, _owners) in RULES.items():
            if not relative.startswith(SCOPE.get(rule, ("",))):
                continue
            hits = find(tree)
            if hits:
                found[rule][relative] = hits
    return found


@pytest.fixture(scope="module")
def literals() -> dict[str, dict[str, list[str]]]:
    return found_literals()


@pytest.mark.parametrize("rule", RULES)
def test_default_is_written_once_in_its_owner(rule, literals):
    _find, owners = RULES[rule]
    others = {path: hits for path, hits in literals[rule].items()
              if path not in owners and (rule, path) not in ALLOWED and (rule, path) not in PENDING}
    assert others == {}, f"{rule}: a second literal; import the default from {sorted(owners)} instead"
    assert {owner: len(literals[rule].get(owner, [])) for owner in owners} == owners


def test_allow_list_names_only_files_that_still_hold_such_a_literal(literals):
    stale = sorted(key for key in ALLOWED if key[1] not in literals[key[0]])
    assert stale == []


def test_pending_names_only_files_that_still_hold_such_a_literal(literals):
    # a file switched to the owner leaves the list: else it would hide the next literal written there
    stale = sorted(key for key in PENDING if key[1] not in literals[key[0]])
    assert stale == []


def test_a_stale_pending_entry_is_found(literals, monkeypatch):
    monkeypatch.setitem(PENDING, ("ports 8000/8001/8002", "src/nnunet_triton/server/watchdog.py"), "old")
    with pytest.raises(AssertionError):
        test_pending_names_only_files_that_still_hold_such_a_literal(literals)


def test_scanner_finds_a_second_literal_in_each_form():
    source = '''
def predict(tile_step_size=0.5, *, max_inflight=4, timeout_s: float = 600.0): ...
client = Client(url="127.0.0.1:8001", timeout_s=600)
parser.add_argument("--tile-step-size", default=0.5)
tile_slicers(shape, patch, 0.5)
METADATA = io_names.REPOSITORY_METADATA_FILE
NAME = "repository_metadata.json"
start(repo, ready_timeout_s=120.0)
RESTART_READY_TIMEOUT_S = 300.0
EXIT_BAD_REPOSITORY = 78
def main():
    if bad:
        return 2
    sys.exit(3)
def run_once():
    raise SystemExit(1)
os.killpg(pid, signal.SIGKILL)
process.kill()
Path(pid_file).write_text("1\\n")
'''
    tree = ast.parse(source)
    assert {rule: find(tree) for rule, (find, _owners) in RULES.items()} == {
        "tile step 0.5": ["tile_step_size", "--tile-step-size", "tile_slicers[2]"],
        "tile batch / in flight 4": ["max_inflight"],
        "ports 8000/8001/8002": ["3:127.0.0.1:8001"],
        "client timeout 600 s": ["timeout_s", "timeout_s"],
        "repository_metadata.json": ["7", "alias METADATA"],
        "ready deadline": ["RESTART_READY_TIMEOUT_S=300.0", "ready_timeout_s=120.0"],
        "exit code literal": ["11:return 2 in main", "14:exit(3)", "16:SystemExit(1)", "EXIT_BAD_REPOSITORY"],
        "SIGKILL outside util.process": ["17:SIGKILL", "18:.kill()"],
        "state file written in place": ["19:.write_text"],
    }


def test_listen_help_states_the_defaults_of_the_node_it_leaves_to_node_config(capsys):
    # listen passes its timing flags only when given (NodeConfig's module loads pydicom, too heavy for the
    # parser of every command), so its help text is the one place that repeats them: it must agree
    from nnunet_triton import cli
    from nnunet_triton.client.dicom.node import NodeConfig

    with pytest.raises(SystemExit):
        cli.main(["listen", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = {name: field.default for name, field in NodeConfig.__dataclass_fields__.items()}
    for shown in (f"series is complete (default {defaults['idle_timeout_s']:g})",
                  f"first failure (default {defaults['retry_window_s'] / 3600:g}h)",
                  f"doubling (default {defaults['retry_delay_s']:g})",
                  f"longest retry delay (default {defaults['max_retry_delay_s']:g})",
                  f"are refused (default {defaults['max_busy_s']:g})"):
        assert shown in text


def test_deploy_and_serve_flags_left_out_give_the_defaults_of_the_dataclasses_that_own_them(tmp_path):
    from nnunet_triton.cli import deploy, serve
    from nnunet_triton.server import readiness
    from nnunet_triton.server.deploy import k8s, service
    from nnunet_triton.server.deploy.sizing import VolumeSpec
    from nnunet_triton.server.embedded import LaunchOptions

    plan = deploy._plan(deploy._parser(False).parse_args(["--model-dir", str(tmp_path)]), undeploy=False)
    assert plan == service.DeployPlan(target=plan.target, out=plan.out, endpoints=plan.endpoints)
    spec = k8s.K8sSpec.__dataclass_fields__
    assert (plan.min_replicas, plan.max_replicas, plan.latency_target_us, plan.autoscaler,
            plan.container_name) == tuple(spec[name].default for name in (
                "min_replicas", "max_replicas", "latency_target_us", "autoscaler", "name"))
    assert plan.max_volume == VolumeSpec().shape
    served = serve._parser().parse_args(["start", "--model-repository", str(tmp_path)])
    assert served.ready_timeout == LaunchOptions().ready_timeout_s == plan.ready_timeout \
        == readiness.READY_TIMEOUT_S
