"""Prefetch: a version pulled and checked in the background applies the same bytes as a
direct pull and pauses the engine for the apply alone; a corrupted byte found during the
prefetch never reaches the engine; a newer version wins and frees the older lease."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from devtools.cluster import Cluster
from rollout_agent.engines.applier import Applier
from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.prefetch import Prefetcher
from rollout_agent.sync.round import apply_prefetched, sync_version
from tests.integration.support import eventually
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
from weightsync.errors import InvalidArgument
from weightsync.failpoints import Failpoints
from weightsync.manifest import Endpoint, TensorSpec
from weightsync.server import RunningServer


def _params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((256, 128)).astype(np.float32) for i in range(4)
    }


def _setup(address: str, *agents: str) -> CoordinatorClient:
    client = CoordinatorClient(address)
    for agent in agents:
        client.register_agent("job", agent, trainer=False, endpoint=Endpoint())
    return client


@contextlib.contextmanager
def _prefetching(
    address: str, applier: Applier | None = None, **settings: Any
) -> Iterator[tuple[WeightPublisher, CoordinatorClient, WeightPuller, Prefetcher]]:
    """A publisher and, for rollout r0, a client, a puller and a prefetcher that does not
    follow the session by itself (the test asks for versions); all closed after."""
    with WeightPublisher(PublisherSettings(coordinator=address, session="job", chunk_bytes=16384, **settings)) as pub:
        client = _setup(address, "r0")
        puller = WeightPuller(client, "job", "r0")
        prefetcher = Prefetcher(puller, applier=applier, follow=False)
        try:
            yield pub, client, puller, prefetcher
        finally:
            prefetcher.close()
            puller.close()
            client.close()


def test_a_prefetched_version_applies_the_same_bytes_and_pauses_for_the_apply_alone(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=16384)
    with WeightPublisher(settings) as pub:
        client = _setup(inprocess_coordinator.address, "r0", "r1")
        puller = WeightPuller(client, "job", "r0")
        prefetcher = Prefetcher(puller)  # follows the session by itself
        try:
            pub.publish(_params(1), 1)
            eventually(lambda: prefetcher.status()["ready"] == 1, what="version 1 prefetched")
            engine = DictApplier()
            assert engine.weights == {}  # nothing applied while it prefetched
            t0 = time.perf_counter()
            with prefetcher.hold(1) as ready:
                assert ready is not None and ready.error is None
                result = apply_prefetched(ready, puller, engine, blocked_since=t0)
            assert result.ok, result.mismatch
            direct = DictApplier()
            other = WeightPuller(client, "job", "r1")
            assert sync_version(other, direct, 1).ok
            other.close()
            assert {k: v.tobytes() for k, v in engine.weights.items()} == {
                k: v.tobytes() for k, v in direct.weights.items()
            }
            t = result.timings
            assert t["pause_seconds"] < t["pull_seconds"] + t["verify_seconds"] + t["apply_seconds"] + 0.05
            hs = {h.agent_id: h for h in client.status("job").handshakes if h.version == 1}
            assert hs["r0"].ok and hs["r0"].timings.pause_seconds == t["pause_seconds"]
            assert pub.wait_committed(1, 30) == "COMMITTED"
        finally:
            prefetcher.close()
            puller.close()
            client.close()


def test_a_corrupted_byte_found_in_prefetch_never_reaches_the_engine(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=16384)
    with WeightPublisher(settings) as pub:
        client = _setup(inprocess_coordinator.address, "r0")
        puller = WeightPuller(client, "job", "r0")
        prefetcher = Prefetcher(puller, failpoints=Failpoints("puller.corrupt_assembled=2"), follow=False)
        engine = DictApplier()
        try:
            pub.publish(_params(1), 1)
            prefetcher.request(1)
            eventually(lambda: prefetcher.status()["ready"] == 1, what="version 1 prefetched")
            with prefetcher.hold(1) as ready:
                assert ready is not None and ready.error is not None and "refusing to apply" in ready.error.message
                refused = apply_prefetched(ready, puller, engine)
            assert not refused.ok and refused.failure == "data_loss"
            assert engine.weights == {} and engine.version == 0  # the live weights never changed
            (hs,) = [h for h in client.status("job").handshakes if h.version == 1]
            assert not hs.ok and "refusing to apply" in hs.mismatch
            params = _params(2)
            pub.publish(params, 2)
            prefetcher.request(2)
            eventually(lambda: prefetcher.status()["ready"] == 2, what="version 2 prefetched")
            with prefetcher.hold(2) as ready:
                assert apply_prefetched(ready, puller, engine).ok
            assert all(engine.weights[k].tobytes() == v.tobytes() for k, v in params.items())
        finally:
            prefetcher.close()
            puller.close()
            client.close()


def test_a_tensor_that_fails_its_check_has_its_chunk_refetched_and_applies(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """Chunks land unchecked; the tensor check finds the flipped byte, the chunk under it
    is located and re-fetched, and the tensor checked again applies bit for bit."""
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=16384)
    with WeightPublisher(settings) as pub:
        client = _setup(inprocess_coordinator.address, "r0")
        puller = WeightPuller(client, "job", "r0")
        prefetcher = Prefetcher(puller, failpoints=Failpoints("puller.corrupt_assembled=1"), follow=False)
        engine = DictApplier()
        try:
            params = _params(1)
            pub.publish(params, 1)
            prefetcher.request(1)
            eventually(lambda: prefetcher.status()["ready"] == 1, what="version 1 prefetched")
            with prefetcher.hold(1) as ready:
                assert ready is not None and ready.error is None and ready.chunk_retries == 1
                result = apply_prefetched(ready, puller, engine)
            assert result.ok and result.chunk_retries == 1
            assert all(engine.weights[k].tobytes() == v.tobytes() for k, v in params.items())
            assert pub.wait_committed(1, 30) == "COMMITTED"
        finally:
            prefetcher.close()
            puller.close()
            client.close()


def test_prefetch_threads_run_at_the_nice_value_asked_for(inprocess_coordinator: RunningServer) -> None:
    """The engine's threads win the cores (the pull's lane threads, started by this
    thread, inherit its value on Linux)."""
    client = CoordinatorClient(inprocess_coordinator.address)  # asked for nothing: no session needed
    puller = WeightPuller(client, "job", "r0")
    prefetcher = Prefetcher(puller, follow=False, nice=7)
    try:
        (thread,) = [t for t in threading.enumerate() if t.name == "prefetch"]
        eventually(lambda: os.getpriority(os.PRIO_PROCESS, thread.native_id) == 7, what="prefetch thread at nice 7")
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0  # the caller's is unchanged
    finally:
        prefetcher.close()
        puller.close()
        client.close()


def test_a_newer_version_wins_and_frees_the_older_lease(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    with _prefetching(inprocess_coordinator.address, slots=2, slot_wait_s=3.0) as (pub, client, puller, prefetcher):
        pub.publish(_params(1), 1)
        prefetcher.request(1)
        eventually(lambda: prefetcher.status()["ready"] == 1, what="version 1 prefetched")
        assert client.get_manifest("job", 1)[0].version.leases == 1  # held while it waits
        pub.publish(_params(2), 2)
        prefetcher.request(2)
        eventually(lambda: prefetcher.status()["ready"] == 2, what="version 2 replaced version 1")
        assert client.get_manifest("job", 1)[0].version.leases == 0  # abandoned: its slot is free
        pub.publish(_params(3), 3)  # reuses version 1's slot without waiting for a lease
        with prefetcher.hold(1) as ready:
            # version 1 is gone: the caller pulls it itself into the buffer, so the waiting
            # version 2 is dropped there and prefetched again after the block
            assert ready is None
        eventually(lambda: prefetcher.status()["ready"] == 2, what="version 2 prefetched again")
        with prefetcher.hold(2) as ready:
            assert ready is not None and ready.version == 2
            assert apply_prefetched(ready, puller, DictApplier()).ok


def test_the_prefetch_thread_outlives_an_unexpected_exception(
    inprocess_coordinator: RunningServer, no_arena_leak: None, monkeypatch
) -> None:  # noqa: ANN001
    """An exception that is not a weightsync error (an allocation, a bug) must not end the
    prefetch thread, or every later update waits out `prefetch_wait_s` for nothing."""
    import rollout_agent.sync.prefetch as prefetch_module

    real, calls = prefetch_module.prefetch, []

    def flaky(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("no receive buffer to be had")
        return real(*args, **kwargs)

    monkeypatch.setattr(prefetch_module, "prefetch", flaky)
    with _prefetching(inprocess_coordinator.address) as (pub, _client, _puller, prefetcher):
        pub.publish(_params(1), 1)
        assert not prefetcher.wait_ready(1, 10)  # its pull failed: the update pulls it
        pub.publish(_params(2), 2)
        assert prefetcher.wait_ready(2, 30)  # the same thread prefetches the next one


class _ModelOfOneShape(DictApplier):
    """An engine whose model takes (256, 128) weights only, as vLLM's takes its norms."""

    def check(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        for spec in tensors.values():
            if spec.shape != (256, 128):
                raise InvalidArgument(f"version {version}'s {spec.name!r} is not (256, 128)", field="manifest.tensors")


def test_another_models_version_is_refused_before_a_byte_of_it_is_pulled(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """A trainer of another model (same names, wider) is refused from the manifest, before
    a receive buffer is sized for its version or a byte of it is pulled."""
    engine = _ModelOfOneShape()
    with _prefetching(inprocess_coordinator.address, applier=engine) as (pub, client, puller, prefetcher):
        pub.publish({k: np.zeros((1024, 512), np.float32) for k in _params(1)}, 1)
        assert prefetcher.wait_ready(1, 30)
        with prefetcher.hold(1) as ready:
            assert ready is not None and ready.bytes_pulled == 0 and "is not (256, 128)" in ready.error.message
            refused = apply_prefetched(ready, puller, engine)
        assert not refused.ok and engine.weights == {}
        (hs,) = [h for h in client.status("job").handshakes if h.version == 1]
        assert not hs.ok and hs.bytes_pulled == 0 and "is not (256, 128)" in hs.mismatch
        assert puller._buffers == {}  # no receive buffer was sized for it
        pub.publish(_params(2), 2)
        assert sync_version(puller, engine, 2).ok  # the same check passes the right model's


def test_an_update_abandons_an_older_prefetch_stuck_on_a_frozen_trainer(cluster: Cluster) -> None:
    """docs/design.md: a newer version abandons an older prefetch. An update (`hold`) of
    version 2 does not wait for the prefetch of version 1 in progress to end, which from a
    trainer frozen mid-transfer is `timeout_s` per read, three reads, with the engine held."""
    coord = cluster.start_coordinator(args=["--lease-ttl-s", "60"])  # r0 beats no lease here
    trainer = ["--model-size", "small", "--steps", "1", "--weight-sync-mode", "tcp", "--hold"]
    t1 = cluster.start_trainer("t1", coord.address, "job", trainer)
    client = _setup(coord.address, "r0")
    puller = WeightPuller(client, "job", "r0", mode="tcp")
    prefetcher = Prefetcher(puller, follow=False)  # told of no version 2: only the update asks for it
    try:
        client.wait_for_version("job", 1, states=("READY",), timeout_s=60)
        t1.popen.send_signal(signal.SIGSTOP)
        prefetcher.request(1)
        eventually(lambda: client.status("job").versions[0].leases == 1, what="version 1 prefetching")
        cluster.start_trainer("t2", coord.address, "job", [*trainer, "--start-version", "2"])
        client.wait_for_version("job", 2, states=("READY",), timeout_s=60)
        t0 = time.monotonic()
        with prefetcher.hold(2) as ready:
            waited = time.monotonic() - t0
            assert ready is None  # the caller pulls version 2 itself
            result = sync_version(puller, DictApplier(), 2)
        assert waited < 10, f"the update waited {waited:.1f}s for the stuck prefetch"
        assert result.ok, result.mismatch
    finally:
        t1.popen.send_signal(signal.SIGCONT)
        prefetcher.close()
        puller.close()
        client.close()
