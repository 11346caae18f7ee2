"""The native `tcp` transport against a real publisher: bytes, tokens, refusals."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import resource
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from devtools.cluster import Cluster
from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.round import sync_version
from tests.integration.support import eventually
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync._proto import coordinator_pb2 as pb
from weightsync.client import CoordinatorClient
from weightsync.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    TransportUnavailable,
    VersionNotFound,
)
from weightsync.manifest import Endpoint, Manifest
from weightsync.server import RunningServer
from weightsync.transports import FetchRequest
from weightsync.transports.base import MAX_INDICES_PER_READ
from weightsync.transports.tcp import MAX_SESSION, MAX_TOKEN, REPLY, REQUEST, STALL_TIMEOUT_S, TcpTransport

# How long a test waits for the server to take or release a connection. The tests that
# time connections out set 0.5 s; the defaults (STALL_TIMEOUT_S, IDLE_TIMEOUT_S) and
# "never" are the outcomes to tell apart, all beyond it.
CONN_WAIT_S = 15.0
assert CONN_WAIT_S < STALL_TIMEOUT_S


def _params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"model.layers.{i}.mlp.gate_proj.weight": rng.standard_normal((80, 96)).astype(np.float32) for i in range(4)
    }


@pytest.mark.parametrize("mode", ["tcp", "grpc"])
def test_versions_sync_bit_exactly_and_egress_is_counted(
    inprocess_coordinator: RunningServer, no_arena_leak: None, mode: str
) -> None:
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(
        PublisherSettings(
            coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192, weight_sync_mode=mode
        )
    ) as pub:
        assert "tcp" in pub.endpoint.transports and pub.endpoint.tcp_address
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        puller = WeightPuller(client, "job", "r0", window_chunks=3)
        total = 0
        for version in (1, 2, 3):  # slots alternate; one connection per lane is reused
            params = {k: v * version for k, v in _params(1).items()}
            total += pub.publish(params, version).total_bytes
            applier = DictApplier()
            outcome = sync_version(puller, applier, version)
            assert outcome.ok, outcome.mismatch
            assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        header, manifest = client.get_manifest("job", 3)
        plan = puller.plan(header)  # the session's mode, from the header: nothing held between calls
        assert plan.mode == mode and plan.upstream is None
        assert puller.transport_for(manifest.parts[0], plan.mode) == mode
        if mode == "tcp":
            assert pub._servicer.bytes_served == total  # every byte went over tcp, once
        else:  # ChunkData framing on top of every chunk
            assert total < pub._servicer.bytes_served < total * 1.01
        puller.close()
    client.close()


def test_tcp_refetches_a_corrupt_chunk_then_reports_data_loss(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192)
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        result = pub.publish(_params(2), 1)
        entry = pub.table.entries()[result.slot]
        pub.arena.slot(result.slot)[entry.chunks[1].offset + 5] ^= 0x40  # the source itself is bad
        puller = WeightPuller(client, "job", "r0", mode="tcp", max_attempts=2)
        outcome = sync_version(puller, DictApplier(), 1)
        assert not outcome.ok and "chunk 1" in outcome.mismatch and "2 attempts" in outcome.mismatch
        assert outcome.chunk_retries == 1 and not outcome.transient  # counted although the pull failed
        # a source that cannot be reached is retried with backoff and is not DATA_LOSS
        pub.tcp_server.close()
        t0 = time.monotonic()
        down = sync_version(puller, DictApplier(), 1)
        assert not down.ok and down.transient and "digest" not in down.mismatch
        assert time.monotonic() - t0 >= 0.2  # the second attempt waited (0.1 * 2**2 s, jittered x0.5..1.5)
        puller.close()
    client.close()


def test_tcp_server_refuses_bad_requests_and_keeps_serving(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192)
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        pub.publish(_params(3), 1)
        header, manifest = client.get_manifest("job", 1, agent_id="r0")
        assert len(header.access_token) == 32
        chunks = manifest.parts[0].chunks
        good = FetchRequest("job", 1, 0, [0, 1], 10.0, [(c.offset, c.length) for c in chunks[:2]], header.access_token)
        t = TcpTransport()
        t.open(pub.endpoint)
        refusals = [
            (dict(token="0" * 32), PermissionDenied, "token"),
            (dict(token=""), PermissionDenied, "token"),
            (dict(version=9), NotFound, "version 9"),
            (dict(indices=[0, 10_000]), InvalidArgument, r"indices\[1\]"),
            (dict(indices=[], spans=[]), InvalidArgument, "indices"),
            (dict(session="other"), NotFound, "session"),
        ]
        for change, error, text in refusals:
            bad = FetchRequest(**{**good.__dict__, **change})
            with pytest.raises(error, match=text):
                t.fetch_into(bad, np.zeros(manifest.parts[0].total_bytes, np.uint8), 0, [0, 0])
        # the same connection still serves a good request, bytes verified in C++
        buf = np.zeros(manifest.parts[0].total_bytes, np.uint8)
        ok = t.fetch_into(good, buf, 0, [c.xxh3 for c in chunks[:2]])
        assert ok.tolist() == [True, True]
        assert t.fetch_into(good, buf, 0, [c.xxh3 ^ 1 for c in chunks[:2]]).tolist() == [False, False]
        # unchecked (the caller checks the tensors): the same bytes land, nothing is hashed
        unchecked = np.zeros_like(buf)
        assert t.fetch_into(good, unchecked, 0, None).tolist() == [True, True]
        assert unchecked.tobytes() == buf.tobytes()
        with pytest.raises(InvalidArgument, match="digests"):
            t.fetch_into(good, buf, 0, [chunks[0].xxh3])
        t.close()
        # a peer speaking another protocol gets one refusal and is disconnected
        host, _, port = pub.endpoint.tcp_address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[: REQUEST.size])
            magic, code, mlen, payload = REPLY.unpack(raw.recv(REPLY.size, socket.MSG_WAITALL))
            assert (magic, code, payload) == (b"WSR1", 3, 0)  # INVALID_ARGUMENT
            assert b"request" in raw.recv(mlen, socket.MSG_WAITALL)
            assert raw.recv(1) == b""
        # an absurd index count is refused from the header alone (no 16 GiB body is awaited)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(REQUEST.pack(b"WST1", 0, 3, 1, 0, 2**32 - 1) + b"job")
            _, code, mlen, _ = REPLY.unpack(raw.recv(REPLY.size, socket.MSG_WAITALL))
            assert code == 3 and b"indices" in raw.recv(mlen, socket.MSG_WAITALL)
    client.close()


def test_random_requests_get_a_deliberate_answer_and_the_server_keeps_serving(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """400 seeded requests built from extremes (the largest integers, empty and oversized
    tokens and sessions, invalid UTF-8, index counts at and past the limit, indices past the
    chunks), one in five cut short or with a bit flipped: each is answered with a refusal's
    status (never INTERNAL or UNKNOWN), served, or closed; afterwards no connection is held
    and a rollout's read is served."""
    rng = random.Random(7)
    params = {"w": np.arange(40_000, dtype=np.float32)}
    with _one_version(inprocess_coordinator.address, params, chunk_bytes=8192) as (pub, header, manifest):
        chunks = manifest.parts[0].chunks
        host, _, port = pub.endpoint.tcp_address.rpartition(":")

        def extreme(bits: int) -> int:
            return rng.choice([0, 1, (1 << bits) - 1, 1 << (bits - 1), rng.getrandbits(bits)])

        def noise(most: int) -> bytes:
            return rng.randbytes(rng.randint(0, most))

        answers: collections.Counter[str] = collections.Counter()
        for _ in range(400):
            token = rng.choice([header.access_token.encode(), b"", noise(MAX_TOKEN + 8)])
            session = rng.choice([b"job", b"", b"\xff\xfe", noise(MAX_SESSION + 8)])
            count = rng.choice([1, 0, rng.randint(0, 300), MAX_INDICES_PER_READ, MAX_INDICES_PER_READ + 1, extreme(32)])
            indices = [rng.choice([0, len(chunks) - 1, len(chunks), extreme(32)]) for _ in range(min(count, 300))]
            head = REQUEST.pack(
                rng.choice([b"WST1", b"WST1", b"WST2"]),
                min(len(token), 0xFFFF),
                min(len(session), 0xFFFF),
                rng.choice([1, extreme(64)]),
                rng.choice([0, extreme(32)]),
                count,
            )
            message = head + token + session + np.asarray(indices, "<u4").tobytes()
            if rng.random() < 0.1:
                message = message[: rng.randint(0, len(message))]
            elif rng.random() < 0.1:
                flipped = bytearray(message)
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
                message = bytes(flipped)
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(message)
                conn.shutdown(socket.SHUT_WR)  # a request cut short ends here, not at the stall timeout
                reply = conn.recv(REPLY.size, socket.MSG_WAITALL)  # a reset here is a lost answer: a failure
                if not reply:
                    answers["closed"] += 1
                    continue
                magic, code, _, _ = REPLY.unpack(reply)
                assert magic == b"WSR1"
                name = next(c.name for c in grpc.StatusCode if c.value[0] == code)
                assert name not in ("INTERNAL", "UNKNOWN"), message[:64]
                answers[name] += 1
        assert answers["INVALID_ARGUMENT"] and answers["NOT_FOUND"] and answers["PERMISSION_DENIED"], answers
        eventually(lambda: pub.tcp_server.connections == 0, timeout_s=CONN_WAIT_S, what="every connection released")
        t = TcpTransport()
        t.open(pub.endpoint)
        request = FetchRequest("job", 1, 0, [0], 10.0, [(chunks[0].offset, chunks[0].length)], header.access_token)
        buf = np.zeros(manifest.parts[0].total_bytes, np.uint8)
        assert t.fetch_into(request, buf, 0, [chunks[0].xxh3]).tolist() == [True]
        t.close()


