"""What the TLS proxy costs a request: the identity model called straight over HTTP vs through the nginx proxy
(HTTPS, client certificate, body buffered whole), for request bodies of a few sizes.

    python -m tools.perf.proxy_overhead [--sizes-mib 1 64 256] [--repeats 5]   (from the checkout root)

One embedded server (the test suite's identity model) with TLS on loopback; certificates made with openssl
in a temporary folder. Each request sends one FP32 tensor of the given size and asks for a tiny output back,
so the time is the upload path (where the proxy buffers). Prints a Markdown table of medians and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.options import DEFAULT_CLIENT_TIMEOUT_S


def _request_seconds(client: Any, array: np.ndarray, repeats: int) -> float:
    import tritonclient.http as httpclient

    inputs = [httpclient.InferInput("INPUT_FP32", list(array.shape), "FP32"),
              httpclient.InferInput("INPUT_INT16", [1, 1, 1], "INT16")]
    inputs[0].set_data_from_numpy(array, binary_data=True)
    inputs[1].set_data_from_numpy(np.zeros((1, 1, 1), np.int16), binary_data=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT_INT16", binary_data=True)]
    client.infer("identity", inputs, outputs=outputs)  # warm-up (connection, stub)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        client.infer("identity", inputs, outputs=outputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import tritonclient.http as httpclient

    from nnunet_triton.client.tls import ClientTls
    from nnunet_triton.server import embedded
    from nnunet_triton.server.proxy import TlsSettings
    from tests.conftest import write_identity_repository
    from tests.tls_support import make_certificates

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        certs = make_certificates(root / "certs")
        repo = write_identity_repository(root / "repo")
        tls = TlsSettings(cert=certs.server_cert, key=certs.server_key, client_ca=certs.ca)
        run = root / "run"
        handle = embedded.start(repo, log_file=run / "tritonserver.log", pid_file=run / "pid",
                                state_file=run / "server.json", recovery=False, tls=tls)
        try:
            assert handle.proxy_url is not None
            direct = httpclient.InferenceServerClient(handle.http_url,
                                                     network_timeout=DEFAULT_CLIENT_TIMEOUT_S)
            proxied = httpclient.InferenceServerClient(
                handle.proxy_url, network_timeout=DEFAULT_CLIENT_TIMEOUT_S,
                **ClientTls(certs.ca, certs.client_cert, certs.client_key).http_kwargs())
            print("| request body | straight to Triton (HTTP) | through the proxy (HTTPS, buffered) "
                  "| ratio |")
            print("|---|---|---|---|")
            for mib in args.sizes_mib:
                array = np.zeros((1, 1, mib * 2**18), np.float32)  # mib MiB of FP32
                plain = _request_seconds(direct, array, args.repeats)
                tls_s = _request_seconds(proxied, array, args.repeats)
                print(f"| {mib} MiB | {plain:.3f} s | {tls_s:.3f} s | {tls_s / plain:.2f} |")
            direct.close()
            proxied.close()
        finally:
            handle.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
