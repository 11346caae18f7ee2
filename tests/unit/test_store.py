"""SessionStore: state machine, idempotent publish, fencing, persistence, handshakes, leases."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.database import READERS, NotOnLoop, StoreBusy
from coordinator.handshake import AppliedReport
from coordinator.states import TRANSITIONS, VersionState, check_transition
from coordinator.store import SessionStore
from tests.unit.helpers import Clock, damage, make_part, row_shards, sample_arrays
from weightsync.errors import (
    AgentNotFound,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NewestCommitted,
    ResourceExhausted,
    SessionNotFound,
    StaleGeneration,
    TransportUnavailable,
    VersionConflict,
    VersionNotFound,
    WrongState,
)
from weightsync.manifest import Endpoint, Manifest

S = VersionState


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> SessionStore:
    s = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock)
    yield s
    s.close()


def attach(store: SessionStore, *, ranks: int = 1, incarnation: str = "run-1", rollouts: tuple[str, ...] = ()) -> int:
    s, _ = store.open_session("job", trainer=True, incarnation=incarnation, trainer_ranks=ranks)
    for r in rollouts:
        store.register_agent("job", r, role="ROLLOUT", endpoint=Endpoint())
    return s.generation


def good_report(store: SessionStore, version: int, arrays: dict[str, np.ndarray] | None = None) -> AppliedReport:
    _, m = store.manifest("job", version)
    return report_for(m, store.version("job", version).manifest_digest)


def report_for(m: Manifest, digest: str) -> AppliedReport:
    sums = m.tensor_sums()
    return AppliedReport(
        manifest_digest=digest,
        tensor_digests={n: (d, sums[n]) for n, d in m.tensor_digests().items()},
        aggregates=m.aggregates(),
        consumed_names=tuple(m.tensors),
    )


def test_transition_table_is_closed_and_enforced() -> None:
    for src, targets in TRANSITIONS.items():
        for t in S:
            if t in targets:
                check_transition(1, src, t)
            else:
                with pytest.raises(WrongState):
                    check_transition(1, src, t)
    assert TRANSITIONS[S.RELEASED] == frozenset()


def test_publish_single_rank_goes_ready_then_committed(store: SessionStore) -> None:
    gen = attach(store, rollouts=("r0", "r1"))
    part, _ = make_part(sample_arrays())
    out = store.publish_part("job", generation=gen, version=1, idempotency_key="k1", part=part)
    assert out.version.state is S.READY and not out.duplicate
    assert store.report_applied("job", 1, "r0", good_report(store, 1)).mismatch is None
    assert store.version("job", 1).state is S.READY  # r1 still required
    store.report_applied("job", 1, "r1", good_report(store, 1))
    assert store.version("job", 1).state is S.COMMITTED
    states = [s for _, _, s in store.event_states_since("job", 0)]
    assert states == ["STAGING", "READY", "COMMITTED"]


def test_idempotent_publish_and_conflicts(store: SessionStore) -> None:
    gen = attach(store)
    part, _ = make_part(sample_arrays())
    first = store.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
    again = store.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
    assert again.duplicate and again.version == first.version
    other, _ = make_part(sample_arrays(seed=1))
    with pytest.raises(VersionConflict):
        store.publish_part("job", generation=gen, version=1, idempotency_key="k", part=other)
    with pytest.raises(VersionConflict):
        store.publish_part("job", generation=gen, version=1, idempotency_key="other-key", part=part)


def test_non_monotonic_new_version_is_refused(store: SessionStore) -> None:
    gen = attach(store)
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=5, idempotency_key="a", part=part)
    with pytest.raises(FailedPrecondition, match="not newer"):
        store.publish_part("job", generation=gen, version=3, idempotency_key="b", part=part)


def test_generation_fencing(store: SessionStore) -> None:
    old = attach(store, ranks=2, incarnation="run-1")
    arrays = sample_arrays()
    p0, _ = make_part(row_shards(arrays, 0, 2), rank=0)
    p1, _ = make_part(row_shards(arrays, 1, 2), rank=1)
    assert store.publish_part("job", generation=old, version=1, idempotency_key="a", part=p0).version.state is S.STAGING
    # Same incarnation: idempotent attach, no bump.
    assert attach(store, ranks=2, incarnation="run-1") == old
    new = attach(store, ranks=2, incarnation="run-2")
    assert new == old + 1
    assert store.version("job", 1).state is S.FAILED  # superseded while staging
    with pytest.raises(StaleGeneration):
        store.publish_part("job", generation=old, version=2, idempotency_key="b", part=p1)
    with pytest.raises(StaleGeneration):
        store.abort_version("job", generation=old, version=1, reason="x")
    with pytest.raises(FailedPrecondition):
        store.open_session("job", trainer=True, incarnation="run-2", trainer_ranks=3)
    # A generation this store never issued: it lost the state that did (the writer opens the session again).
    with pytest.raises(SessionNotFound, match="lost its database"):
        store.publish_part("job", generation=new + 1, version=2, idempotency_key="b", part=p1)


def test_multi_rank_staging_until_every_rank_sealed(store: SessionStore) -> None:
    gen = attach(store, ranks=2)
    arrays = sample_arrays()
    p0, _ = make_part(row_shards(arrays, 0, 2), rank=0)
    p1, _ = make_part(row_shards(arrays, 1, 2), rank=1)
    assert store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=p0).version.state is S.STAGING
    with pytest.raises(WrongState):
        store.manifest("job", 1)
    out = store.publish_part("job", generation=gen, version=1, idempotency_key="b", part=p1)
    assert out.version.state is S.READY and out.version.sealed_ranks == 2
    _, m = store.manifest("job", 1)
    whole, _ = make_part(arrays)
    assert m.aggregates().element_count == sum(a.size for a in arrays.values())
    assert np.isclose(m.aggregates().grand_total, sum(s.sum for s in whole.shards))


def test_refused_requests_leave_state_unchanged(store: SessionStore, tmp_path: Path) -> None:
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    before = (store.versions("job"), store.parts("job", 1), store.event_states_since("job", 0))
    bad = dataclasses.replace(part, total_bytes=part.total_bytes + 1)
    for call in (
        lambda: store.publish_part("job", generation=gen, version=2, idempotency_key="b", part=bad),
        lambda: store.publish_part("job", generation=gen + 7, version=2, idempotency_key="b", part=part),
        lambda: store.publish_part("nope", generation=gen, version=2, idempotency_key="b", part=part),
        lambda: store.publish_part("job", generation=gen, version=0, idempotency_key="b", part=part),
        lambda: store.publish_part("Bad Name", generation=gen, version=2, idempotency_key="b", part=part),
        lambda: store.report_applied("job", 9, "r0", good_report(store, 1)),
        lambda: store.release_version("job", 9, generation=gen),
        lambda: store.release_version("job", 1, generation=gen + 1),  # another generation: fenced
        lambda: store.register_agent("job", "UPPER", role="ROLLOUT", endpoint=Endpoint()),
    ):
        with pytest.raises((InvalidArgument, StaleGeneration, SessionNotFound, VersionNotFound)):
            call()
    assert (store.versions("job"), store.parts("job", 1), store.event_states_since("job", 0)) == before


def test_a_full_disk_is_resource_exhausted_and_changes_nothing(store: SessionStore) -> None:
    """SQLite rolls a transaction back by itself when the disk fills (SQLITE_FULL): the
    error is RESOURCE_EXHAUSTED naming `database`, not hidden as INTERNAL by a ROLLBACK
    after it ("no transaction is active"), and nothing changes. The database's page limit
    is SQLite's own way to the same error."""
    gen = attach(store, rollouts=("r0",))
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=make_part(sample_arrays())[0])
    before = (store.versions("job"), store.parts("job", 1), store.event_states_since("job", 0))
    big, _ = make_part({f"model.layers.{i}.w": np.full((64, 64), i, np.float32) for i in range(200)})
    db = store.db.writer_db
    db.execute(f"PRAGMA max_page_count={db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(ResourceExhausted, match="disk is full") as refused:
        store.publish_part("job", generation=gen, version=2, idempotency_key="b", part=big)
    assert refused.value.field == "database"
    assert not db.in_transaction
    assert (store.versions("job"), store.parts("job", 1), store.event_states_since("job", 0)) == before
    store.heartbeat("job", "r0", 1)  # what fits is still written
    db.execute("PRAGMA max_page_count=1073741823")  # space freed
    out = store.publish_part("job", generation=gen, version=2, idempotency_key="b", part=big)
    assert out.version.state is S.READY


def test_a_database_the_disk_will_not_write_is_unavailable_and_changes_nothing(store: SessionStore) -> None:
    """A file system remounted read-only (SQLITE_READONLY; query_only is SQLite's own way to
    it) or an I/O error: writes are UNAVAILABLE, not INTERNAL, and change nothing. Reads
    go on."""
    gen = attach(store, rollouts=("r0",))
    before = store.versions("job")
    store.db.writer_db.execute("PRAGMA query_only=1")
    with pytest.raises(TransportUnavailable, match="disk failed the database .*SQLITE_READONLY") as refused:
        store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=make_part(sample_arrays())[0])
    assert refused.value.field == "database" and not store.db.writer_db.in_transaction
    with pytest.raises(TransportUnavailable, match="SQLITE_READONLY"):
        store.heartbeat("job", "r0", 1)
    assert store.versions("job") == before and store.session("job").generation == gen
    store.db.writer_db.execute("PRAGMA query_only=0")  # the disk back
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=make_part(sample_arrays())[0])


