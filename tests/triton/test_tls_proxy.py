"""A server exposed beyond loopback: the real nginx proxy (HTTPS, client certificates, allow-list, buffered
bodies) and Triton's own gRPC mutual TLS, attacked as a client on the hospital network would.

One embedded server on ``0.0.0.0`` with TLS serves the identity repository under a registry naming the
endpoint ``identity``: ``identity_numpy_api`` stands for an internal model (not a public endpoint of the
registry).
Certificates are made with openssl (tests/tls_support.py); nginx is Debian's nginx-light.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nnunet_triton.server.handle import ServerHandle
from nnunet_triton.server.proxy import TlsSettings
from tests.conftest import IDENTITY_MODEL, NUMPY_API_MODEL, write_identity_repository
from tests.tls_support import Certificates, make_certificates

ENDPOINT = IDENTITY_MODEL
INTERNAL = NUMPY_API_MODEL
CHUNKED_BYTES = 3 * 2**20


def _nginx_available() -> bool:
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
        return True
    if os.geteuid() == 0 and shutil.which("apt-get"):  # like the PACS tests install Orthanc
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx-light"],
                       check=False, capture_output=True, timeout=600,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return bool(shutil.which("nginx") or Path("/usr/sbin/nginx").exists())


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def server(triton_server: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory,
           certs: Certificates) -> Iterator[ServerHandle]:
    if not _nginx_available():
        pytest.skip("nginx is not installed and cannot be installed here (apt-get install nginx-light)")
    repo = write_identity_repository(tmp_path_factory.mktemp("tls-repo"))
    registry = {"format": 2, "endpoints": {ENDPOINT: {"promoted": 1, "versions": {
        "1": {"models": [IDENTITY_MODEL, NUMPY_API_MODEL]}}}}}
    (repo / "repository_metadata.json").write_text(json.dumps(registry))
    tls = TlsSettings(cert=certs.server_cert, key=certs.server_key, client_ca=certs.ca)
    with triton_server(repo, host="0.0.0.0", tls=tls, metrics=True) as handle:  # with the watchdog
        yield handle


def _context(certs: Certificates, *, client: tuple[Path, Path] | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    return context


def _request(server: ServerHandle, certs: Certificates, method: str, path: str, body: bytes | None = None, *,
             client: tuple[Path, Path] | None = (Path(), Path())) -> tuple[int, bytes]:
    """One HTTPS request through the proxy; ``client`` default: the CA's client certificate."""
    if client == (Path(), Path()):
        client = (certs.client_cert, certs.client_key)
    assert server.proxy_url is not None
    host, port = server.proxy_url.rsplit(":", 1)
    connection = http.client.HTTPSConnection(host, int(port), context=_context(certs, client=client),
                                             timeout=120)
    try:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _infer_body(n_values: int) -> bytes:
    """A JSON infer request for the identity model: ``n_values`` float32s in, only OUTPUT_INT16 back."""
    return json.dumps({
        "inputs": [{"name": "INPUT_FP32", "shape": [1, 1, n_values], "datatype": "FP32",
                    "data": [0.5] * n_values},
                   {"name": "INPUT_INT16", "shape": [1, 1, 3], "datatype": "INT16", "data": [7, -8, 9]}],
        "outputs": [{"name": "OUTPUT_INT16"}],
    }).encode()


def _chunked(body: bytes, chunk_size: int) -> bytes:
    """``body`` in HTTP/1.1 chunked transfer encoding (the input CVE-2025-23310/23311 need); the full chunks
    are laid out with NumPy (millions of 1-byte chunks in a fraction of a second)."""
    full, rest = divmod(len(body), chunk_size)
    head = b"%x\r\n" % chunk_size
    rows = np.empty((full, len(head) + chunk_size + 2), np.uint8)
    rows[:, :len(head)] = np.frombuffer(head, np.uint8)
    rows[:, len(head):-2] = np.frombuffer(body[:full * chunk_size], np.uint8).reshape(full, chunk_size)
    rows[:, -2:] = np.frombuffer(b"\r\n", np.uint8)
    tail = b"%x\r\n%s\r\n" % (rest, body[full * chunk_size:]) if rest else b""
    return rows.tobytes() + tail + b"0\r\n\r\n"


