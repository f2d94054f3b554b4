"""Connection admission of the DICOM node under attack: half-open connections from other hosts (extra
loopback addresses play other machines), an idle connection before a TLS handshake, an oversized
association request. The allowed PACS is a real pynetdicom association throughout."""

from __future__ import annotations

import logging
import socket
import struct

import pytest

from nnunet_triton.client.dicom.access import AccessPolicy, Peer, TlsConfig

try:
    from . import dicom_support as support
    from . import node_support as peers
except ImportError:  # run from tests/unit without package context
    import dicom_support as support
    import node_support as peers

ATTACKERS = [f"127.0.0.{n}" for n in range(2, 12)]
REQUEST_200_MIB = struct.pack(">BBL", 0x01, 0, 200 * 2**20)  # an A-ASSOCIATE-RQ header announcing 200 MiB


@pytest.fixture
def dest():
    destination = peers.Destination().start()
    yield destination
    destination.stop()


@pytest.fixture
def node_factory(tmp_path, dest):
    started = []

    def make(**overrides):
        node = peers.running(peers.node_config(tmp_path / "spool", dest, peers.Threshold(), **overrides))
        started.append(node)
        return node

    yield make
    for node in started:
        node.stop()


def _half_open(host: str, port: int) -> socket.socket:
    """A connection that sends two bytes of a PDU header and waits (the issue's starvation attack)."""
    sock = peers.connect_from(host, port)
    sock.sendall(b"\x01\x00")
    return sock


def test_half_open_connections_of_unknown_hosts_cannot_keep_the_allowed_pacs_from_associating(
        node_factory, tmp_path, dest, caplog):
    caplog.set_level(logging.WARNING, logger="nnunet_triton")
    access = AccessPolicy(peers=(Peer("PACS", ("127.0.0.1",)), Peer("ROAMING")),  # ROAMING: any host
                          association_request_timeout_s=2.0)
    node = node_factory(access=access)
    port = node.config.port
    attack = [_half_open(ATTACKERS[0], port) for _ in range(10)]  # one host, ten connections
    attack += [_half_open(host, port) for host in ATTACKERS[1:]]  # nine more hosts, one each
    series = support.write_ct_series(tmp_path / "ct", n_slices=3)

    assert peers.send(port, series.files, timeout_s=5) == [0, 0, 0]
    assert dest.wait(1)[0].ReferencedSeriesSequence[0].SeriesInstanceUID == series.series_uid
    # past the deadline the node has closed every one of them; the first host got no more than its limit
    peers.wait_for(lambda: all(peers.closed_by_peer(s) for s in attack), timeout_s=20,
                   what="the attackers closed")
    assert "has 4 connections open, the limit is max_associations_per_host=4" in caplog.text
    assert "no complete A-ASSOCIATE-RQ within association_request_timeout_s=2" in caplog.text
    for sock in attack:
        sock.close()


def test_an_idle_connection_does_not_hold_up_another_clients_tls_handshake(node_factory, tmp_path,
                                                                          tmp_path_factory):
    certificates = peers.make_certificates(tmp_path_factory.mktemp("tls"))
    tls = TlsConfig(certificates / "server.pem", certificates / "server.key", certificates / "ca.pem",
                    require_client_cert=True)
    node = node_factory(access=AccessPolicy(tls=tls))
    idle = peers.connect_from("127.0.0.2", node.config.port)  # connects, never says a word
    series = support.write_ct_series(tmp_path / "ct", n_slices=2)
    try:
        client = (peers.tls_client(certificates), "127.0.0.1")
        statuses = peers.send(node.config.port, series.files, tls=client, timeout_s=5)
    finally:
        idle.close()
    assert statuses == [0, 0]


def _push(sock: socket.socket, limit: int) -> int:
    """Send the 200 MiB request's header and up to ``limit`` bytes of body; the bytes the node took."""
    sent = 0
    chunk = b"\x00" * (1 << 20)
    try:
        sock.sendall(REQUEST_200_MIB)
        while sent < limit:
            sent += sock.send(chunk)
    except OSError:  # refused: reset or closed by the node
        pass
    return sent


@pytest.mark.parametrize(("host", "reason"), [
    ("127.0.0.2", "not the host of any allowed sender"),
    ("127.0.0.1", "its A-ASSOCIATE-RQ has 209715200 bytes, more than max_association_request_bytes=65536"),
])
def test_a_200_mib_association_request_is_refused_before_its_body_is_read(node_factory, host, reason, caplog):
    caplog.set_level(logging.WARNING, logger="nnunet_triton")
    node = node_factory(access=AccessPolicy(peers=(Peer("PACS", ("127.0.0.1",)),)))
    sock = peers.connect_from(host, node.config.port)
    sock.settimeout(10)
    try:
        sent = _push(sock, 200 * 2**20)
    finally:
        sock.close()

    assert sent < 32 * 2**20  # what the socket buffers hold, not the 200 MiB
    assert reason in caplog.text
    assert peers.associate(node.config.port, calling="PACS").is_established


def test_a_connection_refused_at_accept_gets_its_rejection_after_its_request_not_before(node_factory):
    """A connection over its host's limit is refused at accept; its A-ASSOCIATE-RJ used to go out at once,
    before the peer had sent its A-ASSOCIATE-RQ. A requestor may not take that as the answer: pynetdicom's
    then found its connection closed before it looked for one and reported an abort, not "busy" (about
    one association in ten on a loaded machine). Now the RJ answers the request (and a connection that
    says nothing gets it after REFUSE_WAIT_S); the accept loop waits for neither."""
    from nnunet_triton.client.dicom import admission

    refuse_wait_s = getattr(admission, "REFUSE_WAIT_S", 1.0)  # (getattr: the test runs on the old node too)
    node = node_factory(access=AccessPolicy(max_associations_per_host=1))
    port = node.config.port
    holder = peers.connect_from("127.0.0.1", port)  # the host's one slot, counted from accept
    refused, silent = peers.connect_from("127.0.0.1", port), peers.connect_from("127.0.0.1", port)
    try:
        refused.settimeout(0.5)
        with pytest.raises(TimeoutError):
            refused.recv(16)  # nothing before its request
        refused.settimeout(10)
        refused.sendall(struct.pack(">BBL", 0x01, 0, 68) + b"\x00" * 68)  # an A-ASSOCIATE-RQ's size
        answer = refused.recv(16)
        assert struct.unpack(">BBLBBBB", answer) == (0x03, 0, 4, 0, 0x02, 0x03, 0x02)  # RJ: transient, busy
        peers.wait_for(lambda: peers.closed_by_peer(refused), timeout_s=5, what="the refused one closed")
        # the one that says nothing: answered and closed after REFUSE_WAIT_S
        peers.wait_for(lambda: peers.closed_by_peer(silent), timeout_s=refuse_wait_s + 5,
                       what="the silent refused connection closed")
    finally:
        for sock in (holder, refused, silent):
            sock.close()
