"""``nnunet-triton deploy | undeploy``: one command from an nnU-Net results folder to a serving endpoint
(a checkout's ``make deploy`` / ``make undeploy`` run these).

    nnunet-triton deploy --model-dir <results folder> [<more folders>] [--endpoint N [N ...]]
        [--configuration C] [--folds 0 1] [--target embedded|docker|k8s] [--out DIR] [--execute]
    nnunet-triton undeploy [--target embedded|docker|k8s] [--out DIR] [--execute]

Several folders with one ``--endpoint`` name each become endpoints of ONE repository served by one server;
without ``--endpoint`` (or one name) they are one endpoint (default ``nnunet``). embedded: build, start the
embedded tritonserver, wait until ready; docker: build the image and start the container(s) (``--replicas N``
behind an nginx balancer) or print the commands; k8s: render manifests (``--execute``: kubectl apply;
``--kube-play``: podman kube play). docs/deploy.md has the details. The flags become a
``server.deploy.service.DeployPlan``; the service runs it and this prints what it says.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from nnunet_triton import io_names
from nnunet_triton.cli import common, run_command, serve
from nnunet_triton.cli.common import DeprecatedAlias, add_model_dir_argument, endpoint_name
from nnunet_triton.cli.serve import add_server_arguments, tls_settings
from nnunet_triton.exit_codes import EPILOG, ExitCode
from nnunet_triton.server.deploy import docker, service
from nnunet_triton.server.deploy import engine as container_engine
from nnunet_triton.server.deploy.service import DEFAULT_OUT, EndpointPlan, endpoint_plans
from nnunet_triton.util.defaults import field_default

__all__ = ["EndpointPlan", "add_parsers", "endpoint_plans", "main"]

LOGGER = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    """Mount ``deploy`` and ``undeploy`` on the ``nnunet-triton`` subparsers ``sub``."""
    deploy_parser = sub.add_parser("deploy", help="build a results folder and serve it (embedded, docker, "
                                                  "k8s)", epilog=EPILOG)
    deploy_parser.set_defaults(run=lambda args: _run_command(args, undeploy=False))
    _arguments(deploy_parser, undeploy=False)
    undeploy_parser = sub.add_parser("undeploy", help="stop what `deploy` started", epilog=EPILOG)
    undeploy_parser.set_defaults(run=lambda args: _run_command(args, undeploy=True))
    _arguments(undeploy_parser, undeploy=True)


def _default(name: str) -> Any:
    """A flag's default: the :class:`~nnunet_triton.server.deploy.service.DeployPlan` field's it becomes."""
    return field_default(service.DeployPlan, name)


def _arguments(p: argparse.ArgumentParser, *, undeploy: bool) -> None:
    p.add_argument("--target", choices=tuple(DEFAULT_OUT), default="embedded")
    p.add_argument("--out", type=Path, default=None,
                   help=f"repository to build (embedded, docker) or manifests (k8s); default {DEFAULT_OUT}")
    p.add_argument("--execute", action="store_true",
                   help="docker: fail unless an engine runs the commands; k8s: kubectl apply")
    p.add_argument("--dry-run", action="store_true", help="docker: only print the commands")
    p.add_argument("--engine", choices=("auto", "docker", "podman"), default=_default("engine"),
                   help="docker: the container engine (auto: docker if its daemon answers, else podman)")
    p.add_argument("--container-name", default=_default("container_name"))
    p.add_argument("--kube-play", action="store_true",
                   help="k8s: run the cpu Deployment here with podman kube play (undeploy: kube down)")
    if undeploy:
        return
    add_model_dir_argument(p, nargs="+",
                           help="nnU-Net results folder(s): with one --endpoint per folder each is its own "
                                "endpoint in one server; else one endpoint (several folders, embedded only: "
                                "an ensemble of configurations); k8s with --model-repository needs none")
    p.add_argument("--name", type=endpoint_name, nargs="+", dest="name", action=DeprecatedAlias,
                   replacement="--endpoint", help="deprecated spelling of --endpoint")
    p.add_argument("--endpoint", type=endpoint_name, nargs="+", default=None, dest="name",
                   help=f"endpoint names, one per --model-dir folder (--model-dir A B --endpoint liver lung: "
                        f"two endpoints in one repository and one server), or one for all of them (default "
                        f"{io_names.ENDPOINT_MODEL}); k8s with --model-repository: endpoints it must hold")
    p.add_argument("--configuration", nargs="+", default=None,
                   help="check the checkpoints' configuration: one for every --model-dir folder or one per "
                        "folder")
    p.add_argument("--folds", nargs="+", type=lambda s: s if s == "all" else int(s), default=None)
    p.add_argument("--tile-batch-size", type=int, default=_default("tile_batch_size"))
    p.add_argument("--fold-instances", type=int, default=_default("fold_instances"))
    p.add_argument("--orchestrator-instances", type=int, default=None,
                   help="requests worked on at once (default: 1 on cpu, 2 on gpu targets)")
    p.add_argument("--host", default=_default("host"),
                   help="embedded: bind address; docker: host address the ports are published on "
                        "(0.0.0.0 for the network)")
    for name in ("http", "grpc", "metrics"):
        p.add_argument(f"--{name}-port", type=int, default=None, help="embedded: default a free port "
                       "(metrics: closed unless --metrics or a port); docker: host port (8000/8001/8002)")
    p.add_argument("--ready-timeout", type=float, default=_default("ready_timeout"),
                   help=f"seconds the server has to answer ready (default {_default('ready_timeout'):.0f})")
    p.add_argument("--backend-directory", action="append", type=Path, default=None,
                   help="embedded, repeatable: a folder of further Triton backends merged with the Python "
                        "backend (default: build/triton-backends when `nnunet-triton install-backend "
                        "pytorch` made it; a checkout: `make triton-backends`)")
    add_server_arguments(p)
    gpu = p.add_argument_group("docker and k8s")
    gpu.add_argument("--variant", choices=("auto", *docker.VARIANTS), default=_default("variant"),
                     help="the image: gpu (NGC base) or cpu (Debian base); auto: gpu where a GPU is visible")
    gpu.add_argument("--base-image", default=None,
                     help="the Dockerfile's BASE_IMAGE (cpu default with podman: the local debootstrapped "
                          f"{container_engine.LOCAL_BASE_IMAGE}; `python -m tools.container_host` in a "
                          "checkout makes it)")
    gpu.add_argument("--triton-release", default=_default("triton_release"),
                     help="the gpu image's NGC release (the cpu image is always the wheel's 24.10)")
    gpu.add_argument("--image-torch-version", default=None, help="libtorch X.Y of a release not known here")
    gpu.add_argument("--precision", choices=("fp16", "fp32"), default=_default("precision"))
    gpu.add_argument("--gpus", type=int, nargs="+", default=list(_default("gpus")),
                     help="host GPU ids for the container")
    gpu.add_argument("--max-volume", type=int, nargs=3, default=list(_default("max_volume")),
                     metavar=("Z", "Y", "X"))
    gpu.add_argument("--max-spacing", type=float, nargs=3, default=None, metavar=("Z", "Y", "X"))
    gpu.add_argument("--probabilities", action="store_true", help="size for PROBABILITIES outputs")
    gpu.add_argument("--replicas", type=int, default=_default("replicas"),
                     help="docker: N containers behind an nginx balancer")
    kube = p.add_argument_group("k8s")
    common.add_model_repository_argument(kube, dest="repository", old="--repository", default=None,
                                         help="built GPU repository (default build/model_repository_gpu)")
    for flag, kind, default, text in (
        ("--image", str, None, "serving image in a registry"), ("--namespace", str, None, "namespace"),
        ("--model-image", str, None, "image holding /models (init container)"),
        ("--model-pvc", str, None, "PVC holding the repository instead"),
        ("--min-replicas", int, _default("min_replicas"), "HPA minimum"),
        ("--max-replicas", int, _default("max_replicas"), "HPA maximum"),
        ("--latency-target-us", int, _default("latency_target_us"),
         "HPA target: time per request at the orchestrator"),
    ):
        kube.add_argument(flag, type=kind, default=default, help=text)
    kube.add_argument("--service-monitor", action="store_true", help="add a ServiceMonitor")
    kube.add_argument("--tls-secret", default=None, help="Secret with tls.crt, tls.key and ca.crt: an nginx "
                      "sidecar (client certificates), a NetworkPolicy admitting only it (docs/security.md)")
    kube.add_argument("--cpu", type=int, default=_default("cpu"),
                      help="--kube-play: the pod's CPUs (requests = limits)")
    kube.add_argument("--autoscaler", choices=("hpa", "keda"), default=_default("autoscaler"),
                      help="HPA + adapter, or KEDA")
    kube.add_argument("--kserve", action="store_true", help="a KServe InferenceService (--autoscaler keda)")
    kube.add_argument("--prometheus-url", default=None, help="the Prometheus KEDA queries")


def _plan(args: argparse.Namespace, *, undeploy: bool) -> service.DeployPlan:
    """The typed plan of the parsed flags (``undeploy``: only the flags ``undeploy`` has)."""
    k8s_flags = ("repository image namespace model_image model_pvc min_replicas max_replicas "
                 "latency_target_us service_monitor tls_secret cpu autoscaler kserve prometheus_url").split()
    kube_play = args.target == "k8s" and args.kube_play
    default_out = service.KUBE_PLAY_OUT if kube_play else DEFAULT_OUT[args.target]
    common = {"target": args.target, "out": Path(args.out or default_out).absolute(), "engine": args.engine,
              "container_name": args.container_name, "execute": args.execute, "dry_run": args.dry_run,
              "kube_play": args.kube_play}
    if undeploy:
        return service.DeployPlan(**common)
    backends = tuple(args.backend_directory) if args.backend_directory is not None else None
    return service.DeployPlan(
        **common, endpoints=endpoint_plans(list(args.model or ()), args.name, args.configuration),
        names=tuple(args.name or ()), folds=tuple(args.folds) if args.folds else None,
        tile_batch_size=args.tile_batch_size, fold_instances=args.fold_instances,
        orchestrator_instances=args.orchestrator_instances, precision=args.precision, host=args.host,
        http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        metrics=args.metrics, allow_token_in_proc_and_readable_shm=args.allow_token_in_proc_and_readable_shm,
        ready_timeout=args.ready_timeout, backend_directory=backends, tls=tls_settings(args),
        proxy_port=args.proxy_port, proxy_allow_statistics=args.proxy_allow_statistics,
        variant=args.variant, base_image=args.base_image, triton_release=args.triton_release,
        image_torch_version=args.image_torch_version, max_volume=tuple(args.max_volume),
        max_spacing=tuple(args.max_spacing) if args.max_spacing else None, probabilities=args.probabilities,
        replicas=args.replicas, gpus=tuple(args.gpus), **{name: getattr(args, name) for name in k8s_flags})


def _run_command(args: argparse.Namespace, *, undeploy: bool) -> int:
    """Deploy or undeploy as ``args`` say; the exit code (errors mapped by ``cli.exit_code``, logged)."""
    return run_command(lambda parsed: _deploy(parsed, undeploy=undeploy), args, logger=LOGGER)


def _deploy(args: argparse.Namespace, *, undeploy: bool) -> int:
    plan = _plan(args, undeploy=undeploy)
    (service.undeploy if undeploy else service.deploy)(plan, print)
    return serve.main(["stop"]) if undeploy and plan.target == "embedded" else ExitCode.OK


def _parser(undeploy: bool) -> argparse.ArgumentParser:
    """The flags of ``deploy`` (or ``undeploy``) as a parser of their own."""
    parser = argparse.ArgumentParser(prog=f"nnunet-triton {'undeploy' if undeploy else 'deploy'}",
                                     description=__doc__.splitlines()[0], epilog=EPILOG)
    _arguments(parser, undeploy=undeploy)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``deploy ARGS`` (the default) or ``undeploy ARGS``; the exit code (``cli.exit_code`` of an error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    undeploy = argv[:1] == ["undeploy"]
    rest = argv[1:] if argv[:1] in (["deploy"], ["undeploy"]) else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return _run_command(_parser(undeploy).parse_args(rest), undeploy=undeploy)