def test_persistence_across_restart(tmp_path: Path, clock: Clock) -> None:
    db = tmp_path / "c.db"
    s1 = SessionStore(db, clock=clock)
    gen = attach(s1, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    s1.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    s1.report_applied("job", 1, "r0", good_report(s1, 1))
    digest = s1.version("job", 1).manifest_digest
    s1.close()
    s2 = SessionStore(db, clock=clock)
    try:
        assert s2.session("job").generation == gen
        rec, m = s2.manifest("job", 0)
        assert rec.state is S.COMMITTED and rec.manifest_digest == digest == m.digest()
        assert [r.agent_id for r in s2.reports("job", [1])] == ["r0"]
        assert s2.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part).duplicate
        out = s2.publish_part("job", generation=gen, version=2, idempotency_key="b", part=part)
        assert out.version.state is S.READY
    finally:
        s2.close()


def test_handshake_comparison_names_first_difference(store: SessionStore) -> None:
    gen = attach(store, rollouts=("r0", "r1"))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    good = good_report(store, 1)
    name = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "manifest digest": dataclasses.replace(good, manifest_digest="0" * 64),
        "was not consumed": dataclasses.replace(good, consumed_names=good.consumed_names[:-1]),
        "not in the manifest": dataclasses.replace(good, consumed_names=good.consumed_names + ("x.y",)),
        f"tensor {name!r}: xxh3": dataclasses.replace(
            good,
            tensor_digests={
                **good.tensor_digests,
                name: (good.tensor_digests[name][0] ^ 1, good.tensor_digests[name][1]),
            },
        ),
        f"tensor {name!r}: sum": dataclasses.replace(
            good,
            tensor_digests={
                **good.tensor_digests,
                name: (good.tensor_digests[name][0], good.tensor_digests[name][1] + 1.0),
            },
        ),
        "element_count": dataclasses.replace(
            good, aggregates=dataclasses.replace(good.aggregates, element_count=good.aggregates.element_count + 1)
        ),
        "grand_total": dataclasses.replace(good, aggregates=dataclasses.replace(good.aggregates, grand_total=1e9)),
        "local failure: boom": dataclasses.replace(good, local_error="boom"),
    }
    for expected, report in cases.items():
        out = store.report_applied("job", 1, "r0", report)
        assert out.mismatch is not None and expected in out.mismatch, (expected, out.mismatch)
    # tiny float differences from summation order are within tolerance
    nudged = {n: (d, s * (1 + 1e-12)) for n, (d, s) in good.tensor_digests.items()}
    assert store.report_applied("job", 1, "r1", dataclasses.replace(good, tensor_digests=nudged)).mismatch is None
    assert store.version("job", 1).state is S.PARTIAL  # r0 failed, r1 ok
    assert store.report_applied("job", 1, "r0", good).mismatch is None
    assert store.version("job", 1).state is S.COMMITTED  # the failed rollout re-synced


