"""Kubernetes manifests (a kustomize base) for one Triton per GPU (or per CPU pod) behind a Service, scaled on
the time per request. The cpu variant (``gpus=0``, the cpu image) is what ``podman kube play`` runs on a CPU
host.

One Deployment serves the whole repository: every endpoint name in it (``deploy --model-dir A B
    --endpoint liver
lung``), every version and their public and pinned endpoints, loaded by one server per pod and sized for
all of them together; its pod template carries the repository's input hash (a new build of any endpoint
rolls the pods) and the endpoint names.

Follows the pattern of Triton's ``deploy/k8s-onprem`` chart: a long startup probe on ``/v2/health/ready``
(the model is READY only after warm-up), an HPA on a custom per-pod metric served by prometheus-adapter
from Triton's request-time counters. Differences: liveness and readiness are exec probes of
``nnunet_triton.server.health`` (Triton's endpoints stay 200 while a model's process is dead; the watchdog in
the container reloads it, and liveness restarts the container only when that failed for a minute); the
metric is the time per request at the orchestrator models, waits included (one per request:
``orchestrator_model``, or ``<name>__v<N>__orchestrator_model`` of every other endpoint version, summed per
pod, so one metric scales a pod whatever endpoint its requests call; :func:`adapter_rules` says why not a
queue time). Instead of the HPA, ``autoscaler="keda"`` renders a KEDA ScaledObject and
``kserve`` a KServe InferenceService on the same metric. The model repository
comes from an init container image or a PVC, and ``/dev/shm`` is a memory-backed emptyDir sized by
:func:`~nnunet_triton.server.deploy.sizing.plan_memory` (Python-backend shm regions).
Manifests are plain dicts; :func:`manifest_files` renders them to YAML (PyYAML imported lazily).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from nnunet_triton.server.deploy import k8s_proxy, monitoring
from nnunet_triton.server.deploy.docker import (
    CONTAINER_PORTS,
    CONTAINER_REPOSITORY,
    CUPY_CACHE_DIR,
    health_probe,
    server_command,
)
from nnunet_triton.server.deploy.repository_info import RepositoryInfo
from nnunet_triton.server.deploy.sizing import MemoryPlan
from nnunet_triton.server.server_config import CONTAINER

__all__ = [
    "LATENCY_METRIC",
    "ORCHESTRATOR_MODELS",
    "ModelSource",
    "K8sSpec",
    "deployment",
    "service",
    "autoscaler",
    "service_monitor",
    "prometheus_rule",
    "scaled_object",
    "inference_service",
    "keda_query",
    "pod_metric_query",
    "manifests",
    "adapter_rules",
    "manifest_files",
]

LATENCY_METRIC = "nnunet_request_latency_us"
AUTOSCALERS = ("hpa", "keda")
# kube-prometheus-stack's / prometheus-operator's Service in front of the Prometheus pods
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
# every endpoint version's orchestrator: orchestrator_model (nnunet v1), liver__v2__orchestrator_model, ...
# (and an ensemble's member<i>_orchestrator_model); Prometheus anchors the regular expression
ORCHESTRATOR_MODELS = 'model=~".*orchestrator_model"'
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_PROBE_PERIOD_S = 10
# new pods need minutes (image pull, model load, warm-up): scale up fast, down slowly
_BEHAVIOR = {"scaleUp": {"stabilizationWindowSeconds": 60}, "scaleDown": {"stabilizationWindowSeconds": 600}}
KSERVE_REPOSITORY = "/mnt/models"  # where KServe's storage initializer or modelcar puts the model


@dataclass(frozen=True)
class ModelSource:
    """Where pods get the model repository: ``image`` (init container copies its ``/models``) or ``pvc``."""

    kind: str
    ref: str  # image reference, or PersistentVolumeClaim name

    def __post_init__(self) -> None:
        if self.kind not in ("image", "pvc") or not self.ref:
            raise ValueError(
                f"model source must be ('image'|'pvc', non-empty ref), got {self.kind!r}, {self.ref!r}."
            )


@dataclass(frozen=True)
class K8sSpec:
    """One Deployment (one GPU per pod), its Service, HPA and optional ServiceMonitor.

    Attributes:
        image: the serving image (docker/Dockerfile) in a registry the cluster can pull from.
        latency_target_us: HPA target of the average time per request at the orchestrator (waits
            included): about twice the latency of one request alone, so a pod scales out when requests
            wait about one request long.
        gpus: GPUs per pod: 1 (the gpu image) or 0 (the cpu image, a target cpu repository).
        host_ports: (http, grpc, metrics) published on the node's loopback (``hostIP: 127.0.0.1``), for a
            single-node run such as ``podman kube play``; None (a cluster) = reached through the Service.
        tls_secret: a Secret with ``tls.crt``, ``tls.key`` and ``ca.crt``: an nginx sidecar serves HTTPS with
            client certificates on ``k8s_proxy.PROXY_PORT``, the Service publishes only that port (and
            metrics with ``service_monitor``) and a NetworkPolicy admits only those (``k8s_proxy``).
        proxy_image: the sidecar's nginx image.
    """

    info: RepositoryInfo
    plan: MemoryPlan
    image: str
    model_source: ModelSource
    name: str = "nnunet-triton"
    namespace: str | None = None
    min_replicas: int = 1
    max_replicas: int = 4
    latency_target_us: int = 4_000_000
    cpu: str = "4"
    service_type: str = "ClusterIP"
    service_monitor: bool = False
    startup_timeout_s: int = 900
    exit_timeout_s: int = CONTAINER.exit_timeout_s
    gpus: int = 1
    host_ports: tuple[int, int, int] | None = None
    tls_secret: str | None = None
    proxy_image: str = k8s_proxy.DEFAULT_PROXY_IMAGE
    autoscaler: str = "hpa"
    kserve: bool = False
    prometheus_url: str = DEFAULT_PROMETHEUS_URL

    def __post_init__(self) -> None:
        if self.autoscaler not in AUTOSCALERS:
            raise ValueError(f"autoscaler must be one of {list(AUTOSCALERS)}, got {self.autoscaler!r}.")
        if self.kserve and (self.autoscaler != "keda" or self.tls_secret is not None
                            or self.host_ports is not None or self.service_monitor):
            raise ValueError(
                "kserve: the InferenceService scales through KEDA (KServe's own HPA scales on CPU or memory "
                "only: autoscaler must be 'keda'), and takes no tls_secret, host_ports or service_monitor "
                "(KServe makes the Deployment and Service; scrape the predictor pods' port 8002 with a "
                f"PodMonitor), got autoscaler {self.autoscaler!r}, tls_secret {self.tls_secret!r}, "
                f"host_ports {self.host_ports!r}, service_monitor {self.service_monitor!r}.")
        if self.autoscaler == "keda" and not self.prometheus_url.startswith(("http://", "https://")):
            raise ValueError(f"prometheus_url must be an http(s) URL, got {self.prometheus_url!r}.")
        if self.gpus not in (0, 1) or (self.gpus == 0) != (self.info.target == "cpu"):
            raise ValueError(f"a pod gets 1 GPU for a target gpu repository or 0 for target cpu, got gpus "
                             f"{self.gpus} for target {self.info.target!r}.")
        if not _NAME.match(self.name) or len(self.name) > 63:
            raise ValueError(f"name must be a DNS-1123 label (a-z, 0-9, '-', <= 63), got {self.name!r}.")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}."
            )
        if self.tls_secret is not None and (not _NAME.match(self.tls_secret) or self.host_ports is not None):
            raise ValueError(f"tls_secret must name a Secret (a DNS-1123 label) of a cluster deployment (no "
                             f"host_ports), got {self.tls_secret!r}.")
        if self.service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
            raise ValueError(
                f"service_type must be ClusterIP, NodePort or LoadBalancer, got {self.service_type!r}."
            )


def _metadata(spec: K8sSpec, name: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name or spec.name, "labels": _labels(spec)}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    return meta


def _selector(spec: K8sSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "nnunet-triton", "app.kubernetes.io/instance": spec.name}


def _labels(spec: K8sSpec) -> dict[str, str]:
    return {**_selector(spec), "app.kubernetes.io/component": "inference-server"}


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _health_probe(period_s: int, failures: int, repository: str = CONTAINER_REPOSITORY) -> dict[str, Any]:
    # nnunet_triton.server.health: Triton's ready endpoints stay 200 while a model's process is dead
    return {"exec": {"command": list(health_probe(repository=repository))}, "periodSeconds": period_s,
            "timeoutSeconds": 10, "failureThreshold": failures}


def _server_container(spec: K8sSpec, repository: str = CONTAINER_REPOSITORY) -> dict[str, Any]:
    memory = f"{spec.plan.host_memory_mib}Mi"
    resources: dict[str, Any] = {"cpu": spec.cpu, "memory": memory}
    if spec.gpus:
        resources["nvidia.com/gpu"] = spec.gpus
    ports: list[dict[str, Any]] = [{"name": name, "containerPort": port, "protocol": "TCP"}
                                   for name, port in CONTAINER_PORTS.items()]
    if spec.host_ports is not None:
        for port, host_port in zip(ports, spec.host_ports, strict=True):
            port.update(hostPort=host_port, hostIP="127.0.0.1")
    return {
        "name": "tritonserver",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        # the repository check, then the thread budget, which reads limits.cpu from the pod's cgroup quota
        "args": list(server_command(spec.info, spec.plan, gpus=spec.gpus,
                                    exit_timeout_s=spec.exit_timeout_s, repository=repository)),
        "ports": ports,
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": ([{"name": "model-repository", "mountPath": repository, "readOnly": True}]
                         if repository == CONTAINER_REPOSITORY else [])  # KServe mounts its own
                        + [{"name": "dshm", "mountPath": "/dev/shm"},
                           {"name": "cupy-cache", "mountPath": CUPY_CACHE_DIR}],
        "startupProbe": _probe("/v2/health/ready", _PROBE_PERIOD_S,
                               math.ceil(spec.startup_timeout_s / _PROBE_PERIOD_S)),
        # the watchdog reloads a dead model in seconds; only when it could not for a minute does the
        # kubelet restart the container. Readiness drops the pod from the Service within 10 s.
        "livenessProbe": _health_probe(_PROBE_PERIOD_S, 6, repository),
        "readinessProbe": _health_probe(5, 2, repository),
        # let the Service drop this pod before tritonserver starts draining (rolling updates)
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
    }


def _volumes(spec: K8sSpec) -> list[dict[str, Any]]:
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{spec.plan.shm_mib}Mi"}}
    if spec.model_source.kind == "pvc":
        repo = {"name": "model-repository",
                "persistentVolumeClaim": {"claimName": spec.model_source.ref, "readOnly": True}}
    else:
        repo = {"name": "model-repository", "emptyDir": {}}
    cupy_cache = {"name": "cupy-cache", "emptyDir": {}}  # compiled CuPy kernels survive container restarts
    return [shm, repo, cupy_cache]


def deployment(spec: K8sSpec) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.exit_timeout_s + 15,
        "containers": [_server_container(spec)],
        "volumes": _volumes(spec),
    }
    if spec.tls_secret is not None:
        pod["containers"].append(k8s_proxy.proxy_container(spec))
        pod["volumes"] += k8s_proxy.proxy_volumes(spec)
    if spec.model_source.kind == "image":
        pod["initContainers"] = [{
            "name": "model-repository",
            "image": spec.model_source.ref,
            "imagePullPolicy": "IfNotPresent",
            # absolute: an imported base image (the models image here) has no PATH of its own
            "command": ["/bin/sh", "-c", f"cp -R {CONTAINER_REPOSITORY}/. /repository/"],
            "volumeMounts": [{"name": "model-repository", "mountPath": "/repository"}],
        }]
    # a new build (of any endpoint) changes the repository's hash, which rolls the pods even when image and
    # PVC path stay the same
    annotations = {"nnunet-triton/input-hash": spec.info.input_hash or "not-built-yet",
                   "nnunet-triton/endpoints": ",".join(spec.info.endpoints)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spec),
        "spec": {
            "replicas": spec.min_replicas,
            "selector": {"matchLabels": _selector(spec)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": _labels(spec), "annotations": annotations}, "spec": pod},
        },
    }


def service(spec: K8sSpec) -> dict[str, Any]:
    published = dict(CONTAINER_PORTS)
    if spec.tls_secret is not None:  # HTTPS through the sidecar only (metrics for the ServiceMonitor)
        published = {"https": k8s_proxy.PROXY_PORT,
                     **({"metrics": CONTAINER_PORTS["metrics"]} if spec.service_monitor else {})}
    ports = [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
             for name, port in published.items()]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(spec),
            "spec": {"type": spec.service_type, "selector": _selector(spec), "ports": ports}}


def autoscaler(spec: K8sSpec) -> dict[str, Any]:
    metric = {"type": "Pods", "pods": {"metric": {"name": LATENCY_METRIC},
                                       "target": {"type": "AverageValue",
                                                  "averageValue": str(spec.latency_target_us)}}}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(spec),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": [metric],
            "behavior": _BEHAVIOR,
        },
    }


def service_monitor(spec: K8sSpec) -> dict[str, Any]:
    """prometheus-operator ServiceMonitor (a CRD: monitoring.coreos.com/v1) scraping the metrics port."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": _metadata(spec),
            "spec": {"selector": {"matchLabels": _selector(spec)},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}


