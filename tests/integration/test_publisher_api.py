"""A publisher used as a library: shared by threads (a training loop's background publish, a
close at exit), handed arguments the coordinator would refuse."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.round import sync_version
from tests.integration.support import eventually
from trainer_agent.publish.publisher import PublishResult, WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, WeightsyncError
from weightsync.manifest import Endpoint
from weightsync.server import RunningServer


def _weights(version: int, layers: int = 16) -> dict[str, np.ndarray]:
    return {
        f"model.layers.{i}.mlp.weight": np.full(1 << 20, version * 100 + i, dtype=np.float32) for i in range(layers)
    }


def test_publishes_from_two_threads_take_two_slots_and_both_serve(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """Two publishes at once claim a free slot each, never the same one (staged over each
    other, both would be READY with version 1's bytes gone, `not staged here`), and no
    arena leaks."""
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=1 << 20, slots=3)
    results: dict[int, PublishResult] = {}
    refused: dict[int, WeightsyncError] = {}
    start = threading.Barrier(2)

    def publish(publisher: WeightPublisher, version: int) -> None:
        start.wait()
        try:
            results[version] = publisher.publish(_weights(version), version)
        except FailedPrecondition as e:  # version 2 went first: 1 is not newer
            refused[version] = e

    with WeightPublisher(settings) as publisher:
        client.register_agent("job", "r0", trainer=False, endpoint=publisher.endpoint)
        threads = [threading.Thread(target=publish, args=(publisher, v)) for v in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert 2 in results and set(results) | set(refused) == {1, 2}
        assert all("not newer" in e.message for e in refused.values())
        assert len({r.slot for r in results.values()}) == len(results)
        for version in results:
            puller = WeightPuller(client, "job", "r0", mode="tcp")
            applier = DictApplier()
            outcome = sync_version(puller, applier, version)
            puller.close()
            assert outcome.ok, outcome.mismatch
            for name, array in _weights(version).items():
                assert np.array_equal(applier.weights[name], array)
    client.close()


def test_a_close_from_another_thread_waits_for_the_publish_it_would_unmap(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """close() unmapped the arena under a publish staging into it on another thread."""
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=1 << 20)
    publisher = WeightPublisher(settings).start()
    weights = _weights(1, layers=64)  # 256 MiB: staging takes a while
    outcome: list[object] = []

    def publish() -> None:
        try:
            outcome.append(publisher.publish(weights, 1))
        except FailedPrecondition as e:  # closed before it claimed a slot
            outcome.append(e)

    thread = threading.Thread(target=publish)
    thread.start()
    time.sleep(0.2)
    publisher.close()
    thread.join(60)
    assert not thread.is_alive() and len(outcome) == 1
    with pytest.raises(FailedPrecondition, match="closed"):
        publisher.publish(weights, 2)


ONES = np.ones(8, np.float32)


@pytest.mark.parametrize(
    ("params", "version", "weight_dtype", "field"),
    [
        ({"model.norm.weight": ONES}, -1, "", "version"),  # broke every later publish
        ({"model.norm.weight": ONES}, 1 << 64, "", "version"),
        ({"model.norm.weight": ONES}, 0, "", "version"),
        ({"model.norm.weight": ONES}, 1.0, "", "version"),
        ({"model.norm.weight": ONES}, True, "", "version"),
        ({7: ONES}, 1, "", "params"),  # INTERNAL once staged
        ([("model.norm.weight", ONES)], 1, "", "params"),  # an AttributeError; publish_stream takes pairs
        ({"model..weight": ONES}, 1, "", "params['model..weight']"),
        ({"model.norm.weight": np.ones(8, np.complex64)}, 1, "", "params['model.norm.weight']"),
        ({"model": {"norm.weight": ONES}}, 1, "", "params['model']"),
        # cast first: a TypeError mid-staging, and complex values cast without a word
        ({"model": {"norm.weight": ONES}}, 1, "bfloat16", "params['model']"),
        ({"model.norm.weight": None}, 1, "bfloat16", "params['model.norm.weight']"),
        ({"model.norm.weight": np.ones(8, np.complex64)}, 1, "bfloat16", "params['model.norm.weight']"),
    ],
)
def test_an_argument_the_coordinator_would_refuse_is_refused_first_and_costs_nothing(
    inprocess_coordinator: RunningServer,
    no_arena_leak: None,
    params: dict,
    version: object,
    weight_dtype: str,
    field: str,
) -> None:
    """A version the request cannot carry is refused before anything is staged, costing
    nothing (staged, it would hold its slot under that version, and every later publish
    and the heartbeat would fail on it for good)."""
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    settings = PublisherSettings(
        coordinator=inprocess_coordinator.address, session="job", publish_wait_s=0, weight_dtype=weight_dtype
    )
    with WeightPublisher(settings) as publisher:
        client.register_agent("job", "r0", trainer=False, endpoint=publisher.endpoint)
        calls = [lambda: publisher.publish(params, version)]  # type: ignore[arg-type]
        if isinstance(params, dict):  # the same tensors as (name, array) pairs
            calls.append(lambda: publisher.publish_stream(iter(params.items()), version, capacity_bytes=1 << 20))  # type: ignore[arg-type]
        for call in calls:
            with pytest.raises(InvalidArgument) as refused:
                call()
            assert refused.value.field == field, refused.value.message
        assert list(client.status("job").versions) == []
        good = _weights(1, layers=2)
        assert publisher.publish(good, 1).state == "READY"
        puller = WeightPuller(client, "job", "r0", mode="tcp")
        applier = DictApplier()
        outcome = sync_version(puller, applier, 1)
        puller.close()
        assert outcome.ok, outcome.mismatch
        assert publisher.wait_committed(1, timeout_s=30) == "COMMITTED"
    client.close()


def test_a_publish_called_again_keeps_its_version_in_one_slot(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """A call made again (same version, key and bytes: a retry after an error the caller
    could not read) is a duplicate in the slot of the first, not a second copy in the
    other slot, so version 2 takes the other slot and version 1 is not released for it."""
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session="job", slots=2)
    with WeightPublisher(settings) as publisher:
        first = publisher.publish(_weights(1, layers=2), 1)
        again = publisher.publish(_weights(1, layers=2), 1)
        assert again.duplicate and again.slot == first.slot
        assert publisher.publish(_weights(2, layers=2), 2).slot != first.slot
        states = {v.version: v.state for v in client.status("job").versions}
        assert tpb.VersionState.Name(states[1]) != "RELEASED"
    client.close()


def test_a_store_root_that_cannot_be_written_fails_the_publish_at_once(
    inprocess_coordinator: RunningServer, no_arena_leak: None, tmp_path: Path
) -> None:
    """A root that is a file (or read-only, or not this user's) fails the publish at once,
    not after trying again for publish_wait_s (120 s): it frees its slot, and publishes
    once the root is fixed."""
    root = tmp_path / "store"
    root.write_bytes(b"a file where the store should be")
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    settings = PublisherSettings(
        coordinator=inprocess_coordinator.address, session="job", chunk_bytes=1 << 20, fs_root=str(root)
    )
    with WeightPublisher(settings) as publisher:
        t0 = time.monotonic()
        with pytest.raises(FailedPrecondition, match="not writable") as e:
            publisher.publish(_weights(1, layers=2), 1)
        assert time.monotonic() - t0 < 10
        assert e.value.field == "fs_root"
        assert list(client.status("job").versions) == []
        root.unlink()
        assert publisher.publish(_weights(1, layers=2), 1).state == "READY"
    client.close()


def test_a_forced_release_from_wsctl_frees_the_slot_a_wedged_rollout_holds(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """The operator's way out that the README gives: a rollout that leases version 1 and
    never reports (an engine wedged while its heartbeats go on), while another reads
    version 2, keeps both of the trainer's slots, so publishing version 3 waits for the
    oldest (up to slot_wait_s, then SlotBusy). `wsctl release-version 1 --force` lets that
    publish go on at once."""
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    settings = PublisherSettings(
        coordinator=inprocess_coordinator.address, session="job", chunk_bytes=1 << 20, slot_wait_s=60
    )
    with WeightPublisher(settings) as publisher:
        for version in (1, 2):
            publisher.publish(_weights(version, layers=2), version)
        for agent, version in (("r9", 1), ("r8", 2)):  # the wedged rollout's lease, and one reading 2
            client.register_agent("job", agent, trainer=False, endpoint=publisher.endpoint)
            client.get_manifest("job", version, agent_id=agent)
        done: list[PublishResult] = []
        third = threading.Thread(target=lambda: done.append(publisher.publish(_weights(3, layers=2), 3)))
        third.start()

        def refused_releases() -> float:
            sample = {"service": "weightsync.v1.Coordinator", "method": "ReleaseVersion", "code": "FAILED_PRECONDITION"}
            return inprocess_coordinator.metrics.registry.get_sample_value("weightsync_rpc_requests_total", sample) or 0

        # Asked to release version 1 and refused, and asked again: the publish waits for the slot.
        eventually(lambda: refused_releases() >= 2, what="the publish of version 3 waiting for a slot")
        assert not done, "version 3 took the slot of a version a live rollout leases"
        forced = subprocess.run(
            [sys.executable, "-m", "weightsync.cli", "--coordinator", inprocess_coordinator.address]
            + ["--session", "job", "release-version", "1", "--force"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert forced.returncode == 0, forced.stderr
        third.join(30)  # a publish still waiting raises SlotBusy at slot_wait_s (60 s)
        assert done and done[0].state == "READY"
        states = {v.version: tpb.VersionState.Name(v.state) for v in client.status("job").versions}
        assert states[1] == "RELEASED" and states[2] == "READY" and states[3] == "READY"
    client.close()


def test_a_commit_not_reached_in_time_says_what_it_waits_for(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """`wait_committed` running out says what it waits for, so a trainer whose rollouts
    follow another session, or have not started, or wedged, can tell which: no live
    rollout at all, or the live rollouts that have not reported the version (and how many
    hold a lease on it)."""
    client = CoordinatorClient(inprocess_coordinator.address)
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=1 << 20)
    with WeightPublisher(settings) as pub:
        pub.publish(_weights(1, layers=2), 1)
        with pytest.raises(DeadlineExceeded, match="within 0.3s: it is READY and no live rollout is registered"):
            pub.wait_committed(1, 0.3)
        puller = WeightPuller(client, "job", "r0")
        client.register_agent("job", "r0", trainer=False, endpoint=Endpoint())
        client.register_agent("job", "wedged", trainer=False, endpoint=Endpoint())
        client.get_manifest("job", 1, agent_id="wedged")  # leases it, never reports
        pub.publish(_weights(2, layers=2), 2)
        assert sync_version(puller, DictApplier(), 2).ok
        with pytest.raises(DeadlineExceeded) as waiting:
            pub.wait_committed(2, 0.3)
        assert "it is READY; 1 of 2 live rollouts reported it, not yet 'wedged'" in waiting.value.message
        client.get_manifest("job", 2, agent_id="wedged")
        with pytest.raises(DeadlineExceeded, match=r"\(1 hold a lease on it; min_rollouts 1\)"):
            pub.wait_committed(2, 0.3)
        puller.close()
    client.close()


class _RefusingApplier(DictApplier):
    """An engine that fails to take any version (its own exception, as out of memory)."""

    def apply(self, tensors):  # type: ignore[no-untyped-def]
        raise RuntimeError("the engine refused the weights")


def test_a_slot_reuse_keeps_the_newest_committed_version_unless_every_other_slot_is_leased(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    """Version 1 commits, version 2 fails its handshake (PARTIAL): publishing 3 reuses 2's
    slot, and 1 stays COMMITTED. Version 3 fails too (1 is what `latest` names) while a
    rollout still leases it: publishing 4 gives 1 up (its slot is the only one not leased)
    rather than wait on a lease only a newer version ends."""
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    settings = PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=1 << 20)

    def states() -> dict[int, str]:
        return {v.version: tpb.VersionState.Name(v.state) for v in client.status("job").versions}

    with WeightPublisher(settings) as publisher:
        client.register_agent("job", "r0", trainer=False, endpoint=publisher.endpoint)
        puller = WeightPuller(client, "job", "r0", mode="tcp")
        try:
            for version, applier in ((1, DictApplier()), (2, _RefusingApplier())):
                publisher.publish(_weights(version, layers=2), version)
                outcome = sync_version(puller, applier, version)
                assert outcome.ok == (version == 1), outcome.mismatch
            assert states() == {1: "COMMITTED", 2: "PARTIAL"}
            assert publisher.publish(_weights(3, layers=2), 3).slot == 1  # 2's slot
            assert states() == {1: "COMMITTED", 2: "RELEASED", 3: "READY"}
            assert not sync_version(puller, _RefusingApplier(), 3).ok
            assert client.get_manifest("job", 0)[0].version.version == 1  # latest: 3 failed
            client.get_manifest("job", 3, agent_id="r0")  # r0 pulls 3 again: its lease
            assert publisher.publish(_weights(4, layers=2), 4).slot == 0  # 1's slot, given up
            assert states() == {1: "RELEASED", 2: "RELEASED", 3: "PARTIAL", 4: "READY"}
        finally:
            puller.close()
    client.close()
