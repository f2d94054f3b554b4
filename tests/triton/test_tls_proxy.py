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
import pwd
import shutil
import signal
import socket
import ssl
import subprocess
import time
import zlib
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


def _raw_request(port: int, certs: Certificates, head: str, body: bytes = b"", *,
                 client: tuple[Path, Path] | None = None) -> tuple[int, bytes]:
    """Send ``head`` (request line and headers, exactly as given: repeated or odd headers included) and
    ``body`` over TLS to the proxy on 127.0.0.1:``port``; (status, body) of the answer."""
    context = _context(certs, client=client or (certs.client_cert, certs.client_key))
    with socket.create_connection(("127.0.0.1", port), timeout=120) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


def _proxy_port(server: ServerHandle) -> int:
    assert server.proxy_url is not None
    return int(server.proxy_url.rsplit(":", 1)[1])


def _memory_mib(pid: int) -> dict[str, float]:
    """Resident (RSS) and proportional (PSS) memory of ``pid`` in MiB."""
    rss = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    pss = next(line for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
               if line.startswith("Pss:"))
    return {"rss": int(rss.split()[1]) / 1024, "pss": int(pss.split()[1]) / 1024}


BOMB_MIB = 256  # what each encoded body inflates to (about 256 KiB on the wire)


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    """Zeros compressed as gzip (what `Content-Encoding: gzip` means) and zlib (`deflate`)."""
    zeros = bytes(2**20)
    made = {}
    for name, wbits in (("gzip", 31), ("deflate", 15)):
        compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
        made[name] = b"".join(compressor.compress(zeros) for _ in range(BOMB_MIB)) + compressor.flush()
    return made


# (Content-Encoding headers as sent, which bomb): exact, other case, a list, repeated headers in both orders,
# and an empty first header (nginx 1.22 reads only the first: forwarded, but without any Content-Encoding)
ENCODINGS = [(("gzip",), "gzip"), (("deflate",), "deflate"), (("GZIP",), "gzip"),
             (("identity, gzip",), "gzip"), (("identity", "gzip"), "gzip"), (("gzip", "identity"), "gzip"),
             (("identity",), "gzip"), (("", "gzip"), "gzip")]


def test_compressed_bodies_are_refused_by_the_proxy_and_triton_memory_stays_flat(
        server: ServerHandle, certs: Certificates, bombs: dict[str, bytes]) -> None:
    before = _memory_mib(server.pid)
    answers = []
    for encodings, bomb in ENCODINGS:
        head = (f"POST /v2/models/{ENDPOINT}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Content-Type: application/json\r\n"
                + "".join(f"Content-Encoding: {value}\r\n" for value in encodings)
                + f"Content-Length: {len(bombs[bomb])}\r\nConnection: close\r\n")
        answers.append(_raw_request(_proxy_port(server), certs, head, bombs[bomb]))
    after = _memory_mib(server.pid)
    assert after["rss"] - before["rss"] < 16 and after["pss"] - before["pss"] < 16, (before, after, answers)
    refused = [(status, b"Content-Encoding is refused" in text) for status, text in answers]
    assert refused[:-1] == [(415, True)] * (len(ENCODINGS) - 1), answers
    # the empty first header: forwarded with every Content-Encoding removed, so Triton parses the gzip bytes
    # as JSON ("Invalid value"; an inflated body of zeros would be "The document is empty")
    assert answers[-1] == (500, b'{"error":"failed to parse the request JSON buffer: Invalid value. at 0"}')
    assert server.is_ready()


@pytest.mark.parametrize(("encodings", "status"), [
    (("gzip, chunked",), 501), (("identity",), 501), (("chunked", "chunked"), 400),
    (("chunked, identity",), 501), (("deflate",), 501)],
    ids=["gzip,chunked", "identity", "two-chunked-headers", "chunked,identity", "deflate"])
