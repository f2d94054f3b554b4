"""server.server_config: one TritonServerConfig renders every target's tritonserver command line."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from deploy_support import write_repository

from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.builder.torch_compat import DEFAULT_TRITON_RELEASE, GPU_TRITON_RELEASE
from nnunet_triton.server import embedded, health, preload
from nnunet_triton.server import server_config as server_config_module
from nnunet_triton.server.deploy import docker, image_check, sizing
from nnunet_triton.server.deploy.repository_info import RepositoryInfo
from nnunet_triton.server.restart import LaunchSpec
from nnunet_triton.server.server_config import (
    CLIENT_SHM_FLAG_SINCE,
    CONTAINER,
    EMBEDDED,
    IMAGE_CHECK,
    TOKEN_FROM_ENVIRONMENT,
    GrpcTls,
    MemoryPools,
    TritonServerConfig,
    client_shm_setting,
    server_config,
)
from nnunet_triton.server.thread_budget import CpuQuota, plan_budget
from nnunet_triton.server.triton_install import TritonInstallation

SRC = Path(__file__).resolve().parents[2] / "src" / "nnunet_triton"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


def _flags(argv: list[str] | tuple[str, ...]) -> dict[str, list[str]]:
    """``--name=value`` flags of a tritonserver argv by name, values in order (bare flags: [""])."""
    flags: dict[str, list[str]] = {}
    for arg in argv[argv.index(next(a for a in argv if a.endswith("tritonserver"))) + 1:]:
        name, _, value = arg.partition("=")
        flags.setdefault(name, []).append(value)
    return flags


def _embedded_argv(repo: Path, tmp_path: Path, *, preload_library: Path | None,
                   ports: dict[str, int | None] | None = None) -> list[str]:
    installation = TritonInstallation(server_dir=tmp_path / "server", lib_dirs=(), python_bin_dir=tmp_path)
    budget = plan_budget(1, env={}, quota=CpuQuota(2, 2, None, "test"))
    token_flag = preload.PLACEHOLDER if preload_library is not None else "secret-token"
    options = embedded.LaunchOptions(exit_timeout_s=EMBEDDED.exit_timeout_s)
    return embedded._server_config((repo,), options, installation, tmp_path / "backends",
                                   tuple(health.repository_models(repo)), budget, MemoryPools(), token_flag,
                                   PORTS if ports is None else ports).to_args()


def test_every_target_renders_the_same_flags_except_its_presets_explicit_differences(tmp_path: Path) -> None:
    repo = write_repository(tmp_path / "repo", BuildOptions(target="cpu"))
    info = RepositoryInfo.from_repository(repo)
    plan = sizing.plan_memory(info, sizing.VolumeSpec())
    targets = {
        "container": _flags(docker.tritonserver_args(info, plan, gpus=0, repository=str(repo))),
        "image-check": _flags(image_check.fixture_command(repo, list(PORTS.values()))),
        "embedded": _flags(_embedded_argv(repo, tmp_path, preload_library=tmp_path / "preload.so")),
    }
    presets = {"container": CONTAINER, "image-check": IMAGE_CHECK, "embedded": EMBEDDED}
    explicit = {  # what each target adds on top of the common flags
        "container": {"--allow-metrics", "--allow-gpu-metrics"},
        "image-check": {"--http-address", "--grpc-address", "--metrics-address", "--allow-gpu-metrics"},
        "embedded": {"--http-address", "--grpc-address", "--metrics-address", "--backend-directory",
                     "--cache-directory", "--http-restricted-api", "--grpc-restricted-protocol"},
    }
    common = {name: flags for name, flags in targets.items()}
    for name, flags in targets.items():
        preset = presets[name]
        assert flags["--exit-timeout-secs"] == [str(preset.exit_timeout_s)]
        assert flags["--backend-config"] == [f"python,shm-default-byte-size={preset.shm_default_bytes}",
                                             f"python,shm-growth-byte-size={preset.shm_growth_bytes}",
                                             "python,stub-timeout-seconds=120"]
        for address in ("--http-address", "--grpc-address", "--metrics-address"):
            assert flags.get(address, [None]) == [preset.host]
        common[name] = {k: v for k, v in flags.items()
                        if k not in explicit[name] | {"--exit-timeout-secs", "--backend-config"}}
    assert common["embedded"] == common["image-check"] == {**common["container"],
                                                           "--model-repository": [str(repo)]}
    assert common["container"]["--strict-readiness"] == ["true"]
    assert common["container"]["--load-model"] == list(info.models)
    assert sizing.SHM_DEFAULT_BYTES == CONTAINER.shm_default_bytes == plan.shm_default_bytes
    assert sizing.SHM_GROWTH_BYTES == CONTAINER.shm_growth_bytes == plan.shm_growth_bytes


def test_the_embedded_command_carries_the_preload_placeholder_never_the_token(tmp_path: Path) -> None:
    repo = write_repository(tmp_path / "repo", BuildOptions(target="cpu"))
    argv = _embedded_argv(repo, tmp_path, preload_library=tmp_path / "preload.so")
    assert not any("secret-token" in a for a in argv)
    assert [a for a in argv if preload.PLACEHOLDER in a] == [a for a in argv if "restricted" in a] != []


def test_every_target_renders_the_sagemaker_and_vertex_frontends_off(tmp_path: Path) -> None:
    repo = write_repository(tmp_path / "repo", BuildOptions(target="cpu"))
    info = RepositoryInfo.from_repository(repo)
    plan = sizing.plan_memory(info, sizing.VolumeSpec())
    for argv in (docker.tritonserver_args(info, plan, gpus=0, repository=str(repo)),
                 image_check.fixture_command(repo, list(PORTS.values())),
                 _embedded_argv(repo, tmp_path, preload_library=tmp_path / "preload.so")):
        flags = _flags(argv)
        assert (flags["--allow-sagemaker"], flags["--allow-vertex-ai"]) == (["false"], ["false"])


@pytest.mark.parametrize("arg", ["--allow-vertex-ai=true", "--vertex-ai-default-model=nnunet",
                                 "--vertex-ai-port=8080", "--allow-sagemaker=true", "--sagemaker-port=8080",
                                 "--sagemaker-safe-port-range=1-65535"])
def test_flags_that_open_the_sagemaker_or_vertex_frontend_are_refused_naming_the_flag(arg: str) -> None:
    with pytest.raises(ValueError, match=f"the tritonserver flag '{arg}' is refused: Triton's SageMaker and "
                                         f"Vertex AI frontends stay off"):
        server_config("/models", EMBEDDED, load_models=(), extra_args=("--log-verbose=1", arg))
    with pytest.raises(ValueError, match=f"'{arg}' is refused"):  # before anything is prepared or started
        embedded.start(Path(__file__).parent, extra_args=(arg,), home=Path("/nonexistent-home"))


def test_the_frontends_variables_are_dropped_from_the_servers_environment() -> None:
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9", "AIP_STORAGE_URI": "gs://x",
           "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "nnunet", "PATH": "/bin", "MY_AIP_MODE": "kept"}
    assert server_config_module.without_frontend_environment(env) == {"PATH": "/bin", "MY_AIP_MODE": "kept"}


def test_the_embedded_command_opens_no_metrics_endpoint_without_a_metrics_port(tmp_path: Path) -> None:
    repo = write_repository(tmp_path / "repo", BuildOptions(target="cpu"))
    argv = _embedded_argv(repo, tmp_path, preload_library=tmp_path / "preload.so",
                          ports={**PORTS, "metrics": None})
    flags = _flags(argv)
    assert flags["--allow-metrics"] == ["false"]
    assert "--metrics-port" not in flags and "--metrics-address" not in flags
    with_port = _flags(_embedded_argv(repo, tmp_path, preload_library=tmp_path / "preload.so"))
    assert with_port["--metrics-port"] == ["8002"] and "--allow-metrics" not in with_port


def _full_config(token: str) -> TritonServerConfig:
    return server_config(
        "/models", EMBEDDED, load_models=("a", "b"), ports={"http": 1, "grpc": 2, "metrics": 3},
        grpc_host="0.0.0.0", backend_config={"pytorch": {"shm-default-byte-size": 7}},
        server_bin="/bin/tritonserver", backend_directory="/backends", cache_directory="/cache",
        allow_metrics=True, allow_gpu_metrics=False,
        memory_pools=MemoryPools(((0, 5), (1, 5)), 6), rate_limit_resources=(("slot", 1),),
        grpc_tls=GrpcTls("/c.pem", "/k.pem", "/ca.pem"), extra_args=("--log-verbose=1",),
        triton_release="26.09", client_shm=True,
    ).with_restricted_apis(("model-repository", "logging"), "triton-grpc-protocol-x", token)


def test_config_round_trips_through_its_dict_and_json_without_the_token() -> None:
    config = _full_config("secret-token")
    stored = json.loads(json.dumps(config.to_dict()))
    assert "secret-token" not in json.dumps(stored) and stored["control_token"] == TOKEN_FROM_ENVIRONMENT
    assert TritonServerConfig.from_dict(stored, token="secret-token") == config
    with pytest.raises(ValueError, match="from the environment"):
        TritonServerConfig.from_dict(stored)
    placeholder = _full_config(preload.PLACEHOLDER)
    kept = json.loads(json.dumps(placeholder.to_dict(keep_token=preload.PLACEHOLDER)))
    assert TritonServerConfig.from_dict(kept) == placeholder
    assert TritonServerConfig.from_dict(kept).to_args() == placeholder.to_args()


def test_the_watchdog_restarts_from_the_stored_config_with_its_own_token(tmp_path: Path) -> None:
    config = _full_config("secret-token")
    spec = LaunchSpec.for_server(config, {}, {}, log_file=tmp_path / "log", pid_file=None, state_file=None)
    spec.write(tmp_path / "launch.json")
    assert "secret-token" not in (tmp_path / "launch.json").read_text()
    restored = LaunchSpec.read(tmp_path / "launch.json", token="secret-token")
    assert restored == spec and list(restored.command) == config.to_args()
    assert "--http-port=1" in restored.command


def _tritonserver_flags() -> tuple[set[str], set[str]]:
    """(flags taking a value, bare flags) of tritonserver as the project passes them."""
    args = _full_config("t").to_args()[1:]
    return {a.partition("=")[0] for a in args if "=" in a}, {a for a in args if "=" not in a}


def test_no_module_but_server_config_builds_a_tritonserver_flag() -> None:
    flags, bare = _tritonserver_flags()
    assert "--disable-auto-complete-config" in bare
    assert {"--model-repository", "--http-port", "--exit-timeout-secs", "--backend-config", "--rate-limit",
            "--cuda-memory-pool-byte-size", "--grpc-use-ssl", "--http-restricted-api",
            "--allow-client-shm"} <= flags
    builders = []
    # the package and the tools that launch servers (the perf harness once spelled --model-repository= there)
    for path in sorted([*SRC.rglob("*.py"), *(SRC.parents[1] / "tools").rglob("*.py")]):
        if path.name == "server_config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            head = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                text = head.value
                # our own commands' options may share a name (``--model-repository PATH``): only
                # ``--flag=value`` and tritonserver's bare flags are built for tritonserver
                if text in bare or any(text.startswith(f"{f}=") for f in flags):
                    builders.append(f"{path.relative_to(SRC.parents[1])}:{node.lineno}: {text}")
    assert builders == []


def test_client_shared_memory_is_allowed_only_where_our_tools_ask_and_the_server_knows_the_flag(
        tmp_path: Path) -> None:
    """--allow-client-shm (NGC >= 26.05, client shared memory off by default there): true only when one of
    our tools asks (perf_analyzer --shared-memory system) on such a release; never rendered for an older
    server (the embedded 2.51 would refuse to start), left out otherwise (Triton's default: off)."""
    def shm(**kwargs: object) -> list[str]:
        argv = server_config("/models", CONTAINER, load_models=(), **kwargs).to_args()
        return [a for a in argv if a.startswith("--allow-client-shm")]

    assert shm(triton_release="26.09", client_shm=True) == ["--allow-client-shm=true"]
    assert shm(triton_release=CLIENT_SHM_FLAG_SINCE, client_shm=True) == ["--allow-client-shm=true"]
    for release in (None, "24.10", "25.12", "26.04"):
        assert shm(triton_release=release, client_shm=True) == [], release
    assert shm(triton_release=GPU_TRITON_RELEASE) == []  # the gpu image's server: off unless asked
    assert client_shm_setting("26.09", False) is None and client_shm_setting(None, True) is None
    repo = write_repository(tmp_path / "repo", BuildOptions(target="cpu"))
    info = RepositoryInfo.from_repository(repo)
    plan = sizing.plan_memory(info, sizing.VolumeSpec())
    asked = docker.server_command(info, plan, gpus=0, triton_release=GPU_TRITON_RELEASE, client_shm=True)
    assert "--allow-client-shm=true" in asked
    for argv in (docker.tritonserver_args(info, plan, gpus=0, triton_release=DEFAULT_TRITON_RELEASE,
                                          client_shm=True),
                 docker.server_command(info, plan, gpus=0),
                 _embedded_argv(repo, tmp_path, preload_library=None)):
        assert not any(a.startswith("--allow-client-shm") for a in argv)


def test_server_modules_compute_no_backoff_of_their_own() -> None:
    """The watchdog's reload backoff and the restart policy's delays come from util.retry.RetryPolicy: no
    ``2 ** attempt`` (a power of two with a variable exponent) under server/."""
    found = [f"{p.relative_to(SRC)}:{node.lineno}" for p in sorted((SRC / "server").rglob("*.py"))
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)
             and isinstance(node.left, ast.Constant) and not isinstance(node.right, ast.Constant)]
    assert found == []


