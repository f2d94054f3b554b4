"""TLS for the clients: the CA that signed the server's certificate and the client's own certificate and key.

A server exposed beyond loopback (docs/security.md) answers HTTPS through its nginx proxy and gRPC with
Triton's own SSL, and asks for a client certificate. Every client of this project (``NnunetClient``, the
CLI's ``predict``, ``validate``, ``info``, ``listen``, the perf tools) takes ``--ca``, ``--cert``, ``--key``
or, when those are not given, ``$NNUNET_TRITON_CA``, ``$NNUNET_TRITON_CERT``, ``$NNUNET_TRITON_KEY``.
``tritonclient`` is imported only when a client is made.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CA_ENV", "CERT_ENV", "KEY_ENV", "ClientTls", "add_client_tls_arguments", "client_tls",
           "triton_client"]

CA_ENV, CERT_ENV, KEY_ENV = "NNUNET_TRITON_CA", "NNUNET_TRITON_CERT", "NNUNET_TRITON_KEY"


@dataclass(frozen=True)
class ClientTls:
    """The files of a TLS client: ``ca`` verifies the server; ``cert``/``key`` authenticate the client."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def http_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``tritonclient.http.InferenceServerClient`` (server verified by ``ca``)."""
        options = {"ca_certs": str(self.ca)}
        if self.cert is not None and self.key is not None:
            options |= {"certfile": str(self.cert), "keyfile": str(self.key)}
        return {"ssl": True, "ssl_options": options}

    def grpc_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``tritonclient.grpc.InferenceServerClient`` (it reads the files itself)."""
        kwargs: dict[str, Any] = {"ssl": True, "root_certificates": str(self.ca)}
        if self.cert is not None and self.key is not None:
            kwargs |= {"certificate_chain": str(self.cert), "private_key": str(self.key)}
        return kwargs

    def perf_analyzer_args(self, protocol: str) -> list[str]:
        """perf_analyzer's SSL flags for ``protocol`` (``http`` or ``grpc``).

        Over HTTP its URL must start with ``https://``, and it reads the statistics API, which the proxy
        refuses unless the server was started with ``--proxy-allow-statistics``."""
        if protocol == "grpc":
            args = ["--ssl-grpc-use-ssl", f"--ssl-grpc-root-certifications-file={self.ca}"]
            if self.cert is not None and self.key is not None:
                args += [f"--ssl-grpc-certificate-chain-file={self.cert}",
                         f"--ssl-grpc-private-key-file={self.key}"]
            return args
        args = [f"--ssl-https-ca-certificates-file={self.ca}", "--ssl-https-verify-peer=1",
                "--ssl-https-verify-host=2"]
        if self.cert is not None and self.key is not None:
            args += [f"--ssl-https-client-certificate-file={self.cert}",
                     f"--ssl-https-private-key-file={self.key}"]
        return args


def client_tls(ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None, *,
               env: Mapping[str, str] | None = None) -> ClientTls | None:
    """The TLS files given, each flag over its environment variable; None when no CA is given anywhere.

    Raises:
        ValueError: a certificate without its key (or the reverse), a client certificate without a CA, or a
            file that does not exist (the message names the flag, the variable and the path).
    """
    env = os.environ if env is None else env
    given = {"--ca": (ca, CA_ENV), "--cert": (cert, CERT_ENV), "--key": (key, KEY_ENV)}
    paths = {flag: (Path(value) if value else Path(env[var]) if env.get(var) else None)
             for flag, (value, var) in given.items()}
    if paths["--ca"] is None:
        if paths["--cert"] is not None or paths["--key"] is not None:
            raise ValueError(f"a client certificate needs the CA that signed the server's: give --ca (or "
                             f"${CA_ENV}).")
        return None
    if (paths["--cert"] is None) != (paths["--key"] is None):
        missing = "--key" if paths["--key"] is None else "--cert"
        raise ValueError(f"{missing} (or ${given[missing][1]}) is missing: a client certificate needs "
                         f"both --cert and --key.")
    for flag, path in paths.items():
        if path is not None and not path.is_file():
            raise ValueError(f"{flag} (or ${given[flag][1]}): no such file {str(path)!r}.")
    return ClientTls(ca=paths["--ca"], cert=paths["--cert"], key=paths["--key"])  # type: ignore[arg-type]


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ca``, ``--cert``, ``--key`` (read back with ``client_tls(args.ca, args.cert, args.key)``)."""
    parser.add_argument("--ca", type=Path, default=None,
                        help=f"CA certificate of a TLS server (HTTPS proxy or gRPC SSL; default ${CA_ENV})")
    parser.add_argument("--cert", type=Path, default=None,
                        help=f"client certificate for a server asking for one (default ${CERT_ENV})")
    parser.add_argument("--key", type=Path, default=None, help=f"its private key (default ${KEY_ENV})")


def triton_client(url: str, protocol: str, timeout_s: float, tls: ClientTls | None = None) -> Any:
    """A ``tritonclient`` InferenceServerClient for ``url`` over ``protocol``; TLS with ``tls``, else with the
    environment's files (:func:`client_tls`) when ``$NNUNET_TRITON_CA`` is set."""
    tls = tls if tls is not None else client_tls()
    if protocol == "http":
        import tritonclient.http as module

        return module.InferenceServerClient(url, connection_timeout=min(timeout_s, 60.0),
                                            network_timeout=timeout_s, **(tls.http_kwargs() if tls else {}))
    if protocol == "grpc":
        import tritonclient.grpc as grpc_module

        return grpc_module.InferenceServerClient(url, **(tls.grpc_kwargs() if tls else {}))
    raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}.")
