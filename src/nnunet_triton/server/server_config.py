"""The tritonserver command line, owned once: :class:`TritonServerConfig` holds every flag the project passes,
:meth:`TritonServerConfig.to_args` renders it, :func:`server_config` builds it from the repository and the
launch choices.

Every launcher renders its command here: the embedded server (``server.embedded``), the watchdog restarting
it (``server.restart`` stores the config in ``launch.json`` with :meth:`~TritonServerConfig.to_dict` and
reads it back with :meth:`~TritonServerConfig.from_dict`), the container command of docker and Kubernetes
(``server.deploy.docker``) and the image check (``server.deploy.image_check``). What differs between these
targets is a :class:`Preset` (exit timeout, Python-backend shm sizes, the address the endpoints bind) or an
explicit argument, never a second literal; ``server.deploy.sizing`` sizes ``/dev/shm`` from the same shm
sizes.

The restricted APIs' token (``control_token``) is what tritonserver's argv carries: with ``server.preload``
that is its ``PLACEHOLDER`` and the real token travels in the environment. :meth:`~TritonServerConfig.to_dict`
never writes a real token (it writes :data:`TOKEN_FROM_ENVIRONMENT`; :meth:`~TritonServerConfig.from_dict`
takes the token back from its caller). In a container the watchdog is forked by the entry point before
tritonserver is exec-ed with the rendered argv; it reads the HTTP port there with :func:`flag_values` and
refuses a command without one (no default port). Only the standard library and ``parameters`` (the watchdog
runs it in containers).

Client shared memory (``--allow-client-shm``): from NGC 26.05 Triton refuses clients' system and CUDA
shared-memory regions unless started with ``--allow-client-shm=true``; older servers (the embedded 2.51 among
them) do not know the flag and would refuse to start with it. :func:`client_shm_setting` decides from the
server's release: the flag is rendered only for a release that knows it and only when one of our own tools
asks for client shared memory (perf_analyzer's ``--shared-memory system``); otherwise it is left out, which is
Triton's default of off. On 2.51 client shared memory stays behind the restricted ``shared-memory`` API.

Triton's SageMaker and Vertex AI frontends are rendered off (``--allow-sagemaker=false
--allow-vertex-ai=false``): Vertex AI's is on by default when ``AIP_MODE=PREDICTION`` is in the server's
environment, binds every address and lets its ``X-Vertex-Ai-Triton-Redirect`` header reach the restricted
APIs without the token. A caller's flag that would turn either on (:data:`FRONTEND_FLAGS`) is refused, and
launchers drop the variables those frontends read (:func:`without_frontend_environment`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nnunet_triton.parameters import DEFAULT_PORTS

__all__ = [
    "CONTAINER",
    "EMBEDDED",
    "IMAGE_CHECK",
    "SHM_DEFAULT_BYTES",
    "SHM_GROWTH_BYTES",
    "STUB_TIMEOUT_S",
    "FRONTEND_ENV_PREFIXES",
    "FRONTEND_FLAGS",
    "TOKEN_FROM_ENVIRONMENT",
    "CLIENT_SHM_FLAG_SINCE",
    "GrpcTls",
    "MemoryPools",
    "Preset",
    "TritonServerConfig",
    "check_extra_args",
    "client_shm_setting",
    "flag_values",
    "from_args",
    "rate_limit_args",
    "restricted_api_args",
    "server_config",
    "without_flag",
    "without_frontend_environment",
]

MiB = 2**20
LOOPBACK = "127.0.0.1"
# the Python stub's start handshake; 30 s (Triton's default) is too short on a busy host once a stub
# imports torch or cupy
STUB_TIMEOUT_S = 120
# written by to_dict instead of a real token: the reader has the token in its environment
TOKEN_FROM_ENVIRONMENT = "@from-environment@"
# Triton's gRPC frontend expects a restricted protocol's key with this prefix added (the flag names the key
# without it); HTTP takes the key as given (server.model_control.CONTROL_HEADER carries the prefix)
GRPC_PROTOCOL_PREFIX = "triton-grpc-protocol-"
# the first NGC release whose tritonserver has --allow-client-shm (client shared memory off by default)
CLIENT_SHM_FLAG_SINCE = "26.05"
# tritonserver 2.51's flags of its SageMaker and Vertex AI frontends (`tritonserver --help`): neither frontend
# knows the restricted APIs' token, so none of these is accepted from a caller
FRONTEND_FLAGS = ("--allow-sagemaker", "--sagemaker-", "--allow-vertex-ai", "--vertex-ai-")
# the variables they read (AIP_MODE=PREDICTION turns Vertex AI on, AIP_HTTP_PORT its port, AIP_STORAGE_URI
# a repository; SAGEMAKER_TRITON_DEFAULT_MODEL_NAME ...): dropped from the server's environment
FRONTEND_ENV_PREFIXES = ("AIP_", "SAGEMAKER_")


@dataclass(frozen=True)
class Preset:
    """What differs between the places tritonserver runs.

    Attributes:
        exit_timeout_s: ``--exit-timeout-secs``, how long a stop drains requests and connections.
        shm_default_bytes, shm_growth_bytes: the Python backend's shm region per stub (one /dev/shm region
            per model instance, never shrunk; tmpfs pages are only used once touched) and its growth step.
        host: the address every endpoint binds (None: not passed, Triton's default of every address).
    """

    name: str
    exit_timeout_s: int
    shm_default_bytes: int
    shm_growth_bytes: int
    host: str | None


# 16 MiB holds a batch of fp16 128^3 tiles; the region then grows in 64 MiB steps, rounded up to fit, so a
# whole CT volume (512x512x300 int16 = 150 MiB) costs one or two growths instead of 150 one-MiB growths with
# Triton's defaults. /dev/shm must hold (Python instances x largest CPU tensor in flight).
SHM_DEFAULT_BYTES = 16 * MiB
SHM_GROWTH_BYTES = 64 * MiB
EMBEDDED = Preset("embedded", exit_timeout_s=15, shm_default_bytes=SHM_DEFAULT_BYTES,
                  shm_growth_bytes=SHM_GROWTH_BYTES, host=LOOPBACK)
# docker and Kubernetes: the container's ports are published (docker) or reached through the pod's address
CONTAINER = Preset("container", exit_timeout_s=30, shm_default_bytes=SHM_DEFAULT_BYTES,
                   shm_growth_bytes=SHM_GROWTH_BYTES, host=None)
# the image check's fixture server inside a build: a build's /dev/shm is 64 MiB, the fixture's tensors small
IMAGE_CHECK = Preset("image-check", exit_timeout_s=5, shm_default_bytes=4 * MiB, shm_growth_bytes=4 * MiB,
                     host=LOOPBACK)


@dataclass(frozen=True)
class GrpcTls:
    """Triton's own gRPC SSL: server certificate and key; mutual TLS when ``root_cert`` (the client CA)."""

    cert: str
    key: str
    root_cert: str | None = None

    def args(self) -> tuple[str, ...]:
        mutual = () if self.root_cert is None else ("--grpc-use-ssl-mutual=true",
                                                    f"--grpc-root-cert={self.root_cert}")
        return ("--grpc-use-ssl=true", f"--grpc-server-cert={self.cert}", f"--grpc-server-key={self.key}",
                *mutual)


@dataclass(frozen=True)
class MemoryPools:
    """Triton's CUDA pool per GPU (``(gpu, bytes)`` pairs) and its pinned host pool (0: Triton's default)."""

    cuda: tuple[tuple[int, int], ...] = ()
    pinned_bytes: int = 0

    def args(self) -> tuple[str, ...]:
        pools = [f"--cuda-memory-pool-byte-size={gpu}:{size}" for gpu, size in self.cuda]
        if self.pinned_bytes:
            pools.append(f"--pinned-memory-pool-byte-size={self.pinned_bytes}")
        return tuple(pools)


def restricted_api_args(apis: Sequence[str], header: str, token: str) -> list[str]:
    """Flags that allow ``apis`` on HTTP and gRPC only with the header ``header: token``."""
    groups = ",".join(apis)
    return [f"--http-restricted-api={groups}:{header}={token}",
            f"--grpc-restricted-protocol={groups}:{header.removeprefix(GRPC_PROTOCOL_PREFIX)}={token}"]


def rate_limit_args(resources: Sequence[tuple[str, int]]) -> list[str]:
    """Flags that turn on Triton's rate limiter with ``(resource, count)`` pairs (none when empty)."""
    if not resources:
        return []
    return ["--rate-limit=execution_count",
            *(f"--rate-limit-resource={name}:{count}" for name, count in resources)]


def _bool(value: bool) -> str:
    return "true" if value else "false"


def check_extra_args(args: Sequence[str]) -> None:
    """ValueError naming the first of a caller's flags that would open the SageMaker or Vertex AI frontend."""
    for arg in args:
        if arg.startswith(FRONTEND_FLAGS):
            raise ValueError(
                f"the tritonserver flag {arg!r} is refused: Triton's SageMaker and Vertex AI frontends stay "
                f"off (they bind every address and their routes reach the restricted APIs without the "
                f"control token; docs/security.md). Serve through the HTTP/gRPC endpoints or the TLS proxy "
                f"instead.")


def without_frontend_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables Triton's SageMaker and Vertex AI frontends read
    (:data:`FRONTEND_ENV_PREFIXES`)."""
    return {key: value for key, value in env.items() if not key.startswith(FRONTEND_ENV_PREFIXES)}


@dataclass(frozen=True)
class TritonServerConfig:
    """Every tritonserver flag the project passes; :meth:`to_args` is the command line.

    Optional fields left None are not passed (Triton's default applies). ``backend_config`` holds
    ``(backend, key, value)`` triples in order; ``rate_limit_resources`` ``(resource, count)`` pairs (with
    ``--rate-limit=execution_count``); ``restricted_apis`` the API groups that need ``control_header:
    control_token``; ``extra_args`` are the caller's own flags, passed last.
    """

    model_repositories: tuple[str, ...]
    http_port: int
    grpc_port: int | None  # None: not passed (Triton's default port; only a hand-written command)
    metrics_port: int | None  # None: no metrics endpoint (``--allow-metrics=false``)
    exit_timeout_s: int | None  # None: not passed (Triton's default; only a hand-written command)
    server_bin: str = "tritonserver"
    backend_directory: str | None = None
    cache_directory: str | None = None
    model_control_mode: str = "explicit"
    load_models: tuple[str, ...] = ()
    strict_readiness: bool = True
    http_address: str | None = None
    grpc_address: str | None = None
    metrics_address: str | None = None
    allow_metrics: bool | None = None
    allow_gpu_metrics: bool | None = None
    allow_client_shm: bool | None = None  # only for releases >= CLIENT_SHM_FLAG_SINCE (client_shm_setting)
    memory_pools: MemoryPools = field(default_factory=MemoryPools)
    backend_config: tuple[tuple[str, str, str], ...] = ()
    disable_auto_complete_config: bool = True  # our configs are generated complete (builder.config_gen)
    rate_limit_resources: tuple[tuple[str, int], ...] = ()
    grpc_tls: GrpcTls | None = None
    restricted_apis: tuple[str, ...] = ()
    control_header: str | None = None
    control_token: str | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_extra_args(self.extra_args)
        if self.metrics_port is None and self.allow_metrics:
            raise ValueError("allow_metrics needs a metrics_port.")
        if self.model_control_mode not in ("none", "explicit"):
            raise ValueError(f"model_control_mode must be 'none' or 'explicit', got "
                             f"{self.model_control_mode!r}.")
        if self.load_models and self.model_control_mode != "explicit":
            raise ValueError(f"load_models {list(self.load_models)} needs model_control_mode='explicit'.")

    def to_args(self) -> list[str]:
        """The command line: ``server_bin`` and its flags."""
        addresses = {"http": self.http_address, "grpc": self.grpc_address, "metrics": self.metrics_address}
        ports = {"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port}
        # an address is rendered with or without its port (Triton's default port then), except a closed
        # metrics endpoint's
        endpoints = [arg for name in ("http", "grpc", "metrics")
                     if name != "metrics" or ports[name] is not None
                     for arg in (() if addresses[name] is None else (f"--{name}-address={addresses[name]}",))
                     + (() if ports[name] is None else (f"--{name}-port={ports[name]}",))]
        allow_metrics = False if self.metrics_port is None else self.allow_metrics
        tls = self.grpc_tls
        return [
            self.server_bin,
            *(f"--model-repository={r}" for r in self.model_repositories),
            *((f"--backend-directory={self.backend_directory}",) if self.backend_directory else ()),
            *((f"--cache-directory={self.cache_directory}",) if self.cache_directory else ()),
            f"--model-control-mode={self.model_control_mode}",
            *(f"--load-model={name}" for name in self.load_models),
            f"--strict-readiness={_bool(self.strict_readiness)}",
            *endpoints,
            *((f"--allow-metrics={_bool(allow_metrics)}",) if allow_metrics is not None else ()),
            *((f"--allow-gpu-metrics={_bool(self.allow_gpu_metrics)}",)
              if self.allow_gpu_metrics is not None else ()),
            *((f"--allow-client-shm={_bool(self.allow_client_shm)}",)
              if self.allow_client_shm is not None else ()),
            *self.memory_pools.args(),
            *(f"--backend-config={backend},{key}={value}" for backend, key, value in self.backend_config),
            *((f"--exit-timeout-secs={self.exit_timeout_s}",) if self.exit_timeout_s is not None else ()),
            "--allow-sagemaker=false",
            "--allow-vertex-ai=false",
            *(("--disable-auto-complete-config",) if self.disable_auto_complete_config else ()),
            *rate_limit_args(self.rate_limit_resources),
            *(() if tls is None else tls.args()),
            *(restricted_api_args(self.restricted_apis, self.control_header, self.control_token)
              if self.restricted_apis and self.control_header and self.control_token else ()),
            *self.extra_args,
        ]

    def to_dict(self, *, keep_token: str | None = None) -> dict[str, Any]:
        """JSON-ready fields; a control token other than ``keep_token`` (the preload placeholder) is written
        as :data:`TOKEN_FROM_ENVIRONMENT`, so no file holds the secret."""
        data = asdict(self)
        if self.control_token is not None and self.control_token != keep_token:
            data["control_token"] = TOKEN_FROM_ENVIRONMENT
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, token: str | None = None) -> TritonServerConfig:
        """The config :meth:`to_dict` wrote; ``token`` replaces :data:`TOKEN_FROM_ENVIRONMENT`."""
        values = dict(data)
        if values.get("control_token") == TOKEN_FROM_ENVIRONMENT:
            if token is None:
                raise ValueError("the stored server config takes its control token from the environment, "
                                 "and none was given.")
            values["control_token"] = token
        pools = values.get("memory_pools") or {}
        values["memory_pools"] = MemoryPools(tuple(tuple(p) for p in pools.get("cuda", ())),
                                             pools.get("pinned_bytes", 0))
        values["grpc_tls"] = GrpcTls(**values["grpc_tls"]) if values.get("grpc_tls") else None
        for name in ("model_repositories", "load_models", "restricted_apis", "extra_args"):
            values[name] = tuple(values.get(name, ()))
        for name in ("backend_config", "rate_limit_resources"):
            values[name] = tuple(tuple(item) for item in values.get(name, ()))
        return cls(**values)

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> TritonServerConfig:
        """The config of a tritonserver command line (:func:`from_args`)."""
        return from_args(argv)

    def with_restricted_apis(self, apis: Sequence[str], header: str, token: str) -> TritonServerConfig:
        return replace(self, restricted_apis=tuple(apis), control_header=header, control_token=token)

    def with_rate_limits(self, resources: Sequence[tuple[str, int]]) -> TritonServerConfig:
        """This config with Triton's rate limiter on ``resources`` (unchanged when there are none)."""
        return replace(self, rate_limit_resources=tuple(resources)) if resources else self


def _release(release: str) -> tuple[int, int]:
    year, month = release.split(".")
    return int(year), int(month)


def client_shm_setting(triton_release: str | None, wanted: bool) -> bool | None:
    """``allow_client_shm`` for a server of ``triton_release`` (NGC ``YY.MM``; None: the embedded 2.51):
    True only when our own tool wants client shared memory and the server knows the flag; None (not passed,
    Triton's default) otherwise: off from 26.05, and never the flag for an older server, which would refuse
    to start with it."""
    if not wanted or triton_release is None or _release(triton_release) < _release(CLIENT_SHM_FLAG_SINCE):
        return None
    return True


def flag_values(args: Sequence[str], flag: str) -> list[str]:
    """The values of ``--<flag>=value`` in ``args`` (a caller's extra flags), in order."""
    prefix = f"--{flag}="
    return [a[len(prefix):] for a in args if a.startswith(prefix)]


def without_flag(args: Sequence[str], flag: str) -> tuple[str, ...]:
    """``args`` without any ``--<flag>=value``."""
    prefix = f"--{flag}="
    return tuple(a for a in args if not a.startswith(prefix))


_BOOL = {"true": True, "false": False}


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the tritonserver flag {flag} must be an integer, got {value!r}.") from None


def from_args(argv: Sequence[str]) -> TritonServerConfig:
    """The :class:`TritonServerConfig` of a tritonserver command line (its binary first): the one parser of
    a server command, the inverse of :meth:`TritonServerConfig.to_args` (``from_args(c.to_args())`` renders
    the same command). The container entry point reads its ``-- tritonserver ...`` with it, once.

    A flag this module does not own (or a value it would render differently) is kept, in order, in
    ``extra_args``. Flags left out take Triton's defaults (``--model-control-mode=none``); the SageMaker and
    Vertex AI frontends stay off and the metrics endpoint is closed without ``--metrics-port``.

    Raises:
        ValueError: an empty command, no ``--http-port`` (the watchdog and the TLS proxy need it: no default
            port), a port or timeout that is not an integer, or a flag :func:`check_extra_args` refuses.
    """
    if not argv:
        raise ValueError("the server command is empty.")
    server_bin, *args = argv
    lists: dict[str, list[Any]] = {flag: [] for flag in _LIST_READERS}
    last: dict[str, str] = {}
    extra: list[str] = []
    held: dict[str, str] = {}  # flags of a group, kept only if the group reads back as rendered here
    for arg in args:
        flag, sep, value = arg.partition("=")
        item = _LIST_READERS[flag](flag, value) if sep and flag in _LIST_READERS else None
        if item is not None:
            lists[flag].append(item)
            if flag == "--rate-limit-resource":  # a field only with --rate-limit=execution_count
                held[arg] = arg
        elif arg == "--disable-auto-complete-config":
            last[arg] = ""
        elif sep and flag in ("--allow-sagemaker", "--allow-vertex-ai") and value == "false":
            continue  # always rendered off
        elif sep and flag in _GROUPED:
            held[flag] = arg
        elif sep and flag in _OWNED and (flag not in _BOOL_FLAGS or value in _BOOL):
            last[flag] = value
        else:
            extra.append(arg)
    http_port = _http_port(last, argv)

    def flag_bool(flag: str) -> bool | None:
        return _BOOL[last[flag]] if flag in last else None

    def flag_int(flag: str) -> int | None:
        return _int(flag, last[flag]) if flag in last else None

    metrics_port = flag_int("--metrics-port")
    allow_metrics = flag_bool("--allow-metrics")
    if metrics_port is None and allow_metrics is False:
        allow_metrics = None  # rendered off anyway without a port
    values = _read_groups(held, lists["--rate-limit-resource"])
    extra += [arg for arg in args if arg in held.values()]  # what did not read back, in its order
    return TritonServerConfig(
        model_repositories=tuple(lists["--model-repository"]),
        http_port=http_port, grpc_port=flag_int("--grpc-port"),
        metrics_port=metrics_port, exit_timeout_s=flag_int("--exit-timeout-secs"), server_bin=server_bin,
        backend_directory=last.get("--backend-directory"), cache_directory=last.get("--cache-directory"),
        model_control_mode=last.get("--model-control-mode", "none"),  # Triton's default
        load_models=tuple(lists["--load-model"]),
        strict_readiness=flag_bool("--strict-readiness") is not False,  # Triton's default: true
        http_address=last.get("--http-address"), grpc_address=last.get("--grpc-address"),
        metrics_address=last.get("--metrics-address"), allow_metrics=allow_metrics,
        allow_gpu_metrics=flag_bool("--allow-gpu-metrics"), allow_client_shm=flag_bool("--allow-client-shm"),
        memory_pools=MemoryPools(tuple(lists["--cuda-memory-pool-byte-size"]),
                                 flag_int("--pinned-memory-pool-byte-size") or 0),
        backend_config=tuple(lists["--backend-config"]),
        disable_auto_complete_config="--disable-auto-complete-config" in last,
        extra_args=tuple(extra), **values)


def _http_port(last: Mapping[str, str], argv: Sequence[str]) -> int:
    """The command's HTTP port: required, no default port (the watchdog and the TLS proxy need it)."""
    if "--http-port" not in last:
        raise ValueError(f"the server command names no HTTP port (--http-port=PORT), so the watchdog cannot "
                         f"watch it: {list(argv)}")
    return _int("--http-port", last["--http-port"])


def _backend_setting(flag: str, value: str) -> tuple[str, str, str] | None:
    backend, comma, setting = value.partition(",")
    key, eq, setting_value = setting.partition("=")
    return (backend, key, setting_value) if comma and eq and "=" not in backend else None  # else: global


def _int_pair(flag: str, value: str) -> tuple[int, int] | None:
    parts = value.split(":")
    return (_int(flag, parts[0]), _int(flag, parts[1])) if len(parts) == 2 else None


def _resource(flag: str, value: str) -> tuple[str, int] | None:
    parts = value.split(":")
    return (parts[0], _int(flag, parts[1])) if len(parts) == 2 else None


def _read_groups(held: dict[str, str], resources: list[tuple[str, int]]) -> dict[str, Any]:
    """The fields of the flag groups (rate limiter, gRPC TLS, restricted APIs) that read back exactly as
    :meth:`TritonServerConfig.to_args` renders them; their flags are taken out of ``held``."""
    values: dict[str, Any] = {}
    if held.get("--rate-limit") == "--rate-limit=execution_count" and resources:
        values["rate_limit_resources"] = tuple(resources)
        for flag in [f for f in held if f == "--rate-limit" or f.startswith("--rate-limit-resource=")]:
            held.pop(flag)
    tls = {f: held[f].partition("=")[2] for f in _TLS_FLAGS if f in held}
    if tls.get("--grpc-use-ssl") == "true":
        mutual = tls.get("--grpc-use-ssl-mutual") == "true" and "--grpc-root-cert" in tls
        candidate = GrpcTls(tls.get("--grpc-server-cert", ""), tls.get("--grpc-server-key", ""),
                            tls["--grpc-root-cert"] if mutual else None)
        if sorted(candidate.args()) == sorted(held[f] for f in tls):
            values["grpc_tls"] = candidate
            for flag in tls:
                held.pop(flag)
    if "--http-restricted-api" in held:
        groups, _, rest = held["--http-restricted-api"].partition("=")[2].partition(":")
        header, _, token = rest.partition("=")
        if restricted_api_args(groups.split(","), header, token) == [
                held["--http-restricted-api"], held.get("--grpc-restricted-protocol")]:
            values.update(restricted_apis=tuple(groups.split(",")), control_header=header,
                          control_token=token)
            held.pop("--http-restricted-api")
            held.pop("--grpc-restricted-protocol")
    return values


# how from_args reads each repeatable flag's value (None: kept in extra_args as given)
_LIST_READERS: dict[str, Any] = {
    "--model-repository": lambda flag, value: value, "--load-model": lambda flag, value: value,
    "--backend-config": _backend_setting, "--rate-limit-resource": _resource,
    "--cuda-memory-pool-byte-size": _int_pair,
}
_TLS_FLAGS = ("--grpc-use-ssl", "--grpc-server-cert", "--grpc-server-key", "--grpc-use-ssl-mutual",
              "--grpc-root-cert")
_GROUPED = ("--rate-limit", *_TLS_FLAGS, "--http-restricted-api", "--grpc-restricted-protocol")


# the flags with one value that from_args reads into a field (the last one given wins, as in Triton)
_BOOL_FLAGS = ("--strict-readiness", "--allow-metrics", "--allow-gpu-metrics", "--allow-client-shm")
_OWNED = ("--backend-directory", "--cache-directory", "--model-control-mode", "--http-address",
          "--grpc-address", "--metrics-address", "--http-port", "--grpc-port", "--metrics-port",
          "--pinned-memory-pool-byte-size", "--exit-timeout-secs", *_BOOL_FLAGS)


def server_config(repository: str, preset: Preset, *, load_models: Sequence[str],
                  ports: Mapping[str, int | None] | None = None, host: str | None = None,
                  grpc_host: str | None = None, exit_timeout_s: int | None = None,
                  backend_config: Mapping[str, Mapping[str, object]] | None = None,
                  shm_default_bytes: int | None = None, shm_growth_bytes: int | None = None,
                  triton_release: str | None = None, client_shm: bool = False,
                  **choices: Any) -> TritonServerConfig:
    """The config of one server of ``repository`` at ``preset``'s target.

    Args:
        load_models: the models ``--load-model`` loads (explicit model control).
        ports: ``{"http", "grpc", "metrics"}``; default Triton's own 8000/8001/8002; ``"metrics": None``
            renders no metrics endpoint (``--allow-metrics=false``).
        host: the address HTTP and metrics bind (default: the preset's); ``grpc_host`` gRPC's (default:
            ``host``).
        exit_timeout_s: default the preset's.
        triton_release: the server's NGC release (None: the embedded 2.51.0); with ``client_shm`` (one of our
            tools sends tensors through client shared memory) it decides ``--allow-client-shm``
            (:func:`client_shm_setting`).
        backend_config: ``{backend: {key: value}}`` merged over the Python backend's shm sizes (the
            preset's, or ``shm_default_bytes``/``shm_growth_bytes``, e.g. the memory plan's) and its stub
            timeout.
        choices: any other :class:`TritonServerConfig` field (memory pools, TLS, backend folder, ...).
    """
    ports = {**DEFAULT_PORTS, **(ports or {})}
    host = preset.host if host is None else host
    merged: dict[str, dict[str, object]] = {"python": {
        "shm-default-byte-size": preset.shm_default_bytes if shm_default_bytes is None else shm_default_bytes,
        "shm-growth-byte-size": preset.shm_growth_bytes if shm_growth_bytes is None else shm_growth_bytes,
        "stub-timeout-seconds": STUB_TIMEOUT_S,
    }}
    for name, values in (backend_config or {}).items():
        merged.setdefault(name, {}).update(values)
    return TritonServerConfig(
        model_repositories=(str(repository),),
        http_port=int(ports["http"]), grpc_port=int(ports["grpc"]),
        metrics_port=None if ports["metrics"] is None else int(ports["metrics"]),
        http_address=host, grpc_address=grpc_host or host,
        metrics_address=None if ports["metrics"] is None else host,
        exit_timeout_s=preset.exit_timeout_s if exit_timeout_s is None else exit_timeout_s,
        load_models=tuple(load_models),
        backend_config=tuple((name, key, str(value)) for name, values in merged.items()
                             for key, value in values.items()),
        allow_client_shm=client_shm_setting(triton_release, client_shm),
        **choices,
    )
