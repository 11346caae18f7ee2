"""Closing a refused connection so that its answer arrives.

A server that answers a request it refuses and closes the socket with the rest of the
request still unread makes the kernel send a reset instead of a plain end of stream; the
reset can overtake the answer, and the client reads ECONNRESET where a status was owed.
So a refusing server half-closes (the client sees the answer, then the end), reads and
drops what the client still sends until it closes its side, and only then closes, each
bounded in bytes and time. One thread does that for all of a server's refused
connections, so refusing never holds a serving thread or a place under the server's
connection limit.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time

log = logging.getLogger(__name__)

# What a refused client may still send, and for how long, before its socket is closed
# anyway (then with a reset: it sent more than any request of ours, or never stopped).
DRAIN_BYTES = 1 << 20
DRAIN_S = 2.0
# Refused connections draining at once; past this the oldest is closed at once.
MAX_DRAINING = 256


class Lingerer:
    """Half-closes refused connections and closes each once its client is done sending
    (end of stream), `max_bytes` more have arrived, or `timeout_s` has passed."""

    def __init__(
        self,
        name: str,
        *,
        max_bytes: int = DRAIN_BYTES,
        timeout_s: float = DRAIN_S,
        max_draining: int = MAX_DRAINING,
    ) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_draining = max_draining
        self._lock = threading.Lock()
        self._draining: dict[socket.socket, tuple[float, int]] = {}  # deadline, bytes left; oldest first
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def draining(self) -> int:
        """Connections being drained now."""
        with self._lock:
            return len(self._draining)

    def close_after_drain(self, conn: socket.socket) -> None:
        """Takes `conn` over (its answer already written): the caller must not use or close it."""
        try:
            conn.shutdown(socket.SHUT_WR)
            conn.setblocking(False)
        except OSError:
            conn.close()  # already reset or gone: nothing left to deliver
            return
        evicted = None
        with self._lock:
            if self._closed:
                conn.close()
                return
            if len(self._draining) >= self.max_draining:
                evicted = next(iter(self._draining))
                self._forget(evicted)
            self._draining[conn] = (time.monotonic() + self.timeout_s, self.max_bytes)
            self._selector.register(conn, selectors.EVENT_READ)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"linger-{self.name}", daemon=True)
                self._thread.start()
        if evicted is not None:
            evicted.close()
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def _forget(self, conn: socket.socket) -> None:
        """Under `_lock`."""
        del self._draining[conn]
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                first_deadline = min((d for d, _ in self._draining.values()), default=None)
            wait = None if first_deadline is None else max(0.0, first_deadline - time.monotonic())
            events = self._selector.select(wait)
            done: list[socket.socket] = []
            with self._lock:
                if self._closed:
                    return
                for key, _ in events:
                    conn = key.fileobj
                    if conn is self._wake_r:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                        continue
                    if conn in self._draining and self._read_ended(conn):  # type: ignore[arg-type]
                        done.append(conn)  # type: ignore[arg-type]
                now = time.monotonic()
                done += [c for c, (deadline, _) in self._draining.items() if deadline <= now and c not in done]
                for conn in done:
                    self._forget(conn)
            for conn in done:
                conn.close()

    def _read_ended(self, conn: socket.socket) -> bool:
        """Under `_lock`: reads what is there; True when the client is done or over its allowance."""
        deadline, left = self._draining[conn]
        try:
            while left > 0:
                data = conn.recv(min(left, 1 << 16))
                if not data:
                    return True
                left -= len(data)
        except BlockingIOError:
            self._draining[conn] = (deadline, left)
            return False
        except OSError:
            return True
        return True  # over its allowance

    def close(self) -> None:
        """Closes every connection still draining and stops the thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._draining)
            for conn in conns:
                self._forget(conn)
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for conn in conns:
            conn.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
