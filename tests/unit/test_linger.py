"""Lingerer: a refused connection's answer arrives, and draining stays bounded."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.integration.support import eventually
from weightsync.linger import Lingerer

# A drain's time bound where a test must not meet it: a drain that ends only at it is the
# outcome such a test rules out.
LONG_S = 30.0


@pytest.fixture
def lingerer() -> Iterator[Lingerer]:
    lg = Lingerer("test", max_bytes=64 << 10, timeout_s=LONG_S, max_draining=2)
    yield lg
    lg.close()


def _answered(lingerer: Lingerer, request: bytes) -> socket.socket:
    """A client that sent `request`, unread by the server, which answered and let go."""
    server, client = socket.socketpair()
    client.sendall(request)
    server.sendall(b"refused")
    lingerer.close_after_drain(server)
    return client


def test_the_answer_arrives_then_the_end_and_the_socket_is_closed_once_the_client_is_done(lingerer: Lingerer) -> None:
    client = _answered(lingerer, b"x" * 50_000)  # still unread by the server
    assert client.recv(7, socket.MSG_WAITALL) == b"refused"
    assert client.recv(1) == b""  # the server half-closed: an end, not a reset
    client.sendall(b"more of the request")  # the server still reads (and drops) it
    assert lingerer.draining == 1
    client.shutdown(socket.SHUT_WR)
    eventually(lambda: lingerer.draining == 0, timeout_s=LONG_S / 2, what="closed once the client was done")
    client.close()


def test_a_client_that_never_stops_is_closed_within_the_time_bound() -> None:
    lg = Lingerer("test", max_bytes=64 << 10, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        client = _answered(lg, b"x" * 100)
        eventually(lambda: lg.draining == 0, what="closed at the time bound")  # not held for good
        assert time.monotonic() - t0 >= 0.3  # nor closed at once: the client still had its time
        client.close()
    finally:
        lg.close()


def test_a_client_that_sends_past_the_byte_bound_is_closed_before_the_time_bound() -> None:
    lg = Lingerer("test", max_bytes=64 << 10, timeout_s=30.0)
    server, client = socket.socketpair()
    server.sendall(b"refused")
    lg.close_after_drain(server)
    stop = threading.Event()

    def flood() -> None:
        try:
            while not stop.is_set():
                client.send(b"y" * 8192)
        except OSError:
            pass  # closed under it: what the bound is for

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        eventually(lambda: lg.draining == 0, timeout_s=15, what="closed past the byte bound (not at 30 s)")
    finally:
        stop.set()
        client.close()
        sender.join(timeout=5)
        lg.close()


def test_past_the_most_draining_the_oldest_is_closed_at_once(lingerer: Lingerer) -> None:
    clients = [_answered(lingerer, b"r") for _ in range(3)]
    assert lingerer.draining == 2
    assert clients[0].recv(7, socket.MSG_WAITALL) == b"refused"  # its answer was delivered all the same
    for c in clients:
        c.close()


def test_close_ends_every_drain_and_refuses_new_ones() -> None:
    lg = Lingerer("test", timeout_s=30.0)
    first = _answered(lg, b"r")
    lg.close()
    assert lg.draining == 0
    second = _answered(lg, b"r")  # taken after close: closed at once, its answer still written
    assert second.recv(7, socket.MSG_WAITALL) == b"refused"
    for c in (first, second):
        c.close()