def _read_refusal(conn: socket.socket) -> tuple[str, bytes]:
    """The status name and message of a reply, then the plain end of the stream (a reset
    raises: the answer would have been lost to it)."""
    magic, code, mlen, payload = REPLY.unpack(conn.recv(REPLY.size, socket.MSG_WAITALL))
    assert (magic, payload) == (b"WSR1", 0)
    message = conn.recv(mlen, socket.MSG_WAITALL)
    assert conn.recv(1) == b""
    return next(c.name for c in grpc.StatusCode if c.value[0] == code), message


@pytest.mark.parametrize("case", ["bad header", "too many indices", "past the connection limit"])
def test_a_refusal_that_ends_the_connection_arrives_whole_never_as_a_reset(
    inprocess_coordinator: RunningServer, no_arena_leak: None, case: str
) -> None:
    """A server that stops reading a request (it cannot find its end, or holds its limit)
    still delivers its answer: it half-closes and drains what the client still sends, so
    the close is never a reset that overtakes the answer. Long requests, sent whole before
    the client reads, many times over to catch the race."""
    with _one_version(inprocess_coordinator.address, chunk_bytes=4096) as (pub, header, manifest):
        host, _, port = pub.endpoint.tcp_address.rpartition(":")
        server = pub.tcp_server
        held: list[socket.socket] = []
        if case == "bad header":
            message = REQUEST.pack(b"WST2", 32, 3, 1, 0, 10) + os.urandom(256 << 10)
            status, field = "INVALID_ARGUMENT", b"request"
        elif case == "too many indices":
            count = MAX_INDICES_PER_READ + 1
            token = header.access_token.encode()
            message = REQUEST.pack(b"WST1", len(token), 3, 1, 0, count) + token + b"job" + bytes(4 * count)
            status, field = "INVALID_ARGUMENT", b"indices"
        else:
            server.max_connections = 2
            held = [_shown_a_token(host, port, header, manifest) for _ in range(2)]
            eventually(lambda: server.connections == 2, timeout_s=CONN_WAIT_S, what="two rollouts' connections")
            message = _raw_request(header, manifest, [0] * MAX_INDICES_PER_READ)
            status, field = "RESOURCE_EXHAUSTED", b"connections"
        for _ in range(40):
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(message)
                name, text = _read_refusal(conn)
                assert name == status and field in text, (name, text)
        for s in held:
            s.close()
        eventually(lambda: server.connections == 0, timeout_s=CONN_WAIT_S, what="every connection released")
        eventually(lambda: server._linger.draining == 0, timeout_s=CONN_WAIT_S, what="every refused connection closed")


