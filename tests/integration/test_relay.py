"""Relay mode in one process: a chain of rollouts, trainer egress, fallback to the trainer."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from rollout_agent.appliers import DictApplier
from rollout_agent.puller import WeightPuller
from rollout_agent.relay import RELAY_PROBE_S, Relay
from rollout_agent.sync import SyncResult, sync_version
from trainer_agent.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
from weightsync.manifest import Endpoint
from weightsync.server import RunningServer
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
        pullers = []
        for i, relay in enumerate(relays):
            client.register_agent(
                "job",
                f"r{i}",
                trainer=False,
                endpoint=Endpoint(transports=("grpc", "relay"), tcp_address=relay.address),
            )
            pullers.append(WeightPuller(client, "job", f"r{i}", window_chunks=4, relay=relay.source))
        served = 0
        for version in (1, 2):
            params = _params(version)
            total = pub.publish(params, version).total_bytes
            results = _sync_all(pullers, version)
            assert len(results) == 4
            for result, applier in results:
                assert result.ok, result.mismatch
                assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
            assert pub._servicer.bytes_served - served == total  # 4 rollouts, 1x egress
            served = pub._servicer.bytes_served
            assert [r.source.bytes_served for r in relays[:3]] == [total * version] * 3 and relays[
                3
            ].source.bytes_served == 0
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


def test_a_relay_that_waits_on_its_own_pull_still_answers_a_probe() -> None:
    """`tcp.answers` tells a relay that ended a reply while alive (its own pull had not
    brought the chunk) from one gone or frozen: a request naming no chunk is refused at
    once, whatever the relay waits for; a closed port refuses the connection; a frozen
    process's kernel takes it and nothing answers."""
    relay = Relay("job", wait_s=30.0)  # holds no version: a read from it would wait 30 s
    try:
        t0 = time.monotonic()
        assert answers(relay.address, RELAY_PROBE_S) and time.monotonic() - t0 < 1
    finally:
        relay.close()
    assert not answers(relay.address, RELAY_PROBE_S)  # gone: refused
    with socket.create_server(("127.0.0.1", 0)) as frozen:  # listens, never accepts or answers
        t0 = time.monotonic()
        assert not answers(f"127.0.0.1:{frozen.getsockname()[1]}", 0.5)
        assert time.monotonic() - t0 < 2