def test_leases_block_release_until_handshake_or_expiry(store: SessionStore, clock: Clock) -> None:
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    rec, _ = store.manifest("job", 1, lease_for="r0")
    assert rec.leases == 1
    with pytest.raises(FailedPrecondition, match="leased by r0"):
        store.release_version("job", 1, generation=gen)
    clock.t += 11  # r0's lease expires
    assert store.sweep() == {"job": 1}  # weightsync_leases_dropped_total counts it
    assert store.sweep() == {}
    assert store.release_version("job", 1, generation=gen).state is S.RELEASED
    with pytest.raises(AgentNotFound):
        store.heartbeat("job", "r0")
    store.publish_part("job", generation=gen, version=2, idempotency_key="b", part=part)
    with pytest.raises(AgentNotFound):
        store.manifest("job", 2, lease_for="r0")


def test_lease_is_refused_when_the_version_moves_on_before_it_is_written(store: SessionStore, clock: Clock) -> None:
    # The manifest is read first and the lease written after, in its own statement: a
    # release (or a lapsed agent) in between must not leave a lease on a RELEASED version.
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    rec, _ = store.manifest("job", 1)
    store.release_version("job", 1, generation=gen)
    with pytest.raises(WrongState, match="RELEASED"):
        store._take_lease(rec, "r0")
    store.publish_part("job", generation=gen, version=2, idempotency_key="b", part=part)
    rec, _ = store.manifest("job", 2)
    clock.t += 11
    with pytest.raises(AgentNotFound, match="r0"):
        store._take_lease(rec, "r0")
    assert store.version("job", 1).leases == store.version("job", 2).leases == 0


def test_nonblocking_calls_do_nothing_while_the_store_is_busy(store: SessionStore) -> None:
    # What the event loop relies on: inside nonblocking(), a call that would wait for the
    # writer's lock (or a reader) raises StoreBusy before it changed anything.
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    before = store.agents("job")[0].lease_expires_at
    report = good_report(store, 1)  # builds the manifest: a cold one is NotOnLoop (next test)
    with store.db.lock, store.nonblocking():  # another thread's write in progress
        with pytest.raises(StoreBusy):
            store.heartbeat("job", "r0", 1)
        with pytest.raises(StoreBusy):
            store.manifest("job", 1, lease_for="r0")
        with pytest.raises(StoreBusy):
            store.report_applied("job", 1, "r0", report)
        assert store.manifest("job", 1)[0].version == 1  # reads never wait for the writer
    assert store.agents("job")[0].lease_expires_at == before
    assert store.version("job", 1).leases == 0 and store.version("job", 1).state is S.READY
    readers = [store.db.readers.get() for _ in range(READERS)]  # every reader taken
    try:
        with store.nonblocking(), pytest.raises(StoreBusy):
            store.session("job")
    finally:
        for r in readers:
            store.db.readers.put(r)
    assert store.heartbeat("job", "r0", 1) == gen  # outside: as ever


def test_expired_required_rollout_does_not_block_commit(store: SessionStore, clock: Clock) -> None:
    gen = attach(store, rollouts=("r0", "r1"))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    store.report_applied("job", 1, "r0", good_report(store, 1))
    clock.t += 5
    store.heartbeat("job", "r0")
    clock.t += 6  # r1 never heartbeats: expired
    store.sweep()
    assert store.version("job", 1).state is S.COMMITTED


def test_a_live_rollout_id_is_refused_to_another_process(store: SessionStore, clock: Clock) -> None:
    store.open_session("job", trainer=False)
    store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint("10.0.0.1:7", host_id="pod-a"), instance="a")
    with pytest.raises(AlreadyExists, match="pod-a, 10.0.0.1:7") as e:
        store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint("10.0.0.2:7"), instance="b")
    assert e.value.field == "agent_id"
    assert endpoint_of(store, "r0") == "10.0.0.1:7"  # nothing changed
    key = store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint("10.0.0.1:7"), instance="a").agent_key
    with pytest.raises(AlreadyExists):  # a client that names none is another process too
        store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint("10.0.0.2:7"))
    assert endpoint_of(store, "r0") == "10.0.0.1:7"
    # itself again, by its instance or its key: the same key
    assert store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint(), agent_key=key).agent_key == key
    assert store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint(), instance="a").agent_key == key
    clock.t += 11  # a's lease lapsed: b may take the id
    taken = store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint("10.0.0.2:7"), instance="b")
    assert endpoint_of(store, "r0") == "10.0.0.2:7" and taken.agent_key != key
    with pytest.raises(InvalidArgument, match="instance"):
        store.register_agent("job", "r1", role="ROLLOUT", endpoint=Endpoint(), instance="x" * 65)


def endpoint_of(store: SessionStore, agent_id: str) -> str:
    return next(a.endpoint.address for a in store.agents("job") if a.agent_id == agent_id)


def test_leases_ignore_steps_of_the_wall_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NTP stepping the clock under a running coordinator: an hour forward expires no
    lease, and an hour back keeps no dead agent's lease for an hour."""
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=0.5)  # the default clock
    try:
        attach(store, rollouts=("r0",))
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600)
        assert [a.alive for a in store.agents("job")] == [True]
        monkeypatch.setattr(time, "time", lambda: real() - 3600)
        time.sleep(0.6)  # r0 never beats again
        assert [a.alive for a in store.agents("job")] == [False]
    finally:
        store.close()


def test_abort_and_release(store: SessionStore) -> None:
    gen = attach(store)
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    assert store.abort_version("job", generation=gen, version=1, reason="bad step").state is S.FAILED
    with pytest.raises(WrongState):
        store.abort_version("job", generation=gen, version=1, reason="again")
    with pytest.raises(WrongState):
        store.manifest("job", 1)
    assert store.release_version("job", 1, generation=gen).state is S.RELEASED
    assert store.release_version("job", 1, generation=gen).state is S.RELEASED  # idempotent


