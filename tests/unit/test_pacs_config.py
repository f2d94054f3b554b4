"""DICOMweb locations, credentials and node destinations: parsed, validated, secrets kept out of reprs."""

from __future__ import annotations

import pytest

from nnunet_triton.client.dicom.node import (
    DicomWebDestination,
    NodeConfig,
    StoreDestination,
    parse_destination,
)
from nnunet_triton.client.dicom.web import DicomWebAuth, DicomWebLocation, is_dicomweb
from nnunet_triton.errors import ClientError, PacsError


@pytest.mark.parametrize(("text", "url"), [
    ("dicomweb://pacs:8042/dicom-web", "http://pacs:8042/dicom-web"),
    ("dicomwebs://pacs.hospital.org/wado/rs/", "https://pacs.hospital.org/wado/rs"),
    ("DICOMWEB://10.0.0.5:80/", "http://10.0.0.5:80"),
])
def test_dicomweb_location_maps_to_the_http_root(text, url):
    assert is_dicomweb(text)
    assert DicomWebLocation.parse(text, allow_http=True).url == url  # plain http beyond loopback: opt-in


@pytest.mark.parametrize("text", ["http://pacs/dicom-web", "dicomweb:///dicom-web", "pacs:8042"])
def test_dicomweb_location_refuses_other_schemes_and_no_host(text):
    with pytest.raises(PacsError, match="must look like dicomweb://HOST"):
        DicomWebLocation.parse(text)


def test_dicomweb_auth_refuses_ambiguous_or_half_credentials_and_hides_secrets(tmp_path, monkeypatch):
    with pytest.raises(PacsError, match="either a user and password or a bearer token"):
        DicomWebAuth(user="u", password="p", token="t")
    with pytest.raises(PacsError, match="needs both a user and a password"):
        DicomWebAuth(user="u")
    with pytest.raises(PacsError, match="CA file .* does not exist"):
        DicomWebAuth(ca_file=tmp_path / "missing.pem")
    monkeypatch.setenv("NNUNET_TRITON_DICOMWEB_TOKEN", "s3cr3t-token")
    auth = DicomWebAuth.from_env()
    assert auth.token == "s3cr3t-token" and "s3cr3t" not in repr(auth)
    assert "hunter2" not in repr(DicomWebAuth(user="u", password="hunter2"))
    assert issubclass(PacsError, ClientError)  # the CLI reports it as a server-side problem (exit 2)


def test_destination_is_a_store_scp_or_a_dicomweb_service():
    assert parse_destination("ORTHANC@pacs:4242", calling_ae="NNUNET") == StoreDestination(
        "ORTHANC", "pacs", 4242, calling_ae="NNUNET")
    assert isinstance(parse_destination("dicomwebs://pacs:8042/dicom-web"), DicomWebDestination)
    for bad in ("ORTHANC@pacs", "pacs:4242", "A_TITLE_LONGER_THAN_16@pacs:4242"):
        with pytest.raises(PacsError, match="AET@HOST:PORT"):
            parse_destination(bad)


def test_node_config_refuses_a_bad_ae_title_or_timing(tmp_path):
    base = dict(port=11112, spool=tmp_path, destination=parse_destination("PACS@h:104"), segment=lambda v: v)
    with pytest.raises(PacsError, match="AE title must have 1 to 16 characters"):
        NodeConfig(ae_title="X" * 17, **base)
    with pytest.raises(PacsError, match="idle timeout must be > 0"):
        NodeConfig(ae_title="NNUNET", idle_timeout_s=0, **base)


def test_allowed_senders_parse_with_hosts_and_networks_and_match_only_those():
    from nnunet_triton.client.dicom.access import Peer, parse_peer

    peer = parse_peer("ORTHANC@10.1.0.0/16,127.0.0.1")
    assert (peer.ae_title, peer.hosts) == ("ORTHANC", ("10.1.0.0/16", "127.0.0.1"))
    assert peer.allows("10.1.2.3") and peer.allows("127.0.0.1") and not peer.allows("10.2.0.1")
    assert parse_peer("CT1") == Peer("CT1") and Peer("CT1").allows("192.0.2.7")
    with pytest.raises(PacsError, match="allowed AE title must have 1 to 16 printable characters"):
        parse_peer("A_TITLE_LONGER_THAN_16")
    with pytest.raises(PacsError, match="not an IP address or network and not resolvable"):
        parse_peer("PACS@no-such-host.invalid")


def test_listen_sizes_and_durations_take_units():
    from nnunet_triton.cli.listen import parse_bytes, parse_duration

    sizes = [parse_bytes(t) for t in ("1048576", "512M", "50G", "1.5K")]
    assert sizes == [2**20, 512 * 2**20, 50 * 2**30, 1536]
    assert [parse_duration(t) for t in ("90", "90s", "30m", "24h", "7d")] == [90, 90, 1800, 86400, 604800]
    with pytest.raises(Exception, match="a size such as"):
        parse_bytes("lots")


def test_access_policy_refuses_limits_that_cannot_work_and_tls_without_its_files(tmp_path):
    from nnunet_triton.client.dicom.access import AccessPolicy, TlsConfig

    with pytest.raises(PacsError, match="max_associations_per_host <= max_associations"):
        AccessPolicy(max_associations=2, max_associations_per_host=3)
    with pytest.raises(PacsError, match="TLS cert file .* does not exist"):
        TlsConfig(tmp_path / "cert.pem", tmp_path / "key.pem")
    (tmp_path / "cert.pem").write_text("x")
    (tmp_path / "key.pem").write_text("x")
    with pytest.raises(PacsError, match="client certificates need a CA file"):
        TlsConfig(tmp_path / "cert.pem", tmp_path / "key.pem", require_client_cert=True)


def test_listen_beyond_loopback_without_known_senders_refuses_to_start_before_contacting_anything(
        tmp_path, capsys):
    from nnunet_triton import cli

    code = cli.main(["listen", "--spool", str(tmp_path / "spool"), "--destination", "PACS@127.0.0.1:104",
                     "--host", "0.0.0.0", "--url", "127.0.0.1:1"])
    assert code == 2
    assert "the node accepts only known senders: name them with --allow" in capsys.readouterr().err
    assert not (tmp_path / "spool").exists()