def test_advertised_host_is_what_rollouts_dial(inprocess_coordinator: RunningServer, no_arena_leak: None) -> None:
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(
        PublisherSettings(
            coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192, advertise_host="localhost"
        )
    ) as pub:
        assert pub.endpoint.address.startswith("localhost:") and pub.endpoint.tcp_address.startswith("localhost:")
        assert pub.endpoint.tcp_address.rpartition(":")[2] == pub.tcp_server.address.rpartition(":")[2]
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        params = _params(5)
        pub.publish(params, 1)
        applier = DictApplier()
        puller = WeightPuller(client, "job", "r0")
        outcome = sync_version(puller, applier, 1)
        assert outcome.ok, outcome.mismatch
        assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        puller.close()
    client.close()


def test_weights_holding_nan_and_inf_publish_and_verify(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """A NaN weight is legitimate data: its sums must be stored and compared, not crash."""
    weird = np.array([np.nan, np.inf, -np.inf, 1.0, -0.0, 5e-324] * 100, np.float32)
    params = {"model.norm.weight": weird, "model.layers.0.mlp.up_proj.weight": np.full((8, 8), np.inf, np.float32)}
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192)
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        pub.publish(params, 1)
        puller = WeightPuller(client, "job", "r0", mode="tcp")
        applier = DictApplier()
        outcome = sync_version(puller, applier, 1)
        assert outcome.ok, outcome.mismatch
        assert all(applier.weights[k].tobytes() == v.tobytes() for k, v in params.items())
        assert pub.wait_committed(1, 30) == "COMMITTED"
        puller.close()
    client.close()


