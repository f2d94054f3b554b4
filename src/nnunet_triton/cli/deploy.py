"""``nnunet-triton deploy | undeploy``: one command from an nnU-Net results folder to a serving endpoint
(a checkout's ``make deploy`` / ``make undeploy`` run these).

    nnunet-triton deploy --model-dir <results folder> [<more folders>] [--endpoint N [N ...]]
        [--configuration C]
        [--folds 0 1] [--target embedded|docker|k8s] [--out DIR] [--execute]
    nnunet-triton undeploy [--target embedded|docker|k8s] [--out DIR] [--execute]

Several models behind one server: ``--model-dir A B --endpoint liver lung`` (one name per folder) builds each
folder as its own endpoint (``liver``, ``lung``, with their typed copies and pinned versions) into ONE
repository, served by one server (one container, one Deployment) sized for all of them; without
``--endpoint``, or with one name, the folders are one endpoint of that name (default ``nnunet``; two or more
folders: an ensemble of configurations). Every endpoint already in the repository is served too
(``nnunet-triton remove --endpoint`` takes one out).

embedded: build the CPU repository (a no-op when the builder's input hash matches), start the embedded
tritonserver detached with every model loaded explicitly, wait until ready, print endpoints and example
calls. docker: the image of --variant (auto: gpu where an NVIDIA GPU is visible, else cpu) with the engine
found (a docker whose daemon answers, else podman; --engine picks one): build the repository with a torch
the image loads, build the image, start the container sized for the largest volume and wait until it is
ready; with no usable engine (or --dry-run) the commands are printed. k8s: render the manifests into --out
(--execute: kubectl apply; --kube-play: run the Deployment here with podman kube play, cpu variant).
docker and k8s build images from the project's source tree (``server.deploy.engine.source_root``: a
checkout, or ``$NNUNET_TRITON_SOURCE``); embedded needs none.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.cli.common import DeprecatedAlias, add_model_dir_argument, endpoint_name
from nnunet_triton.cli.serve import add_tls_arguments, tls_settings
from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.parameters import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT
from nnunet_triton.server import deploy, proxy, readiness
from nnunet_triton.server.deploy import docker, k8s
from nnunet_triton.server.deploy import engine as container_engine

LOGGER = logging.getLogger(__name__)
DEPLOYED_FILE = "deployed.txt"  # next to the embedded server's state file
DEFAULT_OUT = {"embedded": "build/model_repository", "docker": "build/model_repository_gpu",
               "k8s": "build/k8s"}
CPU_IMAGE_OUT = "build/model_repository_cpu_image"  # docker --variant cpu: exported with the image's torch
KUBE_PLAY_OUT = "build/k8s_cpu"  # k8s --kube-play


def _build_options(args: argparse.Namespace, target: str, serving_torch: str | None = None) -> object:
    from nnunet_triton.builder.model_specs import BuildOptions

    # the docker image's libtorch (or the cpu image's torch): the builder refuses a newer exporting torch
    if serving_torch is None and target == "gpu" and getattr(args, "triton_release", None):
        serving_torch = deploy.triton_release(args.triton_release, args.image_torch_version).libtorch
    return BuildOptions(target=target, tile_batch_size=args.tile_batch_size,
                        fold_precision=args.precision if target == "gpu" else "fp32",
                        fold_instances=args.fold_instances,
                        orchestrator_instances=args.orchestrator_instances, serving_torch=serving_torch)


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
    (k8s renders a built ``--repository``). ``--configuration``: one for every folder or one per folder.

    Raises:
        NnunetTritonError: names and folders do not pair up, a name is given twice, or the configurations
            are neither one nor one per folder.
    """
    models, names = tuple(Path(m) for m in models), tuple(names or ())
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise NnunetTritonError(f"--endpoint {' '.join(names)} gives the endpoint name(s) {twice} more than "
                                "once; every endpoint of the repository needs its own name.")
    if not models:
        return ()
    folders = [str(m) for m in models]
    if len(names) > 1 and len(names) != len(models):
        raise NnunetTritonError(
            f"--endpoint takes one name (every --model-dir folder under it: several folders are an "
            f"ensemble of "
            f"configurations) or one name per --model-dir folder (one endpoint each, one server): got "
            f"{len(names)} names {list(names)} for {len(models)} --model-dir folder(s) {folders}.")
    given = tuple(configurations or ())
    if given and len(given) not in (1, len(models)):
        raise NnunetTritonError(f"--configuration takes one value or one per --model-dir folder "
                                f"({len(models)}: "
                                f"{folders}), got {list(given)}.")
    wanted = given * len(models) if len(given) == 1 else given or (None,) * len(models)
    if len(names) > 1:
        return tuple(EndpointPlan(name, (model,), (configuration,))
                     for name, model, configuration in zip(names, models, wanted, strict=True))
    return (EndpointPlan(names[0] if names else io_names.ENDPOINT_MODEL, models, wanted),)


