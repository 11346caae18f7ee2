"""Atomic flips in the session store: the session's flip settings, PREPARED reports, the
decision or abort of an ATOMIC version, and the flip skew a commit records."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.handshake import AppliedReport
from coordinator.records import VersionRecord
from coordinator.states import VersionState
from coordinator.store import SessionStore
from tests.unit.helpers import Clock, make_part, sample_arrays
from weightsync.errors import FailedPrecondition, InvalidArgument, WrongState
from weightsync.manifest import Endpoint

S = VersionState
TTL = 10.0


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[SessionStore]:
    s = SessionStore(tmp_path / "c.db", lease_ttl_s=TTL, clock=clock)
    yield s
    s.close()


def atomic(store: SessionStore, rollouts: tuple[str, ...], **settings: object) -> int:
    """An ATOMIC session with `rollouts` registered; its generation."""
    s, _ = store.open_session("job", trainer=True, incarnation="run-1", flip_policy="ATOMIC", **settings)  # type: ignore[arg-type]
    for r in rollouts:
        store.register_agent("job", r, role="ROLLOUT", endpoint=Endpoint())
    return s.generation


def publish(store: SessionStore, generation: int, version: int) -> VersionRecord:
    part, _ = make_part(sample_arrays(seed=version))
    return store.publish_part(
        "job", generation=generation, version=version, idempotency_key=f"k{version}", part=part
    ).version


def report(store: SessionStore, version: int, *, prepared: bool, flipped_at: float = 0.0) -> AppliedReport:
    _, m = store.manifest("job", version)
    sums = m.tensor_sums()
    return AppliedReport(
        manifest_digest=store.version("job", version).manifest_digest,
        tensor_digests={n: (d, sums[n]) for n, d in m.tensor_digests().items()},
        aggregates=m.aggregates(),
        consumed_names=() if prepared else tuple(m.tensors),
        prepared=prepared,
        flipped_at=flipped_at,
    )


def test_flip_settings_are_the_trainers_kept_when_unsaid_and_checked(store: SessionStore) -> None:
    s, _ = store.open_session("job", trainer=True, incarnation="a")
    assert (s.flip_policy, s.prepare_timeout_s, s.prepared_loss) == ("INDEPENDENT", 300.0, "FLIP_WITHOUT")
    s, _ = store.open_session("job", trainer=True, incarnation="a", flip_policy="ATOMIC", prepare_timeout_s=20)
    assert (s.flip_policy, s.prepare_timeout_s, s.prepared_loss) == ("ATOMIC", 20.0, "FLIP_WITHOUT")
    s, _ = store.open_session("job", trainer=True, incarnation="b", prepared_loss="ABORT_FLIP")  # a new run keeps them
    assert (s.flip_policy, s.prepare_timeout_s, s.prepared_loss) == ("ATOMIC", 20.0, "ABORT_FLIP")
    s, _ = store.open_session("job", trainer=False, flip_policy="INDEPENDENT")  # a rollout's say is ignored
    assert s.flip_policy == "ATOMIC"
    for bad, field in (
        ({"flip_policy": "SOMETIMES"}, "flip_policy"),
        ({"prepared_loss": "SHRUG"}, "prepared_loss"),
        ({"prepare_timeout_s": -1.0}, "prepare_timeout_seconds"),
        ({"prepare_timeout_s": math.nan}, "prepare_timeout_seconds"),
        ({"prepare_timeout_s": math.inf}, "prepare_timeout_seconds"),
    ):
        with pytest.raises(InvalidArgument) as e:
            store.open_session("job", trainer=True, incarnation="c", **bad)  # type: ignore[arg-type]
        assert e.value.field == field
    assert store.session("job") == s  # refused: nothing changed, the generation included


def test_an_atomic_version_flips_once_every_rollout_prepared_and_records_the_skew(
    store: SessionStore, clock: Clock
) -> None:
    gen = atomic(store, ("r0", "r1"))
    decided: list[VersionRecord] = []
    store.on_flip_decided = decided.append
    v = publish(store, gen, 1)
    assert (v.state, v.flip_policy, v.flip_decided_at, v.prepared) == (S.READY, "ATOMIC", 0.0, 0)
    with pytest.raises(FailedPrecondition) as e:  # nothing is applied before the decision
        store.report_applied("job", 1, "r0", report(store, 1, prepared=False))
    assert e.value.field == "prepared"
    assert store.report_prepared("job", 1, "r0", report(store, 1, prepared=True)).mismatch is None
    assert store.version("job", 1).flip_decided_at == 0.0 and store.version("job", 1).prepared == 1
    clock.t += 1
    out = store.report_prepared("job", 1, "r1", report(store, 1, prepared=True))
    assert out.version.flip_decided_at == 1001.0 and out.version.state is S.READY
    assert [d.version for d in decided] == [1]
    events = store.events_since("job", 0)
    assert [(ev.version.state, ev.version.flip_decided_at) for ev in events] == [
        (S.STAGING, 0.0), (S.READY, 0.0), (S.READY, 1001.0),
    ]  # fmt: skip
    # sent again (an outbox): answered, nothing changes
    again = store.report_prepared("job", 1, "r1", report(store, 1, prepared=True))
    assert again.mismatch is None and again.version == out.version
    with pytest.raises(WrongState):  # decided: all flip or none does
        store.abort_version("job", generation=gen, version=1, reason="changed my mind")
    store.report_applied("job", 1, "r0", report(store, 1, prepared=False, flipped_at=1001.010))
    assert store.version("job", 1).state is S.READY
    store.report_applied("job", 1, "r1", report(store, 1, prepared=False, flipped_at=1001.035))
    v = store.version("job", 1)
    assert v.state is S.COMMITTED and v.flip_skew_s == pytest.approx(0.025)
    assert sorted(r.flipped_at for r in store.reports("job", [1])) == [1001.010, 1001.035]


def test_a_prepared_digest_that_differs_or_a_local_failure_aborts_at_once_naming_the_rollout(
    store: SessionStore,
) -> None:
    gen = atomic(store, ("r0", "r1", "r2"))
    publish(store, gen, 1)
    store.report_prepared("job", 1, "r0", report(store, 1, prepared=True))
    good = report(store, 1, prepared=True)
    name, (digest, total) = next(iter(good.tensor_digests.items()))
    wrong = dataclasses.replace(good, tensor_digests={**good.tensor_digests, name: (digest ^ 1, total)})
    out = store.report_prepared("job", 1, "r1", wrong)
    assert out.mismatch is not None and name in out.mismatch
    v = store.version("job", 1)
    assert v.state is S.FAILED and "'r1'" in v.reason and name in v.reason and v.leases == 0
    with pytest.raises(WrongState):  # the others' reports now find it FAILED
        store.report_prepared("job", 1, "r2", report(store, 1, prepared=True))

    publish(store, gen, 2)
    local = dataclasses.replace(report(store, 2, prepared=True), local_error="DATA_LOSS: tensor 'w' differs")
    store.report_prepared("job", 2, "r2", local)
    v = store.version("job", 2)
    assert v.state is S.FAILED and "'r2'" in v.reason and "tensor 'w' differs" in v.reason


def test_a_rollout_lost_before_it_prepared_aborts_and_after_follows_the_sessions_rule(
    store: SessionStore, clock: Clock
) -> None:
    gen = atomic(store, ("r0", "r1", "r2"))
    publish(store, gen, 1)
    store.report_prepared("job", 1, "r0", report(store, 1, prepared=True))
    store.report_prepared("job", 1, "r1", report(store, 1, prepared=True))
    clock.t += TTL + 1  # r2 never prepared; every lease lapses, r0's and r1's renewed
    for r in ("r0", "r1"):
        store.register_agent("job", r, role="ROLLOUT", endpoint=Endpoint())
    store.sweep()
    v = store.version("job", 1)
    assert v.state is S.FAILED and "'r2' was lost" in v.reason and "before it prepared" in v.reason

    # lost after it prepared: FLIP_WITHOUT (the default) decides without it ...
    store.register_agent("job", "r2", role="ROLLOUT", endpoint=Endpoint())
    publish(store, gen, 2)
    for r in ("r0", "r2"):
        store.report_prepared("job", 2, r, report(store, 2, prepared=True))
    clock.t += TTL + 1
    for r in ("r0", "r1"):
        store.register_agent("job", r, role="ROLLOUT", endpoint=Endpoint())
    store.report_prepared("job", 2, "r1", report(store, 2, prepared=True))
    v = store.version("job", 2)
    assert v.state is S.READY and v.flip_decided_at == clock.t and v.prepared == 3
    for r in ("r0", "r1"):  # and commits without it (it is no longer live, so not required)
        store.report_applied("job", 2, r, report(store, 2, prepared=False, flipped_at=clock.t))
    assert store.version("job", 2).state is S.COMMITTED

    # ... ABORT_FLIP aborts
    store.open_session("job", trainer=True, incarnation="run-1", prepared_loss="ABORT_FLIP")
    store.register_agent("job", "r2", role="ROLLOUT", endpoint=Endpoint())
    publish(store, gen, 3)
    for r in ("r0", "r2"):
        store.report_prepared("job", 3, r, report(store, 3, prepared=True))
    clock.t += TTL + 1
    for r in ("r0", "r1"):
        store.register_agent("job", r, role="ROLLOUT", endpoint=Endpoint())
    store.report_prepared("job", 3, "r1", report(store, 3, prepared=True))
    v = store.version("job", 3)
    assert v.state is S.FAILED and "'r2' was lost after it prepared" in v.reason and v.flip_decided_at == 0


def test_a_rollout_that_does_not_prepare_in_time_aborts_at_the_deadline(store: SessionStore, clock: Clock) -> None:
    gen = atomic(store, ("r0", "r1"), prepare_timeout_s=5.0)
    publish(store, gen, 1)
    store.report_prepared("job", 1, "r0", report(store, 1, prepared=True))
    clock.t += 4
    for r in ("r0", "r1"):
        store.heartbeat("job", r)
    store.sweep()
    assert store.version("job", 1).state is S.READY
    clock.t += 2
    store.sweep()
    v = store.version("job", 1)
    assert v.state is S.FAILED and "'r1' did not prepare it in time" in v.reason


def test_a_newer_version_aborts_an_undecided_older_one_but_not_a_decided_one(store: SessionStore) -> None:
    gen = atomic(store, ("r0",))
    publish(store, gen, 1)
    publish(store, gen, 2)
    v1 = store.version("job", 1)
    assert v1.state is S.FAILED and "version 2 became READY before" in v1.reason
    states = [(v, s) for _, v, s in store.event_states_since("job", 0)]
    assert states[-2:] == [(1, "FAILED"), (2, "READY")]  # told in that order
    store.report_prepared("job", 2, "r0", report(store, 2, prepared=True))
    assert store.version("job", 2).flip_decided_at
    publish(store, gen, 3)
    assert store.version("job", 2).state is S.READY  # decided: its rollouts flip it, then take 3


def test_independent_versions_take_no_prepared_reports_and_record_their_skew(store: SessionStore) -> None:
    s, _ = store.open_session("job", trainer=True, incarnation="run-1")
    for r in ("r0", "r1"):
        store.register_agent("job", r, role="ROLLOUT", endpoint=Endpoint())
    publish(store, s.generation, 1)
    with pytest.raises(FailedPrecondition) as e:
        store.report_prepared("job", 1, "r0", report(store, 1, prepared=True))
    assert e.value.field == "prepared"
    store.report_applied("job", 1, "r0", report(store, 1, prepared=False, flipped_at=2000.0))
    store.report_applied("job", 1, "r1", report(store, 1, prepared=False, flipped_at=2000.5))
    v = store.version("job", 1)
    assert v.state is S.COMMITTED and v.flip_policy == "INDEPENDENT" and v.flip_skew_s == pytest.approx(0.5)


def test_a_decision_survives_a_restart(tmp_path: Path, clock: Clock) -> None:
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=TTL, clock=clock)
    gen = atomic(store, ("r0",))
    publish(store, gen, 1)
    store.report_prepared("job", 1, "r0", report(store, 1, prepared=True))
    decided = store.version("job", 1)
    store.close()
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=TTL, clock=clock)
    try:
        assert store.version("job", 1) == decided and decided.flip_decided_at
        assert store.events_since("job", 0)[-1].version.flip_decided_at == decided.flip_decided_at
    finally:
        store.close()