def _send_chunked(server: ServerHandle, certs: Certificates, path: str, body: bytes,
                  chunk_size: int) -> tuple[int, bytes]:
    """POST ``body`` with ``Transfer-Encoding: chunked`` through the proxy, written as raw bytes."""
    assert server.proxy_url is not None
    host, port = server.proxy_url.rsplit(":", 1)
    context = _context(certs, client=(certs.client_cert, certs.client_key))
    with socket.create_connection((host, int(port)), timeout=120) as raw, \
            context.wrap_socket(raw, server_hostname=host) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
        sock.sendall(head + _chunked(body, chunk_size))
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


def test_https_client_without_a_certificate_of_the_ca_is_refused(server: ServerHandle,
                                                                  certs: Certificates) -> None:
    no_cert = _request(server, certs, "GET", "/v2/health/ready", client=None)
    stranger = _request(server, certs, "GET", "/v2/health/ready",
                        client=(certs.stranger_cert, certs.stranger_key))
    assert (no_cert[0], b"No required SSL certificate was sent" in no_cert[1]) == (400, True)
    assert (stranger[0], b"The SSL certificate error" in stranger[1]) == (400, True)
    assert _request(server, certs, "GET", "/v2/health/ready")[0] == 200


def test_public_infer_works_end_to_end_with_a_client_certificate(server: ServerHandle,
                                                                 certs: Certificates) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(
        server.proxy_url, ssl=True,
        ssl_options={"ca_certs": str(certs.ca), "certfile": str(certs.client_cert),
                     "keyfile": str(certs.client_key)})
    try:
        image = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        inputs = [httpclient.InferInput("INPUT_FP32", image.shape, "FP32"),
                  httpclient.InferInput("INPUT_INT16", [1, 1, 2], "INT16")]
        inputs[0].set_data_from_numpy(image, binary_data=True)
        inputs[1].set_data_from_numpy(np.array([[[3, -4]]], dtype=np.int16), binary_data=True)
        result = client.infer(ENDPOINT, inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT_FP32"), image)
        assert client.get_model_config(ENDPOINT)["name"] == ENDPOINT
    finally:
        client.close()


@pytest.mark.parametrize(("total_bytes", "chunk_size"), [(None, 1 << 20), (CHUNKED_BYTES, 1)],
                         ids=["one-chunk", "3MB-in-1-byte-chunks"])
def test_chunked_bodies_are_buffered_answered_and_triton_survives(server: ServerHandle, certs: Certificates,
                                                                  total_bytes: int | None,
                                                                  chunk_size: int) -> None:
    body = _infer_body(3 if total_bytes is None else total_bytes // 4)
    status, answer = _send_chunked(server, certs, f"/v2/models/{ENDPOINT}/infer", body, chunk_size)
    assert status == 200, answer[:500]
    outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
    assert outputs == {"OUTPUT_INT16": [7, -8, 9]}
    assert server.is_ready()


@pytest.mark.parametrize(("method", "path"), [
    ("POST", f"/v2/models/{INTERNAL}/infer"), ("GET", f"/v2/models/{INTERNAL}/config"),
    ("POST", "/v2/systemsharedmemory/region/stub/register"), ("GET", "/v2/systemsharedmemory/status"),
    ("POST", "/v2/cudasharedmemory/region/x/unregister"), ("POST", "/v2/logging"), ("GET", "/v2/logging"),
    ("POST", "/v2/trace/setting"), ("POST", "/v2/repository/index"),
    ("POST", f"/v2/repository/models/{ENDPOINT}/unload"), ("GET", "/v2/models/stats"),
    ("POST", f"/v2/models/{ENDPOINT}/../{INTERNAL}/infer"),
    ("POST", f"/v2/models/{ENDPOINT}%2F..%2F{INTERNAL}/infer"),
])
def test_internal_models_and_management_apis_are_refused_through_the_proxy(
        server: ServerHandle, certs: Certificates, method: str, path: str) -> None:
    body = _infer_body(3) if path.endswith("/infer") else (b"{}" if method == "POST" else None)
    status, answer = _request(server, certs, method, path, body)
    assert (status, b"403 Forbidden" in answer) == (403, True)
    assert server.is_ready()


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_triton_http_and_metrics_listen_on_loopback_only_behind_the_proxy(server: ServerHandle) -> None:
    loopback = {"0100007F"}
    assert (_listening(server.http_port), _listening(server.metrics_port)) == (loopback, loopback)
    assert server.proxy_url is not None
    assert _listening(int(server.proxy_url.rsplit(":", 1)[1])) == {"00000000"}  # the proxy: 0.0.0.0


def test_grpc_needs_a_client_certificate_of_the_ca(server: ServerHandle, certs: Certificates) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    def live(client: tuple[Path, Path] | None) -> bool:
        kwargs = {} if client is None else {"certificate_chain": str(client[0]),
                                            "private_key": str(client[1])}
        with grpcclient.InferenceServerClient(server.grpc_url, ssl=True, root_certificates=str(certs.ca),
                                              **kwargs) as client_:
            try:
                return bool(client_.is_server_live(client_timeout=30))
            except InferenceServerException:
                return False

    assert live(None) is False
    assert live((certs.stranger_cert, certs.stranger_key)) is False
    assert live((certs.client_cert, certs.client_key)) is True


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_nnunet_client_reaches_the_endpoint_with_the_ca_and_a_client_certificate(
        server: ServerHandle, certs: Certificates, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.client.tls import CA_ENV, CERT_ENV, KEY_ENV, client_tls
    from nnunet_triton.errors import ClientError

    url = server.proxy_url if protocol == "http" else server.grpc_url
    assert url is not None
    with NnunetClient(url, protocol, endpoint=ENDPOINT,
                      tls=client_tls(certs.ca, certs.client_cert, certs.client_key)) as client:
        client.check_ready()
    with NnunetClient(url, protocol, endpoint=ENDPOINT, tls=client_tls(certs.ca)) as client, \
            pytest.raises(ClientError, match="Triton server at .* is not (live|reachable)"):
        client.check_ready()
    for name, path in ((CA_ENV, certs.ca), (CERT_ENV, certs.client_cert), (KEY_ENV, certs.client_key)):
        monkeypatch.setenv(name, str(path))
    with NnunetClient(url, protocol, endpoint=ENDPOINT) as client:  # the files from the environment
        client.check_ready()


def test_a_killed_proxy_is_started_again_by_the_watchdog(server: ServerHandle, certs: Certificates) -> None:
    from nnunet_triton.server.proxy import running_pid

    assert server.proxy_config is not None
    killed = running_pid(server.proxy_config)
    assert killed is not None
    os.kill(killed, signal.SIGKILL)  # nginx's workers survive their master and keep the port
    deadline = time.monotonic() + 60.0
    while running_pid(server.proxy_config) in (None, killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running_pid(server.proxy_config) not in (None, killed)
    assert _request(server, certs, "GET", "/v2/health/ready")[0] == 200
    assert _request(server, certs, "GET", "/v2/health/ready", client=None)[0] == 400


def test_bearer_token_proxy_refuses_requests_without_the_token(server: ServerHandle, certs: Certificates,
                                                               tmp_path: Path) -> None:
    from nnunet_triton.server.proxy import ProxyConfig, public_model_pattern, start_proxy

    token_file = tmp_path / "token"
    token_file.write_text("a-long-random-token-0123456789\n")
    config = ProxyConfig(listen_host="127.0.0.1", listen_port=_free_port(), upstream_port=server.http_port,
                         tls=TlsSettings(certs.server_cert, certs.server_key, token_file=token_file),
                         model_pattern=public_model_pattern([ENDPOINT]), run_dir=tmp_path / "proxy")
    proxy = start_proxy(config)
    try:
        def status(headers: dict[str, str]) -> int:
            connection = http.client.HTTPSConnection("127.0.0.1", config.listen_port, timeout=60,
                                                     context=_context(certs, client=None))
            try:
                connection.request("GET", f"/v2/models/{ENDPOINT}/ready", headers=headers)
                return connection.getresponse().status
            finally:
                connection.close()

        assert [status({}), status({"Authorization": "Bearer wrong-token-0123456789"}),
                status({"Authorization": "Bearer a-long-random-token-0123456789"})] == [401, 401, 200]
    finally:
        proxy.stop()
    assert not proxy.is_running()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