def _read_configs(args: argparse.Namespace) -> dict[str, Any]:  # {endpoint name: InferenceConfig}
    """The configuration of each endpoint's (first) results folder, every folder and --configuration
    checked; ensembles of configurations only on the embedded target."""
    from nnunet_triton.numerics.model_folder import read_model_folder

    if not args.endpoints:
        raise NnunetTritonError(f"--target {args.target} needs --model-dir (an nnU-Net results folder).")
    for endpoint in args.endpoints:
        if endpoint.ensemble and args.target != "embedded":
            raise NnunetTritonError(
                f"--target {args.target} serves one model folder per endpoint, got {len(endpoint.models)} "
                f"for {endpoint.name!r} ({', '.join(map(str, endpoint.models))}); an ensemble of "
                "configurations is deployed with --target embedded or built with `nnunet-triton build "
                "--model-dir A B`, several endpoints in one server with one --endpoint per --model-dir "
                "(--model-dir A B "
                "--endpoint liver lung).")
        for model in endpoint.models:
            if not (model / "plans.json").is_file():
                raise NnunetTritonError(f"--model-dir {str(model)!r} is not an nnU-Net results folder.")
    configs = {}
    for endpoint in args.endpoints:
        for index, (model, configuration) in enumerate(zip(endpoint.models, endpoint.configurations,
                                                           strict=True)):
            if index and configuration is None:
                continue
            config = read_model_folder(model, folds=args.folds, allow_cascade=True)
            if configuration is not None and configuration != config.configuration:
                raise NnunetTritonError(f"--configuration {configuration!r} does not match the checkpoints' "
                                        f"configuration {config.configuration!r} in {str(model)!r}.")
            configs.setdefault(endpoint.name, config)
    return configs


def _build(args: argparse.Namespace, target: str, export_device: str | None = None) -> None:
    """Build every endpoint of ``args.endpoints`` into ``args.out`` (one name each; other names stay)."""
    from nnunet_triton.builder.repository import VersionChoice, build_ensemble_repository, build_repository

    options = _build_options(args, target)
    for endpoint in args.endpoints:
        choice = VersionChoice(name=endpoint.name)
        if endpoint.ensemble:
            result = build_ensemble_repository(endpoint.models, args.out, options=options, folds=args.folds,
                                               export_device=export_device, endpoint=choice)
        else:
            result = build_repository(endpoint.model, args.out, options=options, folds=args.folds,
                                      configuration=endpoint.configurations[0], export_device=export_device,
                                      endpoint=choice)
        print(f"repository {'built' if result.rebuilt else 'up to date (input hash matches)'}: {result.out} "
              f"(endpoint {result.name} version {result.version})")


def _print_usage(args: argparse.Namespace, info: deploy.RepositoryInfo, http: str, grpc: str, metrics: str,
                 undeploy: str, images: str = "<images>") -> None:
    print(docker.endpoint_usage(info, http, grpc, metrics, undeploy=undeploy, images=images))
    asked = {endpoint.name for endpoint in getattr(args, "endpoints", ())}
    others = [name for name in info.endpoints if asked and name not in asked]
    if others:
        repository = getattr(args, "repository", None) or args.out
        print(f"note: the repository also holds the endpoint(s) {', '.join(others)} (built before), served "
              f"too; `nnunet-triton remove --endpoint NAME --model-repository {repository}` takes one out.")


def _images(args: argparse.Namespace) -> str:
    """The dataset's held-out images next to the results folder (the fixtures' layout), if any."""
    images = args.model.parent / "imagesTs"
    return str(images) if images.is_dir() else "<images>"


def _deployed(handle: object) -> str | None:
    """``"<pid> <input hash>"`` of the server deploy started last (a server of ``nnunet-triton serve``
    has none)."""
    path = Path(handle.state_file).parent / DEPLOYED_FILE
    return path.read_text().strip() if path.is_file() else None


