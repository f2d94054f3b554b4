"""Deployment as a service: a typed :class:`DeployPlan` and the steps that carry it out.

``nnunet-triton deploy | undeploy`` (``cli.deploy``) parses its flags into a :class:`DeployPlan` and calls
:func:`deploy` or :func:`undeploy`; every line for the user goes through the ``say`` callback it passes (the
command line prints them). The steps per target:

* embedded: build the CPU repository (a no-op when the builder's input hash matches), start the embedded
  tritonserver detached with every model loaded explicitly, wait until ready (``server.readiness``).
* docker: build the repository (here, in an export container, or in the cpu image's export stage), build the
  image, run the container sized for the largest volume, wait until ready; without a usable engine (or
  ``dry_run``) the commands are only said. ``replicas`` > 1: that many containers on loopback ports behind
  an nginx balancer container (``server.deploy.replicas``), each waited for, then the balancer.
* k8s: render the manifests (``execute``: ``kubectl apply``); ``kube_play``: run the cpu Deployment here with
  ``podman kube play`` and wait until ready.
* undeploy: stop what deploy started.

A deployment that cannot work as asked raises :class:`DeployError` naming the input, its rule and the value.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.builder.torch_compat import torch_minor_text
from nnunet_triton.errors import DeployError
from nnunet_triton.parameters import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_TILE_BATCH_SIZE,
)
from nnunet_triton.server import cves, proxy, readiness
from nnunet_triton.server.deploy import container_proxy, docker, k8s, replicas
from nnunet_triton.server.deploy import engine as container_engine
from nnunet_triton.server.deploy.repository_info import RepositoryInfo, triton_release
from nnunet_triton.server.deploy.sizing import VolumeSpec, plan_memory
from nnunet_triton.util.defaults import field_default
from nnunet_triton.util.durable import write_text_atomic

__all__ = ["CPU_IMAGE_OUT", "DEFAULT_OUT", "DEPLOYED_FILE", "KUBE_PLAY_OUT", "DeployPlan", "EndpointPlan",
           "Say", "Target", "check_exposure", "deploy", "endpoint_plans", "local_torch_fits", "undeploy"]

LOGGER = logging.getLogger(__name__)
Say = Callable[[str], None]
DEPLOYED_FILE = "deployed.txt"  # next to the embedded server's state file
DEFAULT_OUT = {"embedded": "build/model_repository", "docker": "build/model_repository_gpu",
               "k8s": "build/k8s"}
CPU_IMAGE_OUT = "build/model_repository_cpu_image"  # docker --variant cpu: exported with the image's torch
KUBE_PLAY_OUT = "build/k8s_cpu"  # k8s --kube-play


class Target(enum.StrEnum):
    EMBEDDED = "embedded"
    DOCKER = "docker"
    K8S = "k8s"


@dataclass(frozen=True)
class EndpointPlan:
    """One endpoint name deploy builds into the repository: its results folder (two or more: an ensemble
    of configurations under the name) and the configuration each folder must have been trained with."""

    name: str
    models: tuple[Path, ...]
    configurations: tuple[str | None, ...]

    def __post_init__(self) -> None:
        io_names.check_endpoint_name(self.name)
        if not self.models or len(self.configurations) != len(self.models):
            raise ValueError(f"endpoint {self.name!r} needs one or more model folders and one configuration "
                             f"(or None) per folder, got {list(self.models)} and "
                             f"{list(self.configurations)}.")

    @property
    def model(self) -> Path:
        return self.models[0]

    @property
    def ensemble(self) -> bool:
        return len(self.models) > 1


def endpoint_plans(models: Sequence[Path], names: Sequence[str] | None = None,
                   configurations: Sequence[str] | None = None) -> tuple[EndpointPlan, ...]:
    """The endpoints ``--model-dir``, ``--endpoint`` and ``--configuration`` ask for.

    No name or one name: every folder under that name (default ``nnunet``; several folders: an ensemble of
    configurations). One name per folder: one endpoint per folder, in the same order. No folder: none
    (k8s renders a built ``--model-repository``). ``--configuration``: one for every folder or one per folder.

    Raises:
        DeployError: names and folders do not pair up, a name is given twice, or the configurations
            are neither one nor one per folder.
    """
    models, names = tuple(Path(m) for m in models), tuple(names or ())
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise DeployError(f"--endpoint {' '.join(names)} gives the endpoint name(s) {twice} more than "
                          "once; every endpoint of the repository needs its own name.")
    if not models:
        return ()
    folders = [str(m) for m in models]
    if len(names) > 1 and len(names) != len(models):
        raise DeployError(
            f"--endpoint takes one name (every --model-dir folder under it: several folders are an "
            f"ensemble of "
            f"configurations) or one name per --model-dir folder (one endpoint each, one server): got "
            f"{len(names)} names {list(names)} for {len(models)} --model-dir folder(s) {folders}.")
    given = tuple(configurations or ())
    if given and len(given) not in (1, len(models)):
        raise DeployError(f"--configuration takes one value or one per --model-dir folder "
                          f"({len(models)}: "
                          f"{folders}), got {list(given)}.")
    wanted = given * len(models) if len(given) == 1 else given or (None,) * len(models)
    if len(names) > 1:
        return tuple(EndpointPlan(name, (model,), (configuration,))
                     for name, model, configuration in zip(names, models, wanted, strict=True))
    return (EndpointPlan(names[0] if names else io_names.ENDPOINT_MODEL, models, wanted),)


@dataclass(frozen=True)
class DeployPlan:
    """Everything one ``deploy`` or ``undeploy`` does, decided before any step runs.

    ``out`` is the repository to build (embedded, docker) or the manifests folder (k8s); ``names`` the
    ``--endpoint`` names as given (k8s with a built ``repository``: the endpoints it must hold). The other
    fields are the command line's flags of the same name.
    """

    target: Target
    out: Path
    endpoints: tuple[EndpointPlan, ...] = ()
    names: tuple[str, ...] = ()
    folds: tuple[int | str, ...] | None = None
    # the repository build
    tile_batch_size: int = DEFAULT_TILE_BATCH_SIZE
    fold_instances: int = 1
    orchestrator_instances: int | None = None
    precision: str = "fp16"
    # the server
    host: str = "127.0.0.1"
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    metrics: bool = False  # embedded: the metrics endpoint (also opened by metrics_port; closed by default)
    # embedded: start without server.preload's library (embedded.ALLOW_DEGRADED_FLAG)
    allow_token_in_proc_and_readable_shm: bool = False
    ready_timeout: float = readiness.READY_TIMEOUT_S
    backend_directory: tuple[Path, ...] | None = None
    tls: proxy.TlsSettings | None = None
    proxy_port: int | None = None
    proxy_allow_statistics: bool = False
    # docker and k8s
    variant: str = "auto"
    engine: str = "auto"
    container_name: str = field_default(k8s.K8sSpec, "name")
    base_image: str | None = None
    triton_release: str = docker.GPU_TRITON_RELEASE
    image_torch_version: str | None = None
    gpus: tuple[int, ...] = (0,)
    max_volume: tuple[int, int, int] = field_default(VolumeSpec, "shape")
    max_spacing: tuple[float, float, float] | None = None
    probabilities: bool = False
    execute: bool = False
    dry_run: bool = False
    replicas: int = 1  # docker: that many containers behind an nginx balancer (server.deploy.replicas)
    # k8s
    kube_play: bool = False
    repository: Path | None = None
    image: str | None = None
    namespace: str | None = None
    model_image: str | None = None
    model_pvc: str | None = None
    min_replicas: int = field_default(k8s.K8sSpec, "min_replicas")
    max_replicas: int = field_default(k8s.K8sSpec, "max_replicas")
    latency_target_us: int = field_default(k8s.K8sSpec, "latency_target_us")
    service_monitor: bool = False
    tls_secret: str | None = None
    cpu: int = 2  # --kube-play: the pod's CPUs here (a cluster's pods get K8sSpec.cpu)
    autoscaler: str = field_default(k8s.K8sSpec, "autoscaler")
    kserve: bool = False
    prometheus_url: str | None = None

    def __post_init__(self) -> None:
        if self.target not in tuple(Target):
            raise DeployError(f"--target must be one of {[str(t) for t in Target]}, got {self.target!r}.")
        object.__setattr__(self, "target", Target(self.target))
        rules = (("--tile-batch-size", self.tile_batch_size, self.tile_batch_size >= 1, "at least 1"),
                 ("--fold-instances", self.fold_instances, self.fold_instances >= 1, "at least 1"),
                 ("--ready-timeout", self.ready_timeout, self.ready_timeout > 0, "positive (seconds)"),
                 ("--max-volume", list(self.max_volume), all(n > 0 for n in self.max_volume),
                  "three positive voxel counts"),
                 ("--max-replicas", self.max_replicas, self.max_replicas >= self.min_replicas,
                  f"at least --min-replicas ({self.min_replicas})"))
        for flag, value, holds, rule in rules:
            if not holds:
                raise DeployError(f"{flag} must be {rule}, got {value}.")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise DeployError(f"--replicas must be an integer of at least 1 (containers behind the "
                              f"balancer), got {self.replicas!r}.")
        if self.replicas > 1 and self.target != Target.DOCKER:
            hint = ("Kubernetes scales the Deployment itself: --min-replicas/--max-replicas"
                    if self.target == Target.K8S else "the embedded server is one process")
            raise DeployError(f"--replicas {self.replicas} (more than 1) runs containers behind an nginx "
                              f"balancer with --target docker only, got --target {self.target} ({hint}).")

    @property
    def model(self) -> Path | None:
        """The first results folder (the dataset's held-out images are looked for next to it)."""
        return self.endpoints[0].model if self.endpoints else None


def _build_options(plan: DeployPlan, target: str, serving_torch: str | None = None) -> Any:
    from nnunet_triton.builder.model_specs import BuildOptions

    # the docker image's libtorch (or the cpu image's torch): the builder refuses a newer exporting torch
    if serving_torch is None and target == "gpu" and plan.triton_release:
        serving_torch = triton_release(plan.triton_release, plan.image_torch_version).libtorch
    return BuildOptions(target=target, tile_batch_size=plan.tile_batch_size,
                        fold_precision=plan.precision if target == "gpu" else "fp32",
                        fold_instances=plan.fold_instances,
                        orchestrator_instances=plan.orchestrator_instances, serving_torch=serving_torch)


def _read_configs(plan: DeployPlan) -> dict[str, Any]:  # {endpoint name: InferenceConfig}
    """The configuration of each endpoint's (first) results folder, every folder and --configuration
    checked; ensembles of configurations only on the embedded target."""
    from nnunet_triton.numerics.model_folder import read_model_folder

    if not plan.endpoints:
        raise DeployError(f"--target {plan.target} needs --model-dir (an nnU-Net results folder).")
    for endpoint in plan.endpoints:
        if endpoint.ensemble and plan.target != "embedded":
            raise DeployError(
                f"--target {plan.target} serves one model folder per endpoint, got {len(endpoint.models)} "
                f"for {endpoint.name!r} ({', '.join(map(str, endpoint.models))}); an ensemble of "
                "configurations is deployed with --target embedded or built with `nnunet-triton build "
                "--model-dir A B`, several endpoints in one server with one --endpoint per --model-dir "
                "(--model-dir A B "
                "--endpoint liver lung).")
        for model in endpoint.models:
            if not (model / "plans.json").is_file():
                raise DeployError(f"--model-dir {str(model)!r} is not an nnU-Net results folder.")
    configs = {}
    for endpoint in plan.endpoints:
        for index, (model, configuration) in enumerate(zip(endpoint.models, endpoint.configurations,
                                                           strict=True)):
            if index and configuration is None:
                continue
            config = read_model_folder(model, folds=plan.folds, allow_cascade=True)
            if configuration is not None and configuration != config.configuration:
                raise DeployError(f"--configuration {configuration!r} does not match the checkpoints' "
                                  f"configuration {config.configuration!r} in {str(model)!r}.")
            configs.setdefault(endpoint.name, config)
    return configs


def _build(plan: DeployPlan, target: str, say: Say, export_device: str | None = None) -> None:
    """Build every endpoint of the plan into ``plan.out`` (one name each; other names stay)."""
    from nnunet_triton.builder.repository import VersionChoice, build_ensemble_repository, build_repository

    options = _build_options(plan, target)
    for endpoint in plan.endpoints:
        choice = VersionChoice(name=endpoint.name)
        if endpoint.ensemble:
            result = build_ensemble_repository(endpoint.models, plan.out, options=options, folds=plan.folds,
                                               export_device=export_device, endpoint=choice)
        else:
            result = build_repository(endpoint.model, plan.out, options=options, folds=plan.folds,
                                      configuration=endpoint.configurations[0], export_device=export_device,
                                      endpoint=choice)
        say(f"repository {'built' if result.rebuilt else 'up to date (input hash matches)'}: {result.out} "
            f"(endpoint {result.name} version {result.version})")


def _usage(plan: DeployPlan, info: RepositoryInfo, http: str, grpc: str | None, metrics: str | None,
           undeploy: str, say: Say, images: str = "<images>", tls: bool = False) -> None:
    say(docker.endpoint_usage(info, http, grpc, metrics, undeploy=undeploy, images=images, tls=tls))
    asked = {endpoint.name for endpoint in plan.endpoints}
    others = [name for name in info.endpoints if asked and name not in asked]
    if others:
        repository = plan.repository or plan.out
        say(f"note: the repository also holds the endpoint(s) {', '.join(others)} (built before), served "
            f"too; `nnunet-triton remove --endpoint NAME --model-repository {repository}` takes one out.")


def _images(plan: DeployPlan) -> str:
    """The dataset's held-out images next to the results folder (the fixtures' layout), if any."""
    images = plan.model.parent / "imagesTs" if plan.model is not None else None
    return str(images) if images is not None and images.is_dir() else "<images>"


def _metrics_address(handle: Any) -> str | None:
    """``host:port`` of an embedded server's metrics; None when they are closed (the default)."""
    return None if handle.metrics_port is None else f"{handle.client_host}:{handle.metrics_port}"


def _deployed(handle: Any) -> str | None:
    """``"<pid> <input hash>"`` of the server deploy started last (a server of ``nnunet-triton serve``
    has none)."""
    path = Path(handle.state_file).parent / DEPLOYED_FILE
    return path.read_text().strip() if path.is_file() else None


def _deploy_embedded(plan: DeployPlan, say: Say) -> None:
    from nnunet_triton.server import embedded as embedded_server
    from nnunet_triton.server.handle import ServerHandle
    from nnunet_triton.server.triton_install import resolve_home

    _read_configs(plan)
    _build(plan, "cpu", say)
    info = RepositoryInfo.from_repository(plan.out)
    info.target  # noqa: B018 - one server serves every endpoint: DeployError when they mix targets
    state = resolve_home(None) / "run" / "server.json"
    if state.is_file():
        running = ServerHandle.from_state_file(state)
        same = Path(running.model_repository) == plan.out.absolute()
        if same and running.is_ready() and _deployed(running) == f"{running.pid} {info.input_hash}":
            say(f"already serving this repository (pid {running.pid})")
            _usage(plan, info, running.http_url, running.grpc_url, _metrics_address(running),
                   "nnunet-triton undeploy", say, _images(plan))
            return
        LOGGER.info("stopping the running server (pid %d, %s)", running.pid, running.model_repository)
        running.stop()
    handle = embedded_server.start(plan.out, embedded_server.LaunchOptions(
        host=plan.host, http_port=plan.http_port, grpc_port=plan.grpc_port,
        metrics_port=plan.metrics_port, metrics=plan.metrics,
        allow_token_in_proc_and_readable_shm=plan.allow_token_in_proc_and_readable_shm,
        model_control_mode="explicit", load_models=tuple(info.models),
        ready_timeout_s=plan.ready_timeout, detach=True,
        backend_dirs=tuple(plan.backend_directory) if plan.backend_directory is not None else None,
        tls=plan.tls, proxy_port=plan.proxy_port, allow_statistics=plan.proxy_allow_statistics))
    write_text_atomic(Path(handle.state_file).parent / DEPLOYED_FILE, f"{handle.pid} {info.input_hash}\n",
                      mode=0o600)
    say(f"tritonserver ready (pid {handle.pid}, {len(info.models)} models of the endpoint(s) "
        f"{', '.join(info.endpoints)}; log {handle.log_file})")
    _usage(plan, info, handle.http_url, handle.grpc_url, _metrics_address(handle), "nnunet-triton undeploy",
           say, _images(plan))


def local_torch_fits(plan: DeployPlan) -> bool:
    """This environment can build the GPU repository itself: its torch loads in the image (the builder's
    own rule) and the fp16 export has CUDA."""
    import torch

    from nnunet_triton.builder.torch_compat import export_fits

    fits = export_fits(torch.__version__, _build_options(plan, "gpu").loading_torch)
    return fits and (plan.precision == "fp32" or torch.cuda.is_available())


def _docker_spec(plan: DeployPlan, info: RepositoryInfo, *, variant: str = "gpu",
                 engine: str = "docker") -> docker.DeploySpec:
    volume = VolumeSpec(tuple(plan.max_volume), plan.max_spacing, probabilities=plan.probabilities)
    gpus = tuple(plan.gpus) if variant == "gpu" else ()
    if variant == "gpu" and cves.RELEASE.fullmatch(plan.triton_release or ""):
        stale = cves.older_release_warning(plan.triton_release)
        if stale:
            LOGGER.warning("--triton-release %s: %s", plan.triton_release, stale)
    memory = plan_memory(info, volume, gpus=max(1, len(gpus)))
    ports = {"http_port": plan.http_port or DEFAULT_HTTP_PORT,
             "grpc_port": plan.grpc_port or DEFAULT_GRPC_PORT,
             "metrics_port": plan.metrics_port or DEFAULT_METRICS_PORT}
    return docker.DeploySpec(info=info, plan=memory, repository=str(plan.out.absolute()),
                             triton_release=plan.triton_release, gpus=gpus, variant=variant, engine=engine,
                             base_image_ref=plan.base_image, container_name=plan.container_name,
                             image_torch_version=plan.image_torch_version, publish_host=plan.host,
                             tls=plan.tls, proxy_port=plan.proxy_port or container_proxy.PROXY_PORT,
                             proxy_allow_statistics=plan.proxy_allow_statistics, **ports)


def _run(commands: list[tuple[str, ...]], execute: bool, say: Say, tool: str = "docker") -> None:
    for argv in commands:
        say(f"  {docker.shell_line(argv)}")
    if execute:
        if shutil.which(tool) is None:
            raise DeployError(f"--execute needs `{tool}` on PATH; it is not installed here.")
        for argv in commands:
            subprocess.run(argv, check=True)


def _gpu_visible() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists()


def _variant(plan: DeployPlan, say: Say) -> str:
    if plan.variant != "auto":
        return plan.variant
    variant = "gpu" if _gpu_visible() else "cpu"
    why = "an NVIDIA GPU is visible" if variant == "gpu" else "no NVIDIA GPU here"
    say(f"image variant: {variant} ({why}; --variant gpu|cpu to choose)")
    return variant


def _engine(plan: DeployPlan, say: Say) -> tuple[str, bool]:
    """The engine to name in the commands, and whether to run them (an engine works, no --dry-run)."""
    found = (container_engine.require_engine(plan.engine, why="--execute") if plan.execute
             else container_engine.find_engine(plan.engine))
    if found is None and not plan.dry_run:
        say("no working container engine here (docker daemon or podman): printing the commands only")
    engine = found or (plan.engine if plan.engine != "auto" else "docker")
    return engine, found is not None and not plan.dry_run


def _deploy_docker(plan: DeployPlan, say: Say) -> None:
    variant = _variant(plan, say)
    engine, execute = _engine(plan, say)
    plan = replace(plan, execute=execute)
    if variant == "cpu":
        plan, spec = _build_cpu_repository(plan, engine, say)
        _start_container(plan, spec, say)
    else:
        _deploy_docker_gpu(plan, engine, say)


def _cpu_image(plan: DeployPlan, engine: str, info: RepositoryInfo, say: Say) -> docker.DeploySpec:
    """The cpu image (and its export stage) built, or said: the base image checked and the wheels made
    first."""
    spec = _docker_spec(plan, info, variant="cpu", engine=engine)
    wheels = None
    if plan.execute:
        if spec.base_image == container_engine.LOCAL_BASE_IMAGE:
            container_engine.require_image(engine, spec.base_image)
        wheels = str(container_engine.fill_wheels())
    say(f"build the cpu image {spec.image_tag} and its export stage (base {spec.base_image}):")
    source = container_engine.source_root()
    builds = [docker.docker_build_command(spec, context=str(source), target=target, wheels=wheels,
                                          dockerfile=str(source / "docker" / "Dockerfile"))
              for target in ("export", None)]
    _run(builds, plan.execute, say, tool=engine)
    return spec


def _build_cpu_repository(plan: DeployPlan, engine: str, say: Say) -> tuple[DeployPlan, docker.DeploySpec]:
    """cpu image: the repository is built in the image's export stage, so its torch loads the fold models.
    The plan (its ``out`` moved to the cpu image's repository) and the container's spec."""
    configs = _read_configs(plan)
    options = _build_options(plan, "cpu", serving_torch=torch_minor_text(docker.IMAGE_TORCH["cpu"]))
    if plan.out == Path(DEFAULT_OUT["docker"]).absolute():
        plan = replace(plan, out=Path(CPU_IMAGE_OUT).absolute())
    if plan.base_image is None and engine == "podman":
        plan = replace(plan, base_image=container_engine.LOCAL_BASE_IMAGE)
    spec = _cpu_image(plan, engine, RepositoryInfo.planned(configs, options), say)
    say(f"build the repository {plan.out} with the image's torch {docker.IMAGE_TORCH['cpu']} (one run per "
        "endpoint, each writes its name into the repository):")
    if plan.execute:
        plan.out.parent.mkdir(parents=True, exist_ok=True)
    _run([docker.cpu_export_command(
        spec, source_root=str(container_engine.source_root()), model_dir=str(endpoint.model.absolute()),
        out_dir=str(plan.out.absolute()), uid=os.getuid(), gid=os.getgid(),
        builder_args=docker.builder_args(options, folds=plan.folds, configuration=endpoint.configurations[0],
                                         export_device=None, name=endpoint.name))
        for endpoint in plan.endpoints], plan.execute, say, tool=engine)
    if plan.execute:
        spec = _docker_spec(plan, RepositoryInfo.from_repository(plan.out), variant="cpu", engine=engine)
    return plan, spec


def _start_container(plan: DeployPlan, spec: docker.DeploySpec, say: Say, step: str = "") -> None:
    if plan.replicas > 1:
        _start_replicas(plan, spec, say, step)
        return
    memory = spec.plan
    pools = (f", CUDA pool {memory.cuda_pool_bytes >> 20} MiB/GPU, pinned {memory.pinned_pool_bytes >> 20} "
             "MiB" if spec.variant == "gpu" else "")
    say(f"{step}start it (shm {memory.shm_mib} MiB{pools} for volumes up to {list(plan.max_volume)}):")
    run = docker.docker_run_command(spec)
    if plan.execute:  # replace the container (or the replicas) of an earlier deploy
        _remove_replicas(plan, spec.engine, say=None)
        for argv in docker.docker_stop_commands(spec.container_name, spec.exit_timeout_s, engine=spec.engine):
            subprocess.run(argv, check=False, capture_output=True)
    _run([run], plan.execute, say, tool=spec.engine)
    http = f"127.0.0.1:{spec.http_port}"
    if plan.execute:
        took = (_wait_container_healthy(spec) if spec.tls is not None
                else _wait_container_ready(http, spec.startup_timeout_s, spec))
        say(f"container {spec.container_name} ready in {took:.1f} s")
    undeploy = "nnunet-triton undeploy --target docker" + (f" --engine {spec.engine}"
                                                          if spec.engine != "docker" else "")
    if spec.tls is None:
        _usage(plan, spec.info, http, f"127.0.0.1:{spec.grpc_port}", f"127.0.0.1:{spec.metrics_port}",
               undeploy, say)
        return
    host = "127.0.0.1" if spec.publish_host in ("0.0.0.0", "::") else spec.publish_host
    say(f"only the TLS proxy is published: https://{host}:{spec.proxy_port} (nginx in the container, "
        f"workers as {container_proxy.PROXY_USER}; Triton's HTTP, gRPC and metrics bind 127.0.0.1 inside "
        "it); clients give --ca (the CA of the server's certificate) and --cert/--key (a client certificate "
        "of --tls-ca), or the bearer token of --tls-token-file")
    _usage(plan, spec.info, f"{host}:{spec.proxy_port}", None, None, undeploy, say, tls=True)


def _replica_state_dir(plan: DeployPlan) -> Path:
    from nnunet_triton.server.triton_install import resolve_home

    return replicas.state_dir(resolve_home(None) / "run", plan.container_name)


def _start_replicas(plan: DeployPlan, spec: docker.DeploySpec, say: Say, step: str = "") -> None:
    """``plan.replicas`` containers of ``spec``'s image on loopback ports, each waited for until ready, then
    the nginx balancer in front of them (its config checked with ``nginx -t`` first); the state file."""
    ports = replicas.free_loopback_ports(3 * plan.replicas)
    listen = plan.proxy_port if spec.tls is not None else spec.http_port
    while listen in ports:  # the kernel's choice never collides with a listening port, but a given one may
        ports = replicas.free_loopback_ports(3 * plan.replicas)
    group = replicas.ReplicaSet(name=plan.container_name, listen_host=spec.publish_host,
                                listen_port=listen or container_proxy.PROXY_PORT, tls=spec.tls,
                                ports=tuple(tuple(ports[i:i + 3]) for i in range(0, len(ports), 3)))
    specs = replicas.replica_specs(spec, group)
    folder = _replica_state_dir(plan)
    if plan.execute:  # replace an earlier deploy's containers, then record the new ones before they start
        _remove_replicas(plan, spec.engine, say=None)
        for argv in docker.docker_stop_commands(plan.container_name, spec.exit_timeout_s, engine=spec.engine):
            subprocess.run(argv, check=False, capture_output=True)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        replicas.write_state(folder, group, spec.engine)  # from now on undeploy removes what started
    memory = spec.plan
    say(f"{step}start {len(specs)} replicas on loopback ports (shm {memory.shm_mib} MiB each, for volumes "
        f"up to {list(plan.max_volume)}):")
    _run([docker.docker_run_command(one) for one in specs], plan.execute, say, tool=spec.engine)
    if plan.execute:
        for one in specs:
            took = _wait_container_ready(f"127.0.0.1:{one.http_port}", one.startup_timeout_s, one)
            say(f"replica {one.container_name} ready in {took:.1f} s (127.0.0.1:{one.http_port})")
    config = replicas.balancer_config(group, spec.info.endpoints,
                                      allow_statistics=plan.proxy_allow_statistics)
    text = proxy_config_text(config)
    how = "HTTPS, client authentication" if spec.tls else "HTTP, loopback only"
    say(f"the balancer {group.balancer}: nginx on {group.url} ({how}) over the replicas' HTTP ports, "
        "passive health checks and retries on the next replica "
        f"(config {folder / 'nginx.conf'}):")
    if plan.execute:
        from nnunet_triton.util.durable import write_text_atomic

        write_text_atomic(folder / "nginx.conf", text, mode=0o600)
        check = subprocess.run(replicas.balancer_run_command(group, image=spec.image_tag, run_dir=folder,
                                                             engine=spec.engine, check_only=True),
                               capture_output=True, text=True, check=False, timeout=120)
        if check.returncode != 0:
            raise DeployError(f"nginx rejected the balancer's config {folder / 'nginx.conf'}: "
                              f"{check.stderr.strip()[-1000:]}")
    balancer = replicas.balancer_run_command(group, image=spec.image_tag, run_dir=folder, engine=spec.engine)
    _run([balancer], plan.execute, say, tool=spec.engine)
    if plan.execute:
        took = _wait_balancer(group, spec)
        say(f"balancer {group.balancer} answering in {took:.1f} s; replicas recorded in "
            f"{folder / replicas.STATE_FILE}")
    undeploy = "nnunet-triton undeploy --target docker" + (f" --engine {spec.engine}"
                                                          if spec.engine != "docker" else "") + (
        f" --container-name {plan.container_name}" if plan.container_name != "nnunet-triton" else "")
    _usage(plan, spec.info, group.url, None, None, undeploy, say, tls=spec.tls is not None)
    say("gRPC and metrics are not balanced: each replica's are on its own loopback ports (" + ", ".join(
        f"{one.container_name}: gRPC {one.grpc_port}, metrics {one.metrics_port}" for one in specs) + ")")


def proxy_config_text(config: Any) -> str:
    """The balancer's nginx.conf (workers as the image's proxy user, bodies under the container's /tmp)."""
    from nnunet_triton.server.proxy_config import render_config

    user = container_proxy.PROXY_USER
    return render_config(config, worker_user=f"{user} {user}", temp_dir=replicas.BALANCER_TEMP_DIR)


def _wait_balancer(group: replicas.ReplicaSet, spec: docker.DeploySpec) -> float:
    """Seconds until the balancer answers ready (over TLS: until its port accepts connections)."""
    balancer = docker.replace_spec(spec, container_name=group.balancer)
    if group.tls is None:
        return _wait_container_ready(group.url, 60.0, balancer)
    start, (host, port) = time.monotonic(), group.url.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return time.monotonic() - start
        except OSError:
            status, code = _container_state(balancer)
            if status in ("exited", "stopped", "missing") or time.monotonic() - start > 60:
                raise DeployError(f"the balancer {group.balancer} does not listen on {group.url} "
                                  f"({status}, exit {code})") from None
            time.sleep(0.5)


def _remove_replicas(plan: DeployPlan, engine: str, say: Say | None, execute: bool = True) -> bool:
    """Stop and remove the recorded replicas and balancer, then forget them (``execute`` False: only say the
    commands); False when none are recorded."""
    folder = _replica_state_dir(plan)
    state = replicas.read_state(folder)
    if state is None:
        return False
    names = [state["balancer"], *(one["name"] for one in state["replicas"])]
    commands = [argv for name in names for argv in docker.docker_stop_commands(name, engine=engine)]
    for argv in commands:
        if say is not None:
            say(f"  {docker.shell_line(argv)}")
        if execute:  # a container already gone is no failure: the state file still goes
            subprocess.run(argv, check=False, capture_output=True, timeout=300)
    if execute:
        (folder / replicas.STATE_FILE).unlink(missing_ok=True)
    return True


def _wait_container_healthy(spec: docker.DeploySpec) -> float:
    """Seconds until the container's own health command passes (behind the TLS proxy nothing of Triton is
    published); DeployError with the container's log when it stops first or the deadline passes."""
    start = time.monotonic()
    while True:
        status, code = _container_state(spec)
        if status in ("exited", "stopped", "missing"):
            reason = f"container {spec.container_name} {status} (exit {code}) before it was healthy"
            break
        probe = subprocess.run([spec.engine, "exec", spec.container_name, *docker.health_probe()],
                               capture_output=True, text=True, check=False, timeout=120)
        if probe.returncode == 0:
            return time.monotonic() - start
        if time.monotonic() - start > spec.startup_timeout_s:
            reason = (f"container {spec.container_name} was not healthy after {spec.startup_timeout_s} s "
                      f"({probe.stdout.strip()[-500:]})")
            break
        time.sleep(2.0)
    logs = subprocess.run([spec.engine, "logs", "--tail", "20", spec.container_name],
                          capture_output=True, text=True, check=False, timeout=60)
    raise DeployError(f"{reason}; its log ends:\n{logs.stdout}{logs.stderr}")


def _deploy_docker_gpu(plan: DeployPlan, engine: str, say: Say) -> None:
    configs, options = _read_configs(plan), _build_options(plan, "gpu")
    local = local_torch_fits(plan)
    if local:
        _build(plan, "gpu", say, export_device="cuda" if plan.precision == "fp16" else None)
    else:
        say(f"1. build the GPU repository with torch {docker.EXPORT_TORCH} (this torch does not match the "
            f"libtorch of Triton {plan.triton_release} or has no CUDA for the fp16 export; one container "
            "per endpoint, each writes its name into the repository):")
        _run([docker.export_container_command(
            source_root=str(container_engine.source_root()), model_dir=str(endpoint.model.absolute()),
            out_dir=str(plan.out.absolute()), gpu=plan.gpus[0], uid=os.getuid(), gid=os.getgid(),
            engine=engine, builder_args=docker.builder_args(options, folds=plan.folds, name=endpoint.name,
                                                            configuration=endpoint.configurations[0]))
            for endpoint in plan.endpoints], plan.execute, say, tool=engine)
    # the repository as built now (locally or by the executed export step), else as it will be built
    built = (local or plan.execute) and (plan.out / io_names.REPOSITORY_METADATA_FILE).is_file()
    spec = _docker_spec(plan, RepositoryInfo.from_repository(plan.out) if built
                        else RepositoryInfo.planned(configs, options), engine=engine)
    say("2. build the serving image:")
    _run([docker.docker_build_command(spec, context=str(container_engine.source_root()))], plan.execute, say,
         tool=engine)
    _start_container(plan, spec, say, step="3. ")


def _container_state(spec: docker.DeploySpec) -> tuple[str, str]:
    """(status, exit code) of the container, e.g. ("running", "0"), ("exited", "78")."""
    result = subprocess.run([spec.engine, "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}",
                             spec.container_name], capture_output=True, text=True, check=False, timeout=60)
    status, _, code = result.stdout.strip().partition(" ")
    return status or "missing", code


def _wait_container_ready(http: str, timeout_s: float, spec: docker.DeploySpec) -> float:
    """Seconds until the container's server is ready (``server.readiness``); DeployError with the
    container's log when it stops first or the deadline passes."""
    def gone() -> str | None:
        status, code = _container_state(spec)
        return f"container {spec.container_name} {status} (exit {code})" if status in (
            "exited", "stopped", "missing") else None

    try:
        return readiness.wait_ready(http, timeout_s=timeout_s, gone=gone,
                                    what=f"container {spec.container_name}", interval_s=2.0)
    except readiness.NotReadyError as exc:
        logs = subprocess.run([spec.engine, "logs", "--tail", "20", spec.container_name],
                              capture_output=True, text=True, check=False, timeout=60)
        raise DeployError(f"{exc}; its log ends:\n{logs.stdout}{logs.stderr}") from None


def _kube_play(plan: DeployPlan, say: Say) -> None:
    """The cpu Deployment run here by ``podman kube play``: repository, images, models image, manifests."""
    container_engine.require_engine("podman", why="--kube-play")
    manifests_dir = plan.out
    plan = replace(plan, execute=True, out=plan.repository or Path(CPU_IMAGE_OUT).absolute())
    plan, spec = _build_cpu_repository(plan, "podman", say)
    info = spec.info
    # the repository in a podman volume behind the PVC (podman 4.3 kube play races its init containers:
    # "failed to remove once init container ... as it is running", so the image source is not used here)
    source = k8s.ModelSource("pvc", f"nnunet-triton-models-{(info.input_hash or 'latest')[:12]}")
    say(f"the model repository in the volume {source.ref} (the PVC's claimName):")
    subprocess.run(["podman", "volume", "rm", "--force", source.ref], check=False, capture_output=True)
    _run([("podman", "volume", "create", source.ref)], True, say, tool="podman")
    tar = subprocess.Popen(["tar", "-C", str(plan.out), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "volume", "import", source.ref, "-"], stdin=tar.stdout, check=True, timeout=600)
    tar.wait(60)
    kspec = k8s.K8sSpec(info=info, plan=spec.plan, image=spec.image_tag, model_source=source, gpus=0,
                        name=plan.container_name, cpu=str(plan.cpu), min_replicas=1, max_replicas=1,
                        host_ports=(spec.http_port, spec.grpc_port, spec.metrics_port),
                        startup_timeout_s=spec.startup_timeout_s)
    manifests_dir.mkdir(parents=True, exist_ok=True)
    for name, text in k8s.manifest_files(kspec).items():
        write_text_atomic(manifests_dir / name, text)
    deployment = manifests_dir / "deployment.yaml"
    say(f"wrote the manifests to {manifests_dir}; podman kube play runs the Deployment (it ignores the "
        "Service, HPA and readiness/startup probes; the liveness probe is its healthcheck):")
    start = time.monotonic()
    _run([("podman", "kube", "play", "--replace", str(deployment))], True, say, tool="podman")
    pod_container = f"{plan.container_name}-pod-0-tritonserver"
    _wait_container_ready(f"127.0.0.1:{spec.http_port}", spec.startup_timeout_s,
                          docker.replace_spec(spec, container_name=pod_container, engine="podman"))
    took = time.monotonic() - start
    say(f"Deployment {plan.container_name} ready under podman kube play in {took:.1f} s "
        f"(container {pod_container})")
    host = "127.0.0.1"
    _usage(plan, info, f"{host}:{spec.http_port}", f"{host}:{spec.grpc_port}", f"{host}:{spec.metrics_port}",
           "nnunet-triton undeploy --target k8s --kube-play", say)


def _deploy_k8s(plan: DeployPlan, say: Say) -> None:
    if plan.kube_play:
        _kube_play(plan, say)
        return
    repo = plan.repository or Path(DEFAULT_OUT["docker"]).absolute()
    if (repo / io_names.REPOSITORY_METADATA_FILE).is_file():
        info = RepositoryInfo.from_repository(repo)
        missing = [name for name in plan.names if name not in info.endpoints]
        if missing:
            raise DeployError(
                f"the repository {str(repo)} has no endpoint(s) {missing} (it holds {list(info.endpoints)}); "
                "build them into it first (`nnunet-triton deploy --target docker --model-dir A B --endpoint "
                "liver lung` shows how), or leave out --endpoint to serve what it holds.")
    else:
        info = RepositoryInfo.planned(_read_configs(plan), _build_options(plan, "gpu"))
        say(f"note: {repo} is not built yet; `nnunet-triton deploy --target docker` shows how to build it")
    if info.target != "gpu":
        raise DeployError(f"{repo} was built for target {info.target!r}; the pods get one GPU each: "
                          "build it with `nnunet-triton deploy --target docker` (target gpu).")
    plan = replace(plan, gpus=(0,))  # one GPU per pod
    dspec = _docker_spec(plan, info)
    docker.check_image_compatible(dspec)
    tag = (info.input_hash or "latest")[:12]
    source = (k8s.ModelSource("pvc", plan.model_pvc) if plan.model_pvc
              else k8s.ModelSource("image", plan.model_image or f"nnunet-triton-models:{tag}"))
    spec = k8s.K8sSpec(info=info, plan=dspec.plan, image=plan.image or dspec.image_tag, model_source=source,
                       namespace=plan.namespace, min_replicas=plan.min_replicas,
                       max_replicas=plan.max_replicas, latency_target_us=plan.latency_target_us,
                       service_monitor=plan.service_monitor, startup_timeout_s=dspec.startup_timeout_s,
                       tls_secret=plan.tls_secret, autoscaler=plan.autoscaler, kserve=plan.kserve,
                       prometheus_url=plan.prometheus_url or k8s.DEFAULT_PROMETHEUS_URL)
    plan.out.mkdir(parents=True, exist_ok=True)
    files = k8s.manifest_files(spec)
    for name, text in files.items():
        write_text_atomic(plan.out / name, text)
    kind = "InferenceService" if spec.kserve else "Deployment"
    say(f"wrote {', '.join(files)} to {plan.out}: one {kind} {spec.name} serving the endpoint(s) "
        f"{', '.join(info.endpoints)} ({len(info.models)} models; per pod /dev/shm {dspec.plan.shm_mib} "
        f"MiB, memory {dspec.plan.host_memory_mib} MiB for all of them)")
    if source.kind == "image":
        say("model repository image (push both images where the cluster pulls from):")
        recipe = container_engine.source_root() / "docker" / "Dockerfile.models"
        say(f"  docker build --file {recipe} --tag {source.ref} {repo}")
    if spec.autoscaler == "hpa":
        say("apply (prometheus-adapter needs prometheus-adapter-values.yaml for the HPA metric):")
    else:
        needs = "KEDA and KServe" if spec.kserve else "KEDA"
        say(f"apply ({needs} installed; KEDA queries {spec.prometheus_url}, which must scrape the pods' "
            "metrics port 8002):")
    _run([("kubectl", "apply", "--kustomize", str(plan.out))], plan.execute, say, tool="kubectl")


def check_exposure(plan: DeployPlan) -> None:
    """ExposureError for a server reachable beyond loopback without TLS and client authentication."""
    if plan.target == "embedded":
        proxy.check_exposure(plan.host, plan.tls, what="the embedded tritonserver")
    elif plan.target == "docker":  # the image's TLS proxy (server.deploy.container_proxy) with TLS
        proxy.check_exposure(plan.host, plan.tls, what="--target docker's tritonserver")


def deploy(plan: DeployPlan, say: Say) -> None:
    """Carry out ``plan``: build, run, wait until ready, say the endpoints (``say``: one text at a time).

    Raises:
        DeployError: the deployment cannot work as asked (the message names the input, rule and value).
        proxy.ExposureError: a server beyond loopback without TLS and client authentication.
        subprocess.CalledProcessError: an engine, kubectl or podman command failed.
    """
    check_exposure(plan)  # before building: a refused deployment costs nothing
    flows = {Target.EMBEDDED: _deploy_embedded, Target.DOCKER: _deploy_docker, Target.K8S: _deploy_k8s}
    flows[plan.target](plan, say)


def undeploy(plan: DeployPlan, say: Say) -> None:
    """Stop what :func:`deploy` started with the containers or Kubernetes (embedded: forget the deployed
    repository; the caller stops the recorded server)."""
    if plan.target == "embedded":
        from nnunet_triton.server.triton_install import resolve_home

        (resolve_home(None) / "run" / DEPLOYED_FILE).unlink(missing_ok=True)
    elif plan.target == "docker":
        engine = container_engine.find_engine(plan.engine)
        execute = plan.execute or (engine is not None and not plan.dry_run)
        if _remove_replicas(plan, engine or "docker", say, execute):
            return
        _run(list(docker.docker_stop_commands(plan.container_name, engine=engine or "docker")), execute, say,
             tool=engine or "docker")
    elif plan.kube_play:
        _run([("podman", "kube", "down", str(plan.out / "deployment.yaml"))], True, say, tool="podman")
    else:
        _run([("kubectl", "delete", "--kustomize", str(plan.out))], plan.execute, say, tool="kubectl")
