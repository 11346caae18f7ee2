"""The version lifecycle against its invariants, under random sequences of what trainers,
rollouts and the clock do: publishes, refused and verified handshakes, leases, slot reuse,
trainer replacements, aborts, lapsed leases and sweeps (a real SessionStore on SQLite).

- The newest version that ever committed stays COMMITTED (servable) until a newer one
  commits: no failure and no replacement releases it, and a trainer reusing a slot gives
  it up only where every other slot is leased (as the publisher does, `unpin`).
- `version=0` names the newest READY or COMMITTED version, never a PARTIAL one.
- A COMMITTED version only ever becomes RELEASED; a RELEASED or FAILED one never changes.
- A PARTIAL version commits once every live rollout that must verify it did.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from coordinator.handshake import AppliedReport
from coordinator.states import VersionState
from coordinator.store import SessionStore
from tests.unit.helpers import Clock, make_part, sample_arrays
from weightsync.errors import (
    AgentNotFound,
    FailedPrecondition,
    NewestCommitted,
    StaleGeneration,
    VersionNotFound,
    WrongState,
)
from weightsync.manifest import Endpoint, Manifest

S = VersionState
ROLLOUTS = ("r0", "r1")
TTL = 10.0
SLOTS = 2
PART, _ = make_part(sample_arrays())


def report(m: Manifest, digest: str, *, ok: bool) -> AppliedReport:
    sums = m.tensor_sums()
    good = AppliedReport(
        manifest_digest=digest,
        tensor_digests={n: (d, sums[n]) for n, d in m.tensor_digests().items()},
        aggregates=m.aggregates(),
        consumed_names=tuple(m.tensors),
    )
    return good if ok else dataclasses.replace(good, local_error="device fingerprint differs")


class Lifecycle(RuleBasedStateMachine):
    """One session, up to three rollouts, a trainer with two arena slots that may be
    replaced; `self.slots` is what the current trainer holds, as its publisher does."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ws-invariants-"))
        self.clock = Clock()
        self.store = SessionStore(self.dir / "c.db", lease_ttl_s=TTL, retain_versions=3, clock=self.clock)
        self.generation = 0
        self.incarnation = 0
        self.next_version = 1
        self.slots: list[int] = []
        self.seen: dict[int, S] = {}  # every version's state as last observed
        self.newest_ever_committed = 0
        self.given_up: set[int] = set()  # committed versions a trainer released, every other slot leased

    @initialize()
    def attach(self) -> None:
        self.replace_trainer()
        for r in ROLLOUTS:
            self.store.register_agent("job", r, role="ROLLOUT", endpoint=Endpoint())

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- what the trainer does -------------------------------------------------------
    @rule()
    def replace_trainer(self) -> None:
        """A new incarnation attaches: a new generation, an empty arena."""
        self.incarnation += 1
        s, _ = self.store.open_session("job", trainer=True, incarnation=f"run-{self.incarnation}")
        self.generation, self.slots = s.generation, []

    @rule()
    def publish(self) -> None:
        """The publisher's slot claim (oldest first, the newest COMMITTED version kept),
        then the version."""
        if len(self.slots) == SLOTS:
            pinned, leased = None, []
            for v in sorted(self.slots):
                try:
                    self.store.release_version("job", v, generation=self.generation)
                except NewestCommitted:
                    pinned = v
                    continue
                except WrongState:  # FAILED or RELEASED already: the slot is free
                    pass
                except FailedPrecondition:  # leased
                    leased.append(v)
                    continue
                self.slots.remove(v)
                break
            else:
                if pinned is None:
                    return  # every slot leased: the publisher would wait; this step gives up
                assert leased, "the newest COMMITTED version given up with another slot free"
                try:
                    self.store.release_version("job", pinned, generation=self.generation, unpin=True)
                except FailedPrecondition:  # leased too: the publisher would wait
                    return
                self.given_up.add(pinned)
                self.slots.remove(pinned)
        v = self.next_version
        self.store.publish_part("job", generation=self.generation, version=v, idempotency_key=f"k{v}", part=PART)
        self.next_version += 1
        self.slots.append(v)

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        v = data.draw(st.sampled_from(self.slots))
        try:
            self.store.abort_version("job", generation=self.generation, version=v, reason="operator")
        except WrongState:
            pass

    # --- what rollouts do --------------------------------------------------------------
    @rule(data=st.data(), ok=st.booleans())
    def handshake(self, data: st.DataObject, ok: bool) -> None:
        """A rollout takes a lease on a servable version and reports it (OK or refused)."""
        servable = [v for v, state in self.seen.items() if state in (S.READY, S.PARTIAL, S.COMMITTED)]
        if not servable:
            return
        v = data.draw(st.sampled_from(sorted(servable)))
        r = data.draw(st.sampled_from(ROLLOUTS))
        try:
            rec, m = self.store.manifest("job", v, lease_for=r)
            self.store.report_applied("job", v, r, report(m, rec.manifest_digest, ok=ok))
        except (AgentNotFound, WrongState):  # lapsed, or the version moved on meanwhile
            pass

    @rule(ok=st.booleans())
    def fleet_reports_the_newest(self, ok: bool) -> None:
        """Every rollout verifies (or every one refuses) the newest servable version."""
        servable = [v for v, state in self.seen.items() if state in (S.READY, S.PARTIAL, S.COMMITTED)]
        if not servable:
            return
        v = max(servable)
        for r in ROLLOUTS:
            try:
                rec, m = self.store.manifest("job", v, lease_for=r)
                self.store.report_applied("job", v, r, report(m, rec.manifest_digest, ok=ok))
            except (AgentNotFound, WrongState):
                pass

    @rule(data=st.data())
    def lease_only(self, data: st.DataObject) -> None:
        """A rollout starts pulling a version and has not reported yet."""
        r = data.draw(st.sampled_from(ROLLOUTS))
        try:
            self.store.manifest("job", 0, lease_for=r)
        except (AgentNotFound, VersionNotFound, WrongState):
            pass

    @rule(alive=st.sets(st.sampled_from(ROLLOUTS)), seconds=st.sampled_from([1.0, 4.0, TTL + 1]))
    def time_passes(self, alive: set[str], seconds: float) -> None:
        """`alive` rollouts beat (re-registering if they lapsed), the rest go quiet; the sweep runs."""
        self.clock.t += seconds
        for r in alive:
            try:
                self.store.heartbeat("job", r)
            except AgentNotFound:
                self.store.register_agent("job", r, role="ROLLOUT", endpoint=Endpoint())
        self.store.sweep()

    @rule()
    def stale_writer(self) -> None:
        """A replaced trainer's release is refused (a fenced trainer changes nothing)."""
        if self.generation > 1 and self.seen:
            with pytest.raises(StaleGeneration):
                self.store.release_version("job", max(self.seen), generation=self.generation - 1)

    # --- invariants ----------------------------------------------------------------------
    @invariant()
    def invariants_hold(self) -> None:
        self.states_move_only_forward()
        self.the_newest_committed_version_stays_servable()
        self.latest_is_the_newest_ready_or_committed_version()

    def states_move_only_forward(self) -> None:
        now = {r.version: r.state for r in self.store.versions("job", limit=1000)}
        for v, before in self.seen.items():
            after = now[v]
            if before is S.COMMITTED:
                assert after in (S.COMMITTED, S.RELEASED), (v, before, after)
            if before in (S.RELEASED, S.FAILED):
                assert after in (before, S.RELEASED), (v, before, after)
        self.seen = now
        committed = [v for v, state in now.items() if state is S.COMMITTED]
        self.newest_ever_committed = max([self.newest_ever_committed, *committed])

    def the_newest_committed_version_stays_servable(self) -> None:
        v = self.newest_ever_committed
        if v and v not in self.given_up:
            rec = self.store.version("job", v)
            assert rec.state is S.COMMITTED, (v, rec.state, rec.reason)

    def latest_is_the_newest_ready_or_committed_version(self) -> None:
        candidates = [v for v, state in self.seen.items() if state in (S.READY, S.COMMITTED)]
        try:
            rec, _ = self.store.manifest("job", 0)
        except VersionNotFound:
            assert not candidates
            return
        assert rec.state in (S.READY, S.COMMITTED) and rec.version == max(candidates)


Lifecycle.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_version_lifecycle_keeps_its_invariants = Lifecycle.TestCase