def test_session_weight_sync_mode_is_the_trainers_choice(store: SessionStore, tmp_path: Path, clock: Clock) -> None:
    s, _ = store.open_session("job", trainer=False)
    assert s.weight_sync_mode == "tcp"  # created by a rollout: the default
    s, _ = store.open_session("job", trainer=True, incarnation="a", weight_sync_mode="filesystem")
    assert s.weight_sync_mode == "fs"
    assert store.open_session("job", trainer=False)[0].weight_sync_mode == "fs"
    assert store.open_session("job", trainer=True, incarnation="a")[0].weight_sync_mode == "fs"  # empty keeps
    with pytest.raises(InvalidArgument, match="not a weight-sync mode") as exc:
        store.open_session("job", trainer=True, incarnation="b", weight_sync_mode="pigeon")
    assert exc.value.field == "weight_sync_mode"
    assert store.session("job").generation == 1  # refused attaches changed nothing
    store.close()
    reopened = SessionStore(tmp_path / "c.db", clock=clock)
    try:
        assert reopened.session("job").weight_sync_mode == "fs"
    finally:
        reopened.close()


def test_access_tokens_are_per_version_derivable_by_the_trainer_and_survive_restarts(
    tmp_path: Path, clock: Clock
) -> None:
    from weightsync.digests import access_token

    store = SessionStore(tmp_path / "t.db", clock=clock)
    key = store.tokens.session_key("job")
    assert store.tokens.access_token("job", 3) == access_token(key, 3)  # what the trainer computes from OpenSession
    assert (
        len(
            {
                store.tokens.access_token("job", 3),
                store.tokens.access_token("job", 4),
                store.tokens.access_token("other", 3),
            }
        )
        == 3
    )
    assert key != store.tokens.session_key("other")
    store.close()
    reopened = SessionStore(tmp_path / "t.db", clock=clock)
    assert reopened.tokens.access_token("job", 3) == access_token(key, 3)
    assert (
        SessionStore(tmp_path / "u.db", clock=clock).tokens.session_key("job") != key
    )  # another coordinator, another key
    reopened.close()


def test_a_relay_that_stops_heartbeating_leaves_new_chains_before_its_lease_ends(
    store: SessionStore, clock: Clock
) -> None:
    attach(store)
    for agent in ("r0", "r1", "r2"):
        store.register_agent(
            "job",
            agent,
            role="ROLLOUT",
            endpoint=Endpoint(transports=("grpc", "relay"), tcp_address=f"127.0.0.1:{7000 + int(agent[1])}"),
        )
    assert [a.agent_id for a in store.relay_chain("job")] == ["r0", "r1", "r2"]
    for _ in range(6):  # r1 is gone (SIGKILL): r0 and r2 keep heartbeating (fresh: 2 beats, 5 s)
        clock.t += 1
        store.heartbeat("job", "r0")
        store.heartbeat("job", "r2")
    assert any(a.agent_id == "r1" and a.alive for a in store.agents("job"))  # its lease (10 s) still holds
    assert [a.agent_id for a in store.relay_chain("job")] == ["r0", "r2"]
    store.heartbeat("job", "r1")  # back: in the chain again
    assert [a.agent_id for a in store.relay_chain("job")] == ["r0", "r1", "r2"]


def test_a_fenced_trainer_changes_nothing(store: SessionStore) -> None:
    old = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=old, version=1, idempotency_key="a", part=part)
    store.report_applied("job", 1, "r0", good_report(store, 1))
    store.register_agent("job", "t-old", role="TRAINER", endpoint=Endpoint(), generation=old)
    new, _ = store.open_session("job", trainer=True, incarnation="run-2")
    assert new.generation == old + 1
    before = (store.versions("job"), store.event_states_since("job", 0))
    for call in (
        lambda: store.release_version("job", 1, generation=old, force=True),
        lambda: store.abort_version("job", generation=old, version=1, reason="x"),
        lambda: store.publish_part("job", generation=old, version=2, idempotency_key="b", part=part),
        lambda: store.register_agent("job", "t-old", role="TRAINER", endpoint=Endpoint(), generation=old),
    ):
        with pytest.raises(StaleGeneration, match="fenced"):
            call()
    assert (store.versions("job"), store.event_states_since("job", 0)) == before
    agents = {a.agent_id: a for a in store.agents("job")}
    assert agents["t-old"].generation == old  # status shows who is behind


def test_a_restart_that_cannot_publish_does_not_bump_the_generation(store: SessionStore) -> None:
    gen = attach(store)
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=3, idempotency_key="a", part=part)
    with pytest.raises(FailedPrecondition, match="next_version 3 .* start at 4"):
        store.open_session("job", trainer=True, incarnation="run-2", next_version=3)
    assert store.session("job").generation == gen
    assert store.open_session("job", trainer=True, incarnation="run-2", next_version=4)[0].generation == gen + 1


def test_deregistered_rollout_stops_being_required_at_once(store: SessionStore) -> None:
    gen = attach(store, rollouts=("r0", "r1"))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    store.manifest("job", 1, lease_for="r1")
    store.report_applied("job", 1, "r0", good_report(store, 1))
    assert store.version("job", 1).state is S.READY  # r1 is required and leased
    assert store.deregister_agent("job", "r1") is True
    assert store.version("job", 1).state is S.COMMITTED
    assert store.version("job", 1).leases == 0
    assert store.deregister_agent("job", "r1") is False  # idempotent
    assert [a.agent_id for a in store.agents("job")] == ["r0"]


def test_replayed_events_carry_the_version_as_it_was(store: SessionStore, clock: Clock) -> None:
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    clock.t += 5
    store.report_applied("job", 1, "r0", good_report(store, 1))
    events = store.events_since("job", 0)
    assert [e.version.state for e in events] == [S.STAGING, S.READY, S.COMMITTED]
    assert events[0].version.committed_at == 0 and events[0].version.ready_at == 0
    assert events[1].version.committed_at == 0 and events[1].version.ready_at > 0
    assert events[2].version.committed_at == events[1].version.ready_at + 5


