"""Connection admission for the DICOM node: what happens to a TCP connection before any DICOM is parsed.

pynetdicom's server accepts every connection, wraps it in TLS inside its accept loop and gives it an
association slot while it waits, without a read timeout, for the A-ASSOCIATE-RQ: one idle connection
blocks every TLS handshake, and a few connections that send two bytes hold every slot. The node's server
(:class:`AdmittingServer`) decides instead, in this order:

1. **At accept** (the accept loop, no read): the peer's address must be allowed when every allowed sender
   of the :class:`~.access.AccessPolicy` is bound to hosts (``--allow AET@HOST``); a host may hold at
   most ``max_associations_per_host`` connections at once (waiting ones included), and hosts that no
   sender names share ``max_pending`` connections that have not yet sent their request. A refused
   connection is handed to one refusing thread, which waits (at most ``REFUSE_WAIT_S``) for its
   A-ASSOCIATE-RQ, discards it unread (at most 256 KiB), answers an A-ASSOCIATE-RJ (transient for a
   limit) and closes it.
2. **In the connection's own thread**, within ``association_request_timeout_s`` together: the TLS
   handshake, then the whole A-ASSOCIATE-RQ PDU (at most ``max_association_request_bytes``; a longer
   one is refused from its 6-byte header, before its body is read). Past the deadline the connection is
   closed and logged.
3. Only then does pynetdicom see the connection, with the request bytes replayed to it, and every read
   bounded by the node's network timeout; the calling AE title, called AE title and per-host
   association limit are then checked on the request (:meth:`~.access.AccessPolicy.refusal`).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from pynetdicom.transport import AssociationSocket, RequestHandler, ThreadedAssociationServer

from nnunet_triton.client.dicom.access import REJECT_BUSY, REJECT_CALLING_AE, AccessPolicy

__all__ = ["Admission", "AdmittingServer"]

LOGGER = logging.getLogger("nnunet_triton.client.dicom.node")  # one logger for the node's story
A_ASSOCIATE_RQ, A_ASSOCIATE_RJ = 0x01, 0x03
PDU_HEADER = 6
REFUSAL_LOG_INTERVAL_S = 30.0  # a host refused again and again is logged once per interval
REFUSE_WAIT_S = 1.0  # a connection refused at accept: how long its A-ASSOCIATE-RQ is waited for
MAX_REFUSING = 256  # refused connections waiting for their request at once; beyond that, answered at once
DISCARDED_BYTES = 4 * 65536  # what a refused connection sent that is read and discarded before its RJ


@dataclass
class _Connection:
    host: str
    sock: Any  # the socket as it is now (the TLS socket once wrapped)
    pending: bool = True  # its A-ASSOCIATE-RQ has not been read yet

    @property
    def closed(self) -> bool:
        try:
            return bool(self.sock.fileno() == -1)
        except OSError:
            return True


class Admission:
    """The admission rules of one listening node (see the module docstring); thread-safe."""

    def __init__(self, policy: AccessPolicy, *, listening_host: str, network_timeout_s: float,
                 ssl_context: ssl.SSLContext | None) -> None:
        self.policy = policy
        self.listening_host = listening_host
        self.network_timeout_s = network_timeout_s
        self.ssl_context = ssl_context
        self.max_pending = 8 * policy.max_associations
        self._lock = threading.Lock()
        self._open: dict[int, _Connection] = {}  # id(raw socket) -> connection
        self._refuser = _Refuser()
        self._logged: dict[str, tuple[float, int]] = {}  # host -> (last logged, refusals since)

    def _prune(self) -> None:
        for key in [k for k, c in self._open.items() if c.closed]:
            del self._open[key]

    def connections(self, host: str | None = None) -> int:
        """Open connections (from ``host``, or in all)."""
        with self._lock:
            self._prune()
            return sum(1 for c in self._open.values() if host is None or c.host == host)

    def accept(self, sock: socket.socket, host: str) -> bool:
        """At accept, before reading: whether the connection from ``host`` may go on (it is counted)."""
        policy = self.policy
        named = policy.names_host(host)
        if not named and not policy.any_host(self.listening_host):
            return self._refuse(sock, host, "not the host of any allowed sender (--allow AET@HOST)",
                                REJECT_CALLING_AE)
        with self._lock:
            self._prune()
            from_host = sum(1 for c in self._open.values() if c.host == host)
            pending = sum(1 for c in self._open.values() if c.pending and not policy.names_host(c.host))
            if from_host >= policy.max_associations_per_host:
                reason = (f"it has {from_host} connections open, the limit is max_associations_per_host="
                          f"{policy.max_associations_per_host}")
            elif not named and pending >= self.max_pending:
                reason = (f"{pending} connections of hosts no sender names are waiting, the limit is "
                          f"{self.max_pending}")
            else:
                self._open[id(sock)] = _Connection(host, sock)
                return True
        return self._refuse(sock, host, reason, REJECT_BUSY)

    def _refuse(self, sock: socket.socket, host: str, reason: str, rsd: tuple[int, int, int]) -> bool:
        """Hand the connection to the refusing thread, which answers its A-ASSOCIATE-RJ once its request
        has arrived and closes it; when too many wait there, answer it at once (without waiting: the
        accept loop never blocks on a peer) and let the server close it."""
        if not self._refuser.take(sock, rsd):
            _answer(sock, rsd)
        now = time.monotonic()
        with self._lock:
            last, since = self._logged.get(host, (-REFUSAL_LOG_INTERVAL_S, 0))
            log = now - last >= REFUSAL_LOG_INTERVAL_S
            self._logged[host] = (now, 0) if log else (last, since + 1)
            if len(self._logged) > 4096:  # many hosts: forget the quiet ones
                self._logged = {h: v for h, v in self._logged.items() if now - v[0] < REFUSAL_LOG_INTERVAL_S}
        if log:
            more = f" ({since} more refusals since the last message)" if since else ""
            LOGGER.warning("refused a connection from %s at accept: %s%s", host, reason, more)
        return False

    def admit(self, raw: socket.socket, host: str) -> tuple[Any, bytes] | None:
        """In the connection's thread: the TLS handshake and the whole A-ASSOCIATE-RQ within the deadline.

        Returns:
            the socket to associate over (TLS-wrapped when the node uses TLS) and the request's bytes, or
            None when the connection was refused (it is closed then, and logged).
        """
        with self._lock:
            connection = self._open.get(id(raw)) or _Connection(host, raw)
        timeout = self.policy.association_request_timeout_s
        deadline = time.monotonic() + timeout
        sock: Any = raw
        try:
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                connection.sock = sock
                sock.settimeout(timeout)
                sock.do_handshake()
            head = _read(sock, PDU_HEADER, deadline)
            pdu_type, _, length = struct.unpack(">BBL", head)
            limit = self.policy.max_association_request_bytes
            if pdu_type != A_ASSOCIATE_RQ:
                return self._close(sock, host, f"its first PDU is of type 0x{pdu_type:02X}, not an "
                                               "A-ASSOCIATE-RQ")
            if length > limit:
                return self._close(sock, host, f"its A-ASSOCIATE-RQ has {length} bytes, more than "
                                               f"max_association_request_bytes={limit}")
            body = _read(sock, length, deadline)
        except TimeoutError:
            what = "TLS handshake and " if self.ssl_context is not None else ""
            return self._close(sock, host, f"no complete {what}A-ASSOCIATE-RQ within "
                                           f"association_request_timeout_s={timeout:g}")
        except ssl.SSLError as exc:
            return self._close(sock, host, f"TLS handshake failed ({exc.reason or type(exc).__name__})")
        except OSError as exc:
            return self._close(sock, host, f"the connection ended before its A-ASSOCIATE-RQ "
                                           f"({type(exc).__name__})")
        sock.settimeout(self.network_timeout_s)  # every later read is bounded too
        connection.pending = False
        return sock, head + body

    def refusing(self, sock: socket.socket) -> bool:
        """Whether the refusing thread answers and closes ``sock`` (a connection refused at accept): then
        the server must not close it (once per connection: the server asks once)."""
        return self._refuser.handed(sock)

    def _close(self, sock: Any, host: str, reason: str) -> None:
        LOGGER.warning("refused a connection from %s: %s", host, reason)
        try:
            sock.close()
        except OSError:
            pass
        return None


def _answer(sock: socket.socket, rsd: tuple[int, int, int]) -> None:
    """Read and discard what the peer sent so far (its A-ASSOCIATE-RQ; at most ``DISCARDED_BYTES``, without
    waiting), then send the A-ASSOCIATE-RJ (dropped when it would block). Closing a socket with unread bytes
    sends a reset instead of a FIN."""
    try:
        sock.setblocking(False)
        for _ in range(DISCARDED_BYTES // 65536):
            if not sock.recv(65536):
                break
    except OSError:  # nothing (more) to read now, or the peer is gone
        pass
    with contextlib.suppress(OSError):
        sock.send(struct.pack(">BBLBBBB", A_ASSOCIATE_RJ, 0, 4, 0, *rsd))


class _Refuser:
    """The connections refused at accept, answered off the accept loop: each gets its A-ASSOCIATE-RJ once
    its A-ASSOCIATE-RQ (or anything) has arrived, at most ``REFUSE_WAIT_S`` after accept, and is closed.

    An RJ sent before the request is out of the protocol's order, and a requestor may not take it as the
    answer: pynetdicom's, for one, can find its connection closed before it looks for the answer (the RJ
    and the close arrive before it has sent its request) and report an abort instead of the transient
    rejection, so a sender over its host's limit did not learn that the node is busy. One thread, started
    when a refused connection waits and ended when none does; at most ``MAX_REFUSING`` wait at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[socket.socket, tuple[int, int, int], float]] = {}  # fd -> ...
        self._handed: set[int] = set()  # id(socket) the server has not asked about yet
        self._thread: threading.Thread | None = None

    def take(self, sock: socket.socket, rsd: tuple[int, int, int]) -> bool:
        """Wait for the request of ``sock``, then answer and close it (False: too many wait already)."""
        with self._lock:
            if len(self._waiting) >= MAX_REFUSING:
                return False
            self._waiting[sock.fileno()] = (sock, rsd, time.monotonic() + REFUSE_WAIT_S)
            self._handed.add(id(sock))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nnunet-triton-refuse", daemon=True)
                self._thread.start()
        return True

    def handed(self, sock: socket.socket) -> bool:
        with self._lock:
            if id(sock) in self._handed:
                self._handed.discard(id(sock))
                return True
            return False

    def _run(self) -> None:
        poller = select.poll()
        registered: set[int] = set()
        while True:
            with self._lock:
                if not self._waiting:
                    self._thread = None
                    return
                waiting = dict(self._waiting)
            for fd in waiting.keys() - registered:
                poller.register(fd, select.POLLIN | select.POLLPRI)
                registered.add(fd)
            ready = {fd for fd, _ in poller.poll(20)}  # readable, closed by the peer or in error
            now = time.monotonic()
            for fd, (sock, rsd, deadline) in waiting.items():
                if fd not in ready and now < deadline:
                    continue
                poller.unregister(fd)
                registered.discard(fd)
                _answer(sock, rsd)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                sock.close()
                with self._lock:
                    del self._waiting[fd]


