"""server.proxy_config: the nginx config it renders and the refusal to expose a server without TLS (nginx only
checks the syntax here; tests/triton/test_tls_proxy.py runs the real one)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nnunet_triton.cli import deploy
from nnunet_triton.cli import main as cli_main
from nnunet_triton.server import embedded
from nnunet_triton.server.proxy_config import (
    ClientLimits,
    ExposureError,
    ProxyConfig,
    ProxyError,
    TlsSettings,
    check_exposure,
    public_model_pattern,
    render_config,
)
from tests.tls_support import make_certificates


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsSettings:
    certs = make_certificates(tmp_path_factory.mktemp("certs"))
    return TlsSettings(cert=certs.server_cert, key=certs.server_key, client_ca=certs.ca)


def _config(tls: TlsSettings, tmp_path: Path, **kwargs: object) -> ProxyConfig:
    defaults: dict[str, object] = {"listen_host": "0.0.0.0", "listen_port": 8443, "upstream_port": 8000,
                                   "tls": tls, "model_pattern": public_model_pattern(["liver"]),
                                   "run_dir": tmp_path}
    return ProxyConfig(**{**defaults, **kwargs})  # type: ignore[arg-type]


def _pcre(pattern: str) -> str:
    """An nginx PCRE pattern in Python's spelling (``\\z``, the very end, is Python's ``\\Z``)."""
    return pattern.replace("\\z", "\\Z")


def _allowed(config_text: str, method: str, path: str) -> bool:
    """Whether the rendered config forwards ``method path`` (nginx's regex locations, first match wins)."""
    for pattern, allowed_method in re.findall(r'location ~ "(.+?)" \{\n\s+limit_except (\w+)', config_text):
        if re.search(_pcre(pattern), path):
            return method == allowed_method
    return False


def _server_refusal(config_text: str, variable: str) -> tuple[str, str, str]:
    """(operator, pattern or value, status) of the server-level ``if ($variable ...) { return ...; }``."""
    found = re.findall(rf'^\s+if \(\${variable} (!?~\*?|!?=) "(.*?)"\) \{{ return (\d+) "', config_text, re.M)
    assert len(found) == 1, (variable, found)
    return found[0]


def _refused_by(config_text: str, variable: str, value: str) -> str | None:
    """The status nginx answers when ``$variable`` is ``value`` (None: not refused by that check)."""
    operator, pattern, status = _server_refusal(config_text, variable)
    flags = re.IGNORECASE if operator.endswith("*") else 0
    if operator in ("~", "~*", "!~", "!~*"):
        matched = re.search(_pcre(pattern), value, flags) is not None
        return status if matched != operator.startswith("!") else None
    return status if (value == pattern) == (operator == "=") else None


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v2/health/ready"), ("GET", "/v2"), ("GET", "/v2/models/liver"),
    ("GET", "/v2/models/liver/ready"),
    ("GET", "/v2/models/liver_int16/config"), ("POST", "/v2/models/liver/infer"),
    ("POST", "/v2/models/liver__v3/infer"), ("POST", "/v2/models/liver__v3_uint8/versions/1/infer"),
])
def test_proxy_forwards_health_metadata_and_infer_of_public_endpoints(
        tls: TlsSettings, tmp_path: Path, method: str, path: str) -> None:
    assert _allowed(render_config(_config(tls, tmp_path)), method, path)


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v2/models/stitch_model/infer"), ("POST", "/v2/models/liver__v3__fold_0/infer"),
    ("POST", "/v2/models/preprocess_model/infer"), ("GET", "/v2/models/liver__v3__orchestrator_model/config"),
    ("POST", "/v2/systemsharedmemory/region/x/register"), ("POST", "/v2/cudasharedmemory/region/x/register"),
    ("GET", "/v2/systemsharedmemory/status"), ("POST", "/v2/logging"), ("GET", "/v2/logging"),
    ("POST", "/v2/trace/setting"), ("POST", "/v2/models/liver/trace/setting"),
    ("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/liver/load"),
    ("GET", "/v2/models/stats"), ("GET", "/v2/models/liver/stats"), ("GET", "/metrics"),
    ("GET", "/v2/models/liver/infer"), ("POST", "/v2/models/liver/config"),
    ("POST", "/v2/models/liverx/infer"),
])
def test_proxy_refuses_internal_models_and_management_apis(
        tls: TlsSettings, tmp_path: Path, method: str, path: str) -> None:
    assert not _allowed(render_config(_config(tls, tmp_path)), method, path)


def test_proxy_forwards_statistics_only_when_allowed(tls: TlsSettings, tmp_path: Path) -> None:
    text = render_config(_config(tls, tmp_path, allow_statistics=True))
    assert [_allowed(text, "GET", p) for p in ("/v2/models/stats", "/v2/models/liver/stats",
                                               "/v2/models/stitch_model/stats")] == [True, True, False]