def test_a_second_store_on_the_same_database_is_refused(tmp_path: Path) -> None:
    first = SessionStore(tmp_path / "c.db")
    try:
        with pytest.raises(FailedPrecondition, match="in use by another coordinator"):
            SessionStore(tmp_path / "c.db")
    finally:
        first.close()
    SessionStore(tmp_path / "c.db").close()  # free again once the first closed


def test_retention_summarizes_old_versions_and_bounds_the_database(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "c.db", retain_versions=3)
    try:
        gen = attach(store, rollouts=("r0",))
        part, _ = make_part(sample_arrays())
        for v in range(1, 41):
            store.publish_part("job", generation=gen, version=v, idempotency_key=f"k{v}", part=part)
            store.report_applied("job", v, "r0", good_report(store, v))
            if v > 1:
                store.release_version("job", v - 1, generation=gen)
            if v == 20:
                grown = store.database_bytes()
                store.prune()
        assert store.prune() == 20  # 18..37: the first call took 1..17; 38..40 are the window
        kept = {v.version: v for v in store.versions("job", 100)}
        assert sorted(kept) == list(range(1, 41))  # every version keeps its row and state
        assert kept[1].state is S.RELEASED and kept[1].total_bytes == part.total_bytes and kept[1].sealed_ranks == 1
        assert kept[40].state is S.COMMITTED
        assert store.parts("job", 1) == [] and store.reports("job", [1]) == []
        assert len(store.parts("job", 38)) == 1 and store.reports("job", [38])
        assert {v for _, v, _ in store.event_states_since("job", 0)} == {38, 39, 40}
        for _ in range(5):
            store.prune()
        assert store.database_bytes() <= grown  # 40 versions take no more room than 20 did
    finally:
        store.close()


def test_what_a_replaced_trainer_left_is_released_once_its_successor_commits_a_newer_version(
    tmp_path: Path, clock: Clock
) -> None:
    """Only the trainer that publishes a version releases it (reusing its slot), so the
    READY and COMMITTED versions of a trainer replaced by a new incarnation (each with its
    descriptors and a handshake per rollout, which the retention window never summarizes)
    are released by the coordinator once the new generation commits a newer version (with
    the commit, or in the sweep once a lease ends), and not while a live rollout holds one."""
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, retain_versions=1, clock=clock)
    try:
        old = attach(store, rollouts=("r0", "r1"), incarnation="run-1")
        part, _ = make_part(sample_arrays())
        for v in (1, 2):
            store.publish_part("job", generation=old, version=v, idempotency_key=f"k{v}", part=part)
        for r in ("r0", "r1"):
            store.report_applied("job", 1, r, good_report(store, 1))
        store.manifest("job", 2, lease_for="r0")  # 2: READY, r0 reading it, when the trainer dies
        new = attach(store, incarnation="run-2")
        store.publish_part("job", generation=new, version=3, idempotency_key="k3", part=part)
        store.sweep()
        assert [store.version("job", v).state for v in (1, 2)] == [S.COMMITTED, S.READY]  # 3 is not committed yet
        for r in ("r0", "r1"):
            store.report_applied("job", 3, r, good_report(store, 3))
        # with the commit (its trainer, seeing it, may reuse what 1 held); r0 still holds 2
        assert [store.version("job", v).state for v in (1, 2, 3)] == [S.RELEASED, S.READY, S.COMMITTED]
        assert store.version("job", 1).reason == "superseded by version 3 of trainer generation 2"
        store.manifest("job", 3, lease_for="r0")  # r0 moves on: its lease on 2 ends
        store.sweep()
        assert store.version("job", 2).state is S.RELEASED
        assert store.prune() == 2 and store.parts("job", 1) == store.parts("job", 2) == []
        assert store.sweep() == {} and store.version("job", 3).state is S.COMMITTED  # the new trainer's own stay
        states = [st for _, v, st in store.event_states_since("job", 0) if v == 3]
        assert states[-1] == "COMMITTED"
    finally:
        store.close()


def test_a_version_a_replaced_trainer_left_half_sealed_fails_and_is_summarized(tmp_path: Path, clock: Clock) -> None:
    """A multi-host trainer preempted between its ranks' seals leaves a version no rank of a
    newer generation may seal: it fails when the new generation attaches, so the retention
    window summarizes it (and the successor removes its fs store parts)."""
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, retain_versions=1, clock=clock)
    try:
        old = attach(store, ranks=2, rollouts=("r0",))
        arrays = sample_arrays()
        halves = [make_part(row_shards(arrays, rank, 2), rank=rank)[0] for rank in (0, 1)]
        store.publish_part("job", generation=old, version=1, idempotency_key="k1", part=halves[0])
        assert store.sweep() == {} and store.version("job", 1).state is S.STAGING  # its rank 1 may still seal it
        new = attach(store, ranks=2, incarnation="run-2")
        with pytest.raises(FailedPrecondition):  # the old generation's rank 1 comes too late
            store.publish_part("job", generation=old, version=1, idempotency_key="k1", part=halves[1])
        rec = store.version("job", 1)
        assert rec.state is S.FAILED and rec.reason == "superseded by generation 2"
        for part in halves:
            store.publish_part("job", generation=new, version=2, idempotency_key="k2", part=part)
        store.report_applied("job", 2, "r0", good_report(store, 2))
        assert store.version("job", 2).state is S.COMMITTED
        assert store.prune() == 1 and store.parts("job", 1) == []
    finally:
        store.close()


