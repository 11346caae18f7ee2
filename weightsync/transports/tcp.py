"""The `tcp` transport, both halves: a native bulk data plane beside gRPC.

gRPC carries every control message and the descriptors; this moves only chunk bytes.
One request names a version's chunks by index and carries the version's access token
(issued by the coordinator); the reply is a small header, then the chunks' bytes back
to back in request order. The server sends straight from the mapped arena (or a
relay's buffers) and the client receives into its receive buffer and hashes
each chunk as it lands, both in the native shim with the GIL released.

    request:  "WST1" u16 token_len u16 session_len u64 version u32 rank u32 count
              token session u32[count] indices
    reply:    "WSR1" u32 status (gRPC code) u32 message_len u64 payload_bytes
              message payload

A server may listen on a unix socket (`unix:/path`, a relay serving the rollouts of its
host); a relay there also answers "WSM1" requests (`MAP_MAGIC`, same layout) with no
payload: `payload_bytes` says how many chunks, from the first, are ready, and the reply
carries a descriptor of the shared memory they lie in (`weightsync.transports.hostshm`).

A refused request gets a status and a message naming the field; the connection stays
usable, except after a request the server cannot read to its end (not our protocol, more
indices than one call may name) or one past the connection limit: those are answered, then
half-closed and drained before the close (`weightsync.linger`), so the answer is never lost
to a reset. Connections are persistent: one per (endpoint, lane), reused across versions.
The server closes a connection idle for `IDLE_TIMEOUT_S` (`STALL_TIMEOUT_S` until it has
shown a version's token) or stalled mid-request (no byte moved either way) for
`STALL_TIMEOUT_S`. At its limit a new connection takes the place of the oldest one that
has not shown a version's token (strangers cannot keep rollouts out by holding or trickling
connections); with none of those left it is refused with `RESOURCE_EXHAUSTED`. The server
keeps accepting through transient accept errors (out of file descriptors); a client finds
its idle connection closed before reusing it and dials again.
"""

from __future__ import annotations

import dataclasses
import errno
import hmac
import logging
import os
import resource
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import grpc
import numpy as np

from weightsync import native
from weightsync.addresses import connect, is_unix, join_host_port, listening_socket, unix_address, unix_path
from weightsync.errors import (
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    TransportStalled,
    TransportUnavailable,
    WeightsyncError,
    cannot_listen,
    error_for_status,
    status_name_for,
)
from weightsync.failpoints import Failpoints
from weightsync.linger import Lingerer
from weightsync.manifest import Endpoint
from weightsync.transports.base import (
    MAX_INDICES_PER_READ,
    ChunkPayload,
    ChunkSource,
    FetchRequest,
    SharedSource,
    Transport,
)
from weightsync.unix_sockets import SocketFile, bind_unix

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<4sHHQII")
REPLY = struct.Struct("<4sIIQ")
REQUEST_MAGIC = b"WST1"
# The same request asking where the chunks lie in memory the server shares (a relay on a
# unix socket, read by rollouts on its host): answered with a descriptor (SCM_RIGHTS) of the
# buffer they lie in and how many of them, from the first, are ready (`transports.hostshm`).
MAP_MAGIC = b"WSM1"
REPLY_MAGIC = b"WSR1"
MAX_TOKEN = 256
MAX_SESSION = 128
MAX_REPLY_MESSAGE = 4096  # an error reply's message; a peer claiming more is no weightsync server
SOCKET_BUFFER = 4 << 20
# A connection between versions waits for the next one (a training step: seconds to
# minutes); past this the server reclaims its thread, and the client dials again.
IDLE_TIMEOUT_S = 300.0
# Once a request has begun, every read and send must move a byte within this (a stopped
# or vanished peer otherwise holds a thread, and the arena mapping it reads from, forever).
STALL_TIMEOUT_S = 30.0
ACCEPT_BACKOFF_S = (0.01, 1.0)  # first and longest pause after a failed accept


