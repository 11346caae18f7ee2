"""The /metrics endpoint: prometheus_client's WSGI app behind a server whose connections
are bounded in number and in time.

prometheus_client's `start_http_server` gives every connection a thread of its own with no
read timeout, so a client that connects and sends nothing (or half a request line) holds a
thread for as long as it keeps the socket open: 500 such connections held 500 threads in a
coordinator, and nothing bounded them short of the process's limits (a pod's pids limit),
from anyone who can reach the port, which has no TLS or token. A bound alone is not enough:
clients that hold every place (or trickle a request a byte at a time, each read within its
timeout) keep Prometheus out. So a request must arrive whole within the I/O timeout, and at
the limit a new connection takes the place of the oldest one still sending its request.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from weightsync.addresses import listening_socket
from weightsync.linger import Lingerer

log = logging.getLogger(__name__)

# Connections served at once; Prometheus scrapes one at a time per target, so this leaves
# room for several scrapers and a curl, and bounds the threads a crowd of idle clients gets.
MAX_CONNECTIONS = 32
# Seconds a connection may wait on one read or write of its reply, and take to send its
# request whole.
IO_TIMEOUT_S = 10.0
# How long a new connection at the limit waits for the place of the one it ended.
TAKE_PLACE_S = 1.0
BUSY_REPLY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, no access log; `timeout` is set on its socket."""

    timeout = IO_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the request line's rest and the headers
        self.server.request_read(self.request)  # type: ignore[attr-defined]
        return parsed


class MetricsServer(ThreadingMixIn, WSGIServer):
    """Serves `registry` on host:port (IPv6 literals included) from a daemon thread, at most
    `max_connections` connections at once. A request must arrive whole within `io_timeout_s`
    and each write of the reply waits at most that; one past the limit takes the place of the
    oldest connection still sending its request, or, with none, is answered 503 and closed."""

    daemon_threads = True

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        *,
        max_connections: int = MAX_CONNECTIONS,
        io_timeout_s: float = IO_TIMEOUT_S,
    ) -> None:
        listener = listening_socket(host, port)
        self.address_family = listener.family
        handler = type("_Handler", (_QuietHandler,), {"timeout": io_timeout_s})
        super().__init__(listener.getsockname()[:2], handler, bind_and_activate=False)
        self.socket.close()
        self.socket = listener
        # what HTTPServer.server_bind would set (without its reverse DNS lookup)
        self.server_address = listener.getsockname()
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()
        metrics_app = make_wsgi_app(registry)
        # GET /ready: 200 while `ready()` is True, else 503 (a rollout's readiness, for an HTTP
        # probe where the gRPC port serves TLS); 404 where no readiness was given.
        self.ready: Callable[[], bool] | None = None

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            if environ.get("PATH_INFO") != "/ready":
                return metrics_app(environ, start_response)
            if self.ready is None:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"no readiness here\n"]
            ok = self.ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ready\n" if ok else b"not ready\n"]

        self.set_app(app)
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self._linger = Lingerer("metrics-http")  # the 503's connections: their request is never read
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._reading: dict[socket.socket, float] = {}  # request not read yet: its accept time, oldest first
        self.readers_dropped = 0
        self._busy_logged = False
        self._thread = threading.Thread(target=self.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not self._take_oldest_readers_place():
            if not self._busy_logged:
                self._busy_logged = True
                log.warning("/metrics: %d connections open; answering 503 until one ends", self.max_connections)
            try:
                request.setblocking(False)
                request.sendall(BUSY_REPLY)  # fits the send buffer: never blocks the accept loop
            except OSError:
                self.shutdown_request(request)
                return
            self._linger.close_after_drain(request)
            return
        with self._lock:
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: the slot is not released by one (the caller closes it)
            self._slots.release()
            raise

    def _take_oldest_readers_place(self) -> bool:
        """Ends the oldest connection still sending its request and waits for its place."""
        with self._lock:
            if not self._reading:
                return False
            self._end_reader(next(iter(self._reading)))
            self.readers_dropped += 1
            if self.readers_dropped == 1 or self.readers_dropped % 1000 == 0:
                log.warning(
                    "/metrics: %d connections open; ended the oldest still sending its request (%d so far)",
                    self.max_connections,
                    self.readers_dropped,
                )
        return self._slots.acquire(timeout=TAKE_PLACE_S)

    def _end_reader(self, request: socket.socket) -> None:
        """Under `_lock`: its thread has not closed it (`shutdown_request` takes the lock
        first), so the shutdown cannot reach a descriptor reused since. Its reads then see
        the end of the stream and its thread leaves."""
        del self._reading[request]
        try:
            request.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def request_read(self, request: socket.socket) -> None:
        """The handler has read the request line and headers: the connection is answered now."""
        with self._lock:
            self._reading.pop(request, None)

    def service_actions(self) -> None:
        """Ends connections whose request has not arrived whole within `io_timeout_s`
        (serve_forever calls this every half second)."""
        deadline = time.monotonic() - self.io_timeout_s
        with self._lock:
            while self._reading:
                request, since = next(iter(self._reading.items()))
                if since > deadline:
                    break
                self._end_reader(request)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._reading.pop(request, None)
        super().shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._busy_logged = False
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that timed out or went away mid-request: nothing for the operator's log
        log.debug("/metrics: connection from %s ended with an error", client_address, exc_info=True)

    def stop(self) -> None:
        """Stops serving and closes the listener (connections being served end by themselves)."""
        self.shutdown()
        self.server_close()
        self._linger.close()
