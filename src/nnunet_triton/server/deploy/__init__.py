"""Deployment of a built model repository: embedded server, NGC container, Kubernetes.

Pure functions of typed frozen specs; nothing here needs Docker or a cluster.

* :mod:`.repository_info` -- :class:`RepositoryInfo` (every endpoint version of a repository, one
  :class:`PipelineInfo` each, from the registry ``repository_metadata.json`` or planned from model folders)
  and the TorchScript/libtorch compatibility check.
* :mod:`.sizing` -- ``/dev/shm``, CUDA and pinned pool and host memory per volume size (summed over every
  endpoint version one server loads).
* :mod:`.docker` -- tritonserver flags, Dockerfile build args, ``docker build``/``docker run`` lines.
* :mod:`.k8s` -- Deployment, Service, HPA (or KEDA ScaledObject, or KServe InferenceService), ServiceMonitor
  (a kustomize base) as dicts and YAML; :mod:`.monitoring` -- alert rules and a Grafana dashboard.

* :mod:`.service` -- :class:`DeployPlan` (typed, frozen) and the steps that carry it out: build, image, run,
  wait until ready, kube play, undeploy (``DeployError`` when a deployment cannot work as asked).

``nnunet-triton deploy`` / ``undeploy`` (``cli.deploy``; ``make deploy`` / ``make undeploy``) is the
command line that parses the flags into a plan; docs/deploy.md the guide.
"""

from __future__ import annotations

from nnunet_triton.builder.torch_compat import TritonRelease
from nnunet_triton.builder.torch_compat import torch_minor_text as torch_compat_minor
from nnunet_triton.server.deploy.docker import (
    DeploySpec,
    check_image_compatible,
    docker_build_command,
    docker_run_command,
    dockerfile_build_args,
    server_command,
    tritonserver_args,
)
from nnunet_triton.server.deploy.k8s import K8sSpec, ModelSource, manifest_files, manifests
from nnunet_triton.server.deploy.repository_info import (
    ModelGeometry,
    PipelineInfo,
    RepositoryInfo,
    check_torch_compatible,
    triton_release,
)
from nnunet_triton.server.deploy.sizing import MemoryPlan, VolumeSpec, plan_memory

__all__ = [
    "DeploySpec",
    "K8sSpec",
    "MemoryPlan",
    "ModelGeometry",
    "ModelSource",
    "PipelineInfo",
    "RepositoryInfo",
    "TritonRelease",
    "VolumeSpec",
    "check_image_compatible",
    "check_torch_compatible",
    "docker_build_command",
    "docker_run_command",
    "dockerfile_build_args",
    "manifest_files",
    "manifests",
    "plan_memory",
    "triton_release",
    "torch_compat_minor",
    "server_command",
    "tritonserver_args",
]
