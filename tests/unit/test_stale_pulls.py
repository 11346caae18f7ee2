"""Abandoning a stale pull: which pulls a newer version makes stale, and a tcp read that
waits on a silent peer ended from another thread."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.follow import NewestAnnounced, StaleWatch
from weightsync import native
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import PullAbandoned, TransportUnavailable
from weightsync.manifest import Endpoint
from weightsync.transports import FetchRequest
from weightsync.transports.tcp import TcpTransport

# The reads of a silent peer below are given READ_TIMEOUT_S: one not ended by the interrupt
# waits all of it, one ended takes well under a second (a few on a loaded machine).
READ_TIMEOUT_S = 60.0
ENDED_WITHIN_S = 20.0


def test_only_an_older_generations_older_version_is_stale() -> None:
    announced = NewestAnnounced()
    assert announced.stale(1, 1) == ""  # nothing announced yet
    announced.note(3, 1)
    assert announced.stale(2, 1) == ""  # the same trainer: the pull finishes (no starving a slow fleet)
    announced.note(4, 2)
    announced.note(2, 1)  # an older announcement changes nothing
    assert "version 4 is servable from trainer generation 2" in announced.stale(3, 1)
    assert announced.stale(4, 1) == "" and announced.stale(5, 1) == ""  # not older
    announced.forget()  # the session was made again
    assert announced.stale(3, 1) == ""
    announced.note(4, 0)  # asked for by number (a rebase, a prefetch request): generation not known
    assert announced.stale(3, 1) == ""
    announced.note(4, 2)  # the watch's event for it
    assert "version 4 is servable from trainer generation 2" in announced.stale(3, 1)


@pytest.mark.needs_inet
@pytest.mark.parametrize(("mode", "abandoned"), [("grpc", True), ("fs", False)])
def test_a_chosen_pull_of_a_replaced_trainers_version_is_abandoned_unless_it_reads_a_store(
    tmp_path: Path, mode: str, abandoned: bool
) -> None:
    """`StaleWatch` (callers choose the versions): a pull from a replaced trainer would wait
    on that trainer's process, a pull from an fs store does not (a version chosen from
    before a restart reads while the coordinator keeps it)."""
    with socket.socket() as s:  # a coordinator that is not there: the watch only retries
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    client = CoordinatorClient(address)
    puller = WeightPuller(client, "job", "r0", mode=mode, fs_root=str(tmp_path))
    watch = StaleWatch(puller)
    try:
        watch.announced.note(2, 2)
        header = cpb.ManifestHeader(version=tpb.VersionInfo(version=1, generation=1))
        if abandoned:
            with pytest.raises(PullAbandoned, match="version 2 is servable from trainer generation 2"):
                with puller.pulling(header):
                    pass
        else:
            with puller.pulling(header):
                pass
        assert puller.in_flight_mode == ""  # (cleared with the pull)
    finally:
        watch.close()
        puller.close()
        client.close()


@pytest.mark.needs_inet
@pytest.mark.skipif(not native.available(), reason="the tcp transport needs the native shim")
def test_an_interrupted_tcp_read_ends_at_once_and_the_transport_stays_interrupted() -> None:
    """A read from a peer that accepts and never answers (a frozen trainer: the kernel
    completes the connection for it) ends at once when interrupted, not after its whole
    timeout, and the transport stays interrupted."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        transport = TcpTransport()
        transport.open(Endpoint(address, ("tcp",), "h", tcp_address=address))
        request = FetchRequest("job", 1, 0, [0], READ_TIMEOUT_S, [(0, 16)], "token")
        outcome: list[BaseException] = []

        def read() -> None:
            try:
                transport.fetch_into(request, np.zeros(16, np.uint8), 0, None)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                outcome.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        silent.settimeout(30)
        peer, _ = silent.accept()
        with peer:
            peer.settimeout(30)
            assert peer.recv(1)  # the request is on its way; the reply never comes
            transport.interrupt()
            reader.join(timeout=ENDED_WITHIN_S)
        assert not reader.is_alive(), "the read waited on for its timeout"
        assert isinstance(outcome[0], TransportUnavailable)
        with pytest.raises(TransportUnavailable, match="interrupted"):  # no new connection after it
            transport.fetch_into(request, np.zeros(16, np.uint8), 0, None)
        transport.close()


@pytest.mark.needs_inet
@pytest.mark.skipif(not native.available(), reason="the tcp transport needs the native shim")
def test_an_interrupt_that_comes_while_the_transport_connects_ends_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """An `interrupt` that comes while `_connect` makes the socket (a relay's child falling
    back to a frozen trainer as a newer version is announced) ends the read once the
    socket is made, rather than leaving it to wait its whole timeout on the frozen peer."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        transport = TcpTransport()
        transport.open(Endpoint(address, ("tcp",), "h", tcp_address=address))
        connect = socket.create_connection

        def connect_then_interrupted(*args: object, **kwargs: object) -> socket.socket:
            sock = connect(*args, **kwargs)  # type: ignore[arg-type]
            transport.interrupt()  # after `_connect`'s first look at the flag, before `_sock` is set
            return sock

        monkeypatch.setattr(socket, "create_connection", connect_then_interrupted)
        t0 = time.monotonic()
        with pytest.raises(TransportUnavailable, match="interrupted"):
            transport.fetch_into(
                FetchRequest("job", 1, 0, [0], READ_TIMEOUT_S, [(0, 16)], "token"), np.zeros(16, np.uint8), 0, None
            )
        assert time.monotonic() - t0 < ENDED_WITHIN_S, "the read waited on for its timeout"
        transport.close()
