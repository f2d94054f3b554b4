"""Run a DICOM node in a process of its own, for tests that watch it from outside: its memory, its system
calls (strace), or its death (SIGKILL).

    python -m tests.unit.node_process --spool DIR --port N --destination AET@HOST:PORT [--settings J]

``--settings`` holds NodeConfig fields (``limits`` and ``access`` as objects of their fields, and
``"accept_deflate": true``). Prints ``listening <pid>`` when ready; exits 0 on SIGTERM, 3 when the node
cannot go on. The model is the threshold of :mod:`node_support`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from nnunet_triton.client.dicom import node as node_module

try:
    from . import node_support as peers
except ImportError:
    import node_support as peers


def _settings(text: str) -> dict:
    settings = json.loads(text or "{}")
    if "limits" in settings:
        from nnunet_triton.client.dicom.spool import SpoolLimits

        settings["limits"] = SpoolLimits(**settings["limits"])
    if settings.pop("accept_deflate", False):
        from nnunet_triton.client.dicom.access import DEFLATED, UNCOMPRESSED, AccessPolicy

        settings["access"] = AccessPolicy(transfer_syntaxes=(*UNCOMPRESSED, DEFLATED))
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spool", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--destination", required=True)
    parser.add_argument("--settings", default="{}")
    args = parser.parse_args(argv)
    destination = node_module.parse_destination(args.destination, calling_ae=peers.NODE_AE)
    config = peers.node_config(args.spool, destination, peers.Threshold(), port=args.port,
                               **_settings(args.settings))
    node = node_module.DicomNode(config)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    node.start()
    print(f"listening {os.getpid()}", flush=True)
    while not stopped.wait(0.2) and getattr(node, "fatal", None) is None:
        pass
    node.stop()
    return 3 if getattr(node, "fatal", None) else 0


if __name__ == "__main__":
    sys.exit(main())
