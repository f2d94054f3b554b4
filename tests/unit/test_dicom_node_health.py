"""The DICOM node's worker liveness: an endpoint that accepts a request and never answers (the "model"
blocks until the test lets it go) makes the node degraded past ``max_busy_s``, ``node-status`` exits 1,
and instances of new series are not acknowledged; once the request ends, everything is back."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from nnunet_triton import cli
from nnunet_triton.client.dicom.node import read_status

try:
    from . import dicom_support as support
    from . import node_support as peers
except ImportError:  # run from tests/unit without package context
    import dicom_support as support
    import node_support as peers


class HungEndpoint(peers.Threshold):
    """The threshold model, which blocks in its first request until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def __call__(self, volume) -> np.ndarray:
        if not self.calls:
            self.release.wait(60)
        return super().__call__(volume)


@pytest.fixture
def dest():
    destination = peers.Destination().start()
    yield destination
    destination.stop()


def test_a_worker_stuck_past_max_busy_makes_the_node_degraded_and_refuses_new_series(tmp_path, dest):
    model = HungEndpoint()
    node = peers.running(peers.node_config(tmp_path / "spool", dest, model, max_busy_s=1.0))
    first = support.write_ct_series(tmp_path / "first", n_slices=2)
    second = support.write_ct_series(tmp_path / "second", n_slices=2, seed=1)
    status_cmd = ["node-status", "--spool", str(tmp_path / "spool")]
    try:
        assert peers.send(node.config.port, first.files) == [0, 0]
        peers.wait_for(lambda: not read_status(tmp_path / "spool")[0], what="the node reported unhealthy")
        healthy, status = read_status(tmp_path / "spool")
        refused = peers.send(node.config.port, second.files)
        exit_code = cli.main(status_cmd)
    finally:
        model.release.set()
    peers.wait_for(lambda: read_status(tmp_path / "spool")[0], what="the node healthy again")
    accepted = peers.send(node.config.port, second.files)
    dest.wait(2)
    node.stop()

    assert (status["state"], status["worker_stuck"], status["busy_series"]) == ("degraded", True,
                                                                               first.series_uid)
    assert f"busy with series {first.series_uid}" in status["reason"] and "max_busy_s=1" in status["reason"]
    assert exit_code == 1
    assert refused == [0xA700, 0xA700] and accepted == [0, 0]


def test_an_endpoint_that_accepts_and_never_answers_is_not_ready_in_the_nodes_status(tmp_path, dest):
    import socket

    from nnunet_triton.client.client import NnunetClient
    from nnunet_triton.client.dicom.node import NodeModel

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # the kernel completes the connections; nobody ever reads or answers
    probe = NnunetClient(f"127.0.0.1:{hung.getsockname()[1]}", "http", timeout_s=1.0)
    models = {"nnunet": NodeModel(peers.Threshold(), ready=probe.check_ready)}
    node = peers.running(peers.node_config(tmp_path / "spool", dest, None, models=models,
                                           endpoint_check_s=0.5))
    try:
        peers.wait_for(lambda: node.status()["endpoints"].get("nnunet", "").startswith("not ready"),
                       what="the endpoint reported not ready")
        status = node.status()
    finally:
        node.stop()
        probe.close()
        hung.close()

    assert status["state"] == "degraded"
    assert "endpoint nnunet is not ready (ServerNotRunningError: Triton server at http://127.0.0.1:" in \
        status["reason"]
