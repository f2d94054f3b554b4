"""Real certificates for the TLS tests, made with the ``openssl`` command line in a tmp folder.

EC P-256 keys (fast to make). One CA signs the server certificate (``localhost`` and ``127.0.0.1``) and a
client certificate and a second client's; a second, unrelated CA signs a client certificate the server must
refuse.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Certificates", "make_certificates"]

_NEW_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # signed by another CA
    stranger_key: Path
    other_client_cert: Path  # a second client of the CA (the proxy's per-client limits tell them apart)
    other_client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", *_NEW_KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN={name}", cwd=cwd)


def _signed(name: str, ca: str, subject: str, cwd: Path, ext: str | None = None) -> None:
    _openssl("req", *_NEW_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={subject}", cwd=cwd)
    extra = ["-extfile", ext] if ext else []
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *extra, cwd=cwd)


def make_certificates(folder: Path) -> Certificates:
    """Write a CA, a server and a client certificate (and a stranger's) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _ca("ca", folder)
    _ca("other-ca", folder)
    _signed("server", "ca", "localhost", folder, "san.ext")
    _signed("client", "ca", "client", folder)
    _signed("stranger", "other-ca", "stranger", folder)
    _signed("other-client", "ca", "other-client", folder)
    return Certificates(ca=folder / "ca.pem", server_cert=folder / "server.pem",
                        server_key=folder / "server.key",
                        client_cert=folder / "client.pem", client_key=folder / "client.key",
                        stranger_cert=folder / "stranger.pem", stranger_key=folder / "stranger.key",
                        other_client_cert=folder / "other-client.pem",
                        other_client_key=folder / "other-client.key")