def test_the_containers_watchdog_refuses_a_server_command_without_an_http_port(tmp_path: Path) -> None:
    """No fallback to Triton's default port: the rendered command always names it (the entry point reads
    its command with server_config.from_args before the watchdog is forked)."""
    with pytest.raises(ValueError, match="names no HTTP port"):
        server_config_module.from_args(["tritonserver", f"--model-repository={tmp_path}"])


def test_a_rendered_command_reads_back_as_its_config_and_a_foreign_flag_stays_in_place(
        tmp_path: Path) -> None:
    """server_config.from_args, the one parser of a server command (the container entry point's)."""
    repo = write_repository(tmp_path / "repo", BuildOptions(target="cpu"))
    info = RepositoryInfo.from_repository(repo)
    container = docker.tritonserver_args(info, sizing.plan_memory(info, sizing.VolumeSpec()), gpus=1)
    for config in (_full_config("secret-token"), _full_config(preload.PLACEHOLDER),
                   server_config_module.from_args(container)):
        assert server_config_module.from_args(config.to_args()) == config
    assert server_config_module.from_args(container).to_args() == list(container)
    # a hand-written command: Triton's defaults, frontends off, the metrics endpoint closed without a port
    minimal = server_config_module.from_args(["tritonserver", "--http-port=8000", "--log-verbose=1",
                                              "--rate-limit-resource=r:02"])
    assert minimal.to_args() == ["tritonserver", "--model-control-mode=none", "--strict-readiness=true",
                                 "--http-port=8000", "--allow-metrics=false", "--allow-sagemaker=false",
                                 "--allow-vertex-ai=false", "--log-verbose=1", "--rate-limit-resource=r:02"]
    with pytest.raises(ValueError, match="'--allow-vertex-ai=true' is refused"):
        server_config_module.from_args(["tritonserver", "--http-port=8000", "--allow-vertex-ai=true"])