def _deploy_embedded(args: argparse.Namespace) -> int:
    from nnunet_triton.server import embedded as embedded_server
    from nnunet_triton.server.handle import ServerHandle
    from nnunet_triton.server.triton_install import resolve_home

    _read_configs(args)
    _build(args, "cpu")
    info = deploy.RepositoryInfo.from_repository(args.out)
    info.target  # noqa: B018 - one server serves every endpoint: DeployError when they mix targets
    state = resolve_home(None) / "run" / "server.json"
    if state.is_file():
        running = ServerHandle.from_state_file(state)
        same = Path(running.model_repository) == args.out.absolute()
        if same and running.is_ready() and _deployed(running) == f"{running.pid} {info.input_hash}":
            print(f"already serving this repository (pid {running.pid})")
            _print_usage(args, info, running.http_url, running.grpc_url,
                         f"{running.client_host}:{running.metrics_port}", "nnunet-triton undeploy",
                         _images(args))
            return 0
        LOGGER.info("stopping the running server (pid %d, %s)", running.pid, running.model_repository)
        running.stop()
    handle = embedded_server.start(
        args.out, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, model_control_mode="explicit", load_models=info.models,
        ready_timeout_s=args.ready_timeout, detach=True, backend_dirs=args.backend_directory,
        tls=tls_settings(args), proxy_port=args.proxy_port,
        allow_statistics=args.proxy_allow_statistics)
    (Path(handle.state_file).parent / DEPLOYED_FILE).write_text(f"{handle.pid} {info.input_hash}\n")
    print(f"tritonserver ready (pid {handle.pid}, {len(info.models)} models of the endpoint(s) "
          f"{', '.join(info.endpoints)}; log {handle.log_file})")
    _print_usage(args, info, handle.http_url, handle.grpc_url, f"{handle.client_host}:{handle.metrics_port}",
                 "nnunet-triton undeploy", _images(args))
    return 0


def _local_torch_fits(args: argparse.Namespace) -> bool:
    """This environment can build the GPU repository itself: its torch loads in the image (the builder's
    own rule) and the fp16 export has CUDA."""
    import torch

    from nnunet_triton.builder.torch_compat import export_fits

    fits = export_fits(torch.__version__, _build_options(args, "gpu").loading_torch)
    return fits and (args.precision == "fp32" or torch.cuda.is_available())


def _docker_spec(args: argparse.Namespace, info: deploy.RepositoryInfo, *, variant: str = "gpu",
                 engine: str = "docker") -> docker.DeploySpec:
    spacing = tuple(args.max_spacing) if args.max_spacing else None
    volume = deploy.VolumeSpec(tuple(args.max_volume), spacing, probabilities=args.probabilities)
    gpus = tuple(args.gpus) if variant == "gpu" else ()
    plan = deploy.plan_memory(info, volume, gpus=max(1, len(gpus)))
    ports = {"http_port": args.http_port or DEFAULT_HTTP_PORT,
             "grpc_port": args.grpc_port or DEFAULT_GRPC_PORT,
             "metrics_port": args.metrics_port or DEFAULT_METRICS_PORT}
    return docker.DeploySpec(info=info, plan=plan, repository=str(args.out.absolute()),
                             triton_release=args.triton_release, gpus=gpus, variant=variant, engine=engine,
                             base_image_ref=args.base_image, container_name=args.container_name,
                             image_torch_version=args.image_torch_version, publish_host=args.host, **ports)


def _run(commands: list[tuple[str, ...]], execute: bool, tool: str = "docker") -> None:
    for argv in commands:
        print(f"  {docker.shell_line(argv)}")
    if execute:
        if shutil.which(tool) is None:
            raise NnunetTritonError(f"--execute needs `{tool}` on PATH; it is not installed here.")
        for argv in commands:
            subprocess.run(argv, check=True)


def _gpu_visible() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists()


def _variant(args: argparse.Namespace) -> str:
    if args.variant != "auto":
        return args.variant
    variant = "gpu" if _gpu_visible() else "cpu"
    why = "an NVIDIA GPU is visible" if variant == "gpu" else "no NVIDIA GPU here"
    print(f"image variant: {variant} ({why}; --variant gpu|cpu to choose)")
    return variant


def _engine(args: argparse.Namespace) -> tuple[str, bool]:
    """The engine to name in the commands, and whether to run them (an engine works, no --dry-run)."""
    found = (container_engine.require_engine(args.engine, why="--execute") if args.execute
             else container_engine.find_engine(args.engine))
    if found is None and not args.dry_run:
        print("no working container engine here (docker daemon or podman): printing the commands only")
    engine = found or (args.engine if args.engine != "auto" else "docker")
    return engine, found is not None and not args.dry_run


