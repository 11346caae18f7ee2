"""Delta sync with real servers on loopback: a rollout holding the base version pulls only
the delta (tcp and grpc), rebuilds bit for bit and commits; one without the base pulls
the whole version; a corrupted delta chunk is re-fetched or the round fails with
DATA_LOSS and nothing is applied; a rebuild on a wrong base is never applied."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.assembly import assemble, digest_all, mismatched
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.pull.relay import Relay
from rollout_agent.sync.prefetch import Prefetcher
from rollout_agent.sync.round import SyncResult, apply_prefetched, sync_version
from tests.integration.support import eventually
from trainer_agent.__main__ import rank_rows
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from trainer_agent.update_model import AdamSteps, initial_weights
from weightsync.client import CoordinatorClient
from weightsync.failpoints import Failpoints
from weightsync.manifest import Endpoint
from weightsync.metrics import build_metrics
from weightsync.server import RunningServer

SHAPES = {f"model.layers.{i}.mlp.up_proj.weight": (512, 256) for i in range(3)} | {"model.norm.weight": (256,)}


def _steps(dtype: object = ml_dtypes.bfloat16, lr: float = 1e-6) -> AdamSteps:
    return AdamSteps(initial_weights(SHAPES, dtype), lr, seed=3)


@contextmanager
def _fleet(address: str, **pullers: dict[str, object]) -> Iterator[tuple[CoordinatorClient, dict[str, WeightPuller]]]:
    """Registered rollouts `name -> WeightPuller(**kwargs)`, closed after the block."""
    client = CoordinatorClient(address)
    made = {}
    try:
        for name, kw in pullers.items():
            client.register_agent("job", name, trainer=False, endpoint=Endpoint())
            made[name] = WeightPuller(client, "job", name, **kw)  # type: ignore[arg-type]
        yield client, made
    finally:
        for p in made.values():
            p.close()
        client.close()


def _publisher(address: str, **kw: object) -> WeightPublisher:
    return WeightPublisher(PublisherSettings(coordinator=address, session="job", chunk_bytes=16384, delta="auto", **kw))  # type: ignore[arg-type]


def _same(engine: DictApplier, params: dict[str, np.ndarray]) -> bool:
    return all(engine.weights[k].tobytes() == v.tobytes() for k, v in params.items())


def test_a_rollout_holding_the_base_pulls_only_the_delta_and_rebuilds_bit_for_bit(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    steps = _steps()
    with (
        _publisher(inprocess_coordinator.address) as pub,
        _fleet(
            inprocess_coordinator.address,
            tcp={"mode": "tcp", "metrics": build_metrics("rollout")},
            grpc={"mode": "grpc"},
        ) as (_, pullers),
    ):
        engines = {name: DictApplier() for name in pullers}
        for v in range(1, 5):
            params = steps.step()
            published = pub.publish(params, v)
            assert (published.delta_base, published.delta_bytes > 0) == ((v - 1, True) if v > 1 else (0, False))
            for name, puller in pullers.items():
                result = sync_version(puller, engines[name], v)
                assert result.ok, result.mismatch
                assert _same(engines[name], params)
                if v == 1:
                    assert result.bytes_pulled == published.total_bytes and result.delta_base == 0
                else:  # lr 1e-6: a few percent of the bytes
                    assert result.delta_base == v - 1 and result.bytes_pulled == published.delta_bytes
                    assert published.delta_bytes < 0.05 * published.total_bytes
            assert pub.wait_committed(v, 30) == "COMMITTED"
        registry = pullers["tcp"].metrics.registry
        pulls = {
            kind: registry.get_sample_value(
                "weightsync_pulls_total", {"role": "rollout", "session": "job", "kind": kind}
            )
            for kind in ("whole", "delta")
        }
        assert pulls == {"whole": 1.0, "delta": 3.0}


def test_two_trainer_ranks_publish_deltas_and_a_rollout_rebuilds_both_parts(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """Each rank's part is rebuilt from its own delta and the rebuild's own pass digests the
    tensors a part holds whole; a tensor split across the ranks (an empty shard included)
    is checked after assembly, and the version applies bit for bit."""
    shapes = SHAPES | {"model.embed_tokens.weight": (1, 256)}  # rank 0's rows of it: none
    steps = AdamSteps(initial_weights(shapes, ml_dtypes.bfloat16), 1e-6, seed=3)
    ranks = dict(world_size=2, incarnation="run-a")
    with (
        _publisher(inprocess_coordinator.address, rank=0, **ranks) as pub0,
        _publisher(inprocess_coordinator.address, rank=1, **ranks) as pub1,
        _fleet(inprocess_coordinator.address, r0={"mode": "tcp"}) as (_, pullers),
    ):
        puller, engine = pullers["r0"], DictApplier()
        for v in range(1, 4):
            params = steps.step()
            split = {k: a for k, a in params.items() if k != "model.norm.weight"}
            pub0.publish(rank_rows(split, 0, 2) | {"model.norm.weight": params["model.norm.weight"]}, v)
            assert pub1.publish(rank_rows(split, 1, 2), v).delta_base == v - 1
            if v < 3:
                result = sync_version(puller, engine, v)
                assert result.ok, result.mismatch
                assert result.delta_base == v - 1 and result.chunk_retries == 0
                assert _same(engine, params)
                continue
            header, manifest = puller.fetch_manifest(v)
            pulled = puller.pull(header, manifest, check_chunks=False)
            # the rebuild's digests: every tensor one shard holds whole, none other
            whole = {n for n, sh in manifest.shards_of().items() if len(sh) == 1}
            assert pulled.delta_base == 2 and set(pulled.digests) == whole == {"model.norm.weight"}
            tensors = assemble(manifest, pulled.buffers)
            assert mismatched(manifest, digest_all(manifest, tensors, pulled.digests)) == []
            assert all(tensors[k].tobytes() == a.tobytes() for k, a in params.items())


def test_rollouts_without_the_base_pull_whole_and_a_mixed_fleet_commits(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """`every` rebuilds each version from its delta; `late` missed version 2 (it holds 1,
    the delta's base is 2) and `shm` reads a mode that serves whole parts: both pull
    whole. All three commit the same version."""
    steps = _steps()
    with (
        _publisher(inprocess_coordinator.address, slots=3) as pub,
        _fleet(inprocess_coordinator.address, every={"mode": "tcp"}, late={"mode": "tcp"}, shm={"mode": "shm"}) as (
            client,
            pullers,
        ),
    ):
        engines = {name: DictApplier() for name in pullers}
        versions = {v: steps.step() for v in (1, 2, 3)}
        for v, params in versions.items():
            pub.publish(params, v)
            for name in ("every", "shm") if v == 2 else pullers:
                result = sync_version(pullers[name], engines[name], v)
                assert result.ok, result.mismatch
        total = sum(a.nbytes for a in versions[3].values())
        assert pullers["every"].holding == 3 and pullers["late"].holding == 3
        for name, engine in engines.items():
            assert engine.version == 3 and _same(engine, versions[3]), name
        (hs,) = [h for h in client.status("job").handshakes if h.version == 3 and h.agent_id == "late"]
        assert hs.bytes_pulled >= total  # whole
        (hs,) = [h for h in client.status("job").handshakes if h.version == 3 and h.agent_id == "every"]
        assert hs.bytes_pulled < total // 10  # the delta
        assert pub.wait_committed(3, 30) == "COMMITTED"


def test_a_corrupted_delta_chunk_is_refetched_or_the_round_fails_and_nothing_is_applied(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    steps = _steps()
    with (
        _publisher(inprocess_coordinator.address) as pub,
        _fleet(inprocess_coordinator.address, r0={"mode": "tcp", "streams": 1, "window_chunks": 1024}) as (_, pullers),
    ):
        puller, engine = pullers["r0"], DictApplier()
        for v in (1, 2):
            params = steps.step()
            pub.publish(params, v)
            if v == 2:
                pub.table.failpoints.arm("chunk_server.corrupt_chunk", 1)  # the first delta chunk sent
            result = sync_version(puller, engine, v)
            assert result.ok and _same(engine, params)
        assert result.delta_base == 1 and result.chunk_retries == 1
        pub.publish(steps.step(), 3)
        pub.table.failpoints.arm("chunk_server.corrupt_chunk", puller.max_attempts)  # every attempt (one read each)
        failed = sync_version(puller, engine, 3)
        assert not failed.ok and failed.failure == "data_loss" and "failed after 3 attempts" in failed.mismatch
        assert engine.version == 2 and _same(engine, params)  # nothing of version 3 was applied
        assert puller.holding == 0  # the buffers are no base now: the next version comes whole
        latest = steps.step()
        published = pub.publish(latest, 4)
        result = sync_version(puller, engine, 4)
        assert result.ok and result.delta_base == 0 and result.bytes_pulled == published.total_bytes
        assert _same(engine, latest)


def test_a_rebuild_on_a_wrong_base_is_never_applied(inprocess_coordinator: RunningServer, no_arena_leak: None) -> None:
    """The receive buffer does not hold what the rollout believes (a flipped byte): the
    rebuilt tensor fails its check, the chunk that differs is fetched whole and the tensor
    applies bit for bit. With the check failing twice, the version is refused and nothing
    is applied."""
    steps = _steps()
    with (
        _publisher(inprocess_coordinator.address) as pub,
        _fleet(inprocess_coordinator.address, r0={"mode": "tcp"}) as (_, pullers),
    ):
        puller, engine = pullers["r0"], DictApplier()
        params = steps.step()
        pub.publish(params, 1)
        assert sync_version(puller, engine, 1).ok
        puller._buffers[0][12345] ^= 0x40  # the base is wrong from here on
        params = steps.step()
        pub.publish(params, 2)
        result = sync_version(puller, engine, 2)
        assert result.ok and result.delta_base == 1 and result.chunk_retries == 1
        assert _same(engine, params)
        pub.publish(steps.step(), 3)
        refused = sync_version(puller, engine, 3, failpoints=Failpoints("puller.corrupt_assembled=2"))
        assert not refused.ok and refused.failure == "data_loss" and "refusing to apply" in refused.mismatch
        assert engine.version == 2 and _same(engine, params)


def test_a_prefetched_delta_applies(inprocess_coordinator: RunningServer, no_arena_leak: None) -> None:
    steps = _steps()
    with (
        _publisher(inprocess_coordinator.address) as pub,
        _fleet(inprocess_coordinator.address, r0={"mode": "tcp"}) as (_, pullers),
    ):
        puller, engine = pullers["r0"], DictApplier()
        prefetcher = Prefetcher(puller, follow=False)
        try:
            for v in (1, 2, 3):
                params = steps.step()
                pub.publish(params, v)
                prefetcher.request(v)
                eventually(lambda v=v: prefetcher.status()["ready"] == v, what=f"version {v} prefetched")
                with prefetcher.hold(v) as ready:
                    assert ready is not None and ready.error is None
                    assert ready.delta_base == (v - 1 if v > 1 else 0)
                    assert apply_prefetched(ready, puller, engine).ok
                assert _same(engine, params)
        finally:
            prefetcher.close()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_what_auto_publishes(inprocess_coordinator: RunningServer, no_arena_leak: None, dtype: object) -> None:
    """fp32 weights change in nearly every 16-bit word: no delta is worth publishing. A
    delta the coordinator refuses (here: a wrong base digest) is dropped and the version
    published whole."""
    steps = _steps(dtype)
    with _publisher(inprocess_coordinator.address) as pub:
        pub.publish(steps.step(), 1)
        if dtype is np.float32:
            assert pub.publish(steps.step(), 2).delta_bytes == 0
            return
        pub._manifest_digests[1] = "0" * 64
        published = pub.publish(steps.step(), 2)
        assert published.delta_bytes == 0 and published.state == "READY"


def test_relays_re_serve_the_delta_and_a_rollout_without_the_base_reads_the_rebuilt_version(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """A chain of 4 relays: the trainer sends each delta byte once. r2 sits version 2 out
    (r3, reading from it, gets the delta from the trainer instead), so for version 3 it
    reads whole chunks from r1, which re-serves its rebuilt version once its tensors
    checked; r3 asks r2 for the delta, which r2 did not pull, and reads it from the
    trainer again."""
    steps = _steps()
    relays = [Relay("job", wait_s=2.0) for _ in range(4)]
    client = CoordinatorClient(inprocess_coordinator.address)
    pullers: list[WeightPuller] = []
    try:
        with _publisher(inprocess_coordinator.address, weight_sync_mode="relay", slots=3) as pub:
            for i, relay in enumerate(relays):
                endpoint = Endpoint(transports=("grpc", "relay"), tcp_address=relay.address)
                client.register_agent("job", f"r{i}", trainer=False, endpoint=endpoint)
                pullers.append(WeightPuller(client, "job", f"r{i}", relay=relay.source))
            engines = [DictApplier() for _ in pullers]
            served = 0
            for v in (1, 2, 3):
                params = steps.step()
                published = pub.publish(params, v)
                chain = [0, 1, 3] if v == 2 else [0, 1, 2, 3]
                results = _sync_in_parallel([pullers[i] for i in chain], [engines[i] for i in chain], v)
                for i, result in zip(chain, results):
                    assert result.ok, (i, result.mismatch)
                    assert _same(engines[i], params)
                egress = pub._servicer.bytes_served - served
                served = pub._servicer.bytes_served
                if v == 1:
                    assert egress == published.total_bytes
                elif v == 2:
                    assert [r.delta_base for r in results] == [1, 1, 1]
                    assert egress == 2 * published.delta_bytes  # to r0, and to r3 past r2
                else:
                    assert [r.delta_base for r in results] == [2, 2, 0, 2]
                    assert egress == 2 * published.delta_bytes  # r2 read whole chunks from r1
                    assert relays[1].source.bytes_served >= published.total_bytes + published.delta_bytes
    finally:
        for closeable in [*pullers, *relays, client]:
            closeable.close()


def test_rollouts_of_one_host_rebuild_the_delta_from_their_pullers_buffers(
    inprocess_coordinator: RunningServer, sockets: Path, no_arena_leak: None
) -> None:
    """Relays on unix sockets: r0 pulls the delta from the trainer, r1 and r2 (holding the
    base too) map r0's delta buffers and rebuild on their side; the trainer sends the
    delta once for the host."""
    steps = _steps()
    relays = [Relay("job", host=f"unix:{sockets}/relay-r{i}.sock", wait_s=2.0) for i in range(3)]
    client = CoordinatorClient(inprocess_coordinator.address)
    pullers: list[WeightPuller] = []
    try:
        with _publisher(inprocess_coordinator.address, weight_sync_mode="relay") as pub:
            for i, relay in enumerate(relays):
                here = Endpoint(transports=("grpc", "relay"), host_id=socket.gethostname(), tcp_address=relay.address)
                client.register_agent("job", f"r{i}", trainer=False, endpoint=here)
                pullers.append(WeightPuller(client, "job", f"r{i}", relay=relay.source))
            engines = [DictApplier() for _ in pullers]
            for v in (1, 2):
                params = steps.step()
                published = pub.publish(params, v)
                served = pub._servicer.bytes_served
                results = _sync_in_parallel(pullers, engines, v)
                assert all(r.ok for r in results) and all(_same(e, params) for e in engines)
                assert [r.delta_base for r in results] == ([0, 0, 0] if v == 1 else [1, 1, 1])
                sent = published.total_bytes if v == 1 else published.delta_bytes
                assert pub._servicer.bytes_served - served == sent
    finally:
        for closeable in [*pullers, *relays, client]:
            closeable.close()


def _sync_in_parallel(pullers: list[WeightPuller], engines: list[DictApplier], version: int) -> list[SyncResult]:
    out: dict[int, SyncResult] = {}

    def run(i: int) -> None:
        out[i] = sync_version(pullers[i], engines[i], version)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pullers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [out[i] for i in range(len(pullers))]


def test_the_fs_store_holds_the_delta_beside_the_part(
    inprocess_coordinator: RunningServer, no_arena_leak: None, tmp_path: Path
) -> None:
    """fs mode: the trainer writes delta.bin beside part.bin; a rollout holding the base
    range-reads only the delta from the store (no route to the trainer needed)."""
    steps = _steps()
    root = str(tmp_path / "store")
    with (
        _publisher(inprocess_coordinator.address, fs_root=root, weight_sync_mode="fs") as pub,
        _fleet(inprocess_coordinator.address, r0={"mode": "fs", "fs_root": root}) as (_, pullers),
    ):
        engine = DictApplier()
        for v in (1, 2, 3):
            params = steps.step()
            published = pub.publish(params, v)
            result = sync_version(pullers["r0"], engine, v)
            assert result.ok and _same(engine, params)
            if v > 1:
                assert result.delta_base == v - 1 and result.bytes_pulled == published.delta_bytes
                (delta,) = (tmp_path / "store" / "job" / f"v{v}" / "r0").glob("*/delta.bin")
                assert delta.stat().st_size > 0
        assert pub._servicer.bytes_served == 0  # every byte came from the store