def pod_metric_query(spec: K8sSpec) -> str:
    """The HPA's metric outside the adapter: the adapter's query filled for this Deployment's pods
    (``namespace``, ``pod=~"<name>-.*"``), one value per pod."""
    matchers = [f'namespace="{spec.namespace}"'] if spec.namespace else []
    matchers.append(f'pod=~"{_pod_prefix(spec)}-.*"')
    return monitoring.latency_expression(spec, label_matchers=",".join(matchers), group_by="pod")


def _pod_prefix(spec: K8sSpec) -> str:
    return f"{spec.name}-predictor" if spec.kserve else spec.name


def keda_query(spec: K8sSpec) -> str:
    """KEDA's Prometheus trigger query: the per-pod metric summed over the pods. KEDA's ``AverageValue``
    divides it by the replicas, so the target compares with the average per pod, as the HPA's Pods metric."""
    return f"sum({pod_metric_query(spec)})"


def scaled_object(spec: K8sSpec) -> dict[str, Any]:
    """KEDA ScaledObject (a CRD: keda.sh/v1alpha1) in place of the HPA: a Prometheus trigger on the same
    metric and target, no prometheus-adapter needed (KEDA makes the HPA and serves the metric)."""
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _metadata(spec),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
            "minReplicaCount": spec.min_replicas, "maxReplicaCount": spec.max_replicas,
            "pollingInterval": 15,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _BEHAVIOR}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue",
                          "metadata": {"serverAddress": spec.prometheus_url, "query": keda_query(spec),
                                       "threshold": str(spec.latency_target_us)}}],
        },
    }