def _deploy_docker(args: argparse.Namespace) -> int:
    variant = _variant(args)
    engine, execute = _engine(args)
    args.execute = execute
    if variant == "cpu":
        return _deploy_docker_cpu(args, engine)
    return _deploy_docker_gpu(args, engine)


def _cpu_image(args: argparse.Namespace, engine: str, info: deploy.RepositoryInfo) -> docker.DeploySpec:
    """The cpu image (and its export stage) built, or printed: the base image and wheels made here first."""
    if args.base_image is None and engine == "podman":
        args.base_image = container_engine.LOCAL_BASE_IMAGE
    spec = _docker_spec(args, info, variant="cpu", engine=engine)
    wheels = None
    if args.execute:
        if spec.base_image == container_engine.LOCAL_BASE_IMAGE:
            container_engine.require_image(engine, spec.base_image)
        wheels = str(container_engine.fill_wheels())
    print(f"build the cpu image {spec.image_tag} and its export stage (base {spec.base_image}):")
    source = container_engine.source_root()
    builds = [docker.docker_build_command(spec, context=str(source), target=target, wheels=wheels,
                                          dockerfile=str(source / "docker" / "Dockerfile"))
              for target in ("export", None)]
    _run(builds, args.execute, tool=engine)
    return spec


def _deploy_docker_cpu(args: argparse.Namespace, engine: str) -> int:
    return _start_container(args, _build_cpu_repository(args, engine))


def _build_cpu_repository(args: argparse.Namespace, engine: str) -> docker.DeploySpec:
    """cpu image: the repository is built in the image's export stage, so its torch loads the fold models."""
    configs = _read_configs(args)
    serving_torch = deploy.torch_compat_minor(docker.IMAGE_TORCH["cpu"])
    options = _build_options(args, "cpu", serving_torch=serving_torch)
    if args.out == Path(DEFAULT_OUT["docker"]).absolute():
        args.out = Path(CPU_IMAGE_OUT).absolute()
    spec = _cpu_image(args, engine, deploy.RepositoryInfo.planned(configs, options))
    print(f"build the repository {args.out} with the image's torch {docker.IMAGE_TORCH['cpu']} (one run per "
          "endpoint, each writes its name into the repository):")
    if args.execute:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    _run([docker.cpu_export_command(
        spec, source_root=str(container_engine.source_root()), model_dir=str(endpoint.model.absolute()),
        out_dir=str(args.out.absolute()), uid=os.getuid(), gid=os.getgid(),
        builder_args=docker.builder_args(options, folds=args.folds, configuration=endpoint.configurations[0],
                                         export_device=None, name=endpoint.name))
        for endpoint in args.endpoints], args.execute, tool=engine)
    if args.execute:
        spec = _docker_spec(args, deploy.RepositoryInfo.from_repository(args.out), variant="cpu",
                            engine=engine)
    return spec


def _start_container(args: argparse.Namespace, spec: docker.DeploySpec) -> int:
    plan = spec.plan
    pools = (f", CUDA pool {plan.cuda_pool_bytes >> 20} MiB/GPU, pinned {plan.pinned_pool_bytes >> 20} MiB"
             if spec.variant == "gpu" else "")
    print(f"start it (shm {spec.plan.shm_mib} MiB{pools} for volumes up to {args.max_volume}):")
    run = docker.docker_run_command(spec)
    if args.execute:  # replace the container of an earlier deploy
        for argv in docker.docker_stop_commands(spec.container_name, spec.exit_timeout_s, engine=spec.engine):
            subprocess.run(argv, check=False, capture_output=True)
    _run([run], args.execute, tool=spec.engine)
    http = f"127.0.0.1:{spec.http_port}"
    if args.execute:
        start = time.monotonic()
        _wait_http_ready(http, spec.startup_timeout_s, spec)
        print(f"container {spec.container_name} ready in {time.monotonic() - start:.1f} s")
    undeploy = "nnunet-triton undeploy --target docker" + (f" --engine {spec.engine}"
                                                          if spec.engine != "docker" else "")
    _print_usage(args, spec.info, http, f"127.0.0.1:{spec.grpc_port}", f"127.0.0.1:{spec.metrics_port}",
                 undeploy)
    return 0


