"""The /metrics endpoint: prometheus_client's WSGI app behind a server whose connections
are bounded in number and in time.

prometheus_client's `start_http_server` gives every connection a thread of its own with no
read timeout, so a client that connects and sends nothing (or half a request line) holds a
thread for as long as it keeps the socket open: 500 such connections held 500 threads in a
coordinator, and nothing bounded them short of the process's limits (a pod's pids limit),
from anyone who can reach the port, which has no TLS or token.
"""

from __future__ import annotations

import logging
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from weightsync.addresses import listening_socket

log = logging.getLogger(__name__)

# Connections served at once; Prometheus scrapes one at a time per target, so this leaves
# room for several scrapers and a curl, and bounds the threads a crowd of idle clients gets.
MAX_CONNECTIONS = 32
# Seconds a connection may wait on one read or write of its request and reply.
IO_TIMEOUT_S = 10.0
BUSY_REPLY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, no access log; `timeout` is set on its socket."""

    timeout = IO_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class MetricsServer(ThreadingMixIn, WSGIServer):
    """Serves `registry` on host:port (IPv6 literals included) from a daemon thread, at most
    `max_connections` connections at once: one past them is answered 503 and closed; each
    read or write waits at most `io_timeout_s`."""

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
        self.set_app(make_wsgi_app(registry))
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._busy_logged = False
        self._thread = threading.Thread(target=self.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            if not self._busy_logged:
                self._busy_logged = True
                log.warning("/metrics: %d connections open; answering 503 until one ends", self.max_connections)
            try:
                request.sendall(BUSY_REPLY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: the slot is not released by one
            self._slots.release()
            raise

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
