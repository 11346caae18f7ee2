"""A JAX engine's weights synced from a real publisher: sync_version into a JaxApplier
(tpu-inference's layout), prefetched (host fingerprints taken right after the digest
check) and not, and built aside by the prefetch; the handshake, the pause the applier
reports, its metrics; a bit flipped on its way to the device refused, the old weights
serving on; and a version past the rollout's host memory limit refused before its pull."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ml_dtypes
import numpy as np
from prometheus_client import generate_latest

from devtools.scrape import metric_value
from rollout_agent.engines.jax.applier import JaxApplier
from rollout_agent.engines.jax.model import PROFILES, empty_leaves, family_map, mesh_of
from rollout_agent.engines.jax.names import NameMap, reference_leaf
from rollout_agent.engines.jax.targets import WeightsHolder
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.host_budget import memory_status
from rollout_agent.sync.prefetch import Prefetcher
from rollout_agent.sync.round import apply_prefetched, sync_version
from tests.integration.support import eventually
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
from weightsync.failpoints import Failpoints
from weightsync.host_memory import host_memory
from weightsync.manifest import Endpoint, Manifest
from weightsync.metrics import build_metrics
from weightsync.model_shapes import ModelShape, param_shapes
from weightsync.server import RunningServer

SHAPE = ModelShape(64, 2, 4, 2, 32, 128, 256, tied=True)


def _params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s, dtype=np.float32).astype(ml_dtypes.bfloat16)
            for n, s in param_shapes(SHAPE).items()}  # fmt: skip


def _holder() -> tuple[WeightsHolder, NameMap]:
    """An engine's tpu-inference-layout leaves over this process's devices, and its name map."""
    import jax

    name_map = family_map("qwen3", "tpu_inference", SHAPE)
    mesh = mesh_of((1, len(jax.devices())))
    return WeightsHolder(
        empty_leaves(name_map, SHAPE, SHAPE.layers, SHAPE.tied, mesh, PROFILES["tpu_inference"])
    ), name_map


@contextlib.contextmanager
def _publisher_and_puller(address: str) -> Iterator[tuple[WeightPublisher, CoordinatorClient, WeightPuller]]:
    settings = PublisherSettings(coordinator=address, session="job", chunk_bytes=65536)
    with WeightPublisher(settings) as pub:
        client = CoordinatorClient(address)
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        puller = WeightPuller(client, "job", "r0")
        try:
            yield pub, client, puller
        finally:
            puller.close()
            client.close()


def _assert_holds(holder: WeightsHolder, applier: JaxApplier, params: dict[str, np.ndarray]) -> None:
    plans = applier._plan({n: (a.shape, "bfloat16") for n, a in params.items()})
    tree = holder.get()
    for path, plan in plans.items():
        assert np.array_equal(np.asarray(tree[path]).view(np.uint16), reference_leaf(plan, params).view(np.uint16)), (
            path
        )


def test_versions_sync_into_a_jax_engine_and_a_corrupted_one_never_serves(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    holder, name_map = _holder()
    fail = Failpoints("jax_applier.corrupt_after_check=1")
    armed = [False]
    point = "jax_applier.corrupt_after_check"
    applier = JaxApplier(holder, name_map, corrupt_next=lambda: armed[0] and fail.fire(point))
    metrics = build_metrics("rollout")
    with _publisher_and_puller(inprocess_coordinator.address) as (pub, client, puller):
        try:
            for v in (1, 2):
                params = _params(v)
                pub.publish(params, v)
                result = sync_version(puller, applier, v, metrics=metrics)
                assert result.ok, result.mismatch
                assert pub.wait_committed(v, 30) == "COMMITTED"
                assert result.apply["mode"] == "swap" and result.apply["version"] == v
                assert result.timings["pause_seconds"] == result.apply["pause_seconds"]
                assert result.timings["pause_seconds"] < result.timings["apply_seconds"]  # built aside
                assert result.apply["host_fingerprint_seconds"] > 0  # taken in the prefetch, after the digests
                _assert_holds(holder, applier, params)
            text = generate_latest(metrics.registry).decode()
            assert metric_value(text, "weightsync_applies_total", session="job", mode="swap") == 2
            served = holder.get()
            armed[0] = True
            pub.publish(_params(3), 3)
            refused = sync_version(puller, applier, 3, metrics=metrics)
            assert not refused.ok and refused.failure == "data_loss"
            assert "on the device does not match the verified bytes" in refused.mismatch
            assert holder.get() is served  # the old weights keep serving
            (hs,) = [h for h in client.status("job").handshakes if h.version == 3]
            assert not hs.ok and "old weights keep serving" in hs.mismatch
            pub.publish(_params(4), 4)
            assert sync_version(puller, applier, 4, apply_mode="streaming", metrics=metrics).ok
            assert holder.get() is not served
        finally:
            applier.close()


def test_in_place_a_leaf_damaged_on_its_way_is_built_again_and_counted(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    holder, name_map = _holder()
    fire = iter([True, False])
    applier = JaxApplier(holder, name_map, mode="inplace", corrupt_next=lambda: next(fire, False))
    metrics = build_metrics("rollout")
    with _publisher_and_puller(inprocess_coordinator.address) as (pub, _, puller):
        try:
            params = _params(5)
            pub.publish(params, 1)
            result = sync_version(puller, applier, 1, metrics=metrics)
            assert result.ok, result.mismatch
            assert result.apply["mode"] == "inplace" and len(result.apply["repaired_leaves"]) == 1
            assert pub.wait_committed(1, 30) == "COMMITTED"
            _assert_holds(holder, applier, params)
            text = generate_latest(metrics.registry).decode()
            assert metric_value(text, "weightsync_apply_repaired_leaves_total", session="job") == 1
        finally:
            applier.close()


def test_a_version_built_aside_while_the_engine_serves_is_only_committed_at_its_sync(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """The prefetch builds each verified version's leaves aside (the old ones serve on);
    a newer version replaces a staged older one, whose leaves are freed; the sync of the
    staged version swaps it in; an in-place engine is left to its sync."""
    holder, name_map = _holder()
    applier = JaxApplier(holder, name_map, mode="swap")
    with _publisher_and_puller(inprocess_coordinator.address) as (pub, _, puller):
        prefetcher = Prefetcher(puller, applier=applier, follow=False, stage=True)
        try:
            served = holder.get()
            pub.publish(_params(1), 1)
            prefetcher.request(1)
            eventually(lambda: prefetcher.status()["staged"] == 1, what="version 1 built aside")
            assert holder.get() is served  # nothing swapped in yet
            staged_v1 = list(applier._open().new.values())
            assert len(staged_v1) == len(served) and not any(a.is_deleted() for a in staged_v1)
            pub.publish(_params(2), 2)
            prefetcher.request(2)
            eventually(lambda: prefetcher.status()["staged"] == 2, what="version 2 built aside")
            assert all(a.is_deleted() for a in staged_v1)  # the older round aborted, its leaves freed
            with prefetcher.hold(2) as ready:
                assert ready is not None and ready.staged
                result = apply_prefetched(ready, puller, applier)
            assert result.ok, result.mismatch
            assert result.apply["mode"] == "swap" and result.apply["version"] == 2
            assert pub.wait_committed(2, 30) == "COMMITTED"
            _assert_holds(holder, applier, _params(2))
            pub.publish(_params(3), 3)
            prefetcher.request(3)
            eventually(lambda: prefetcher.status()["staged"] == 3, what="version 3 built aside")
            with prefetcher.hold(3) as ready:
                assert ready is not None and ready.staged  # taken, and not committed
            assert applier._round is None  # its round aborted on the way out
        finally:
            prefetcher.close()
        prefetcher = Prefetcher(puller, applier=applier, follow=False, stage=True)
        try:
            prefetcher.request(3)
            eventually(lambda: prefetcher.status()["staged"] == 3, what="version 3 built aside again")
        finally:
            prefetcher.close()  # a staged version left: its round aborted
        assert applier._round is None
        _assert_holds(holder, applier, _params(2))

        inplace = JaxApplier(holder, name_map, mode="inplace")  # version 3 again, into the same engine
        prefetcher = Prefetcher(puller, applier=inplace, follow=False, stage=True)
        try:
            prefetcher.request(3)
            eventually(lambda: prefetcher.status()["ready"] == 3, what="version 3 prefetched")
            assert prefetcher.status()["staged"] == 0 and inplace._round is None  # in place writes the live leaves
            with prefetcher.hold(3) as ready:
                assert ready is not None and apply_prefetched(ready, puller, inplace).ok
            _assert_holds(holder, inplace, _params(3))
        finally:
            prefetcher.close()
            applier.close()
            inplace.close()


def test_a_version_past_the_host_memory_limit_is_refused_before_a_byte_is_pulled(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    holder, name_map = _holder()
    applier = JaxApplier(holder, name_map)
    metrics = build_metrics("rollout")
    with _publisher_and_puller(inprocess_coordinator.address) as (pub, client, puller):
        try:
            puller.metrics = metrics
            now = host_memory()
            # a limit the process is already past, by far more than the heap's own ups and
            # downs (the suite's process frees and trims megabytes between two readings)
            puller.host_memory_limit_bytes = (now.anon or now.rss) // 2
            pub.publish(_params(1), 1)
            refused = sync_version(puller, applier, 1, metrics=metrics)
            assert not refused.ok and refused.failure == "local" and refused.bytes_pulled == 0
            assert "host_memory_limit_bytes" in refused.mismatch and "receive buffers" in refused.mismatch
            assert puller.held()["receive"] == 0  # no buffer sized for it
            (hs,) = [h for h in client.status("job").handshakes if h.version == 1]
            assert not hs.ok and "host_memory_limit_bytes" in hs.mismatch
            model = sum(a.nbytes for a in _params(1).values())
            assert puller.growth(_published_manifest(client, 2, pub, _params(2))) >= model

            puller.host_memory_limit_bytes = (now.anon or now.rss) + (1 << 30)
            result = sync_version(puller, applier, 2, metrics=metrics)
            assert result.ok, result.mismatch
            status = memory_status(puller)
            assert status["held"]["receive"] >= model and status["limit"] == puller.host_memory_limit_bytes
            assert status["anon"] > 0 and status["rss"] >= status["anon"]
            text = generate_latest(metrics.registry).decode()
            assert metric_value(text, "weightsync_host_memory_bytes", session="job", kind="anon") > 0
            assert metric_value(text, "weightsync_host_memory_limit_bytes", session="job") == status["limit"]
        finally:
            applier.close()


def _published_manifest(
    client: CoordinatorClient, v: int, pub: WeightPublisher, params: dict[str, np.ndarray]
) -> Manifest:
    """Publishes `params` as version `v` and returns its manifest (leased by nobody)."""
    pub.publish(params, v)
    return client.get_manifest("job", v)[1]