def _deploy_docker_gpu(args: argparse.Namespace, engine: str) -> int:
    configs, options = _read_configs(args), _build_options(args, "gpu")
    local = _local_torch_fits(args)
    if local:
        _build(args, "gpu", export_device="cuda" if args.precision == "fp16" else None)
    else:
        print(f"1. build the GPU repository with torch {docker.EXPORT_TORCH} (this torch does not match the "
              f"libtorch of Triton {args.triton_release} or has no CUDA for the fp16 export; one container "
              "per endpoint, each writes its name into the repository):")
        _run([docker.export_container_command(
            source_root=str(container_engine.source_root()), model_dir=str(endpoint.model.absolute()),
            out_dir=str(args.out.absolute()), gpu=args.gpus[0], uid=os.getuid(), gid=os.getgid(),
            engine=engine, builder_args=docker.builder_args(options, folds=args.folds, name=endpoint.name,
                                                            configuration=endpoint.configurations[0]))
            for endpoint in args.endpoints], args.execute, tool=engine)
    # the repository as built now (locally or by the executed export step), else as it will be built
    built = (local or args.execute) and (args.out / io_names.REPOSITORY_METADATA_FILE).is_file()
    spec = _docker_spec(args, deploy.RepositoryInfo.from_repository(args.out) if built
                        else deploy.RepositoryInfo.planned(configs, options), engine=engine)
    print("2. build the serving image:")
    _run([docker.docker_build_command(spec, context=str(container_engine.source_root()))], args.execute,
         tool=engine)
    print("3.", end=" ")
    return _start_container(args, spec)


def _container_state(spec: docker.DeploySpec) -> tuple[str, str]:
    """(status, exit code) of the container, e.g. ("running", "0"), ("exited", "78")."""
    result = subprocess.run([spec.engine, "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}",
                             spec.container_name], capture_output=True, text=True, check=False, timeout=60)
    status, _, code = result.stdout.strip().partition(" ")
    return status or "missing", code


def _wait_http_ready(http: str, timeout_s: float, spec: docker.DeploySpec) -> None:
    def gone() -> str | None:
        status, code = _container_state(spec)
        return f"container {spec.container_name} {status} (exit {code})" if status in (
            "exited", "stopped", "missing") else None

    try:
        readiness.wait_ready(http, timeout_s=timeout_s, gone=gone, what=f"container {spec.container_name}",
                             interval_s=2.0)
    except readiness.NotReadyError as exc:
        logs = subprocess.run([spec.engine, "logs", "--tail", "20", spec.container_name],
                              capture_output=True, text=True, check=False, timeout=60)
        raise NnunetTritonError(f"{exc}; its log ends:\n{logs.stdout}{logs.stderr}") from None


def _kube_play(args: argparse.Namespace) -> int:
    """The cpu Deployment run here by ``podman kube play``: repository, images, models image, manifests."""
    container_engine.require_engine("podman", why="--kube-play")
    args.execute, manifests_dir = True, args.out
    args.out = args.repository or Path(CPU_IMAGE_OUT).absolute()
    spec = _build_cpu_repository(args, "podman")
    info = spec.info
    # the repository in a podman volume behind the PVC (podman 4.3 kube play races its init containers:
    # "failed to remove once init container ... as it is running", so the image source is not used here)
    source = k8s.ModelSource("pvc", f"nnunet-triton-models-{(info.input_hash or 'latest')[:12]}")
    print(f"the model repository in the volume {source.ref} (the PVC's claimName):")
    subprocess.run(["podman", "volume", "rm", "--force", source.ref], check=False, capture_output=True)
    _run([("podman", "volume", "create", source.ref)], True, tool="podman")
    tar = subprocess.Popen(["tar", "-C", str(args.out), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "volume", "import", source.ref, "-"], stdin=tar.stdout, check=True, timeout=600)
    tar.wait(60)
    kspec = k8s.K8sSpec(info=info, plan=spec.plan, image=spec.image_tag, model_source=source, gpus=0,
                        name=args.container_name, cpu=str(args.cpu), min_replicas=1, max_replicas=1,
                        host_ports=(spec.http_port, spec.grpc_port, spec.metrics_port),
                        startup_timeout_s=spec.startup_timeout_s)
    manifests_dir.mkdir(parents=True, exist_ok=True)
    for name, text in k8s.manifest_files(kspec).items():
        (manifests_dir / name).write_text(text)
    deployment = manifests_dir / "deployment.yaml"
    print(f"wrote the manifests to {manifests_dir}; podman kube play runs the Deployment (it ignores the "
          "Service, HPA and readiness/startup probes; the liveness probe is its healthcheck):")
    start = time.monotonic()
    _run([("podman", "kube", "play", "--replace", str(deployment))], True, tool="podman")
    pod_container = f"{args.container_name}-pod-0-tritonserver"
    _wait_http_ready(f"127.0.0.1:{spec.http_port}", spec.startup_timeout_s,
                     docker.replace_spec(spec, container_name=pod_container, engine="podman"))
    took = time.monotonic() - start
    print(f"Deployment {args.container_name} ready under podman kube play in {took:.1f} s "
          f"(container {pod_container})")
    host = "127.0.0.1"
    _print_usage(args, info, f"{host}:{spec.http_port}", f"{host}:{spec.grpc_port}",
                 f"{host}:{spec.metrics_port}",
                 "nnunet-triton undeploy --target k8s --kube-play")
    return 0


