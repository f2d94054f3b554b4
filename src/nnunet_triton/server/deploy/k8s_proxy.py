"""The TLS proxy of a Kubernetes deployment (``deploy --target k8s --tls-secret NAME``): an nginx sidecar in
each pod with the embedded launcher's configuration (``server.proxy_config``), and a NetworkPolicy admitting
only its port.

The sidecar (an unprivileged nginx image, read-only root, no capabilities) serves HTTPS on ``PROXY_PORT`` with
the certificate, key and client CA of the Secret (``tls.crt``, ``tls.key``, ``ca.crt``: a kubernetes.io/tls
Secret plus the CA) and forwards the allow-listed paths to Triton on the pod's loopback. The Service then
publishes only that port, and the NetworkPolicy drops every other connection to the pods (Triton's own HTTP,
gRPC and metrics ports included), where the cluster's network plugin enforces NetworkPolicies.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnunet_triton.server.deploy import container_proxy
from nnunet_triton.server.deploy.docker import CONTAINER_PORTS
from nnunet_triton.server.proxy_config import ProxyConfig, TlsSettings, public_model_pattern, render_config

if TYPE_CHECKING:
    from nnunet_triton.server.deploy.k8s import K8sSpec

__all__ = ["DEFAULT_PROXY_IMAGE", "PROXY_PORT", "network_policy", "proxy_config_map", "proxy_container",
           "proxy_volumes"]

PROXY_PORT = container_proxy.PROXY_PORT  # the docker image's proxy port too
# nginx's own unprivileged image (uid 101, no root needed to bind 8443)
DEFAULT_PROXY_IMAGE = "docker.io/nginxinc/nginx-unprivileged:1.27-alpine"
# Paths inside the proxy sidecar's container, not on the host that renders the manifest: each is a volume
# mount of the pod spec below (the TLS secret, the nginx config map, an emptyDir for the pid file, logs and
# request bodies); the image's nginx runs from them.
_TLS_DIR = Path("/etc/nnunet-triton/tls")
_CONF_DIR = Path("/etc/nnunet-triton/nginx")
_RUN_DIR = Path("/tmp/nginx")


def _config_name(spec: K8sSpec) -> str:
    return f"{spec.name}-proxy"


def proxy_config_map(spec: K8sSpec) -> dict[str, Any]:
    """The ConfigMap holding nginx.conf (no secret in it: client certificates, not a token)."""
    from nnunet_triton.server.deploy.k8s import _metadata

    config = ProxyConfig(
        listen_host="0.0.0.0", listen_port=PROXY_PORT, upstream_port=CONTAINER_PORTS["http"],
        tls=TlsSettings(cert=_TLS_DIR / "tls.crt", key=_TLS_DIR / "tls.key", client_ca=_TLS_DIR / "ca.crt"),
        model_pattern=public_model_pattern(spec.info.endpoints), run_dir=_RUN_DIR)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(spec, _config_name(spec)),
            "data": {"nginx.conf": render_config(config)}}


def proxy_container(spec: K8sSpec) -> dict[str, Any]:
    """The nginx sidecar."""
    return {
        "name": "tls-proxy",
        "image": spec.proxy_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["nginx", "-p", str(_RUN_DIR), "-c", str(_CONF_DIR / "nginx.conf"),
                    "-e", str(_RUN_DIR / "nginx-error.log")],
        "ports": [{"name": "https", "containerPort": PROXY_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "250m", "memory": "128Mi"},
                      "limits": {"cpu": "1", "memory": "256Mi"}},
        "readinessProbe": {"tcpSocket": {"port": "https"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": "https"}, "periodSeconds": 10, "failureThreshold": 3},
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "proxy-tls", "mountPath": str(_TLS_DIR), "readOnly": True},
                         {"name": "proxy-config", "mountPath": str(_CONF_DIR), "readOnly": True},
                         {"name": "proxy-run", "mountPath": str(_RUN_DIR)}],
    }


def proxy_volumes(spec: K8sSpec) -> list[dict[str, Any]]:
    """The Secret (certificate, key, client CA), the ConfigMap and the sidecar's writable folder."""
    return [{"name": "proxy-tls", "secret": {"secretName": spec.tls_secret, "defaultMode": 0o400}},
            {"name": "proxy-config", "configMap": {"name": _config_name(spec)}},
            {"name": "proxy-run", "emptyDir": {}}]


def network_policy(spec: K8sSpec) -> dict[str, Any]:
    """Admit connections to the proxy port only, and to the metrics port for a ServiceMonitor (exec probes
    need no network; the kubelet's startup probe comes from the node, which network plugins admit)."""
    from nnunet_triton.server.deploy.k8s import _metadata, _selector

    ports = [PROXY_PORT] + ([CONTAINER_PORTS["metrics"]] if spec.service_monitor else [])
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _metadata(spec),
            "spec": {"podSelector": {"matchLabels": _selector(spec)}, "policyTypes": ["Ingress"],
                     "ingress": [{"ports": [{"port": port, "protocol": "TCP"} for port in ports]}]}}
