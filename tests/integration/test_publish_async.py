"""`WeightPublisher.publish_async` against a real coordinator: versions commit and read back
bit-exact, latest wins, failures surface, close() with work pending, donated parameters."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import wait

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.round import sync_version
from tests.integration.support import eventually
from trainer_agent.publish.async_publish import PublishSuperseded
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage import params as params_module
from weightsync.client import CoordinatorClient
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.server import RunningServer

CPU = jax.devices("cpu")[0]
NAMES = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)] + ["model.norm.weight"]


def _params(version: int) -> dict[str, jax.Array]:
    with jax.default_device(CPU):
        return {
            name: jnp.full((64, 32) if "proj" in name else (32,), version + i / 8, jnp.float32)
            for i, name in enumerate(NAMES)
        }


def _host(params: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).copy() for k, v in params.items()}


@pytest.fixture
def client(inprocess_coordinator: RunningServer) -> Iterator[CoordinatorClient]:
    c = CoordinatorClient(inprocess_coordinator.address)
    c.open_session("job", trainer=False)
    yield c
    c.close()


def _publisher(coordinator: RunningServer, **kw: object) -> WeightPublisher:
    settings = PublisherSettings(coordinator=coordinator.address, session="job", chunk_bytes=8192, **kw)  # type: ignore[arg-type]
    return WeightPublisher(settings).start()


def _pulled(client: CoordinatorClient, version: int) -> dict[str, np.ndarray]:
    puller = WeightPuller(client, "job", "r0", mode="shm")
    applier = DictApplier()
    try:
        outcome = sync_version(puller, applier, version)
    finally:
        puller.close()
    assert outcome.ok, outcome.mismatch
    return applier.weights


@pytest.mark.parametrize("snapshot", [False, True])
def test_async_publishes_commit_and_read_back_bit_exact(
    inprocess_coordinator: RunningServer, client: CoordinatorClient, no_arena_leak: None, snapshot: bool
) -> None:
    with _publisher(inprocess_coordinator, weight_dtype="bfloat16", use_ffi=False) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        for version in (1, 2, 3):
            params = _params(version)
            future = pub.publish_async(params, version, snapshot=snapshot)
            assert future.version == version and future.result(60).state == "READY"
            weights = _pulled(client, version)
            for name, value in params.items():
                expect = np.asarray(value.astype(jnp.bfloat16))
                assert weights[name].dtype == expect.dtype and np.array_equal(weights[name], expect)
            assert pub.wait_committed(version, 30) == "COMMITTED"
        assert pub.publish_held_bytes == 0 and pub.publish_skipped == 0


def test_a_newer_version_replaces_the_waiting_one(
    inprocess_coordinator: RunningServer, client: CoordinatorClient, no_arena_leak: None
) -> None:
    with _publisher(inprocess_coordinator) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        versions = {v: _params(v) for v in (1, 2, 3)}
        with pub._one_publish():  # the gate: the worker takes version 1 and waits for it
            f1 = pub.publish_async(versions[1], 1)
            eventually(lambda: pub._async.busy, timeout_s=10, what="the worker on version 1")
            assert not pub.publish_waiting
            f2 = pub.publish_async(versions[2], 2)
            assert pub.publish_waiting  # a publish_async now would supersede version 2
            f3 = pub.publish_async(versions[3], 3)
            skipped = f2.exception(0)
            assert isinstance(skipped, PublishSuperseded) and (skipped.version, skipped.by) == (2, 3)
            one = sum(int(v.nbytes) for v in versions[1].values())
            assert pub.publish_held_bytes == 2 * one  # versions 1 and 3: never three
            registry = pub.metrics.registry
            assert registry.get_sample_value("weightsync_publish_held_bytes", {"session": "job"}) == 2 * one
        assert f1.result(60).state == "READY" and f3.result(60).state == "READY"
        assert pub.publish_skipped == 1 and not pub.publish_waiting
        assert registry.get_sample_value("weightsync_publish_skipped_total", {"session": "job"}) == 1
        with pytest.raises(PublishSuperseded, match="superseded by version 3"):
            pub.wait_committed(2, 5)
        weights = _pulled(client, 3)
        assert all(np.array_equal(weights[k], np.asarray(v)) for k, v in versions[3].items())
        assert pub.wait_committed(3, 30) == "COMMITTED"
        eventually(lambda: pub.publish_held_bytes == 0, timeout_s=10, what="held bytes released")
        assert registry.get_sample_value("weightsync_publish_held_bytes", {"session": "job"}) == 0


def test_a_failure_in_the_background_surfaces_on_the_next_call_and_in_its_future(
    inprocess_coordinator: RunningServer, client: CoordinatorClient, no_arena_leak: None
) -> None:
    with _publisher(inprocess_coordinator, publish_wait_s=0) as pub:
        pub.publish(_params(5), 5)
        refused = pub.publish_async(_params(3), 3)  # the coordinator refuses it: not newer than 5
        wait([refused], 30)
        with pytest.raises(FailedPrecondition, match="not newer") as raised:
            pub.publish_async(_params(6), 6)
        assert refused.exception() is raised.value  # the same failure, in the future too
        assert pub.publish_async(_params(6), 6).result(60).state == "READY"  # raised once

        read = pub.publish_async(_params(4), 4)
        assert isinstance(read.exception(30), FailedPrecondition)  # read from its future
        assert pub.publish(_params(7), 7).state == "READY"  # so not raised again

        with pub._one_publish():  # donated (deleted) before the worker reads it, without a snapshot
            params = _params(8)
            donated = pub.publish_async(params, 8)
            jax.jit(lambda p: {k: v + 1 for k, v in p.items()}, donate_argnums=0)(params)
            assert params[NAMES[0]].is_deleted()
        with pytest.raises(InvalidArgument, match="snapshot=True") as deleted:
            donated.result(30)
        assert deleted.value.field == f"params[{NAMES[0]!r}]"
        with pytest.raises(InvalidArgument, match="params"):  # refused at the call, before anything is held
            pub.publish_async({7: _params(9)[NAMES[0]]}, 9)  # type: ignore[dict-item]
        assert pub.publish_held_bytes == 0


def test_a_donating_step_after_a_snapshot_publishes_the_bytes_offered(
    inprocess_coordinator: RunningServer, client: CoordinatorClient, no_arena_leak: None
) -> None:
    step = jax.jit(lambda p: {k: v * 2 for k, v in p.items()}, donate_argnums=0)
    with _publisher(inprocess_coordinator) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        params = _params(1)
        offered = _host(params)
        with pub._one_publish():  # the worker reads only after the step donated them
            future = pub.publish_async(params, 1, snapshot=True)
            params = step(params)
        assert future.result(60).state == "READY"
        weights = _pulled(client, 1)
        assert all(np.array_equal(weights[k], v) for k, v in offered.items())
        assert all(np.array_equal(np.asarray(params[k]), 2 * v) for k, v in offered.items())


def test_a_blocking_publish_goes_after_the_async_ones(
    inprocess_coordinator: RunningServer, client: CoordinatorClient, no_arena_leak: None
) -> None:
    with _publisher(inprocess_coordinator) as pub:
        done: list[object] = []
        with pub._one_publish():
            f1 = pub.publish_async(_params(1), 1)
            eventually(lambda: pub._async.busy, timeout_s=10, what="the worker on version 1")
            f2 = pub.publish_async(_params(2), 2)
            blocking = threading.Thread(target=lambda: done.append(pub.publish(_params(3), 3)))
            blocking.start()
            eventually(f2.done, timeout_s=10, what="version 2 superseded by the blocking publish")
            assert isinstance(e := f2.exception(), PublishSuperseded) and e.by == 3
        blocking.join(60)
        assert f1.result(0).state == "READY" and done and done[0].version == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize("cancel", [False, True])
def test_close_with_async_work_pending(
    inprocess_coordinator: RunningServer, client: CoordinatorClient, no_arena_leak: None, cancel: bool
) -> None:
    pub = _publisher(inprocess_coordinator)
    gate = threading.Event()
    taken = threading.Event()

    def hold() -> None:
        with pub._one_publish():
            taken.set()
            gate.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(10)
    f1 = pub.publish_async(_params(1), 1)
    eventually(lambda: pub._async.busy, timeout_s=10, what="the worker on version 1")
    f2 = pub.publish_async(_params(2), 2)
    threading.Timer(0.3, gate.set).start()
    pub.close(cancel_pending=cancel)
    holder.join(10)
    if cancel:  # version 2 never ran; version 1 ran, or found the publisher closed
        assert f2.cancelled()
        assert f1.done() and (f1.exception() is None or isinstance(f1.exception(), FailedPrecondition))
    else:  # both ran to their end before the arena went
        assert f1.result(0).state == "READY" and f2.result(0).state == "READY"
    assert pub.publish_held_bytes == 0
    with pytest.raises(FailedPrecondition, match="closed"):
        pub.publish_async(_params(3), 3)
    pub.close()  # idempotent


def test_a_snapshot_cut_into_blocks_by_its_program_publishes_the_manifest_of_a_blocking_publish(
    inprocess_coordinator: RunningServer,
    client: CoordinatorClient,
    no_arena_leak: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an accelerator (CPU devices take its branch here) the snapshot's program writes the
    device path's blocks; after a donating step, the version's chunks are those a blocking
    publish of the same arrays gives, and it reads back bit-exact."""
    monkeypatch.setattr(params_module, "HOST_MEMORY_PLATFORMS", frozenset())
    step = jax.jit(lambda p: {k: v * 2 for k, v in p.items()}, donate_argnums=0)
    with _publisher(inprocess_coordinator, weight_dtype="bfloat16", d2h_block_bytes=8192) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        params = _params(1)
        pub.publish(params, 1)
        with pub._one_publish():  # the worker reads only after the step donated them
            future = pub.publish_async(params, 2, snapshot=True)
            params = step(params)
        assert future.result(60).state == "READY"
        blocking, cut = ([c for p in client.get_manifest("job", v)[1].parts for c in p.chunks] for v in (1, 2))
        assert [(c.offset, c.xxh3) for c in cut] == [(c.offset, c.xxh3) for c in blocking]
        want = {k: np.asarray(v.astype(jnp.bfloat16)) for k, v in _params(1).items()}
        assert all(np.array_equal(w, want[k]) for k, w in _pulled(client, 2).items())
