"""Kubernetes with ``--tls-secret``: the nginx sidecar (the embedded proxy's configuration), a Service
publishing only HTTPS and a NetworkPolicy admitting only the proxy port; validated offline like the other
manifests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from deploy_support import k8s_spec

from nnunet_triton.server.deploy import k8s, k8s_proxy
from tests.tls_support import make_certificates


def test_tls_secret_adds_the_sidecar_configmap_and_networkpolicy_which_validate(tmp_path: Path) -> None:
    manifests = k8s.manifests(k8s_spec(tmp_path, tls_secret="nnunet-tls", namespace="imaging"))
    assert list(manifests) == ["proxy-configmap.yaml", "deployment.yaml", "service.yaml", "hpa.yaml",
                               "networkpolicy.yaml"]
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for name, manifest in manifests.items():
        assert kubernetes_validate.validate(manifest, "1.30", strict=True) == "1.30", name


@pytest.mark.parametrize(("monitor", "ports"), [(False, [8443]), (True, [8443, 8002])])
def test_only_the_proxy_port_is_published_and_admitted(tmp_path: Path, monitor: bool,
                                                       ports: list[int]) -> None:
    spec = k8s_spec(tmp_path, tls_secret="nnunet-tls", service_monitor=monitor)
    assert [p["port"] for p in k8s.service(spec)["spec"]["ports"]] == ports
    policy = k8s_proxy.network_policy(spec)["spec"]
    assert policy["podSelector"] == {"matchLabels": k8s.service(spec)["spec"]["selector"]}
    assert policy["ingress"] == [{"ports": [{"port": port, "protocol": "TCP"} for port in ports]}]


def test_sidecar_is_unprivileged_and_reads_the_secret(tmp_path: Path) -> None:
    pod = k8s.deployment(k8s_spec(tmp_path, tls_secret="nnunet-tls"))["spec"]["template"]["spec"]
    sidecar = {c["name"]: c for c in pod["containers"]}["tls-proxy"]
    assert sidecar["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                          "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["proxy-tls"]["secret"] == {"secretName": "nnunet-tls", "defaultMode": 0o400}


def test_without_tls_secret_nothing_changes(tmp_path: Path) -> None:
    assert list(k8s.manifests(k8s_spec(tmp_path))) == ["deployment.yaml", "service.yaml", "hpa.yaml"]


@pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                    reason="nginx is not installed (apt-get install nginx-light)")
def test_sidecar_config_passes_nginx_check_and_serves_the_endpoints_only(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    text = k8s_proxy.proxy_config_map(k8s_spec(tmp_path, tls_secret="nnunet-tls"))["data"]["nginx.conf"]
    assert "location ~ \"^/v2/models/(nnunet(__v[1-9][0-9]*)?(_(fp16|int16|uint16|uint8))?)" in text
    for name, path in (("tls.crt", certs.server_cert), ("tls.key", certs.server_key), ("ca.crt", certs.ca)):
        text = text.replace(f"/etc/nnunet-triton/tls/{name}", str(path))
    text = text.replace("/tmp/nginx", str(tmp_path)).replace("0.0.0.0:8443", "127.0.0.1:8443")
    (tmp_path / "nginx.conf").write_text(text)
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    result = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e",
                             str(tmp_path / "error.log")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_tls_secret_needs_a_secret_name_and_a_cluster(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tls_secret must name a Secret .* got 'Bad_Name'"):
        k8s_spec(tmp_path, tls_secret="Bad_Name")