def test_sessions_no_trainer_opened_are_forgotten_once_empty(tmp_path: Path, clock: Clock) -> None:
    """A rollout's registration makes its session, so a mistyped --session makes one,
    counted against --max-sessions. Once no agent and no version is left
    in it, a session no trainer opened is forgotten; a trainer's session never is, nor one
    made within three lease TTLs (a rollout makes it, then registers)."""
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock, forget_agents_after_s=60, max_sessions=3)
    try:
        attach(store)  # "job": a trainer's, with no agent left below
        store.open_session("jbo", trainer=False)
        store.register_agent("jbo", "typo", role="ROLLOUT", endpoint=Endpoint())
        store.open_session("fresh", trainer=False)
        with pytest.raises(ResourceExhausted, match="max-sessions"):
            store.open_session("other", trainer=False)
        clock.t += 61  # typo's lease lapsed 51 s ago: still listed, so "jbo" stays
        assert store.forget_agents() == 0 and store.forget_empty_sessions() == ["fresh"]
        clock.t += 10
        assert store.forget_agents() == 1 and store.forget_empty_sessions() == ["jbo"]
        for name in ("jbo", "fresh"):
            with pytest.raises(SessionNotFound):
                store.session(name)
        assert store.session("job").generation == 1 and store.forget_empty_sessions() == []
        store.open_session("other", trainer=False)  # room again
        store.open_session("jbo", trainer=False)  # and the rollout, back, makes its session anew
        store.register_agent("jbo", "typo", role="ROLLOUT", endpoint=Endpoint())
        clock.t += 59
        assert store.forget_empty_sessions() == []
        clock.t += 2
        assert store.forget_empty_sessions() == ["other"]
    finally:
        store.close()
    store = SessionStore(tmp_path / "d.db", lease_ttl_s=10, clock=clock, forget_agents_after_s=0)
    try:
        store.open_session("jbo", trainer=False)
        assert store.forget_empty_sessions() == []  # made within three lease TTLs: its rollout registers next
        clock.t += 31
        assert store.forget_empty_sessions() == ["jbo"]
    finally:
        store.close()


def test_agents_expired_past_the_window_are_forgotten_and_may_register_again(tmp_path: Path, clock: Clock) -> None:
    """Agents expired past the window are forgotten (pods that come and go under new names
    would each leave a row in every status reply for good), and may register again."""
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock, forget_agents_after_s=60)
    try:
        gen = attach(store, rollouts=("r0", "r1", "r2"))
        part, _ = make_part(sample_arrays())
        store.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
        store.report_applied("job", 1, "r1", good_report(store, 1))
        clock.t += 9
        store.heartbeat("job", "r0")
        clock.t += 60  # r1 and r2 expired 59 s ago: still listed
        assert store.forget_agents() == 0 and [a.agent_id for a in store.agents("job")] == ["r0", "r1", "r2"]
        clock.t += 2  # r1 and r2 expired 61 s ago, r0 52 s ago
        assert store.forget_agents() == 2
        assert [a.agent_id for a in store.agents("job")] == ["r0"]
        assert [r.agent_id for r in store.reports("job", [1])] == ["r1"]  # its handshake stays with the version
        with pytest.raises(AgentNotFound):
            store.heartbeat("job", "r1")
        store.register_agent("job", "r1", role="ROLLOUT", endpoint=Endpoint())
        assert [a.agent_id for a in store.agents("job")] == ["r0", "r1"]
    finally:
        store.close()
    with pytest.raises(InvalidArgument, match="forget_agents_after_s|>= 0"):
        SessionStore(tmp_path / "d.db", forget_agents_after_s=float("nan"))


def test_a_deleted_session_leaves_nothing_and_its_name_starts_afresh(store: SessionStore, clock: Clock) -> None:
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
    store.manifest("job", 1, lease_for="r0")  # kept decoded, and leased
    store.report_applied("job", 1, "r0", good_report(store, 1))
    with pytest.raises(FailedPrecondition, match="live lease, first 'r0'") as refused:
        store.delete_session("job")
    assert refused.value.field == "force" and store.version("job", 1).state is S.COMMITTED  # nothing changed
    clock.t += 11  # r0's lease lapsed
    assert store.delete_session("job") == (1, 1)
    with pytest.raises(SessionNotFound):
        store.session("job")
    for table in ("sessions", "agents", "versions", "parts", "reports", "leases", "events"):
        with store._read() as db:
            column = "name" if table == "sessions" else "session"
            assert db.execute(f"SELECT COUNT(*) FROM {table} WHERE {column}='job'").fetchone()[0] == 0, table
    with pytest.raises(SessionNotFound):
        store.delete_session("job")
    gen = attach(store)  # the name again: a new session, generation 1, no versions
    assert gen == 1 and store.versions("job", 10) == []
    other, _ = make_part(sample_arrays(seed=9))
    store.publish_part("job", generation=gen, version=1, idempotency_key="k", part=other)
    assert store.manifest("job", 1)[1].parts == (other,)  # not the deleted session's, kept decoded


def test_sessions_past_the_limit_are_refused_until_one_is_deleted(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "c.db", max_sessions=2)
    try:
        for name in ("a", "b"):
            store.open_session(name, trainer=False)
        with pytest.raises(ResourceExhausted, match="limit of 2 sessions") as refused:
            store.open_session("c", trainer=True, incarnation="x")
        assert refused.value.field == "session"
        store.open_session("a", trainer=True, incarnation="x")  # opening one that exists is fine
        store.delete_session("b", force=True)
        store.open_session("c", trainer=False)
    finally:
        store.close()


def test_a_cold_manifest_is_never_built_on_the_event_loop(store: SessionStore) -> None:
    # Decoding a large model's descriptors takes seconds: inside nonblocking() a manifest
    # not yet built raises NotOnLoop (run it on a thread) before any lease is written.
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    store._manifests.clear()
    with store.nonblocking(), pytest.raises(NotOnLoop):
        store.manifest("job", 1, lease_for="r0")
    assert store.version("job", 1).leases == 0
    store.manifest("job", 1)  # built (on a thread, in the servicer)
    with store.nonblocking():
        assert store.manifest("job", 1, lease_for="r0")[0].leases == 1


def test_the_sealing_publish_keeps_the_manifest_it_digested(store: SessionStore, monkeypatch) -> None:  # noqa: ANN001
    # Its first reader would otherwise decode every rank's stored body on the spot: one
    # json.loads of a 10^5-tensor part holds the GIL for most of a second.
    from weightsync.manifest import Part

    gen = attach(store, ranks=2)
    arrays = sample_arrays()
    for rank in (0, 1):
        part, _ = make_part(row_shards(arrays, rank, 2), rank=rank)
        store.publish_part("job", generation=gen, version=1, idempotency_key=f"k{rank}", part=part)
    with monkeypatch.context() as m:
        m.setattr(Part, "from_dict", classmethod(lambda cls, d: pytest.fail("decoded a stored body")))
        with store.nonblocking():  # and so it is served from the event loop at once
            rec, kept = store.manifest("job", 1)
    assert kept.digest() == rec.manifest_digest
    store._manifests.clear()
    assert store.manifest("job", 1)[1] == kept  # what the stored bodies decode to


