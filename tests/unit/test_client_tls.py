"""client.tls: which TLS files a client uses (flags over environment), the errors naming what is missing, and
the arguments tritonclient and perf_analyzer get (tests/triton/test_tls_proxy.py connects for real)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nnunet_triton.cli import parser
from nnunet_triton.cli.common import connection_tls
from nnunet_triton.client.tls import CA_ENV, CERT_ENV, KEY_ENV, ClientTls, client_tls
from tools.perf import analyzer


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key", "other-ca")}
    for path in paths.values():
        path.write_text("PEM\n")
    return paths


def test_client_tls_is_none_without_a_ca() -> None:
    assert client_tls(env={}) is None


def test_client_tls_takes_the_flags_over_the_environment(files: dict[str, Path]) -> None:
    env = {CA_ENV: str(files["other-ca"]), CERT_ENV: str(files["cert"]), KEY_ENV: str(files["key"])}
    assert client_tls(files["ca"], env=env) == ClientTls(files["ca"], files["cert"], files["key"])
    assert client_tls(env=env) == ClientTls(files["other-ca"], files["cert"], files["key"])


@pytest.mark.parametrize(("given", "message"), [
    ({"cert": "cert", "key": "key"}, r"a client certificate needs the CA that signed the server's"),
    ({"ca": "ca", "cert": "cert"}, r"--key \(or \$NNUNET_TRITON_KEY\) is missing"),
    ({"ca": "ca", "key": "key"}, r"--cert \(or \$NNUNET_TRITON_CERT\) is missing"),
    ({"ca": "missing"}, r"--ca \(or \$NNUNET_TRITON_CA\): no such file '.*missing.pem'"),
])
def test_client_tls_names_the_missing_piece(files: dict[str, Path], tmp_path: Path, given: dict[str, str],
                                            message: str) -> None:
    paths = {flag: files.get(name, tmp_path / f"{name}.pem") for flag, name in given.items()}
    with pytest.raises(ValueError, match=message):
        client_tls(**paths, env={})


def test_tritonclient_arguments_verify_the_server_and_present_the_client_certificate(
        files: dict[str, Path]) -> None:
    tls = ClientTls(files["ca"], files["cert"], files["key"])
    assert tls.http_kwargs() == {"ssl": True, "ssl_options": {
        "ca_certs": str(files["ca"]), "certfile": str(files["cert"]), "keyfile": str(files["key"])}}
    assert tls.grpc_kwargs() == {"ssl": True, "root_certificates": str(files["ca"]),
                                 "certificate_chain": str(files["cert"]), "private_key": str(files["key"])}


def test_client_commands_take_ca_cert_and_key(files: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (CA_ENV, CERT_ENV, KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for command in (["predict", "-i", "in", "-o", "out"], ["info"],
                    ["validate", "--input", "i", "--against", "r"],
                    ["listen", "--spool", "s", "--destination", "A@h:1"]):
        args = parser().parse_args([*command, "--ca", str(files["ca"]), "--cert", str(files["cert"]),
                                    "--key", str(files["key"])])
        assert connection_tls(args) == ClientTls(files["ca"], files["cert"], files["key"]), command


@pytest.mark.parametrize(("protocol", "url", "expected"), [
    ("http", "https://h:8443", ["--ssl-https-ca-certificates-file={ca}", "--ssl-https-verify-peer=1",
                                "--ssl-https-verify-host=2", "--ssl-https-client-certificate-file={cert}",
                                "--ssl-https-private-key-file={key}"]),
    ("grpc", "h:8443", ["--ssl-grpc-use-ssl", "--ssl-grpc-root-certifications-file={ca}",
                        "--ssl-grpc-certificate-chain-file={cert}", "--ssl-grpc-private-key-file={key}"]),
])
def test_perf_analyzer_gets_the_ssl_flags_and_an_https_url(
        files: dict[str, Path], tmp_path: Path, protocol: str, url: str, expected: list[str]) -> None:
    settings = analyzer.AnalyzerSettings(model="nnunet", url="h:8443", protocol=protocol,
                                         input_data=tmp_path / "in.json", concurrency=1,
                                         measurement_request_count=1,
                                         tls=ClientTls(files["ca"], files["cert"], files["key"]))
    command = analyzer.command(settings, tmp_path / "o.csv", binary=Path("pa"))
    assert command[command.index("-u") + 1] == url
    assert command[-len(expected):] == [e.format(**{k: files[k] for k in ("ca", "cert", "key")})
                                        for e in expected]