def test_proxy_buffers_bodies_and_forwards_them_unchunked_with_mutual_tls(tls: TlsSettings,
                                                                          tmp_path: Path) -> None:
    lines = {line.strip() for line in render_config(_config(tls, tmp_path)).splitlines()}
    assert {
        "listen 0.0.0.0:8443 ssl;", f"ssl_client_certificate {tls.client_ca};", "ssl_verify_client on;",
        "proxy_request_buffering on;", "proxy_http_version 1.0;", f"client_max_body_size {1100 * 2**20};",
        "location / { return 403; }",
    } <= lines
    # the forwarded path is the normalized one that matched, to loopback, without the query string
    assert {line for line in lines if line.startswith("proxy_pass")} == {"proxy_pass http://127.0.0.1:8000$uri;"}


def test_proxy_checks_the_bearer_token_when_one_is_given(tls: TlsSettings, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789\n")
    text = render_config(_config(TlsSettings(tls.cert, tls.key, token_file=token_file), tmp_path))
    assert 'if ($http_authorization != "Bearer s3cret-token-0123456789") { return 401; }' in text
    assert "ssl_verify_client" not in text


@pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                    reason="nginx is not installed (apt-get install nginx-light)")
def test_rendered_config_passes_nginx_syntax_check(tls: TlsSettings, tmp_path: Path) -> None:
    config = _config(tls, tmp_path, listen_host="127.0.0.1")
    (tmp_path / "nginx.conf").write_text(render_config(config))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    result = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e",
                             str(tmp_path / "error.log")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_exposure_beyond_loopback_without_tls_is_refused(host: str) -> None:
    with pytest.raises(ExposureError, match=rf"would listen on '{re.escape(host)}' \(beyond loopback\) "
                                            r"without TLS: give --tls-cert"):
        check_exposure(host, None)


def test_tls_without_client_authentication_is_refused(tls: TlsSettings) -> None:
    with pytest.raises(ExposureError, match="TLS without client authentication: give --tls-ca"):
        check_exposure("0.0.0.0", TlsSettings(tls.cert, tls.key))