def test_transfer_encodings_other_than_chunked_are_refused_through_the_proxy(
        server: ServerHandle, certs: Certificates, encodings: tuple[str, ...], status: int) -> None:
    """nginx 1.22 itself answers these (501 unknown coding, 400 a repeated header) before the config's own
    check (tests/unit/test_proxy.py); either way nothing reaches Triton."""
    body = _chunked(_infer_body(3), 16)
    head = (f"POST /v2/models/{ENDPOINT}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + "".join(f"Transfer-Encoding: {value}\r\n" for value in encodings) + "Connection: close\r\n")
    assert _raw_request(_proxy_port(server), certs, head, body)[0] == status
    assert server.is_ready()


@pytest.mark.parametrize("path", [
    f"/v2/models/{ENDPOINT}/../{INTERNAL}/infer", f"/v2/models/{ENDPOINT}%2F..%2F{INTERNAL}/infer",
    f"/v2/models/{ENDPOINT}/%2e%2e/{INTERNAL}/infer", f"/v2/models/{ENDPOINT}/../{ENDPOINT}/infer",
    f"/v2/models/{ENDPOINT}%5c..%5c{INTERNAL}/infer", f"/v2/models/{ENDPOINT}\\..\\{INTERNAL}/infer",
    f"/v2/models/{ENDPOINT}%00/infer", f"/v2/models/{ENDPOINT}%0d/infer", f"/v2/models/{ENDPOINT}%7f/infer",
])
def test_model_names_with_traversal_characters_are_refused_by_the_proxy(
        server: ServerHandle, certs: Certificates, path: str) -> None:
    status, answer = _request(server, certs, "POST", path, _infer_body(3))
    # nginx itself refuses an encoded NUL, before the proxy's own check
    reason = b"400 Bad Request" if "%00" in path else b"traversal or control character"
    assert (status, reason in answer) == (400, True), answer[:300]
    assert server.is_ready()


@pytest.mark.parametrize(("method", "path"), [("POST", f"/v2/models/{ENDPOINT}/infer%0a"),
                                              ("GET", f"/v2/models/{ENDPOINT}/config%0A"),
                                              ("GET", "/v2/health/ready%0a")])
def test_a_path_ending_in_an_encoded_line_feed_is_refused_by_the_proxy(
        server: ServerHandle, certs: Certificates, method: str, path: str) -> None:
    """It passed the allow-list (PCRE's `$` matches before a final newline) and reached Triton as a raw line
    feed (502)."""
    status, answer = _request(server, certs, method, path, _infer_body(3) if method == "POST" else None)
    assert (status, b"traversal or control character" in answer) == (400, True), answer[:300]


def _limited_proxy(server: ServerHandle, certs: Certificates, run_dir: Path, **limits: int) -> Any:
    from nnunet_triton.server.proxy import ClientLimits, ProxyConfig, public_model_pattern, start_proxy

    return start_proxy(ProxyConfig(
        listen_host="127.0.0.1", listen_port=_free_port(), upstream_port=server.http_port,
        tls=TlsSettings(certs.server_cert, certs.server_key, client_ca=certs.ca),
        model_pattern=public_model_pattern([ENDPOINT]), run_dir=run_dir, limits=ClientLimits(**limits)))


def test_a_client_over_its_request_rate_or_concurrency_gets_429(server: ServerHandle, certs: Certificates,
                                                                tmp_path: Path) -> None:
    ready = "GET /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    other = (certs.other_client_cert, certs.other_client_key)
    # rate: 1 a minute with a burst of 2 lets 3 requests through at once, then 429; another client's
    # certificate (same address) has its own allowance
    rate = _limited_proxy(server, certs, tmp_path / "rate", requests_per_minute=1, burst=2)
    try:
        port = int(rate.url.rsplit(":", 1)[1])
        statuses = [_raw_request(port, certs, ready)[0] for _ in range(4)]
        assert (statuses, _raw_request(port, certs, ready, client=other)[0]) == ([200, 200, 200, 429], 200)
    finally:
        rate.stop()
    # concurrency: 1 request in progress per client; one whose body is still arriving holds the slot
    busy = _limited_proxy(server, certs, tmp_path / "busy", concurrent=1)
    try:
        port = int(busy.url.rsplit(":", 1)[1])
        context = _context(certs, client=(certs.client_cert, certs.client_key))
        with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as holder:
            holder.sendall(f"POST /v2/models/{ENDPOINT}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           "Content-Length: 1000\r\n\r\n{".encode())
            deadline, held = time.monotonic() + 30.0, 200
            while held != 429 and time.monotonic() < deadline:  # until nginx has read the holder's headers
                held = _raw_request(port, certs, ready)[0]
            assert (held, _raw_request(port, certs, ready, client=other)[0]) == (429, 200)
        deadline, freed = time.monotonic() + 30.0, 429
        while freed == 429 and time.monotonic() < deadline:  # the slot comes back once nginx saw the close
            freed = _raw_request(port, certs, ready)[0]
            time.sleep(0.1)
        assert freed == 200
    finally:
        busy.stop()


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _uids(pid: int) -> set[int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    line = next(line for line in status if line.startswith("Uid:"))
    return {int(uid) for uid in line.split()[1:]}


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                                reason="runs commands as user nobody (needs root and runuser)")

# run as nobody: read the first writable mapping of a process (ptrace access: what a debugger needs)
_READ_MEMORY = """
import sys
pid = sys.argv[1]
try:
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if perms.startswith("rw"):
                start, end = (int(x, 16) for x in span.split("-"))
                mem.seek(start)
                print("read", len(mem.read(min(end - start, 65536))))
                break
except OSError as exc:
    print("denied", exc.errno)
"""


@needs_root
def test_the_proxy_workers_run_as_their_own_user_and_nobody_cannot_read_their_memory(
        server: ServerHandle, certs: Certificates) -> None:
    from nnunet_triton.server.proxy import running_pid

    assert server.proxy_config is not None
    master = running_pid(server.proxy_config)
    assert master is not None
    workers = _children(master)
    assert workers
    for pid in workers:  # nobody reads them (it could while they ran as nobody)
        attempt = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", _READ_MEMORY,
                                  str(pid)], capture_output=True, text=True, timeout=60, check=False)
        assert attempt.stdout.startswith("denied"), (pid, attempt)
    account = pwd.getpwnam("nnunet-proxy")
    assert account.pw_shell.endswith("nologin")
    assert {uid for pid in workers for uid in _uids(pid)} == {account.pw_uid}
    temp = Path((Path(server.proxy_config).parent / "nginx-temp-dir").read_text().strip())
    for folder in (temp, temp / "nginx-body"):
        assert (folder.stat().st_uid, folder.stat().st_mode & 0o777) == (account.pw_uid, 0o700), folder
    assert _request(server, certs, "GET", "/v2/health/ready")[0] == 200  # they serve


def test_a_restarted_proxy_gets_no_secret_in_its_environment(server: ServerHandle,
                                                             certs: Certificates) -> None:
    from nnunet_triton.server.model_control import TOKEN_ENV
    from nnunet_triton.server.proxy import running_pid

    assert server.proxy_config is not None and server.control_token
    killed = running_pid(server.proxy_config)
    assert killed is not None
    os.kill(killed, signal.SIGKILL)  # the watchdog (whose environment holds the token) starts it again
    deadline = time.monotonic() + 60.0
    while running_pid(server.proxy_config) in (None, killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    master = running_pid(server.proxy_config)
    assert master not in (None, killed)
    assert _request(server, certs, "GET", "/v2/health/ready")[0] == 200
    for pid in (master, *_children(master)):
        # nginx writes its process title over the start of its environment and keeps a copy of the
        # environment in its heap: the secret is looked for in all of the process's memory
        assert TOKEN_ENV.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), pid
        assert not _memory_holds(pid, server.control_token.encode()), pid
        assert not _memory_holds(pid, TOKEN_ENV.encode()), pid


def _memory_holds(pid: int, needle: bytes) -> bool:
    """Whether ``needle`` is anywhere in ``pid``'s readable memory (read as root)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if not perms.startswith("r") or line.rstrip().endswith(("[vvar]", "[vsyscall]")):
                continue
            try:
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
            except (OSError, OverflowError):
                continue
    return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
