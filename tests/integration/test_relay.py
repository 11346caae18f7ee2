"""Relay mode in one process: a chain of rollouts, trainer egress, fallback to the trainer;
relays on unix sockets serving their host's rollouts from shared memory."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.pull.relay import RELAY_PROBE_S, Relay
from rollout_agent.sync.round import SyncResult, sync_version
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
from weightsync.errors import InvalidArgument
from weightsync.manifest import Endpoint
from weightsync.server import RunningServer
from weightsync.transports import FetchRequest
from weightsync.transports.hostshm import HostShmTransport
from weightsync.transports.tcp import answers


def _params(scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": (rng.standard_normal((128, 96)) * scale).astype(np.float32)
        for i in range(6)
    }


def _sync_all(pullers: list[WeightPuller], version: int) -> list[tuple[SyncResult, DictApplier]]:
    out: list[tuple[SyncResult, DictApplier] | None] = [None] * len(pullers)

    def run(i: int) -> None:
        applier = DictApplier()
        out[i] = (sync_version(pullers[i], applier, version), applier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pullers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [o for o in out if o is not None]


def _register(client: CoordinatorClient, relays: list[Relay]) -> list[WeightPuller]:
    """Rollouts r0, r1, ... of this host, relaying through `relays`; their pullers."""
    pullers = []
    for i, relay in enumerate(relays):
        endpoint = Endpoint(transports=("grpc", "relay"), host_id=socket.gethostname(), tcp_address=relay.address)
        client.register_agent("job", f"r{i}", trainer=False, endpoint=endpoint)
        pullers.append(WeightPuller(client, "job", f"r{i}", window_chunks=4, relay=relay.source))
    return pullers


def _sync_each_once(pub: WeightPublisher, pullers: list[WeightPuller], version: int) -> int:
    """Publishes `version` and syncs every puller at once: each applies it exactly, and the
    trainer sends it once however many pull it. Returns its bytes."""
    params = _params(version)
    served = pub._servicer.bytes_served
    total = pub.publish(params, version).total_bytes
    results = _sync_all(pullers, version)
    assert len(results) == len(pullers)
    for result, applier in results:
        assert result.ok, result.mismatch
        assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
    assert pub._servicer.bytes_served - served == total
    return total


def test_a_chain_of_relays_takes_each_byte_from_the_trainer_once(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(
        PublisherSettings(
            coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192, weight_sync_mode="relay"
        )
    ) as pub:
        relays = [Relay("job", wait_s=5.0) for _ in range(4)]
        pullers = _register(client, relays)
        for version in (1, 2):
            total = _sync_each_once(pub, pullers, version)
            assert [r.source.bytes_served for r in relays[:3]] == [total * version] * 3 and relays[
                3
            ].source.bytes_served == 0
        served = pub._servicer.bytes_served
        header, _ = client.get_manifest("job", 2, agent_id="r3")
        assert [p.agent_id for p in header.relay_chain] == ["r0", "r1", "r2", "r3"]

        relays[1].close()  # r1 stops relaying: r2 reads from the trainer, r3 still from r2
        total = pub.publish(_params(3), 3).total_bytes
        results = _sync_all(pullers, 3)
        assert all(result.ok for result, _ in results), [r.mismatch for r, _ in results]
        assert pullers[2].relay_fallbacks > 0 and pullers[3].relay_fallbacks == 0
        assert pub._servicer.bytes_served - served == 2 * total
        for p in pullers:
            p.close()
        for r in relays:
            r.close()
    client.close()


def test_relays_on_unix_sockets_serve_their_host_from_the_first_ones_buffers(
    inprocess_coordinator: RunningServer, sockets: Path, no_arena_leak: None
) -> None:
    """Four rollouts of one host relaying on unix sockets: r0 pulls each version from the
    trainer, r1-r3 map its buffers and check every chunk they copy (one pull per host, a
    star rather than a chain). Only a relay shares its memory, and only a rollout registers
    a unix relay address."""
    client = CoordinatorClient(inprocess_coordinator.address)
    settings = PublisherSettings(
        coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192, weight_sync_mode="relay"
    )
    with WeightPublisher(settings) as pub:
        relays = [Relay("job", host=f"unix:{sockets}/relay-r{i}.sock", wait_s=5.0) for i in range(4)]
        pullers = _register(client, relays)
        for version in (1, 2):
            total = _sync_each_once(pub, pullers, version)
            assert [r.source.bytes_served for r in relays] == [3 * total * version, 0, 0, 0]
        header, manifest = client.get_manifest("job", 2, agent_id="r0")
        chunk = manifest.parts[0].chunks[0]
        reader = HostShmTransport()
        reader.open(manifest.parts[0].endpoint)  # the trainer's tcp server, on an inet socket
        request = FetchRequest("job", 2, 0, [0], 5.0, [(chunk.offset, chunk.length)], header.access_token)
        with pytest.raises(InvalidArgument, match="shares no memory"):
            reader.fetch_into(request, np.empty(chunk.length, np.uint8), chunk.offset, None)
        reader.close()
        with pytest.raises(InvalidArgument) as e:
            client.register_agent("job", "t1", trainer=True, endpoint=Endpoint(tcp_address=relays[0].address))
        assert e.value.field == "endpoint.tcp_address"
        for closeable in (*pullers, *relays):
            closeable.close()
    assert list(sockets.iterdir()) == []
    client.close()


def test_a_relay_that_waits_on_its_own_pull_still_answers_a_probe() -> None:
    """`tcp.answers` tells a relay that ended a reply while alive (its own pull had not
    brought the chunk) from one gone or frozen: a request naming no chunk is refused at
    once, whatever the relay waits for; a closed port refuses the connection; a frozen
    process's kernel takes it and nothing answers."""
    # Holds no version: a read from it waits 120 s, and a probe given 30 s that waited on
    # the read would get no answer in time.
    relay = Relay("job", wait_s=120.0)
    try:
        assert RELAY_PROBE_S < 30 and answers(relay.address, 30)
    finally:
        relay.close()
    assert not answers(relay.address, RELAY_PROBE_S)  # gone: refused
    with socket.create_server(("127.0.0.1", 0)) as frozen:  # listens, never accepts or answers
        t0 = time.monotonic()
        assert not answers(f"127.0.0.1:{frozen.getsockname()[1]}", 0.5)
        assert time.monotonic() - t0 < 30  # a probe that ignored its timeout would wait for good