@pytest.mark.parametrize("taken", ["port", "tcp_port"])
def test_a_publisher_that_cannot_start_releases_what_it_opened(
    inprocess_coordinator: RunningServer, no_arena_leak: None, taken: str
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        settings = PublisherSettings(
            coordinator=inprocess_coordinator.address, session="job", **{taken: busy.getsockname()[1]}
        )
        pub = WeightPublisher(settings)
        with pytest.raises(Exception, match=str(busy.getsockname()[1])):
            pub.start()  # the arena was mapped and the session attached before the bind failed
    with pytest.raises(FailedPrecondition, match="closed"):
        pub.publish(_params(0), 1)
    with CoordinatorClient(inprocess_coordinator.address) as client:
        assert [a.agent_id for a in client.status("job").agents] == []  # registered nothing


def test_handshakes_carry_the_engines_pause_and_ready_to_serving(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(PublisherSettings(coordinator=inprocess_coordinator.address, session="job")) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        puller = WeightPuller(client, "job", "r0")
        pub.publish(_params(1), 1)
        alone = sync_version(puller, DictApplier(), 1)  # a sidecar: the engine waits only for the apply
        pub.publish(_params(2), 2)
        held = sync_version(puller, DictApplier(), 2, engine_blocked=True)  # vLLM: held for the round
        puller.close()
        assert alone.ok and held.ok
        assert alone.timings["pause_seconds"] == alone.timings["apply_seconds"]
        t = held.timings
        assert t["pause_seconds"] >= t["pull_seconds"] + t["verify_seconds"] + t["apply_seconds"]
        assert 0 < t["ready_to_serving_seconds"] < 60
        hs = {h.version: h for h in client.status("job").handshakes}
        assert hs[2].timings.pause_seconds == pytest.approx(t["pause_seconds"])
        assert hs[1].timings.ready_to_serving_seconds > 0
    client.close()


def test_ready_to_serving_does_not_compare_two_hosts_clocks(
    inprocess_coordinator: RunningServer, no_arena_leak: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """READY -> serving is the READY age the coordinator reports plus the rollout's own
    monotonic time since, not the rollout's wall clock minus the coordinator's READY time:
    a rollout host whose clock runs an hour ahead (or behind) reports seconds."""
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(PublisherSettings(coordinator=inprocess_coordinator.address, session="job")) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        puller = WeightPuller(client, "job", "r0")
        pub.publish(_params(1), 1)
        time.sleep(1.0)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600)  # this (the rollout's) host only
        result = sync_version(puller, DictApplier(), 1)
        monkeypatch.undo()
        puller.close()
        assert result.ok and 1.0 <= result.timings["ready_to_serving_seconds"] < 30
    client.close()


def _raw_request(header, manifest, indices: list[int]) -> bytes:  # noqa: ANN001
    token, session = header.access_token.encode(), b"job"
    head = REQUEST.pack(b"WST1", len(token), len(session), 1, 0, len(indices))
    return head + token + session + np.asarray(indices, "<u4").tobytes()


def _shown_a_token(host: str, port: str, header, manifest) -> socket.socket:  # noqa: ANN001
    """A connection that has read one chunk with the version's token, as a rollout's has."""
    conn = socket.create_connection((host, int(port)), timeout=5)
    conn.sendall(_raw_request(header, manifest, [0]))
    _, code, _, payload = REPLY.unpack(conn.recv(REPLY.size, socket.MSG_WAITALL))
    assert code == 0
    _drain(conn, payload)
    return conn


def _drain(conn: socket.socket, nbytes: int) -> None:
    while nbytes:
        got = len(conn.recv(min(nbytes, 1 << 20)))
        assert got, "the server closed the connection mid-reply"
        nbytes -= got


def test_tcp_server_reclaims_idle_and_stalled_connections_and_holds_its_limit(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """A connection thread per client is only safe when nothing can hold one forever: an
    idle client, one that stops mid-request or one that stops reading are dropped after
    the server's timeouts, connections past a limit of rollouts' connections are refused
    with RESOURCE_EXHAUSTED, and a client whose idle connection was reclaimed dials again
    without failing a fetch."""
    big = {f"w{i}": np.full((2048, 2048), i, np.float32) for i in range(3)}  # 48 MiB: more than socket buffers hold
    with (
        CoordinatorClient(inprocess_coordinator.address) as client,
        WeightPublisher(PublisherSettings(coordinator=inprocess_coordinator.address, session="job")) as pub,
    ):
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        pub.publish(big, 1)
        header, manifest = client.get_manifest("job", 1, agent_id="r0")
        chunks = manifest.parts[0].chunks
        server = pub.tcp_server
        assert server is not None
        host, _, port = pub.endpoint.tcp_address.rpartition(":")

        server.max_connections = 2
        held = [_shown_a_token(host, port, header, manifest) for _ in range(2)]
        eventually(lambda: server.connections == 2, timeout_s=CONN_WAIT_S, what="two connections served")
        with socket.create_connection((host, int(port)), timeout=5) as third:
            _, code, mlen, _ = REPLY.unpack(third.recv(REPLY.size, socket.MSG_WAITALL))
            assert code == 8 and b"connections" in third.recv(mlen, socket.MSG_WAITALL)  # RESOURCE_EXHAUSTED
            assert third.recv(1) == b""
        for s in held:
            s.close()
        eventually(lambda: server.connections == 0, timeout_s=CONN_WAIT_S, what="closed connections released")
        server.max_connections = 64

        server.idle_timeout_s = server.stall_timeout_s = 0.5
        t = TcpTransport()
        t.open(pub.endpoint)
        good = FetchRequest("job", 1, 0, [0], 10.0, [(chunks[0].offset, chunks[0].length)], header.access_token)
        buf = np.zeros(manifest.parts[0].total_bytes, np.uint8)
        assert t.fetch_into(good, buf, 0, [chunks[0].xxh3]).tolist() == [True]
        eventually(lambda: server.connections == 0, timeout_s=CONN_WAIT_S, what="the idle connection reclaimed")
        assert t.fetch_into(good, buf, 0, [chunks[0].xxh3]).tolist() == [True]  # dialled again, no error
        t.close()

        with socket.create_connection((host, int(port)), timeout=5) as half:
            half.sendall(_raw_request(header, manifest, [0])[:7])  # a header cut short, then nothing
            eventually(lambda: server.connections == 0, timeout_s=CONN_WAIT_S, what="the stalled request dropped")
            assert half.recv(1) == b""
        with socket.create_connection((host, int(port)), timeout=5) as deaf:
            deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            deaf.sendall(_raw_request(header, manifest, list(range(len(chunks)))))  # and never reads the reply
            eventually(lambda: server.connections == 0, timeout_s=CONN_WAIT_S, what="the reader that stopped dropped")
    client.close()


@contextlib.contextmanager
def _one_version(
    coordinator: str, params: dict[str, np.ndarray] | None = None, **settings: int
) -> Iterator[tuple[WeightPublisher, pb.ManifestHeader, Manifest]]:
    """A publisher serving version 1 of "job", and the header and manifest rollout r0 got."""
    with (
        CoordinatorClient(coordinator) as client,
        WeightPublisher(PublisherSettings(coordinator=coordinator, session="job", **settings)) as pub,
    ):
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        pub.publish(params or {"w": np.ones(4096, np.float32)}, 1)
        header, manifest = client.get_manifest("job", 1, agent_id="r0")
        yield pub, header, manifest


def test_a_connection_that_never_showed_a_token_is_not_kept_idle(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """Until it shows a valid token, a connection waits between requests only the stall
    timeout, not the idle timeout (5 minutes), so a stranger's connections, one per place
    under the limit, cannot keep every rollout out that long; a rollout's connection
    (valid token) stays for reuse."""
    with _one_version(inprocess_coordinator.address) as (pub, header, manifest):
        server = pub.tcp_server
        assert server is not None
        host, _, port = pub.endpoint.tcp_address.rpartition(":")
        server.idle_timeout_s, server.stall_timeout_s = 60.0, 0.5
        silent = socket.create_connection((host, int(port)), timeout=CONN_WAIT_S)
        stranger = socket.create_connection((host, int(port)), timeout=CONN_WAIT_S)
        wrong = header.__class__()
        wrong.CopyFrom(header)
        wrong.access_token = "0" * len(header.access_token)
        stranger.sendall(_raw_request(wrong, manifest, [0]))
        _, code, mlen, _ = REPLY.unpack(stranger.recv(REPLY.size, socket.MSG_WAITALL))
        assert code == 7 and b"token" in stranger.recv(mlen, socket.MSG_WAITALL)  # PERMISSION_DENIED
        rollout = socket.create_connection((host, int(port)), timeout=CONN_WAIT_S)
        rollout.sendall(_raw_request(header, manifest, [0]))
        _, code, _, payload = REPLY.unpack(rollout.recv(REPLY.size, socket.MSG_WAITALL))
        assert code == 0 and len(rollout.recv(payload, socket.MSG_WAITALL)) == payload
        for strangers in (silent, stranger):
            assert strangers.recv(1) == b""  # closed by the server after 0.5 s idle
            strangers.close()
        time.sleep(1.0)  # the rollout's connection idle for twice the stall timeout
        eventually(lambda: server.connections == 1, timeout_s=CONN_WAIT_S, what="the strangers' places released")
        rollout.sendall(_raw_request(header, manifest, [0]))  # and reused
        assert REPLY.unpack(rollout.recv(REPLY.size, socket.MSG_WAITALL))[1] == 0
        rollout.close()


def test_strangers_at_the_limit_give_way_and_rollouts_connections_do_not(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """At its limit the server gives a new connection the place of the oldest that has
    shown no token, so connections that send nothing (or trickle a request a byte at a
    time), opened again as the server times them out, cannot keep rollouts out; a
    connection that has shown one is never displaced, and with only those held a new one
    is refused."""
    with _one_version(inprocess_coordinator.address) as (pub, header, manifest):
        chunk = manifest.parts[0].chunks[0]
        server = pub.tcp_server
        assert server is not None
        host, _, port = pub.endpoint.tcp_address.rpartition(":")
        server.max_connections = 3

        def fetch(t: TcpTransport) -> None:
            request = FetchRequest("job", 1, 0, [0], 10.0, [(chunk.offset, chunk.length)], header.access_token)
            buf = np.zeros(manifest.parts[0].total_bytes, np.uint8)
            assert t.fetch_into(request, buf, 0, [chunk.xxh3]).tolist() == [True]

        rollout = _shown_a_token(host, port, header, manifest)
        silent = socket.create_connection((host, int(port)), timeout=5)
        trickler = socket.create_connection((host, int(port)), timeout=5)
        trickler.sendall(_raw_request(header, manifest, [0])[:5])  # a byte now and then keeps it read
        eventually(lambda: server.connections == 3, timeout_s=CONN_WAIT_S, what="the limit reached")
        transports = [TcpTransport(), TcpTransport()]
        try:
            transports[0].open(pub.endpoint)
            fetch(transports[0])  # takes the oldest stranger's place
            assert silent.recv(1) == b""
            flood = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
            for conn in [trickler, *flood[:-1]]:  # each arrival ended the oldest stranger
                assert conn.recv(1) == b""
            rollout.sendall(_raw_request(header, manifest, [0]))  # the rollouts' connections stayed
            assert REPLY.unpack(rollout.recv(REPLY.size, socket.MSG_WAITALL))[1] == 0
            _drain(rollout, chunk.length)
            fetch(transports[0])
            transports[1].open(pub.endpoint)
            fetch(transports[1])  # the last stranger gives way too
            assert flood[-1].recv(1) == b""
            assert server.strangers_dropped == 22 and server.connections == 3
            with socket.create_connection((host, int(port)), timeout=5) as late:  # none left to end
                _, code, mlen, _ = REPLY.unpack(late.recv(REPLY.size, socket.MSG_WAITALL))
                assert code == 8 and b"connections" in late.recv(mlen, socket.MSG_WAITALL)
            fetch(transports[0])
            fetch(transports[1])
        finally:
            for t in transports:
                t.close()
            for conn in [rollout, silent, trickler, *flood]:
                conn.close()


def test_a_trainer_out_of_file_descriptors_serves_tcp_again_once_they_free(cluster: Cluster) -> None:
    """Accepting past the process's descriptor limit fails (EMFILE); an accept loop that ended
    there would leave a trainer whose gRPC health says SERVING and whose tcp port takes
    connections nobody answers, for good. It waits and accepts again."""
    coord = cluster.start_coordinator()
    trainer = cluster.start_trainer("trainer", coord.address, "job", ["--model-size", "tiny", "--steps", "1", "--hold"])
    with CoordinatorClient(coord.address) as client:
        client.wait_for_version("job", 1, states=("READY", "COMMITTED"), timeout_s=120)
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        header, manifest = client.get_manifest("job", 1, agent_id="r0")
    part = manifest.parts[0]
    host, _, port = part.endpoint.tcp_address.rpartition(":")

    def open_fds() -> int:
        return len(os.listdir(f"/proc/{trainer.pid}/fd"))

    soft, hard = resource.prlimit(trainer.pid, resource.RLIMIT_NOFILE)
    limit = open_fds() + 4
    resource.prlimit(trainer.pid, resource.RLIMIT_NOFILE, (limit, hard))
    flood: list[socket.socket] = []
    try:
        # past the limit, the rest wait in the listen backlog
        flood += [socket.create_connection((host, int(port)), timeout=5) for _ in range(16)]
        eventually(lambda: open_fds() >= limit, what="the trainer at its descriptor limit")
        eventually(lambda: "accept failed ([Errno 24] Too many open files)" in trainer.log(), what="accept failing")
    finally:
        for s in flood:
            s.close()
        resource.prlimit(trainer.pid, resource.RLIMIT_NOFILE, (soft, hard))
    t = TcpTransport()
    t.open(part.endpoint)
    first = part.chunks[0]
    request = FetchRequest("job", 1, 0, [0], 10.0, [(first.offset, first.length)], header.access_token)
    assert t.fetch_into(request, np.zeros(part.total_bytes, np.uint8), 0, [first.xxh3]).tolist() == [True]
    t.close()
    assert trainer.alive()
    assert "accept failed ([Errno 24] Too many open files); retrying" in trainer.log()


def test_a_reader_during_an_arena_reallocation_finds_its_version_or_not_found(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """A publish whose layout outgrows the arena reallocates it. A chunk read meanwhile
    finds its version or NOT_FOUND, never INTERNAL ("arena is not allocated") nor the new
    arena's bytes under the old version: entries are forgotten before the release, and a
    view is taken with its entry under the table's lock."""
    small = {"model.norm.weight": np.arange(1024, dtype=np.float32)}
    with WeightPublisher(PublisherSettings(coordinator=inprocess_coordinator.address, session="job")) as pub:
        pub.publish(small, 1)
        offset, first = pub.table.chunk_view("job", 1, 0, 0)
        expected = bytes(first)
        del first
        seen: dict[str, int] = {}
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                try:
                    _, view = pub.table.chunk_view("job", 1, 0, 0)
                    key = "same" if bytes(view) == expected else "other bytes"
                except VersionNotFound:
                    key = "not found"
                except Exception as e:  # noqa: BLE001 - what the test looks for
                    key = f"{type(e).__name__}: {e}"
                seen[key] = seen.get(key, 0) + 1

        reader = threading.Thread(target=read)
        reader.start()
        try:
            big = {
                "model.embed_tokens.weight": np.ones((64 << 20) // 4, np.float32)
            }  # 64 MiB: populating takes a while
            pub.publish(big, 2)
        finally:
            stop.set()
            reader.join()
        assert pub.arena.allocations == 2
        assert set(seen) <= {"same", "not found"}, seen
        assert seen.get("not found", 0) > 0


def test_a_peer_claiming_a_huge_error_message_is_refused_from_the_header() -> None:
    """A peer (a relay is another rollout) whose reply header claims a 2 GiB error message:
    the client read on until that many bytes came or its deadline passed, buffering them."""
    # The peer holds the connection open until the client is done: a client that read on
    # would wait out its 60 s deadline (and say so), not see the peer go.
    done = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(REPLY.pack(b"WSR1", 13, 1 << 31, 0) + b"x" * 65536)
                done.wait(120)

        server = threading.Thread(target=answer)
        server.start()
        t = TcpTransport()
        t.open(Endpoint(tcp_address=f"127.0.0.1:{listener.getsockname()[1]}"))
        try:
            with pytest.raises(TransportUnavailable, match="not a weightsync tcp server"):
                t.fetch_into(FetchRequest("job", 1, 0, [0], 60.0, [(0, 8)], "t" * 32), np.zeros(8, np.uint8), 0, None)
        finally:
            done.set()
            t.close()
            server.join()