def default_max_connections() -> int:
    """Half of the file descriptors this process may open (the rest stay for the arena,
    gRPC and logs), between 64 and 4,096: one thread and one descriptor per connection."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 2))


def _code(name: str) -> int:
    return grpc.StatusCode[name].value[0]


_NAME_BY_CODE = {c.value[0]: c.name for c in grpc.StatusCode}


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from `sock`; ConnectionResetError when the peer closes first."""
    parts, left = [], n
    while left:
        b = sock.recv(left)
        if not b:
            raise ConnectionResetError("peer closed the connection")
        parts.append(b)
        left -= len(b)
    return b"".join(parts)


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when an idle connection has been closed or reset by the other side (a
    non-blocking peek: end of stream or an error; nothing waiting means it is open)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _unix_listener(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket with kernel timeouts (native calls see EAGAIN on expiry)."""
    sock.settimeout(None)
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Unreadable(ConnectionAbortedError):
    """A request whose end cannot be found (answered; the connection cannot go on)."""


class TcpChunkServer:
    """Serves chunk bytes from a ChunkSource on host:port; a thread per connection, at
    most `max_connections` of them (default: `default_max_connections()`), strangers
    (connections yet to show a valid token) giving way to new connections at the limit."""

    def __init__(
        self,
        source: ChunkSource,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        on_sent: Callable[[int], None] | None = None,  # bytes of each reply's payload
        failpoints: Failpoints | None = None,
        max_connections: int | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        port_field: str = "tcp_port",  # the flag that set `port`, named when it cannot be had
        host_field: str = "host",  # the flag that set a `unix:/path` host, named when it cannot be bound
    ) -> None:
        if not native.available():
            raise RuntimeError(f"the tcp transport needs the native shim: {native.missing_reason()}")
        self._source = source
        self._on_sent = on_sent
        self._failpoints = failpoints or Failpoints()
        self.max_connections = max_connections or default_max_connections()
        self.idle_timeout_s = idle_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._socket_file: SocketFile | None = None
        if is_unix(host):  # a relay for the rollouts on its host (`hostshm`); checked as gRPC's are
            self._listener, self._socket_file = bind_unix(unix_path(host), _unix_listener, host_field)
            self.address = unix_address(unix_path(host))
        else:
            try:
                self._listener = listening_socket(host, port)
            except OSError as e:
                raise cannot_listen(port_field, join_host_port(host, port), e.strerror) from None
            self.address = join_host_port(host, self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._strangers: dict[socket.socket, None] = {}  # of _conns, no valid token yet; oldest first
        self._linger = Lingerer(f"tcp-{self.address}")
        self.strangers_dropped = 0
        self._closed = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{self.address}", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        pause = 0.0
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                # Out of descriptors or buffers, or a connection reset before it was
                # taken: transient. Waiting lets what holds them go; returning would
                # leave a listener nobody answers for as long as the process lives.
                pause = min(ACCEPT_BACKOFF_S[1], max(ACCEPT_BACKOFF_S[0], pause * 2))
                if pause == ACCEPT_BACKOFF_S[0]:  # once per outage
                    log.warning("tcp %s: accept failed (%s); retrying with backoff", self.address, e)
                self._stopped.wait(pause)
                continue
            pause = 0.0
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._conns) >= self.max_connections and self._strangers:
                    self._drop_oldest_stranger()
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
                    self._strangers[conn] = None
            if full:
                self._refuse(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="tcp-serve", daemon=True).start()
            except RuntimeError as e:  # no thread to be had: as a full server would
                log.warning("tcp %s: cannot start a connection thread (%s)", self.address, e)
                self._forget(conn)
                self._refuse(conn)

    def _drop_oldest_stranger(self) -> None:
        """Ends the oldest connection yet to show a token (under `_lock`, so its thread has
        not closed it: the shutdown cannot reach a descriptor reused since); its thread sees
        the end of the stream and leaves."""
        conn = next(iter(self._strangers))
        del self._strangers[conn]
        self._conns.discard(conn)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.strangers_dropped += 1
        if self.strangers_dropped == 1 or self.strangers_dropped % 1000 == 0:
            log.warning(
                "tcp %s: at its limit of %d connections; dropped the oldest without a valid token "
                "(%d so far): is something other than rollouts connecting?",
                self.address,
                self.max_connections,
                self.strangers_dropped,
            )

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)
            self._strangers.pop(conn, None)

    def _refuse(self, conn: socket.socket) -> None:
        """Answers a connection over the limit once and hands it to the lingerer (never
        blocks the accept loop: the answer fits the socket's send buffer)."""
        try:
            conn.setblocking(False)
            self._reply(
                conn,
                ResourceExhausted(
                    f"connections: this server holds its limit of {self.max_connections}; retry later",
                    field="connections",
                ),
            )
        except OSError:
            conn.close()
            return
        self._linger.close_after_drain(conn)

    def _serve(self, conn: socket.socket) -> None:
        # A connection waits `idle_timeout_s` between requests only once it has shown a
        # version's token: one that never did (a scanner, a stranger) held a thread and a
        # place under the connection limit for 5 minutes, and the limit's worth of them
        # kept every rollout out for that long.
        trusted = False
        refused = False
        try:
            _tune(conn)
            while True:
                _set_io_timeout(conn, self.idle_timeout_s if trusted else self.stall_timeout_s)
                try:
                    first = conn.recv(REQUEST.size)
                except OSError:
                    return  # the client went away, or stayed idle past the idle timeout
                if not first:
                    return
                _set_io_timeout(conn, self.stall_timeout_s)
                trusted = self._answer(conn, first + recv_exact(conn, REQUEST.size - len(first))) or trusted
        except _Unreadable as e:
            log.debug("tcp connection refused: %s", e)
            refused = True
        except (OSError, WeightsyncError) as e:
            log.debug("tcp connection ended mid-reply: %s", e)
        finally:
            self._forget(conn)
            if refused:
                self._linger.close_after_drain(conn)
            else:
                conn.close()

    def _answer(self, conn: socket.socket, head: bytes) -> bool:
        """Answers one request; True when it carried a version's valid token."""
        magic, token_len, session_len, version, rank, count = REQUEST.unpack(head)
        if magic not in (REQUEST_MAGIC, MAP_MAGIC) or token_len > MAX_TOKEN or session_len > MAX_SESSION:
            # Not our protocol (or a corrupt stream): answer once and drop the connection.
            self._reply(conn, InvalidArgument("not a weightsync tcp request (bad magic or sizes)", field="request"))
            raise _Unreadable("bad request header")
        if count > MAX_INDICES_PER_READ:  # refused before its body is read: the stream cannot continue
            self._reply(conn, InvalidArgument(f"{count} exceed {MAX_INDICES_PER_READ} per call", field="indices"))
            raise _Unreadable("too many indices")
        body = recv_exact(conn, token_len + session_len + 4 * count)
        token = body[:token_len].decode("utf-8", "replace")
        session = body[token_len : token_len + session_len].decode("utf-8", "replace")
        indices = np.frombuffer(body, "<u4", count, token_len + session_len).tolist()
        trusted = False
        try:
            if count == 0:
                raise InvalidArgument("must name at least one chunk", field="indices")
            self._source.check_token(session, version, token)
            trusted = True
            with self._lock:  # before any reply: from here on no stranger's arrival ends it
                self._strangers.pop(conn, None)
            self._source.check_read(session, version, rank, indices)
            if magic == MAP_MAGIC:
                fd, ready, total = self._map(conn, session, version, rank, indices)
            else:
                total = self._source.chunk_lengths(session, version, rank, indices)
        except WeightsyncError as e:
            self._reply(conn, e)
            return trusted
        if magic == MAP_MAGIC:
            try:
                socket.send_fds(conn, [REPLY.pack(REPLY_MAGIC, 0, 0, ready)], [fd])
            finally:
                os.close(fd)
            if self._on_sent is not None:
                self._on_sent(total)
            return True
        conn.sendall(REPLY.pack(REPLY_MAGIC, 0, 0, total))
        if self._failpoints.fire("tcp_server.drop_mid_reply"):
            raise ConnectionAbortedError("failpoint tcp_server.drop_mid_reply: connection dropped mid-reply")
        if self._on_sent is not None:  # counted before the bytes go: a reader may be done before we return
            self._on_sent(total)
        sent = self._source.send_chunks(conn.fileno(), session, version, rank, indices)
        if sent != total:
            raise ConnectionAbortedError(f"sent {sent} of {total} bytes")
        return True

    def _map(
        self, conn: socket.socket, session: str, version: int, rank: int, indices: Sequence[int]
    ) -> tuple[int, int, int]:
        """A map request's answer from a source that shares its memory with readers on its
        unix socket (`SharedSource`): (read-only descriptor, chunks ready, their bytes)."""
        if conn.family != socket.AF_UNIX or not isinstance(self._source, SharedSource):
            raise InvalidArgument("this server sends chunk bytes and shares no memory", field="request")
        return self._source.map_chunks(session, version, rank, indices)

    @staticmethod
    def _reply(conn: socket.socket, error: WeightsyncError) -> None:
        message = error.message.encode()[:MAX_REPLY_MESSAGE]
        conn.sendall(REPLY.pack(REPLY_MAGIC, _code(status_name_for(error)), len(message), 0) + message)

    def close(self) -> None:
        """Stops accepting and drops every connection; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        self._stopped.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        if self._socket_file is not None:
            self._socket_file.remove()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)
        self._linger.close()


class TcpTransport(Transport):
    """Pulls chunks from a TcpChunkServer; receives and verifies in place (`fetch_into`)."""

    name = "tcp"
    cross_host = True
    receives_in_place = True
    magic: ClassVar[bytes] = REQUEST_MAGIC  # what its requests ask for (`MAP_MAGIC`: where, not bytes)

    def __init__(self) -> None:
        if not native.available():
            raise TransportUnavailable(f"the tcp transport needs the native shim: {native.missing_reason()}")
        self._sock: socket.socket | None = None
        self._address = ""
        self._interrupted = False

    def open(self, endpoint: Endpoint) -> None:
        if not endpoint.tcp_address:
            raise TransportUnavailable(f"endpoint {endpoint.address!r} offers no tcp address")
        if self._sock is not None and endpoint.tcp_address == self._address:
            return
        self.close()
        self._address = endpoint.tcp_address

    def _connect(self, timeout_s: float) -> socket.socket:
        if self._interrupted:
            raise TransportUnavailable(f"{self.name} {self._address}: interrupted")
        if self._sock is not None and _closed_by_peer(self._sock):
            self.close()  # the server reclaimed it while idle: dial again, costing no attempt
        if self._sock is None:
            try:
                sock = connect(self._address, min(timeout_s, 10.0))
            except OSError as e:
                raise TransportUnavailable(f"cannot connect to {self.name} {self._address}: {e}") from None
            _tune(sock)
            self._sock = sock
            # `interrupt` sets the flag, then shuts down `_sock`: one made after its look at
            # `_sock` (it came while this connected) is seen here by its flag, not missed (the
            # read then waited `timeout_s` on a frozen peer)
            if self._interrupted:
                self.close()
                raise TransportUnavailable(f"{self.name} {self._address}: interrupted")
        _set_io_timeout(self._sock, timeout_s)
        return self._sock

    def _failed(self, e: OSError, request: FetchRequest) -> TransportUnavailable:
        """A socket error as the retryable error it is; a receive timeout says what timed
        out (no byte moved either way for the call's timeout: the server or relay is stopped,
        frozen or cut off)."""
        self.close()
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return TransportStalled(f"{self.name} {self._address}: no byte moved for {request.timeout_s:g}s")
        return TransportUnavailable(f"{self.name} {self._address}: {e}")

    def _recv_head(self, sock: socket.socket) -> bytes:
        """A reply's header."""
        return recv_exact(sock, REPLY.size)

    def _request(self, request: FetchRequest) -> tuple[socket.socket, int]:
        """Sends one request and reads the reply header; returns (socket, payload bytes)."""
        token = request.token.encode()
        session = request.session.encode()
        head = REQUEST.pack(self.magic, len(token), len(session), request.version, request.rank, len(request.indices))
        sock = self._connect(request.timeout_s)
        try:
            sock.sendall(head + token + session + np.asarray(request.indices, "<u4").tobytes())
            magic, code, message_len, payload = REPLY.unpack(self._recv_head(sock))
            if magic != REPLY_MAGIC or message_len > MAX_REPLY_MESSAGE:  # read no further: it could say 4 GiB
                self.close()
                raise TransportUnavailable(f"{self.name} {self._address}: not a weightsync tcp server")
            message = recv_exact(sock, message_len).decode("utf-8", "replace") if message_len else ""
        except OSError as e:
            raise self._failed(e, request) from None
        if code != 0:
            raise error_for_status(_NAME_BY_CODE.get(code, "INTERNAL"), message)
        return sock, payload

    def fetch_into(
        self, request: FetchRequest, buf: np.ndarray, base: int, digests: Sequence[int] | None
    ) -> np.ndarray:
        """Receives the requested chunks into buf[offset - base : ...] and verifies them
        (unless `digests` is None); returns one bool per index (digest matched)."""
        sock, payload = self._request(request)
        expected = sum(length for _, length in request.spans)
        if payload != expected:
            self.close()
            raise TransportUnavailable(
                f"{self.name} {self._address} offered {payload} bytes, the manifest says {expected}"
            )
        spans = [(offset - base, length) for offset, length in request.spans]
        try:
            return native.recv_verify(sock.fileno(), buf, spans, digests)
        except OSError as e:
            raise self._failed(e, request) from None

    def fetch(self, request: FetchRequest) -> Iterator[ChunkPayload]:
        """Receives into a scratch buffer (for callers that want payloads, e.g. tests);
        the payloads are not verified here."""
        packed, pos = [], 0  # the chunks back to back in the scratch buffer
        for _, length in request.spans:
            packed.append((pos, length))
            pos += length
        scratch = np.empty(max(pos, 1), np.uint8)
        self.fetch_into(dataclasses.replace(request, spans=packed), scratch, 0, [0] * len(packed))
        for index, (offset, _), (pos, length) in zip(request.indices, request.spans, packed):
            yield ChunkPayload(index, offset, memoryview(scratch[pos : pos + length]))

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    def interrupt(self) -> None:
        # shutdown, not close: the reading thread still holds the descriptor, which a close
        # would free for reuse under it
        self._interrupted = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def answers(address: str, timeout_s: float) -> bool:
    """Whether a weightsync tcp server at `address` answers within `timeout_s`: a process
    that is up, not one gone (refused) or frozen (the kernel takes the connection and
    nothing replies). The request names no chunk, which a server refuses at once without
    asking its source, so a server busy waiting on its own source answers too."""
    try:
        with connect(address, timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(REQUEST.pack(REQUEST_MAGIC, 0, 0, 0, 0, 0))
            return recv_exact(sock, REPLY.size)[:4] == REPLY_MAGIC
    except OSError:
        return False


def check_token(expected: str | None, token: str, version: int) -> None:
    """PermissionDenied unless a token is known for the version and `token` equals it."""
    if not expected:
        raise PermissionDenied(f"token: version {version} has no access token here yet (not published)", field="token")
    if not hmac.compare_digest(expected.encode(), token.encode()):
        raise PermissionDenied(f"token: wrong access token for version {version}", field="token")
