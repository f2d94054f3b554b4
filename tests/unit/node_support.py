"""Real DICOM peers for the node tests: a storage SCP that records what it receives (the destination) and a
sender (the PACS), both pynetdicom associations on loopback, plus a small threshold "model".

The node under test is the real :class:`~nnunet_triton.client.dicom.node.DicomNode`; only its ``segment``
callable is a threshold instead of the Triton endpoint (the endpoint is not what these tests are about; the
Orthanc + Triton tests in ``tests/triton`` cover it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pydicom

from nnunet_triton.client.dicom.node import DicomNode, NodeConfig, StoreDestination

RTSTRUCT_STORAGE = "1.2.840.10008.5.1.4.1.1.481.3"
SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"
NODE_AE = "NNUNET"
SENDER_AE = "PACS"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Destination:
    """A C-STORE SCP (AE ``DEST``) keeping every dataset it stores; ``status`` is what it answers."""

    port: int = field(default_factory=free_port)
    status: int = 0x0000
    received: list[pydicom.Dataset] = field(default_factory=list)
    server: Any = None

    @property
    def address(self) -> str:
        return f"DEST@127.0.0.1:{self.port}"

    def destination(self) -> StoreDestination:
        extra = {"timeout_s": 5.0} if "timeout_s" in StoreDestination.__dataclass_fields__ else {}
        return StoreDestination("DEST", "127.0.0.1", self.port, calling_ae=NODE_AE, **extra)

    def start(self) -> Destination:
        from pynetdicom import AE, evt

        def on_store(event: Any) -> int:
            if self.status == 0x0000:
                ds = event.dataset
                ds.file_meta = event.file_meta
                self.received.append(ds)
            return self.status

        ae = AE(ae_title="DEST")
        ae.add_supported_context(SEG_STORAGE)
        ae.add_supported_context(RTSTRUCT_STORAGE)  # a node whose output is rtstruct or both
        self.server = ae.start_server(("127.0.0.1", self.port), block=False,
                                      evt_handlers=[(evt.EVT_C_STORE, on_store)])
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None

    def wait(self, count: int = 1, timeout_s: float = 30.0) -> list[pydicom.Dataset]:
        wait_for(lambda: len(self.received) >= count, timeout_s)
        return self.received


def wait_for(condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def associate(port: int, *, called: str = NODE_AE, calling: str = SENDER_AE, contexts: Sequence[tuple] = (),
              tls: Any = None, timeout_s: float = 10.0) -> Any:
    """An association to the node (established or not: the caller looks)."""
    from pynetdicom import AE

    ae = AE(ae_title=calling)
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = timeout_s
    for sop_class, syntax in contexts:
        ae.add_requested_context(sop_class, syntax)
    if not contexts:
        ae.add_requested_context("1.2.840.10008.5.1.4.1.1.2")  # CT Image Storage
    return ae.associate("127.0.0.1", port, ae_title=called, tls_args=tls)


def send(port: int, files: Sequence[Path], **kwargs: Any) -> list[int]:
    """C-STORE ``files`` over one association; the statuses (-1: no answer). Raises when refused."""
    datasets = [pydicom.dcmread(p) for p in files]
    contexts = sorted({(str(ds.SOPClassUID), str(ds.file_meta.TransferSyntaxUID)) for ds in datasets})
    assoc = associate(port, contexts=contexts, **kwargs)
    if not assoc.is_established:
        raise ConnectionRefusedError(f"association refused or aborted (rejected={assoc.is_rejected})")
    try:
        statuses = []
        for ds in datasets:
            status = assoc.send_c_store(ds)
            statuses.append(int(status.Status) if status else -1)
        return statuses
    finally:
        if assoc.is_established:
            assoc.release()


class Threshold:
    """The "model": voxels above ``level`` are label 1; counts its calls (inference runs)."""

    def __init__(self, level: float = 0.0) -> None:
        self.level = level
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, volume: Any) -> np.ndarray:
        with self._lock:
            self.calls.append(volume.series_instance_uid)
        return (volume.data > self.level).astype(np.uint8)


def node_config(spool: Path, destination: Destination | StoreDestination, model: Any, **overrides: Any
                ) -> NodeConfig:
    """A node with short timings: idle 0.3 s, retries 0.1 s doubling to 0.4 s, polls of 50 ms.

    Settings the :class:`NodeConfig` in use does not have are left out, so the same tests can be run
    against an older node (to see them fail there for the behaviour they test, not for a TypeError).
    """
    target = destination.destination() if isinstance(destination, Destination) else destination
    config: dict[str, Any] = dict(
        ae_title=NODE_AE, port=free_port(), spool=spool, destination=target, segment=model,
        idle_timeout_s=0.3, retry_delay_s=0.1, max_retry_delay_s=0.4, poll_s=0.05, heartbeat_s=0.2,
        rescan_s=0.2, network_timeout_s=10)
    if "models" in overrides:  # several models (one per endpoint name): no single segment callable
        config["segment"] = None
    config.update(overrides)
    known = set(NodeConfig.__dataclass_fields__)
    return NodeConfig(**{k: v for k, v in config.items() if k in known})


def threshold_models(*names: str) -> tuple[dict[str, Any], dict[str, Threshold]]:
    """One threshold "model" per endpoint name, each counting its own calls: the ``NodeConfig.models``
    (name -> NodeModel) and the thresholds to look at (name -> Threshold)."""
    from nnunet_triton.client.dicom.node import NodeModel

    thresholds = {name: Threshold() for name in names}
    return {name: NodeModel(t) for name, t in thresholds.items()}, thresholds


def running(config: NodeConfig) -> DicomNode:
    node = DicomNode(config)
    node.start()
    return node


def make_certificates(folder: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate in ``folder``, made with openssl
    (the test is skipped without it)."""
    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA",
            "-keyout", "ca.key", "-out", "ca.pem")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.pem")
    return folder


def tls_client(certificates: Path, *, with_cert: bool = True) -> Any:
    """A client TLS context trusting the test CA, with the client certificate unless ``with_cert``
    is False."""
    import ssl

    context = ssl.create_default_context(cafile=str(certificates / "ca.pem"))
    if with_cert:
        context.load_cert_chain(str(certificates / "client.pem"), str(certificates / "client.key"))
    return context


def connect_from(host: str, port: int) -> socket.socket:
    """A raw TCP connection to the node on loopback from the source address ``host`` (127.0.0.x plays
    another machine)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(host, 0))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the node closed ``sock`` (reads until end of stream; False while it stays open)."""
    sock.settimeout(0.05)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True