def test_a_short_bearer_token_is_refused(tls: TlsSettings, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("short")
    with pytest.raises(ExposureError, match=r"the token must be 16 to 256 characters .* \(got 5 chara"):
        check_exposure("0.0.0.0", TlsSettings(tls.cert, tls.key, token_file=tmp_path / "token"))


def test_embedded_start_refuses_a_public_host_without_tls(tmp_path: Path) -> None:
    with pytest.raises(ExposureError, match="tritonserver would listen on '0.0.0.0'"):
        embedded.start(tmp_path, host="0.0.0.0", home=tmp_path / "home")
    assert not (tmp_path / "home").exists()  # refused before anything was prepared


def test_serve_and_deploy_refuse_a_public_host_without_tls(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    assert cli_main(["serve", "--model-repository", str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "tritonserver would listen on '0.0.0.0' (beyond loopback) without TLS" in capsys.readouterr().err
    for target in ("embedded", "docker"):
        assert deploy.main(["--target", target, "--host", "0.0.0.0", "--model", str(tmp_path),
                            "--out", str(tmp_path / "out")]) == 2  # like serve: one exit-code policy
    assert not (tmp_path / "out").exists()  # refused before building
    assert [r.message.split(" would ")[0].split(" publishes ")[0] for r in caplog.records
            if r.levelname == "ERROR"] == ["the embedded tritonserver", "--target docker's tritonserver"]


@pytest.mark.parametrize(("value", "refused"), [
    ("", False), ("chunked", False), ("Chunked", False),
    ("gzip, chunked", True), ("identity", True), ("chunked, chunked", True),  # nginx >= 1.23 joins repeats
    ("chunked\n", True), ("deflate", True), (" chunked", True),
])
def test_transfer_encodings_other_than_chunked_are_refused(tls: TlsSettings, tmp_path: Path, value: str,
                                                           refused: bool) -> None:
    text = render_config(_config(tls, tmp_path))
    assert _refused_by(text, "http_transfer_encoding", value) == ("501" if refused else None)
    # and the encoding never reaches Triton: nginx de-chunks the buffered body
    assert 'proxy_set_header Transfer-Encoding "";' in {line.strip() for line in text.splitlines()}


@pytest.mark.parametrize("value", ["gzip", "deflate", "GZIP", "identity, gzip", "identity", "br", "0"])
def test_request_bodies_with_a_content_encoding_are_refused(tls: TlsSettings, tmp_path: Path,
                                                            value: str) -> None:
    text = render_config(_config(tls, tmp_path))
    assert _refused_by(text, "http_content_encoding", value) == "415"
    assert _refused_by(text, "http_content_encoding", "") is None
    assert 'proxy_set_header Content-Encoding "";' in {line.strip() for line in text.splitlines()}


@pytest.mark.parametrize("raw_path", [
    "/v2/models/liver/../stitch_model/infer", "/v2/models/liver/%2e%2e/stitch_model/infer",
    "/v2/models/liver/%2E./x", "/v2/models/liver%2Finfer", "/v2/models/liver%2f..%2fstitch_model/infer",
    "/v2/models/liver%5c..%5cstitch_model/infer", "/v2/models/liver\\infer", "/v2/models/liver%00/infer",
    "/v2/models/liver/infer%0a", "/v2/models/liver/infer%0D%0A", "/v2/models/liver%09/infer",
    "/v2/models/liver%7f/infer", "/v2/models/liver/infer\x01",
])
def test_model_names_with_traversal_characters_are_refused(tls: TlsSettings, tmp_path: Path,
                                                           raw_path: str) -> None:
    text = render_config(_config(tls, tmp_path))
    assert _refused_by(text, "request_uri", raw_path) == "400"


def test_a_public_path_is_not_mistaken_for_a_traversal(tls: TlsSettings, tmp_path: Path) -> None:
    text = render_config(_config(tls, tmp_path))
    for path in ("/v2/models/liver/infer", "/v2/models/liver__v3_int16/versions/2/config", "/v2/health/ready",
                 "/v2/models/liver.v1/ready"):
        assert _refused_by(text, "request_uri", path) is None, path


@pytest.mark.parametrize("path", ["/v2/models/liver/infer\n", "/v2/models/liver\n", "/v2\n",
                                  "/v2/health/ready\n"])
def test_the_allow_list_does_not_match_before_a_final_line_feed(tls: TlsSettings, tmp_path: Path,
                                                                 path: str) -> None:
    """PCRE's ``$`` matches before a final newline: nginx decodes ``%0a`` into $uri, which reached Triton."""
    text = render_config(_config(tls, tmp_path))
    assert not any(_allowed(text, method, path) for method in ("GET", "POST"))
    assert "$\" {" not in text  # every location pattern ends in \z


def test_each_client_is_limited_by_its_certificate_else_its_address(tls: TlsSettings, tmp_path: Path) -> None:
    lines = [line.strip() for line in render_config(_config(
        tls, tmp_path, limits=ClientLimits(requests_per_minute=120, burst=7, concurrent=3))).splitlines()]
    key = lines[lines.index("map $ssl_client_fingerprint $nnunet_client {") + 1:][:2]
    assert key == ['"" $binary_remote_addr;', "default $ssl_client_fingerprint;"]
    assert {"limit_req_zone $nnunet_client zone=nnunet_rate:2m rate=120r/m;",
            "limit_conn_zone $nnunet_client zone=nnunet_busy:2m;", "limit_req_status 429;",
            "limit_conn_status 429;", "limit_req zone=nnunet_rate burst=7 nodelay;",
            "limit_conn nnunet_busy 3;"} <= set(lines)


@pytest.mark.parametrize(("field", "flag", "value"), [
    ("requests_per_minute", "--proxy-requests-per-minute", 0), ("burst", "--proxy-burst", -1),
    ("concurrent", "--proxy-concurrent-requests", 0), ("concurrent", "--proxy-concurrent-requests", 2.5),
    ("requests_per_minute", "--proxy-requests-per-minute", True)])
def test_a_limit_out_of_range_is_refused_with_its_name(field: str, flag: str, value: object) -> None:
    got = re.escape(repr(value))
    with pytest.raises(ProxyError, match=rf"the proxy's {field} per client \({flag}\) must be an integer "
                                         rf">= \d \(got {got}\)"):
        ClientLimits(**{field: value})  # type: ignore[arg-type]


def test_serve_refuses_a_proxy_limit_out_of_range_before_starting(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", "--model-repository", str(tmp_path), "--home", str(tmp_path / "home"),
                     "--proxy-concurrent-requests", "0"]) == 2
    assert "the proxy's concurrent per client (--proxy-concurrent-requests) must be an integer >= 1 (got 0)" \
        in capsys.readouterr().err
    assert not (tmp_path / "home").exists()


@pytest.mark.skipif(shutil.which("useradd") is None and not Path("/usr/sbin/useradd").exists(),
                    reason="useradd is not installed")
def test_a_worker_user_that_cannot_be_created_is_a_clear_error() -> None:
    from nnunet_triton.server.proxy import worker_account

    with pytest.raises(ProxyError, match=r"the TLS proxy's workers run as the system user 'no such user!', "
                                         r"which could not be created \(useradd exit code [1-9].*: create it "
                                         r"\(useradd --system .*\) or start the server as a user other than "
                                         r"root"):
        worker_account("no such user!")
