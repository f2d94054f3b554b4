"""Who may store to the DICOM node: AE titles, hosts, TLS, storage classes and association limits.

What a PACS administrator sets for a DICOM peer, as Orthanc (``DicomCheckCalledAet``,
``DicomAlwaysAllowStore=false`` with ``DicomModalities`` and ``DicomCheckModalityHost``, ``DicomTlsEnabled``)
and MONAI Informatics Gateway (``rejectUnknownSources``) offer it:

- the called AE title must be the node's (``check_called_ae``);
- the calling AE title must be one of ``peers``, each optionally bound to the hosts it may call from (IP
  addresses or networks; names are resolved once, when the policy is made); a caller that is not listed
  is refused, unless ``accept_unknown`` says otherwise. ``accept_unknown=None`` (the default) accepts
  unknown callers only on a node without an allow-list that listens on loopback: a node reachable from
  the network stores only what known senders send;
- TLS (``tls``): the node's certificate and key, a CA bundle, and optionally client certificates the CA
  signed (``require_client_cert``);
- only the SOP classes of ``storage_classes`` (default: image storage, so no SR, SEG, RT, presentation
  states, encapsulated documents) in the transfer syntaxes of ``transfer_syntaxes`` (default: the two
  uncompressed little-endian ones; Deflate only when asked for, and then inflated with a size limit);
- at most ``max_associations`` associations at once, ``max_associations_per_host`` connections from one
  host (counted from accept, also while they have not sent their request), and an A-ASSOCIATE-RQ of at
  most ``max_association_request_bytes`` complete within ``association_request_timeout_s`` of accept
  (the TLS handshake included); see :mod:`.admission`.

:mod:`.admission` applies the host rules at accept; :meth:`AccessPolicy.refusal` decides one association
request; :mod:`.node` calls it when the A-ASSOCIATE-RQ arrives and answers with an A-ASSOCIATE-RJ (a
permanent rejection naming the calling or called AE title as not recognised, or a transient one for a host
over its limit).
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nnunet_triton.client.dicom.uids import shown
from nnunet_triton.errors import PacsError

__all__ = ["Peer", "TlsConfig", "AccessPolicy", "Refusal", "IMAGE_STORAGE_CLASSES", "UNCOMPRESSED",
           "DEFLATED", "parse_peer", "is_loopback_host"]

DEFLATED = "1.2.840.10008.1.2.1.99"
UNCOMPRESSED = ("1.2.840.10008.1.2", "1.2.840.10008.1.2.1")  # implicit / explicit VR little endian
VERIFICATION = "1.2.840.10008.1.1"
# A-ASSOCIATE-RJ (result, source, diagnostic), PS3.8 9.3.4
REJECT_CALLING_AE = (0x01, 0x01, 0x03)
REJECT_CALLED_AE = (0x01, 0x01, 0x07)
REJECT_BUSY = (0x02, 0x03, 0x02)  # transient, local limit exceeded
REJECT_UNAVAILABLE = (0x02, 0x03, 0x01)  # transient, temporary congestion


def _image_storage_classes() -> tuple[str, ...]:
    from pynetdicom.sop_class import _STORAGE_CLASSES

    return tuple(uid for name, uid in _STORAGE_CLASSES.items() if name.endswith("ImageStorage"))


IMAGE_STORAGE_CLASSES: tuple[str, ...] = _image_storage_classes()


def is_loopback_host(host: str) -> bool:
    """True for loopback listening addresses (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _networks(hosts: Sequence[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    networks = []
    for host in hosts:
        try:
            networks.append(ipaddress.ip_network(host, strict=False))
            continue
        except ValueError:
            pass
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            raise PacsError(f"allowed host {host!r}: not an IP address or network and not resolvable."
                            ) from None
        networks.extend(ipaddress.ip_network(a) for a in sorted(addresses))
    return tuple(networks)


@dataclass(frozen=True)
class Peer:
    """A sender the node accepts: AE title ``ae_title``, from ``hosts`` (IPs, networks or names; () = any)."""

    ae_title: str
    hosts: tuple[str, ...] = ()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(
        default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= len(self.ae_title) <= 16 or "\\" in self.ae_title or not self.ae_title.isprintable():
            raise PacsError(f"allowed AE title must have 1 to 16 printable characters, got "
                            f"{self.ae_title!r}.")
        object.__setattr__(self, "networks", _networks(self.hosts))

    def allows(self, host: str) -> bool:
        if not self.hosts:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.networks)


def parse_peer(text: str) -> Peer:
    """``AET`` (from any host) or ``AET@HOST[,HOST...]`` (``HOST``: an IP, a network such as
    ``10.1.0.0/16``, or a name resolved now)."""
    title, _, hosts = text.partition("@")
    return Peer(title, tuple(h for h in hosts.split(",") if h) if hosts else ())


@dataclass(frozen=True)
class TlsConfig:
    """DICOM TLS for the listener: certificate and key, ``ca_file`` to verify clients against."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise PacsError(f"TLS {name.replace('_', ' ')} {str(path)!r} does not exist.")
        if self.require_client_cert and self.ca_file is None:
            raise PacsError("TLS client certificates need a CA file to verify them against.")

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
            if self.ca_file is not None:
                context.load_verify_locations(str(self.ca_file))
        except (ssl.SSLError, OSError) as exc:
            raise PacsError(f"TLS: cannot load the certificate, key or CA ({type(exc).__name__}: "
                            f"{getattr(exc, 'reason', None) or exc.strerror or 'unreadable'}).") from None
        context.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else (
            ssl.CERT_OPTIONAL if self.ca_file is not None else ssl.CERT_NONE)
        return context


@dataclass(frozen=True)
class Refusal:
    """An A-ASSOCIATE-RJ to send: ``(result, source, diagnostic)`` and the reason for the log."""

    rsd: tuple[int, int, int]
    reason: str


@dataclass(frozen=True)
class AccessPolicy:
    """Who may store; see the module docstring."""

    peers: tuple[Peer, ...] = ()
    accept_unknown: bool | None = None
    check_called_ae: bool = True
    tls: TlsConfig | None = None
    storage_classes: tuple[str, ...] = IMAGE_STORAGE_CLASSES
    transfer_syntaxes: tuple[str, ...] = UNCOMPRESSED
    max_associations: int = 10
    max_associations_per_host: int = 4
    association_request_timeout_s: float = 10.0
    max_association_request_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if not 1 <= self.max_associations_per_host <= self.max_associations:
            raise PacsError("association limits: need 1 <= max_associations_per_host <= max_associations, "
                            f"got {self.max_associations_per_host} and {self.max_associations}.")
        if self.association_request_timeout_s <= 0 or self.max_association_request_bytes < 1024:
            raise PacsError("association request: need a timeout > 0 s and a size bound >= 1024 bytes, "
                            f"got {self.association_request_timeout_s} s and "
                            f"{self.max_association_request_bytes}.")
        if not self.storage_classes or not self.transfer_syntaxes:
            raise PacsError("the node must accept at least one storage class and one transfer syntax.")

    def accepts_unknown(self, listening_host: str) -> bool:
        """Whether a calling AE title that is not in :attr:`peers` is accepted: as set, else only by a node
        without an allow-list that listens on loopback."""
        if self.accept_unknown is not None:
            return self.accept_unknown
        return not self.peers and is_loopback_host(listening_host)

    def names_host(self, host: str) -> bool:
        """Whether an allowed sender is bound to hosts that include ``host`` (an IP address)."""
        return any(peer.hosts and peer.allows(host) for peer in self.peers)

    def any_host(self, listening_host: str) -> bool:
        """Whether a connection from any host may go on to its association request: unknown callers are
        accepted, or an allowed sender is not bound to hosts."""
        return self.accepts_unknown(listening_host) or any(not peer.hosts for peer in self.peers)

    def check_listening(self, listening_host: str) -> None:
        """Refuse a configuration that would accept no one (beyond loopback, no known sender)."""
        if not self.peers and not self.accepts_unknown(listening_host):
            raise PacsError(
                f"listening on {listening_host} (beyond loopback) the node accepts only known senders: name "
                "them with --allow AET[@HOST] (repeatable), or accept any caller explicitly with "
                "--accept-unknown-callers.")

    def refusal(self, *, own_ae: str, called_ae: str, calling_ae: str, host: str, listening_host: str,
                from_host: int) -> Refusal | None:
        """The rejection of an association request, or None to accept it.

        Args:
            own_ae: the node's AE title; ``called_ae``/``calling_ae``: the request's AE titles.
            host: the requestor's IP address; ``from_host``: its associations open now, this one included.
        """
        called, calling = called_ae.strip(), calling_ae.strip()
        if self.check_called_ae and called != own_ae:
            return Refusal(REJECT_CALLED_AE, f"called AE title {shown(called, 16)} is not this node's")
        peer = next((p for p in self.peers if p.ae_title == calling), None)
        if peer is None and not self.accepts_unknown(listening_host):
            return Refusal(REJECT_CALLING_AE,
                           f"calling AE title {shown(calling, 16)} is not an allowed sender")
        if peer is not None and not peer.allows(host):
            return Refusal(REJECT_CALLING_AE, f"calling AE title {shown(calling, 16)} is not allowed from "
                                              f"host {host}")
        if from_host > self.max_associations_per_host:
            return Refusal(REJECT_BUSY, f"host {host} has {from_host - 1} associations open, the limit is "
                                        f"{self.max_associations_per_host}")
        return None