def inference_service(spec: K8sSpec) -> dict[str, Any]:
    """KServe InferenceService (a CRD: serving.kserve.io/v1beta1) on the ``kserve-tritonserver`` runtime in
    raw deployment mode, scaled by KEDA on the same metric and target. The runtime's image is replaced by
    ours (the Python models need the nnunet_triton package and its dependencies) and its arguments by our
    server command, with KServe's storage mount ``/mnt/models`` as the repository: ``pvc://<claim>`` or
    the model image as a modelcar (``oci://``, its files under ``/models``, which Dockerfile.models does)."""
    container = _server_container(spec, repository=KSERVE_REPOSITORY)
    storage = (f"pvc://{spec.model_source.ref}" if spec.model_source.kind == "pvc"
               else f"oci://{spec.model_source.ref}")
    model = {"modelFormat": {"name": "triton", "version": "2"}, "runtime": "kserve-tritonserver",
             "protocolVersion": "v2", "storageUri": storage,
             **{k: v for k, v in container.items() if k not in ("name", "lifecycle")}}
    external = {"metric": {"backend": "prometheus", "serverAddress": spec.prometheus_url,
                           "query": keda_query(spec)},
                "target": {"type": "Value", "value": str(spec.latency_target_us)}}
    metadata = _metadata(spec)
    metadata["annotations"] = {"serving.kserve.io/deploymentMode": "RawDeployment",
                               "serving.kserve.io/autoscalerClass": "keda"}
    return {
        "apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": metadata,
        "spec": {"predictor": {
            "minReplicas": spec.min_replicas, "maxReplicas": spec.max_replicas,
            "autoScaling": {"metrics": [{"type": "External", "external": external}],
                            "behavior": _BEHAVIOR},
            "terminationGracePeriodSeconds": spec.exit_timeout_s + 15,
            "model": model,
            "volumes": [v for v in _volumes(spec) if v["name"] != "model-repository"],
        }},
    }