def _deploy_k8s(args: argparse.Namespace) -> int:
    if args.kube_play:
        return _kube_play(args)
    repo = args.repository or Path(DEFAULT_OUT["docker"]).absolute()
    if (repo / io_names.REPOSITORY_METADATA_FILE).is_file():
        info = deploy.RepositoryInfo.from_repository(repo)
        missing = [name for name in args.name or () if name not in info.endpoints]
        if missing:
            raise NnunetTritonError(
                f"the repository {str(repo)} has no endpoint(s) {missing} (it holds {list(info.endpoints)}); "
                "build them into it first (`nnunet-triton deploy --target docker --model-dir A B --endpoint "
                "liver lung` shows how), or leave out --endpoint to serve what it holds.")
    else:
        info = deploy.RepositoryInfo.planned(_read_configs(args), _build_options(args, "gpu"))
        print(f"note: {repo} is not built yet; `nnunet-triton deploy --target docker` shows how to build it")
    if info.target != "gpu":
        raise NnunetTritonError(f"{repo} was built for target {info.target!r}; the pods get one GPU each: "
                                "build it with `nnunet-triton deploy --target docker` (target gpu).")
    args.gpus = [0]  # one GPU per pod
    dspec = _docker_spec(args, info)
    docker.check_image_compatible(dspec)
    tag = (info.input_hash or "latest")[:12]
    source = (k8s.ModelSource("pvc", args.model_pvc) if args.model_pvc
              else k8s.ModelSource("image", args.model_image or f"nnunet-triton-models:{tag}"))
    spec = k8s.K8sSpec(info=info, plan=dspec.plan, image=args.image or dspec.image_tag, model_source=source,
                       namespace=args.namespace, min_replicas=args.min_replicas,
                       max_replicas=args.max_replicas, queue_target_us=args.queue_target_us,
                       service_monitor=args.service_monitor, startup_timeout_s=dspec.startup_timeout_s,
                       tls_secret=args.tls_secret)
    args.out.mkdir(parents=True, exist_ok=True)
    files = k8s.manifest_files(spec)
    for name, text in files.items():
        (args.out / name).write_text(text)
    print(f"wrote {', '.join(files)} to {args.out}: one Deployment {spec.name} serving the endpoint(s) "
          f"{', '.join(info.endpoints)} ({len(info.models)} models; per pod /dev/shm {dspec.plan.shm_mib} "
          f"MiB, memory {dspec.plan.host_memory_mib} MiB for all of them)")
    if source.kind == "image":
        print("model repository image (push both images where the cluster pulls from):")
        recipe = container_engine.source_root() / "docker" / "Dockerfile.models"
        print(f"  docker build --file {recipe} --tag {source.ref} {repo}")
    print("apply (prometheus-adapter needs prometheus-adapter-values.yaml for the HPA metric):")
    _run([("kubectl", "apply", "--kustomize", str(args.out))], args.execute, tool="kubectl")
    return 0


def _undeploy(args: argparse.Namespace) -> int:
    if args.target == "embedded":
        from nnunet_triton.cli import serve as embedded_cli
        from nnunet_triton.server.triton_install import resolve_home

        (resolve_home(None) / "run" / DEPLOYED_FILE).unlink(missing_ok=True)
        return embedded_cli.main(["stop"])
    if args.target == "docker":
        engine = container_engine.find_engine(args.engine)
        execute = args.execute or (engine is not None and not args.dry_run)
        _run(list(docker.docker_stop_commands(args.container_name, engine=engine or "docker")), execute,
             tool=engine or "docker")
    elif args.kube_play:
        _run([("podman", "kube", "down", str(args.out / "deployment.yaml"))], True, tool="podman")
    else:
        _run([("kubectl", "delete", "--kustomize", str(args.out))], args.execute, tool="kubectl")
    return 0


