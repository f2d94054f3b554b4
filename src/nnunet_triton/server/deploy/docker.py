"""Render the tritonserver flags and the exact ``docker|podman build`` / ``run`` command lines.

Everything here is a pure function of a frozen :class:`DeploySpec`; nothing needs or calls a container engine.
Command lines are argv tuples (``shlex.join`` prints them; ``subprocess.run`` runs them unchanged). The engine
(``docker`` or ``podman``, same flags) is the first word.

Images (docker/Dockerfile, one recipe): ``gpu`` on NGC's tritonserver, ``cpu`` on a plain Debian bookworm;
both carry torch (the orchestrator imports it whatever the fold runner). The container command is
:func:`server_command`: ``nnunet_triton.server.deploy.entrypoint`` checks the mounted repository and exits
with :data:`EXIT_BAD_REPOSITORY` and one clear line when it cannot be served, so that the restart policy
(:data:`RESTART_POLICY`) restarts a crashed or killed server but gives up on a repository that never
loads.

One server serves the whole repository: every endpoint name (``nnunet-triton deploy --model-dir A B --endpoint
liver lung``), every version of each, and their public and pinned endpoints; sizes add up over them
(:func:`~nnunet_triton.server.deploy.sizing.plan_memory`).

Server flags: ``--model-control-mode=explicit`` with one ``--load-model`` per model
of the repository (an ensemble loads its steps, but the orchestrator's BLS callees ``fold_<k>`` are
invisible to the repository manager and would never load), ``--cuda-memory-pool-byte-size`` per GPU and
``--pinned-memory-pool-byte-size`` from :func:`~nnunet_triton.server.deploy.sizing.plan_memory`, the Python
backend's shm sizes, and ``--exit-timeout-secs`` so a stop drains in-flight requests.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nnunet_triton import __version__, io_names
from nnunet_triton.builder.torch_compat import DEFAULT_TRITON_RELEASE, GPU_TRITON_RELEASE, TRITON_RELEASES
from nnunet_triton.errors import DeployError
from nnunet_triton.exit_codes import ExitCode
from nnunet_triton.parameters import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT, DEFAULT_PORTS
from nnunet_triton.server.deploy import container_proxy
from nnunet_triton.server.deploy.repository_info import RepositoryInfo, check_torch_compatible, triton_release
from nnunet_triton.server.deploy.sizing import MemoryPlan
from nnunet_triton.server.proxy_config import TlsSettings, check_exposure
from nnunet_triton.server.server_config import CONTAINER, server_config

__all__ = [
    "VARIANTS",
    "IMAGE_TORCH",
    "RESTART_POLICY",
    "EXIT_BAD_REPOSITORY",
    "CONTAINER_PORTS",
    "CONTAINER_REPOSITORY",
    "DEFAULT_TRITON_RELEASE",
    "GPU_TRITON_RELEASE",
    "DEFAULT_RUNNER_TORCH",
    "DeploySpec",
    "tritonserver_args",
    "server_command",
    "health_command",
    "health_probe",
    "dockerfile_build_args",
    "docker_build_command",
    "docker_run_command",
    "published_ports",
    "docker_stop_commands",
    "builder_args",
    "export_container_command",
    "cpu_export_command",
    "shell_line",
    "endpoint_usage",
    "check_image_compatible",
]

VARIANTS = ("gpu", "cpu")
# torch in each image's Python: cpu, requirements/image-cpu.txt's pin (a unit test keeps them equal); gpu, the
# torch NGC's -pyt-python-py3 base already holds (its libtorch's major.minor; no second torch is installed)
IMAGE_TORCH = {"gpu": TRITON_RELEASES[GPU_TRITON_RELEASE].libtorch, "cpu": "2.13.0+cpu"}
DEFAULT_RUNNER_TORCH = IMAGE_TORCH["gpu"]
# any Debian bookworm (here: the debootstrapped localhost/debian:bookworm of tools.container_host)
CPU_BASE_IMAGE = "docker.io/library/debian:bookworm-slim"
# a killed or crashed server is restarted (up to 5 times: docker and podman never reset the count); a
# repository the entry point refuses exits with EXIT_BAD_REPOSITORY each time and then stays down
RESTART_POLICY = "on-failure:5"
EXIT_BAD_REPOSITORY = ExitCode.CONFIG  # EX_CONFIG (sysexits.h), the entry point's refusal
CONTAINER_REPOSITORY = "/models"
CONTAINER_PORTS = DEFAULT_PORTS  # the container side: tritonserver's own defaults
EXPORT_IMAGE = "python:3.11-slim"
EXPORT_TORCH = "2.14.1"  # pip release of the torch 2.14 that Triton 26.09's libtorch is built from
EXPORT_TORCHVISION = "0.29.1"  # the torchvision that pins torch 2.14.1 (nnU-Net's trainer lookup needs it)
CUPY_CACHE_DIR = "/var/cache/cupy"  # docker/Dockerfile's CUPY_CACHE_DIR: compiled CuPy kernels
CUPY_CACHE_VOLUME = "nnunet-triton-cupy-cache"  # a named volume: the kernels outlive the container


@dataclass(frozen=True)
class DeploySpec:
    """One containerized deployment of a repository: one server for every endpoint in it.

    Attributes:
        info: the whole repository (every endpoint version); its pipelines must share one target.
        repository: host path of the built repository (bind-mounted read-only at ``/models``).
        gpus: host GPU ids given to the container; empty = CPU-only host (no ``--gpus``).
        http_port, grpc_port, metrics_port: host ports published for the container's 8000/8001/8002.
        publish_host: the host address they are published on: loopback by default, like the embedded
            server. Beyond loopback only with ``tls`` (``proxy_config.ExposureError`` otherwise, the
            embedded server's refusal).
        tls: the TLS proxy inside the container (``container_proxy``; host paths of the certificate, key,
            client CA and/or token file, mounted read-only): tritonserver then binds 127.0.0.1 inside the
            container and only the proxy's port is published, as ``proxy_port`` on ``publish_host``.
        proxy_allow_statistics: the proxy lets the statistics API through too.
        image_torch_version: libtorch (or pip torch) major.minor override for releases not in
            ``TRITON_RELEASES``.
        startup_timeout_s: model loading + warm-up allowance (docker health start period, k8s startup probe).
        variant: the image, ``gpu`` (NGC base, KIND_GPU repositories) or ``cpu`` (Debian base, target cpu).
        engine: ``docker`` or ``podman`` (the first word of every command).
        base_image_ref: the Dockerfile's BASE_IMAGE; None = NGC's tritonserver (gpu), Debian bookworm-slim
            (cpu).
    """

    info: RepositoryInfo
    plan: MemoryPlan
    repository: str
    triton_release: str = GPU_TRITON_RELEASE  # the gpu image's NGC release (cpu: always the wheel's 24.10)
    image_name: str = "nnunet-triton"
    container_name: str = "nnunet-triton"
    gpus: tuple[int, ...] = (0,)
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    publish_host: str = "127.0.0.1"
    runner_torch_version: str = DEFAULT_RUNNER_TORCH
    image_torch_version: str | None = None
    exit_timeout_s: int = CONTAINER.exit_timeout_s
    startup_timeout_s: int = 900
    variant: str = "gpu"
    engine: str = "docker"
    base_image_ref: str | None = None
    tls: TlsSettings | None = None
    proxy_port: int = container_proxy.PROXY_PORT
    proxy_allow_statistics: bool = False

    def __post_init__(self) -> None:
        if self.tls is None:  # the same refusal as the embedded server's (the files are checked at deploy)
            check_exposure(self.publish_host, None, what=f"--target docker's {self.container_name}")
        if self.variant not in VARIANTS or self.engine not in ("docker", "podman"):
            raise ValueError(f"variant must be one of {VARIANTS} and engine docker or podman, got "
                             f"{self.variant!r}, {self.engine!r}.")
        if self.variant == "cpu" and (self.info.target != "cpu" or self.gpus):
            raise DeployError(
                f"the cpu image serves repositories built for target 'cpu' without GPUs, got target "
                f"{self.info.target!r} and gpus {list(self.gpus)}; use the gpu image (--variant gpu) or "
                "build with --target cpu."
            )
        if self.info.target == "gpu" and not self.gpus:
            raise DeployError(
                "the repository was built for target 'gpu' (KIND_GPU models, libtorch on CUDA) but no GPU "
                "was given; pass --gpus or build with --target cpu."
            )
        names = ("http_port", "grpc_port", "metrics_port", "proxy_port", "exit_timeout_s",
                 "startup_timeout_s")
        bad = {name: getattr(self, name) for name in names if getattr(self, name) < 1}
        if bad:
            raise ValueError(f"deploy ports and timeouts must be >= 1, got {bad}.")

    @property
    def image_torch(self) -> str:
        """The torch in the image's Python (the orchestrator's, and the Python fold runner's)."""
        return IMAGE_TORCH[self.variant] if self.variant == "cpu" else self.runner_torch_version

    @property
    def release(self) -> str:
        """The image's Triton release: the NGC base's (gpu), the nvidia-pytriton wheel's (cpu)."""
        return DEFAULT_TRITON_RELEASE if self.variant == "cpu" else self.triton_release

    @property
    def image_tag(self) -> str:
        suffix = "-cpu" if self.variant == "cpu" else ""
        return f"{self.image_name}:{__version__}-triton{self.release}{suffix}"

    @property
    def export_image_tag(self) -> str:
        """The ``export`` stage of the same build (cpu: builds repositories with the image's torch)."""
        return f"{self.image_tag}-export"

    @property
    def base_image(self) -> str:
        if self.base_image_ref:
            return self.base_image_ref
        if self.variant == "cpu":
            return CPU_BASE_IMAGE
        # -pyt-python-py3: the PyTorch and Python backends only, and the torch they are built with, so the
        # image installs no second torch (the full -py3 flavour has every backend)
        return f"nvcr.io/nvidia/tritonserver:{self.triton_release}-pyt-python-py3"


def replace_spec(spec: DeploySpec, **changes: Any) -> DeploySpec:
    """``spec`` with some fields changed (checked again)."""
    return replace(spec, **changes)


def tritonserver_args(info: RepositoryInfo, plan: MemoryPlan, *, gpus: int,
                      exit_timeout_s: int = CONTAINER.exit_timeout_s,
                      repository: str = CONTAINER_REPOSITORY, host: str | None = None,
                      triton_release: str | None = None, client_shm: bool = False) -> tuple[str, ...]:
    """``tritonserver`` argv (container side: fixed ports 8000/8001/8002, repository at ``/models``; the
    ``server.server_config.CONTAINER`` preset with the plan's shm sizes and pools; ``host``: the address
    every endpoint binds, 127.0.0.1 behind the container's TLS proxy). ``client_shm``: one of our tools
    (perf_analyzer's ``--shared-memory system``) needs client shared memory; on an image of ``triton_release``
    >= 26.05 that passes ``--allow-client-shm=true``, otherwise nothing (off)."""
    config = server_config(repository, CONTAINER, load_models=info.models, ports=CONTAINER_PORTS, host=host,
                           exit_timeout_s=exit_timeout_s, shm_default_bytes=plan.shm_default_bytes,
                           shm_growth_bytes=plan.shm_growth_bytes, allow_metrics=True,
                           allow_gpu_metrics=bool(gpus), memory_pools=plan.pools(gpus),
                           triton_release=triton_release, client_shm=client_shm)
    return tuple(config.to_args())


def server_command(info: RepositoryInfo, plan: MemoryPlan, *, gpus: int,
                   exit_timeout_s: int = CONTAINER.exit_timeout_s,
                   repository: str = CONTAINER_REPOSITORY, tls: TlsSettings | None = None,
                   proxy_allow_statistics: bool = False, triton_release: str | None = None,
                   client_shm: bool = False) -> tuple[str, ...]:
    """The container's command: the repository check, then ``tritonserver_args`` through the thread budget.

    ``nnunet_triton.server.deploy.entrypoint`` refuses a repository that cannot be served here (one line on
    stderr, exit :data:`EXIT_BAD_REPOSITORY`) and otherwise execs (same pid)
    ``nnunet_triton.server.thread_budget exec``, which reads the container's CPUs (affinity and cgroup quota,
    so
    ``docker run --cpus`` and a pod's ``limits.cpu`` count) and the repository's fold instances, sets
    ``OMP_WAIT_POLICY=PASSIVE`` and the fold threads, forks the watchdog (``nnunet_triton.server.watchdog``:
    it reloads a model whose process died) and execs tritonserver (same pid, same signals) with the image's
    preload library (the token off its command line, owner-only /dev/shm regions).

    ``tls`` (host files; ``container_proxy``): the entry point's TLS flags for the mounted files, and every
    tritonserver endpoint on 127.0.0.1 behind the proxy the watchdog keeps running.
    """
    proxy = container_proxy.entrypoint_args(tls, allow_statistics=proxy_allow_statistics) if tls else ()
    host = "127.0.0.1" if tls is not None else None
    return ("python3", "-m", "nnunet_triton.server.deploy.entrypoint", "--model-repository", repository,
            *proxy, "--",
            *tritonserver_args(info, plan, gpus=gpus, exit_timeout_s=exit_timeout_s, repository=repository,
                               host=host, triton_release=triton_release, client_shm=client_shm))


def health_probe(port: int = CONTAINER_PORTS["http"],
                 repository: str = CONTAINER_REPOSITORY) -> tuple[str, ...]:
    """The honest health check inside the container (``nnunet_triton.server.health``): exit 0 only when the
    server is ready and every model is ready with all its Python-backend processes alive."""
    return ("python3", "-m", "nnunet_triton.server.health", "--url", f"127.0.0.1:{port}",
            "--model-repository", repository)


def health_command(port: int = CONTAINER_PORTS["http"]) -> str:
    """``health_probe`` as one shell command line (``docker run --health-cmd``)."""
    return " ".join(health_probe(port))


def check_image_compatible(spec: DeploySpec) -> None:
    """Refuse TorchScript files exported by a torch newer than the one that loads them in the image: each
    endpoint version against the torch of its own fold runner (the image's pip torch for the Python
    runner, its libtorch otherwise)."""
    for pipeline in spec.info.pipelines:
        if pipeline.fold_runner == "python":
            runtime, what = spec.image_torch, f"the Python fold runner's pip torch in {spec.image_tag}"
        else:
            release = triton_release(spec.triton_release, spec.image_torch_version)
            runtime, what = release.libtorch, f"libtorch of {spec.base_image}"
        check_torch_compatible(RepositoryInfo(pipelines=(pipeline,), models=pipeline.models), runtime, what)


def dockerfile_build_args(spec: DeploySpec) -> dict[str, str]:
    """``--build-arg`` values for docker/Dockerfile (each one is declared there with an ``ARG``)."""
    return {"VARIANT": spec.variant, "TRITON_RELEASE": spec.release, "BASE_IMAGE": spec.base_image}


def docker_build_command(spec: DeploySpec, *, dockerfile: str = "docker/Dockerfile", context: str = ".",
                         target: str | None = None, wheels: str | None = None) -> tuple[str, ...]:
    """``build`` of the serving image (``target="export"``: its export stage) from the checkout.

    ``wheels``: a local wheel directory given as the named build context ``wheels`` (offline install).
    podman gets ``--format docker`` and the ignore file explicitly (BuildKit finds
    ``<Dockerfile>.dockerignore`` itself).
    """
    build_args = [part for key, value in dockerfile_build_args(spec).items()
                  for part in ("--build-arg", f"{key}={value}")]
    # podman: the ignore file explicitly, and the docker image format (OCI images drop SHELL and HEALTHCHECK)
    ignore = (("--format", "docker", "--ignorefile", f"{dockerfile}.dockerignore") if spec.engine == "podman"
              else ())
    extra = ("--build-context", f"wheels={wheels}") if wheels else ()
    stage = ("--target", target) if target else ()
    tag = spec.export_image_tag if target == "export" else spec.image_tag
    return (spec.engine, "build", "--file", dockerfile, *ignore, *build_args, *extra, *stage, "--tag", tag,
            context)


def _gpus_flag(gpus: tuple[int, ...]) -> tuple[str, ...]:
    if not gpus:
        return ()
    devices = ",".join(str(g) for g in gpus)
    # docker parses --gpus as CSV: several devices need the inner quotes
    return ("--gpus", f"device={devices}" if len(gpus) == 1 else f'"device={devices}"')


def published_ports(spec: DeploySpec) -> tuple[tuple[int, int], ...]:
    """``(host port, container port)`` pairs ``docker run`` publishes on ``spec.publish_host``: Triton's three
    ports, or with TLS only the proxy's (Triton binds 127.0.0.1 inside the container then)."""
    if spec.tls is not None:
        return ((spec.proxy_port, container_proxy.PROXY_PORT),)
    return ((spec.http_port, CONTAINER_PORTS["http"]), (spec.grpc_port, CONTAINER_PORTS["grpc"]),
            (spec.metrics_port, CONTAINER_PORTS["metrics"]))


def docker_run_command(spec: DeploySpec) -> tuple[str, ...]:
    """``docker run`` of the server; raises DeployError for TorchScript the image cannot load."""
    check_image_compatible(spec)
    host = f"[{spec.publish_host}]" if ":" in spec.publish_host else spec.publish_host
    publish = [part for host_port, port in published_ports(spec)
               for part in ("--publish", f"{host}:{host_port}:{port}")]
    tls_files = container_proxy.volumes(spec.tls) if spec.tls is not None else ()
    gpu = spec.variant == "gpu"
    # pinned host memory for the CUDA copies (NGC's recommended limits); nothing to pin on the cpu image
    ulimits = ("--ulimit", "memlock=-1", "--ulimit", "stack=67108864") if gpu else ()
    cupy_cache = ("--volume", f"{CUPY_CACHE_VOLUME}:{CUPY_CACHE_DIR}") if gpu else ()
    return (
        spec.engine, "run", "--detach", "--name", spec.container_name, "--restart", RESTART_POLICY,
        *_gpus_flag(spec.gpus),
        f"--shm-size={spec.plan.shm_mib}m",
        *ulimits,
        *publish,
        "--volume", f"{spec.repository}:{CONTAINER_REPOSITORY}:ro",
        *tls_files,
        *cupy_cache,
        "--health-cmd", health_command(),
        "--health-interval", "30s", "--health-timeout", "10s", "--health-retries", "3",
        "--health-start-period", f"{spec.startup_timeout_s}s",
        "--stop-timeout", str(spec.exit_timeout_s + 10),
        spec.image_tag,
        *server_command(spec.info, spec.plan, gpus=len(spec.gpus), exit_timeout_s=spec.exit_timeout_s,
                        tls=spec.tls, proxy_allow_statistics=spec.proxy_allow_statistics),
    )


def docker_stop_commands(container_name: str = "nnunet-triton",
                         exit_timeout_s: int = CONTAINER.exit_timeout_s, *,
                         engine: str = "docker") -> tuple[tuple[str, ...], ...]:
    """Stop (SIGTERM; tritonserver drains for ``exit_timeout_s``) and then remove the container."""
    return ((engine, "stop", "--time", str(exit_timeout_s + 10), container_name),
            (engine, "rm", container_name))


def builder_args(options: Any, *, folds: tuple[int | str, ...] | None = None,
                 configuration: str | None = None, export_device: str | None = "cuda",
                 name: str | None = None) -> tuple[str, ...]:
    """``repository/build.py`` flags that rebuild ``options`` (a BuildOptions) in the export container
    (``export_device`` cuda on the GPU export host; None: the builder's default, cpu) as the endpoint
    ``name`` (``--endpoint``: one run per endpoint writes it into the shared repository; None: the builder's
    default name)."""
    fold_args = ("--folds", *map(str, folds)) if folds else ()
    config_args = ("--configuration", configuration) if configuration else ()
    torch_args = ("--serving-torch", options.serving_torch) if options.serving_torch else ()
    device_args = ("--export-device", export_device) if export_device else ()
    name_args = ("--endpoint", name) if name else ()
    return ("--target", str(options.target), "--precision", options.fold_precision,
            *device_args, "--tile-batch-size", str(options.tile_batch_size),
            "--fold-instances", str(options.fold_instances),
            "--orchestrator-instances", str(options.orchestrator_instances),
            "--max-inflight", str(options.max_inflight), *fold_args, *config_args, *torch_args, *name_args)


def export_container_command(*, source_root: str, model_dir: str, out_dir: str, builder_args: tuple[str, ...],
                             gpu: int | None, uid: int, gid: int, torch_version: str = EXPORT_TORCH,
                             torchvision_version: str = EXPORT_TORCHVISION, engine: str = "docker",
                             ) -> tuple[str, ...]:
    """``docker run`` that builds the repository with a torch matching the image's libtorch.

    Runs ``docker/export_in_container.sh`` in ``python:3.11-slim`` (the builder's Python, with pip's
    torch): pip torch ``torch_version`` (2.14.1 = libtorch 2.14 of Triton 26.09),
    then ``python -m repository.build --model-dir /models/<name> --model-repository /out/<name>
    <builder_args>``; the result is handed to ``uid:gid``. The model folder's parent is mounted (read-only)
    so that a cascade stage finds its previous stage (nnU-Net's sibling folder). fp16 exports trace under
    CUDA autocast: ``--gpus``.
    """
    out, model = Path(out_dir), Path(model_dir)
    gpus = ("--gpus", f"device={gpu}") if gpu is not None else ()
    return (
        engine, "run", "--rm", *gpus,
        "--volume", f"{source_root}:/src:ro",
        "--volume", f"{model.parent}:/models:ro",
        "--volume", f"{out.parent}:/out",
        "--env", f"REPOSITORY_OUT=/out/{out.name}",
        "--env", f"HOST_UID={uid}", "--env", f"HOST_GID={gid}",
        "--env", f"TORCH_VERSION={torch_version}", "--env", f"TORCHVISION_VERSION={torchvision_version}",
        EXPORT_IMAGE, "bash", "/src/docker/export_in_container.sh", "--model-dir", f"/models/{model.name}",
        *builder_args,
    )


def cpu_export_command(spec: DeploySpec, *, source_root: str, model_dir: str, out_dir: str,
                       builder_args: tuple[str, ...], uid: int, gid: int) -> tuple[str, ...]:
    """``run`` of the cpu image's export stage: ``repository.build`` with the serving image's own torch.

    The checkout is mounted read-only at ``/src`` (the stage's PYTHONPATH), the results folder's parent at
    ``/models`` (a cascade stage finds its sibling previous stage), the output's parent at ``/out``; the
    builder runs as ``uid:gid`` so the repository belongs to the caller.
    """
    out, model = Path(out_dir), Path(model_dir)
    return (
        spec.engine, "run", "--rm", "--user", f"{uid}:{gid}", "--env", "HOME=/tmp",
        "--volume", f"{source_root}:/src:ro",
        "--volume", f"{model.parent}:/models:ro",
        "--volume", f"{out.parent}:/out",
        spec.export_image_tag, "python3", "-m", "repository.build", "--model-dir", f"/models/{model.name}",
        "--model-repository", f"/out/{out.name}", *builder_args,
    )


def endpoint_usage(info: RepositoryInfo, http: str, grpc: str | None, metrics: str | None, *, undeploy: str,
                   images: str = "<images>", tls: bool = False) -> str:
    """What ``make deploy`` prints once the server is up: every endpoint of the repository with its URL and
    versions, example calls, how to stop it. ``tls``: ``http`` is the TLS proxy (HTTPS, client certificate);
    ``grpc`` or ``metrics`` None: not published (the embedded server's metrics: closed unless asked for)."""
    names = info.endpoints
    scheme = "https" if tls else "http"
    urls = {name: f"{scheme}://{http}/v2/models/{name}" for name in names}
    width, url_width = max(map(len, names)), max(map(len, urls.values()))
    lines = [f"{len(names)} endpoint(s) on one server, each IMAGE fp32 [C, z, y, x] + SPACING fp64 [3] -> "
             "SEGMENTATION:"]
    for name in names:
        mine = [p for p in info.pipelines if p.name == name]  # the promoted version first
        pinned = ", ".join(io_names.pinned_endpoint(name, v) for v in sorted(p.version for p in mine))
        lines.append(f"  {name:<{width}}  {urls[name]:<{url_width}}  (runs version {mine[0].version}; "
                     f"pinned: {pinned})")
    lines.append("  typed copies <name>_fp16, _int16, _uint16, _uint8 take those images as they are")
    client_flags = " --ca ca.pem --cert client.pem --key client.key" if tls else ""
    calls = [f"  nnunet-triton predict --endpoint {name} -i {images} -o build/predictions/{name} --url {http}"
             f"{client_flags}" for name in names]
    client_tls = ", tls=client_tls('ca.pem', 'client.pem', 'client.key')" if tls else ""
    tls_import = "from nnunet_triton.client.tls import client_tls; " if tls else ""
    imports = f"from nnunet_triton.client.client import NnunetClient; {tls_import}import numpy as np; \\"
    return "\n".join([
        "",
        *lines,
        f"  {'HTTPS' if tls else 'HTTP':<8} {scheme}://{http}   (ready: {scheme}://{http}/v2/health/ready)",
        f"  gRPC     {grpc if grpc is not None else 'not published'}",
        f"  metrics  http://{metrics}/metrics" if metrics is not None else
        ("  metrics  not published" if tls else
         "  metrics  closed (no authentication there: deploy with --metrics or --metrics-port to open it)"),
        f"call it (or python -m nnunet_triton; `nnunet-triton info --url {http}{client_flags}` describes "
        "every endpoint):",
        *calls,
        f'  python -c "{imports}',
        "image = np.zeros((1, 32, 64, 64), np.float32); \\",
        f"client = NnunetClient('{http}', endpoint='{names[0]}'{client_tls}); \\",
        'print(client.segment(image, (1.0, 1.0, 1.0)).segmentation.shape)"',
        "stop it:",
        f"  {undeploy}",
    ])


def shell_line(argv: tuple[str, ...]) -> str:
    """The argv as one copy-pasteable shell line."""
    return shlex.join(argv)