def manifests(spec: K8sSpec) -> dict[str, dict[str, Any]]:
    """``{file name: manifest}`` in apply order."""
    if spec.kserve:
        return {"inferenceservice.yaml": inference_service(spec)}
    scaler = {"scaledobject.yaml": scaled_object(spec)} if spec.autoscaler == "keda" else {"hpa.yaml":
                                                                                           autoscaler(spec)}
    files = {"deployment.yaml": deployment(spec), "service.yaml": service(spec), **scaler}
    if spec.tls_secret is not None:
        files = {"proxy-configmap.yaml": k8s_proxy.proxy_config_map(spec), **files,
                 "networkpolicy.yaml": k8s_proxy.network_policy(spec)}
    if spec.service_monitor:
        files["servicemonitor.yaml"] = service_monitor(spec)
        files["prometheusrule.yaml"] = prometheus_rule(spec)
    return files


def prometheus_rule(spec: K8sSpec) -> dict[str, Any]:
    """prometheus-operator PrometheusRule (a CRD: monitoring.coreos.com/v1) with the alerts of
    :func:`monitoring.alert_rules` (also written as a plain rule file, ``prometheus-rules.yaml``)."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": _metadata(spec),
            "spec": monitoring.alert_rules(spec)}


def adapter_rules(spec: K8sSpec) -> dict[str, Any]:
    """prometheus-adapter Helm values: per pod, the time (us) a request spent at the orchestrator over 1 min
    (Triton's request duration of every endpoint version's orchestrator over its requests; with one endpoint,
    that of ``orchestrator_model``): its own queue plus its whole fold loop, waits at the fold models
    included. Not the orchestrator's queue time alone (the metric before): it sees the requests waiting for a
    free orchestrator instance, but not those that several instances hold at once while they wait for the
    fold models; nor the fold models' queue time, which a single request already fills with its own tile
    batches in flight (measured in tests/triton/test_autoscaling_metric.py, docs/deploy.md). Divided by
    the requests clamped at 1, not by 1 + requests (k8s-onprem's form, fine for millisecond models): a pod
    answering three 8 s requests a minute would read 6 s, a quarter low."""
    model = ORCHESTRATOR_MODELS
    query = (f"sum(delta(nv_inference_request_duration_us{{<<.LabelMatchers>>,{model}}}[1m])) "
             f"by (<<.GroupBy>>)/clamp_min(sum(delta(nv_inference_request_success"
             f"{{<<.LabelMatchers>>,{model}}}[1m])) by (<<.GroupBy>>), 1)")
    return {"rules": {"custom": [{
        "seriesQuery": f'nv_inference_request_duration_us{{{model},namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": "nv_inference_request_duration_us", "as": LATENCY_METRIC},
        "metricsQuery": query,
    }]}}


def manifest_files(spec: K8sSpec) -> dict[str, str]:
    """Text per file: the manifests, a kustomization.yaml listing them, the adapter values, the alert rules
    (a Prometheus rule file) and the Grafana dashboard (JSON)."""
    import yaml

    def dump(data: dict[str, Any]) -> str:
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)

    files = {name: dump(manifest) for name, manifest in manifests(spec).items()}
    kustomization: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                     "resources": list(files)}
    files["kustomization.yaml"] = dump(kustomization)
    if spec.autoscaler == "hpa":  # KEDA serves its metric itself
        files["prometheus-adapter-values.yaml"] = dump(adapter_rules(spec))
    files["prometheus-rules.yaml"] = dump(monitoring.alert_rules(spec))
    files["grafana-dashboard.json"] = json.dumps(monitoring.dashboard(spec), indent=1) + "\n"
    return files