def add_parsers(sub: Any) -> None:
    """Mount ``deploy`` and ``undeploy`` on the ``nnunet-triton`` subparsers ``sub``."""
    deploy_parser = sub.add_parser("deploy", help="build a results folder and serve it (embedded, docker, "
                                                  "k8s)")
    deploy_parser.set_defaults(run=lambda args: _run_command(args, undeploy=False))
    _arguments(deploy_parser, undeploy=False)
    undeploy_parser = sub.add_parser("undeploy", help="stop what `deploy` started")
    undeploy_parser.set_defaults(run=lambda args: _run_command(args, undeploy=True))
    _arguments(undeploy_parser, undeploy=True)


def _arguments(p: argparse.ArgumentParser, *, undeploy: bool) -> None:
    p.add_argument("--target", choices=tuple(DEFAULT_OUT), default="embedded")
    p.add_argument("--out", type=Path, default=None,
                   help=f"repository to build (embedded, docker) or manifests (k8s); default {DEFAULT_OUT}")
    p.add_argument("--execute", action="store_true",
                   help="docker: fail unless an engine runs the commands; k8s: kubectl apply")
    p.add_argument("--dry-run", action="store_true", help="docker: only print the commands")
    p.add_argument("--engine", choices=("auto", "docker", "podman"), default="auto",
                   help="docker: the container engine (auto: docker if its daemon answers, else podman)")
    p.add_argument("--container-name", default="nnunet-triton")
    p.add_argument("--kube-play", action="store_true",
                   help="k8s: run the cpu Deployment here with podman kube play (undeploy: kube down)")
    if undeploy:
        return
    add_model_dir_argument(p, nargs="+",
                           help="nnU-Net results folder(s): with one --endpoint per folder each is its "
                                "own endpoint "
                        "in one server; else one endpoint (several folders, embedded only: an ensemble of "
                        "configurations); k8s with a built --repository needs none")
    p.add_argument("--name", type=endpoint_name, nargs="+", dest="name", action=DeprecatedAlias,
                   replacement="--endpoint", help="deprecated spelling of --endpoint")
    p.add_argument("--endpoint", type=endpoint_name, nargs="+", default=None, dest="name",
                   help=f"endpoint names, one per --model-dir folder (--model-dir A B --endpoint liver "
                        f"lung: two "
                        f"endpoints in one repository and one server), or one for all of them (default "
                        f"{io_names.ENDPOINT_MODEL}); k8s with a built --repository: the endpoints it must "
                        "hold")
    p.add_argument("--configuration", nargs="+", default=None,
                   help="check the checkpoints' configuration: one for every --model-dir folder or one per "
                        "folder")
    p.add_argument("--folds", nargs="+", type=lambda s: s if s == "all" else int(s), default=None)
    p.add_argument("--tile-batch-size", type=int, default=4)
    p.add_argument("--fold-instances", type=int, default=1)
    p.add_argument("--orchestrator-instances", type=int, default=None,
                   help="requests worked on at once (default: 1 on cpu, 2 on gpu targets)")
    p.add_argument("--host", default="127.0.0.1",
                   help="embedded: bind address; docker: host address the ports are published on "
                        "(0.0.0.0 for the network)")
    for name in ("http", "grpc", "metrics"):
        p.add_argument(f"--{name}-port", type=int, default=None,
                       help="embedded: default a free port; docker: host port (default 8000/8001/8002)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--backend-directory", action="append", type=Path, default=None,
                   help="embedded, repeatable: a folder of further Triton backends merged with the Python "
                        "backend (default: build/triton-backends when `nnunet-triton install-backend "
                        "pytorch` made it; a checkout: `make triton-backends`)")
    add_tls_arguments(p)
    gpu = p.add_argument_group("docker and k8s")
    gpu.add_argument("--variant", choices=("auto", *docker.VARIANTS), default="auto",
                     help="the image: gpu (NGC base) or cpu (Debian base); auto: gpu where a GPU is visible")
    gpu.add_argument("--base-image", default=None,
                     help="the Dockerfile's BASE_IMAGE (cpu default with podman: the local debootstrapped "
                          f"{container_engine.LOCAL_BASE_IMAGE}; `python -m tools.container_host` in a "
                          "checkout makes it)")
    gpu.add_argument("--triton-release", default=docker.GPU_TRITON_RELEASE,
                     help="the gpu image's NGC release (the cpu image is always the wheel's 24.10)")
    gpu.add_argument("--image-torch-version", default=None, help="libtorch X.Y of a release not known here")
    gpu.add_argument("--precision", choices=("fp16", "fp32"), default="fp16")
    gpu.add_argument("--gpus", type=int, nargs="+", default=[0], help="host GPU ids for the container")
    gpu.add_argument("--max-volume", type=int, nargs=3, default=[600, 512, 512], metavar=("Z", "Y", "X"))
    gpu.add_argument("--max-spacing", type=float, nargs=3, default=None, metavar=("Z", "Y", "X"))
    gpu.add_argument("--probabilities", action="store_true", help="size for PROBABILITIES outputs")
    kube = p.add_argument_group("k8s")
    for flag, kind, default, text in (
        ("--repository", Path, None, "built GPU repository (default build/model_repository_gpu)"),
        ("--image", str, None, "serving image in a registry"), ("--namespace", str, None, "namespace"),
        ("--model-image", str, None, "image holding /models (init container)"),
        ("--model-pvc", str, None, "PVC holding the repository instead"),
        ("--min-replicas", int, 1, "HPA minimum"), ("--max-replicas", int, 4, "HPA maximum"),
        ("--queue-target-us", int, 2_000_000, "HPA target: orchestrator queue time per request"),
    ):
        kube.add_argument(flag, type=kind, default=default, help=text)
    kube.add_argument("--service-monitor", action="store_true", help="add a ServiceMonitor")
    kube.add_argument("--tls-secret", default=None,
                      help="Secret with tls.crt, tls.key and ca.crt: an nginx sidecar serves HTTPS with "
                           "client certificates (allow-list of paths) and a NetworkPolicy admits only its "
                           "port (docs/security.md)")
    kube.add_argument("--cpu", type=int, default=2, help="--kube-play: the pod's CPUs (requests = limits)")