def _read(sock: Any, size: int, deadline: float) -> bytes:
    """Exactly ``size`` bytes from ``sock`` before ``deadline`` (TimeoutError after it, ConnectionError when
    the peer closes first)."""
    data = bytearray()
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(min(size - len(data), 65536))
        if not chunk:
            raise ConnectionError
        data.extend(chunk)
    return bytes(data)


class _ReplaySocket(AssociationSocket):
    """pynetdicom's socket that first returns the bytes admission read (the A-ASSOCIATE-RQ)."""

    replay: bytearray

    @property
    def ready(self) -> bool:
        return bool(self.replay) or bool(super().ready)

    def recv(self, nr_bytes: int) -> bytearray:
        head = bytearray(self.replay[:nr_bytes])
        del self.replay[:nr_bytes]
        if len(head) < nr_bytes:
            head.extend(super().recv(nr_bytes - len(head)))
        return head


class _AdmittedHandler(RequestHandler):
    """pynetdicom's request handler, run in the connection's thread, after :meth:`Admission.admit`."""

    server: AdmittingServer

    def handle(self) -> None:
        from pynetdicom import evt

        admitted = self.server.admission.admit(self.request, str(self.client_address[0]))
        if admitted is None:
            return
        self.request, request_bytes = admitted
        assoc = self._create_association()
        # the socket pynetdicom made around self.request: the request bytes are read before the socket's
        sock = assoc.dul.socket
        sock.__class__ = _ReplaySocket
        sock.replay = bytearray(request_bytes)
        evt.trigger(assoc, evt.EVT_CONN_OPEN, {"address": self.client_address})
        assoc.start()


class AdmittingServer(ThreadedAssociationServer):
    """pynetdicom's threaded server with :class:`Admission` at accept and before the association (give it
    to ``AE.make_server(..., server_class=AdmittingServer, admission=...)``; TLS is the admission's)."""

    daemon_threads = True

    def __init__(self, *args: Any, admission: Admission, **kwargs: Any) -> None:
        self.admission = admission
        super().__init__(*args, request_handler=_AdmittedHandler, **kwargs)

    def get_request(self) -> tuple[socket.socket, Any]:
        """Accept only: no TLS handshake and no read in the accept loop."""
        return self.socket.accept()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.admission.accept(request, str(client_address[0]))

    def shutdown_request(self, request: Any) -> None:
        """Close a connection, unless admission's refusing thread answers and closes it."""
        if not self.admission.refusing(request):
            super().shutdown_request(request)