@given(st.integers(1, 5), st.lists(st.tuples(st.sampled_from(["put", "discard"]), st.integers(0, 7)), max_size=40))
def test_recent_keeps_the_last_puts_like_a_bounded_fifo(size: int, ops: list[tuple[str, int]]) -> None:
    from coordinator.recent import Recent

    recent: Recent[int, str] = Recent(size)
    model: list[int] = []  # keys, oldest first
    for op, key in ops:
        if key in model:
            model.remove(key)
        if op == "put":
            recent.put(key, f"v{key}")
            model.append(key)
            del model[:-size]
        else:
            recent.discard(key)
    assert len(recent) == len(model)
    assert all(recent.get(k) == f"v{k}" for k in model)
    assert all(k not in recent for k in range(8) if k not in model)


def test_every_transition_passes_the_hook_and_fleet_gauges_count_the_fleet(store: SessionStore, clock: Clock) -> None:
    seen: list[tuple[int, str]] = []
    store.on_transition = lambda rec: seen.append((rec.version, rec.state.value))
    gen = attach(store, rollouts=("r0", "r1"))
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=gen, version=1, idempotency_key="a", part=part)
    store.manifest("job", 1, lease_for="r0")
    (g,) = store.fleet_gauges()
    assert (g.session, g.published, g.committed, g.leases) == ("job", 1, 0, 1)
    assert g.agents == {("rollout", True): 2}
    for agent in ("r0", "r1"):
        store.report_applied("job", 1, agent, good_report(store, 1))
    assert seen == [(1, "STAGING"), (1, "READY"), (1, "COMMITTED")]
    clock.t += 11  # both rollouts lapse
    (g,) = store.fleet_gauges()
    assert (g.published, g.committed) == (1, 1) and g.agents == {("rollout", False): 2}


def test_a_database_that_cannot_be_opened_names_its_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(FailedPrecondition, match=f"cannot open the database {blocker}/sub/c.db") as e:
        SessionStore(str(blocker / "sub" / "c.db"))
    assert e.value.field == "db_path"


def test_a_damaged_database_is_moved_aside_and_a_new_one_begun(tmp_path: Path, clock: Clock) -> None:
    """Found while serving: the first statement that meets the damage answers UNAVAILABLE
    naming `database` (not INTERNAL, nor is any later one) and calls `on_corrupt`, once;
    found at start (a file that is no database, or a damaged page): moved aside, not a
    coordinator that starts and fails every request or refuses to start at all."""
    db = tmp_path / "c.db"
    s1 = SessionStore(db, clock=clock)
    met: list[BaseException] = []
    s1.db.on_corrupt = met.append
    for i in range(40):
        s1.open_session(f"job-{i:02d}-{'x' * 50}", trainer=False)
    damage(db)
    for call in (lambda: s1.session("job-01-" + "x" * 50), lambda: s1.open_session("job-new", trainer=True)):
        with pytest.raises(TransportUnavailable, match="database is damaged") as refused:
            call()
        assert refused.value.field == "database"
    assert len(met) == 1 and s1.db.corrupt is met[0]
    s1.close()
    s2 = SessionStore(db, clock=clock)  # the damage is found at start
    try:
        kept = [p.name for p in tmp_path.glob("c.db.corrupt-*")]
        assert len(kept) == 1 and not kept[0].endswith(("-wal", "-shm"))
        assert s2.db.corrupt is None
        with pytest.raises(SessionNotFound):
            s2.session("job-01-" + "x" * 50)
        assert attach(s2) == 1
    finally:
        s2.close()
    not_a_database = tmp_path / "other.db"
    not_a_database.write_bytes(b"no database" * 1000)
    SessionStore(not_a_database, clock=clock).close()
    assert [p.name for p in tmp_path.glob("other.db.corrupt-*")]


def test_calls_after_close_are_unavailable_not_internal(tmp_path: Path, clock: Clock) -> None:
    """A handler the server's stop leaves running meets a closed store: its calls are
    UNAVAILABLE, not sqlite3.ProgrammingError (INTERNAL, a traceback in the log at every
    shutdown), and a read does not wait for a reader that never comes back."""
    store = SessionStore(tmp_path / "c.db", clock=clock)
    attach(store)
    store.close()
    for call in (lambda: store.session("job"), lambda: store.open_session("other", trainer=False)):
        with pytest.raises(TransportUnavailable, match="stopping") as refused:
            call()
        assert refused.value.field == "database"


def test_a_rollout_holds_only_its_newest_lease(store: SessionStore) -> None:
    # A prefetch abandoned for a newer version must not hold the trainer's slot while the
    # rollout lives: leasing the newer version ends the older lease.
    gen = attach(store, rollouts=("r0", "r1"))
    part, _ = make_part(sample_arrays())
    for v in (1, 2):
        store.publish_part("job", generation=gen, version=v, idempotency_key=f"k{v}", part=part)
    store.manifest("job", 1, lease_for="r0")
    store.manifest("job", 1, lease_for="r1")
    store.manifest("job", 2, lease_for="r0")
    assert (store.version("job", 1).leases, store.version("job", 2).leases) == (1, 1)  # r1's stays
    store.manifest("job", 1, lease_for="r0")  # an older version again: the newer lease is kept
    assert (store.version("job", 1).leases, store.version("job", 2).leases) == (2, 1)
    store.manifest("job", 2, lease_for="r1")
    assert store.version("job", 1).leases == 1