def _check_exposure(args: argparse.Namespace) -> None:
    """ExposureError for a server reachable beyond loopback without TLS and client authentication."""
    if args.target == "embedded":
        proxy.check_exposure(args.host, tls_settings(args), what="the embedded tritonserver")
    elif args.target == "docker" and not proxy.is_loopback(args.host):
        raise proxy.ExposureError(
            f"--target docker publishes Triton's ports on {args.host!r} (beyond loopback) without TLS or "
            f"authentication: the image has no TLS proxy. Publish on 127.0.0.1, or use --target embedded "
            f"with --tls-cert/--tls-key/--tls-ca (docs/security.md).")


def _run_command(args: argparse.Namespace, *, undeploy: bool) -> int:
    """Deploy or undeploy as ``args`` say; the exit code (1 on a reported error)."""
    default_out = KUBE_PLAY_OUT if args.target == "k8s" and args.kube_play else DEFAULT_OUT[args.target]
    args.out = Path(args.out or default_out).absolute()
    if not undeploy:
        args.models = list(args.model or ())
        args.model = args.models[0] if args.models else None
    flows = {"embedded": _deploy_embedded, "docker": _deploy_docker, "k8s": _deploy_k8s}
    try:
        if undeploy:
            return _undeploy(args)
        _check_exposure(args)  # before building: a refused deployment costs nothing
        args.endpoints = endpoint_plans(args.models, args.name, args.configuration)
        return flows[args.target](args)
    except (NnunetTritonError, ValueError, subprocess.CalledProcessError) as exc:
        LOGGER.error("%s", exc)
        return 1


def _parser(undeploy: bool) -> argparse.ArgumentParser:
    """The flags of ``deploy`` (or ``undeploy``) as a parser of their own."""
    parser = argparse.ArgumentParser(prog=f"nnunet-triton {'undeploy' if undeploy else 'deploy'}",
                                     description=__doc__.splitlines()[0])
    _arguments(parser, undeploy=undeploy)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``deploy ARGS`` (the default) or ``undeploy ARGS``; the exit code (1 on a reported error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    undeploy = argv[:1] == ["undeploy"]
    rest = argv[1:] if argv[:1] in (["deploy"], ["undeploy"]) else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return _run_command(_parser(undeploy).parse_args(rest), undeploy=undeploy)
