"""The /metrics endpoint holds a bounded number of connections for a bounded time.

Before session 22 every connection got a thread with no read timeout (prometheus_client's
`start_http_server`): clients that connect and send half a request line, from anyone who
reaches the port, held a thread each for as long as they kept their sockets open.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.error
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


def test_a_crowd_of_idle_clients_holds_few_threads_and_is_timed_out(cluster: Cluster) -> None:
    coord = cluster.start_coordinator()
    port = int(re.search(r"metrics on (\d+)", coord.log()).group(1))
    before = threads(coord.pid)
    crowd = half_requests(port, 200)
    try:
        time.sleep(1.0)
        assert threads(coord.pid) <= before + MAX_CONNECTIONS + 2
        # those past the limit were told so and closed at once
        refused = 0
        for conn in crowd[MAX_CONNECTIONS + 10 :]:
            conn.settimeout(5)
            reply = conn.recv(256)
            assert reply.startswith(b"HTTP/1.0 503"), reply
            refused += 1
        assert refused == 200 - MAX_CONNECTIONS - 10
        # the held ones are closed by the server once their read times out
        t0 = time.monotonic()
        for conn in crowd[:MAX_CONNECTIONS]:
            conn.settimeout(IO_TIMEOUT_S + 10)
            assert conn.recv(256) == b""
        assert time.monotonic() - t0 < IO_TIMEOUT_S + 10
    finally:
        for conn in crowd:
            conn.close()
    assert "weightsync_build_info" in scrape(port)
    eventually(lambda: threads(coord.pid) <= before + 1, what="the metrics threads to end")


def test_a_trickling_or_stalled_client_is_cut_off_and_others_are_served() -> None:
    registry = CollectorRegistry()
    Counter("probe_total", "a series to scrape", registry=registry).inc()
    server = MetricsServer("127.0.0.1", 0, registry, max_connections=2, io_timeout_s=0.5)
    try:
        stalled = half_requests(server.server_port, 2)
        # both slots held: a third is refused, not queued behind them
        with pytest.raises(urllib.error.HTTPError) as busy:
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5)
        assert busy.value.code == 503
        busy.value.close()
        for conn in stalled:
            conn.settimeout(5)
            assert conn.recv(64) == b""  # closed after 0.5 s without a byte
            conn.close()
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read()
        assert b"probe_total 1.0" in body
    finally:
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