def test_a_database_from_before_the_newer_columns_opens_with_them_filled_in(tmp_path: Path, clock: Clock) -> None:
    """Columns added since (parts' sizes, reports' marks) are added on open, and parts'
    sizes are filled in from their bodies: version records add up as before."""
    import sqlite3

    db = tmp_path / "c.db"
    store = SessionStore(db, lease_ttl_s=10, clock=clock)
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    part = dataclasses.replace(part, stage_seconds=0.25)
    store.publish_part("job", generation=gen, version=1, idempotency_key="k", part=part)
    store.report_applied("job", 1, "r0", good_report(store, 1))
    store.close()
    old = sqlite3.connect(db)
    for table, column in (("parts", "total_bytes"), ("parts", "stage_seconds"), ("reports", "written")):
        old.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    old.commit()
    old.close()
    store = SessionStore(db, lease_ttl_s=10, clock=clock)
    try:
        rec = store.version("job", 1)
        assert (rec.total_bytes, rec.sealed_ranks, rec.stage_seconds) == (part.total_bytes, 1, 0.25)
        assert [r.agent_id for r in store.reports("job", [1])] == ["r0"]
        assert store.report_stamps("job", [1])[1].count == 1
    finally:
        store.close()


def test_only_writes_that_append_events_wake_the_watchers(tmp_path: Path, clock: Clock) -> None:
    """A handshake that commits nothing must not wake a session's thousand watch streams;
    the one that commits does, after its transaction committed."""
    woken: list[tuple[str, list[str]]] = []

    class Listener:
        def notify(self, session: str) -> None:
            woken.append((session, [s for _, _, s in store.event_states_since(session, 0)]))

    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock, listener=Listener())
    try:
        gen = attach(store, rollouts=("r0", "r1"))
        woken.clear()
        part, _ = make_part(sample_arrays())
        store.publish_part("job", generation=gen, version=1, idempotency_key="k1", part=part)
        assert woken == [("job", ["STAGING", "READY"])]  # what it wrote is readable when told
        store.heartbeat("job", "r0", 0)
        store.report_applied("job", 1, "r0", good_report(store, 1))  # r1 still required
        assert len(woken) == 1
        store.report_applied("job", 1, "r1", good_report(store, 1))
        assert woken[-1] == ("job", ["STAGING", "READY", "COMMITTED"]) and len(woken) == 2
    finally:
        store.close()


def test_a_replaced_trainers_refused_version_never_releases_the_committed_one(tmp_path: Path, clock: Clock) -> None:
    """Generation 1's version 1 commits; generation 2's version 2 is refused by every
    rollout (PARTIAL). Version 1 stays COMMITTED through every sweep and is what `latest`
    names; once version 2 verifies and commits, version 1 is released as superseded."""
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock)
    try:
        old = attach(store, rollouts=("r0", "r1"), incarnation="run-1")
        part, _ = make_part(sample_arrays())
        store.publish_part("job", generation=old, version=1, idempotency_key="k1", part=part)
        for r in ("r0", "r1"):
            store.report_applied("job", 1, r, good_report(store, 1))
        new = attach(store, incarnation="run-2")
        store.publish_part("job", generation=new, version=2, idempotency_key="k2", part=part)
        refused = dataclasses.replace(good_report(store, 2), local_error="device fingerprint differs")
        for r in ("r0", "r1"):
            store.report_applied("job", 2, r, refused)
        assert store.version("job", 2).state is S.PARTIAL
        for _ in range(3):
            clock.t += 3
            for r in ("r0", "r1"):
                store.heartbeat("job", r)
            store.sweep()
        assert store.version("job", 1).state is S.COMMITTED
        rec, _ = store.manifest("job", 0)
        assert rec.version == 1  # the PARTIAL version is nobody's default
        assert store.manifest("job", 2)[0].state is S.PARTIAL  # still served by its number: rollouts retry it
        for r in ("r0", "r1"):
            store.report_applied("job", 2, r, good_report(store, 2))
        assert [store.version("job", v).state for v in (1, 2)] == [S.RELEASED, S.COMMITTED]
        assert store.version("job", 1).reason == "superseded by version 2 of trainer generation 2"
    finally:
        store.close()


def test_the_newest_committed_version_is_released_only_once_a_newer_one_commits(store: SessionStore) -> None:
    """A trainer reusing a slot may not release the session's newest COMMITTED version
    (NewestCommitted, naming `version`) while no newer one committed, not even for a newer
    READY one (which may fail yet); `unpin` and `force` may; an older COMMITTED version is
    released as before."""
    gen = attach(store, rollouts=("r0",))
    part, _ = make_part(sample_arrays())
    for v in (1, 2):
        store.publish_part("job", generation=gen, version=v, idempotency_key=f"k{v}", part=part)
        store.report_applied("job", v, "r0", good_report(store, v))
    store.publish_part("job", generation=gen, version=3, idempotency_key="k3", part=part)
    store.report_applied("job", 3, "r0", dataclasses.replace(good_report(store, 3), local_error="boom"))
    assert [store.version("job", v).state for v in (1, 2, 3)] == [S.COMMITTED, S.COMMITTED, S.PARTIAL]
    with pytest.raises(NewestCommitted) as exc:
        store.release_version("job", 2, generation=gen)
    assert exc.value.field == "version" and "newest COMMITTED" in exc.value.message
    assert store.version("job", 2).state is S.COMMITTED  # refused: nothing changed
    assert store.release_version("job", 1, generation=gen).state is S.RELEASED
    assert store.release_version("job", 3, generation=gen).state is S.RELEASED  # PARTIAL: not protected
    store.publish_part("job", generation=gen, version=4, idempotency_key="k4", part=part)  # READY, not yet reported
    with pytest.raises(NewestCommitted):
        store.release_version("job", 2, generation=gen)
    store.report_applied("job", 4, "r0", good_report(store, 4))
    assert store.release_version("job", 2, generation=gen).state is S.RELEASED  # 4 committed
    store.publish_part("job", generation=gen, version=5, idempotency_key="k5", part=part)
    store.report_applied("job", 5, "r0", dataclasses.replace(good_report(store, 5), local_error="boom"))
    with pytest.raises(NewestCommitted):
        store.release_version("job", 4, generation=gen)
    assert store.release_version("job", 4, generation=gen, unpin=True).state is S.RELEASED
    store.publish_part("job", generation=gen, version=6, idempotency_key="k6", part=part)
    store.report_applied("job", 6, "r0", good_report(store, 6))
    assert store.release_version("job", 6, generation=gen, force=True).state is S.RELEASED
