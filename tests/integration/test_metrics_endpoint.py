"""The /metrics endpoint holds a bounded number of connections for a bounded time.

prometheus_client's `start_http_server` gives every connection a thread with no read
timeout: clients that connect and send half a request line, from anyone who reaches the
port, would hold a thread each for as long as they kept their sockets open.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from devtools.cluster import Cluster
from devtools.scrape import scrape
from tests.integration.support import eventually
from weightsync.metrics_http import IO_TIMEOUT_S, MAX_CONNECTIONS, MetricsServer


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def half_requests(port: int, count: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """`count` connections that each send half a request line and then nothing."""
    conns = []
    for _ in range(count):
        conn = socket.create_connection((host, port), timeout=30)
        conn.sendall(b"GET /metr")
        conns.append(conn)
    return conns


def ended_by_server(conn: socket.socket, timeout_s: float) -> bool:
    """True once the server has closed `conn` (end of stream, or a reset: it closed with
    part of the request unread), reading within `timeout_s`."""
    conn.settimeout(timeout_s)
    try:
        return conn.recv(256) == b""
    except ConnectionResetError:
        return True


def open_now(conn: socket.socket) -> bool:
    """True while the server keeps `conn` open (nothing to read, no end of stream)."""
    timeout = conn.gettimeout()
    conn.setblocking(False)
    try:
        conn.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        conn.settimeout(timeout)
    return False


def test_a_crowd_of_idle_clients_holds_few_threads_and_keeps_no_scrape_out(cluster: Cluster) -> None:
    """200 connections that each send half a request line: threads stay bounded, each
    arrival past the limit ends the oldest of them (so a scrape is answered at once, not
    refused), and the last ones are ended once their requests are past the I/O timeout.
    Which connections are still open tells arrivals' ends from the I/O timeout's, which
    ends them all together (all were sent within a moment)."""
    coord = cluster.start_coordinator()
    port = int(re.search(r"metrics on (\d+)", coord.log()).group(1))
    before = threads(coord.pid)
    crowd = half_requests(port, 200)
    oldest, newest = crowd[: 200 - MAX_CONNECTIONS], crowd[200 - MAX_CONNECTIONS :]
    try:
        for conn in oldest:
            assert ended_by_server(conn, 30)
        assert all(open_now(conn) for conn in newest), "ended by the I/O timeout, not by the arrivals"
        eventually(lambda: threads(coord.pid) <= before + MAX_CONNECTIONS + 2, what="a thread per place at most")
        assert "weightsync_build_info" in scrape(port)
        assert ended_by_server(newest[0], 30)  # its place taken by the scrape
        assert all(open_now(conn) for conn in newest[1:]), "the scrape waited for the I/O timeout"
        for conn in newest[1:]:
            assert ended_by_server(conn, IO_TIMEOUT_S + 30)
    finally:
        for conn in crowd:
            conn.close()
    assert "weightsync_build_info" in scrape(port)
    eventually(lambda: threads(coord.pid) <= before + 1, what="the metrics threads to end")


def test_tricklers_and_stalled_clients_are_cut_off_and_scrapes_are_served() -> None:
    """A request must arrive whole within the timeout, so a client that sends it a byte at
    a time, each within the read timeout, cannot hold its place (the limit's worth of them
    would keep every scrape out, answered 503), and a scrape takes the place of the oldest
    connection still sending one."""
    registry = CollectorRegistry()
    Counter("probe_total", "a series to scrape", registry=registry).inc()
    # The request's deadline is 1 s; the default (IO_TIMEOUT_S) is 10 s, and a byte every
    # 0.2 s passes any read's timeout: only the whole request's deadline ends the trickle.
    server = MetricsServer("127.0.0.1", 0, registry, max_connections=2, io_timeout_s=1.0)
    try:
        stalled = half_requests(server.server_port, 1)[0]
        trickler = socket.create_connection(("127.0.0.1", server.server_port), timeout=30)
        t0 = time.monotonic()
        with pytest.raises(OSError):  # cut off by the whole request's deadline, not a read's
            for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 300:
                trickler.sendall(bytes([byte]))
                time.sleep(0.2)
        assert time.monotonic() - t0 < IO_TIMEOUT_S / 2, "not cut off at the deadline it was given"
        assert ended_by_server(stalled, 30)
        stalled.close()
        trickler.close()
    finally:
        server.stop()
    # Places held for a minute: only the scrape's arrival ends one.
    server = MetricsServer("127.0.0.1", 0, registry, max_connections=2, io_timeout_s=60.0)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        stalled, trickler = half_requests(server.server_port, 2)
        body = urllib.request.urlopen(url, timeout=30).read()  # both places held: the oldest gives way
        assert b"probe_total 1.0" in body
        assert ended_by_server(stalled, 30) and server.readers_dropped == 1 and open_now(trickler)
        stalled.close()
        assert b"probe_total 1.0" in urllib.request.urlopen(url, timeout=30).read()  # a place was free
        trickler.close()
    finally:
        server.stop()


class _HeldCollector:
    """A collector whose scrape waits for `release`: the scrape's connection holds its place."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.scraping = threading.Event()

    def collect(self) -> list:
        self.scraping.set()
        self.release.wait(30)
        return []


def test_a_busy_answer_arrives_whole_never_as_a_reset() -> None:
    """With every place held by a request being answered, a new connection gets 503 and
    the plain end of the stream, although the server never reads its (long) request: the
    server half-closes and drains it, so the close is no reset overtaking the answer."""
    registry = CollectorRegistry()
    held = _HeldCollector()
    registry.register(held)
    server = MetricsServer("127.0.0.1", 0, registry, max_connections=1, io_timeout_s=5.0)
    scraper = threading.Thread(
        target=lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30).read(),
        daemon=True,
    )
    try:
        scraper.start()
        assert held.scraping.wait(10)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (512 << 10) + b"\r\n\r\n"
        for _ in range(30):
            with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as conn:
                conn.sendall(request)  # more than the socket buffers hold: only a reading server lets it all go
                reply = b""
                while chunk := conn.recv(4096):  # a reset raises here: the answer would be lost
                    reply += chunk
                assert reply.startswith(b"HTTP/1.0 503"), reply[:64]
    finally:
        held.release.set()
        scraper.join(timeout=10)
        server.stop()


def test_serves_an_ipv6_literal() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    registry = CollectorRegistry()
    Counter("probe_total", "a series to scrape", registry=registry).inc()
    server = MetricsServer("::1", 0, registry)
    try:
        body = urllib.request.urlopen(f"http://[::1]:{server.server_port}/metrics", timeout=5).read()
        assert b"probe_total 1.0" in body
    finally:
        server.stop()
