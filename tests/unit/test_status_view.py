"""StatusReplies: the kept, encoded GetStatus pieces equal a reply built message by
message from the store, whatever happened in between (reports new and replaced, leases
renewed and lapsed, agents registered again, moved, gone and forgotten, versions published, released
and pruned)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.handshake import AppliedReport
from coordinator.messages import agent_info, handshake_info, version_info
from coordinator.status_view import StatusReplies
from coordinator.store import SessionStore
from tests.unit.helpers import make_part, sample_arrays
from tests.unit.test_store import Clock, good_report
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import WeightsyncError
from weightsync.manifest import Endpoint
from weightsync.wire import part_to_proto

AGENTS = [f"r{i}" for i in range(4)]
ENDPOINTS = [Endpoint(), Endpoint("127.0.0.1:7001", ("tcp", "grpc"), "host-a", tcp_address="127.0.0.1:7002")]


def built_whole(store: SessionStore, request: pb.GetStatusRequest) -> pb.GetStatusResponse:
    """The reply as GetStatus builds it without what is kept: every message from its row."""
    s = store.session(request.session)
    versions = store.versions(s.name, request.version_limit or 20)
    parts = store.parts(s.name, versions[0].version) if versions else []
    return pb.GetStatusResponse(
        session=s.name,
        generation=s.generation,
        trainer_ranks=s.trainer_ranks,
        min_rollouts=s.min_rollouts,
        versions=[version_info(v) for v in versions],
        agents=[agent_info(a) for a in store.agents(s.name)],
        handshakes=[handshake_info(r) for r in store.reports(s.name, [v.version for v in versions])],
        parts=[part_to_proto(p) for p in parts],
        event_seq=store.latest_seq(s.name),
        flip_policy=tpb.FlipPolicy.Value(s.flip_policy),
        prepare_timeout_seconds=s.prepare_timeout_s,
        prepared_loss=tpb.PreparedLoss.Value(s.prepared_loss),
    )


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("report"), st.integers(0, 3), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("beat"), st.integers(0, 3), st.integers(0, 5)),
        st.tuples(st.just("register"), st.integers(0, 3), st.integers(0, 1), st.integers(0, 2)),
        st.tuples(st.just("deregister"), st.integers(0, 3)),
        st.tuples(st.just("trainer")),
        st.tuples(st.just("tick"), st.sampled_from([0.0, 0.0004, 0.3, 4.0, 11.0])),
        st.tuples(st.just("publish")),
        st.tuples(st.just("release_and_prune")),
        st.tuples(st.just("sweep")),
        st.tuples(st.just("forget")),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, limit=st.sampled_from([0, 1, 2]))
def test_kept_reply_equals_the_reply_built_whole(ops: list[tuple], limit: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clock = Clock()
        store = SessionStore(
            Path(tmp) / "c.db", lease_ttl_s=10, clock=clock, retain_versions=1, forget_agents_after_s=5
        )
        try:
            replies = StatusReplies(store)
            s, _ = store.open_session("job", trainer=True, incarnation="run-1", trainer_ranks=1)
            for a in AGENTS[:2]:
                store.register_agent("job", a, role="ROLLOUT", endpoint=ENDPOINTS[0], instance=a)
            part, _ = make_part(sample_arrays())
            published = [0]
            request = pb.GetStatusRequest(session="job", version_limit=limit)
            for op in ops:
                try:
                    run(store, op, clock, part, s.generation, published)
                except WeightsyncError:
                    pass  # refused (a report for a released version, a lapsed agent): nothing changed
                assert replies.reply(request) == built_whole(store, request), op
        finally:
            store.close()


def run(store: SessionStore, op: tuple, clock: Clock, part: object, generation: int, published: list[int]) -> None:
    kind = op[0]
    if kind == "report" and published[-1]:
        version = max(1, published[-1] - op[2])
        report = good_report(store, version)
        if not op[3]:
            report = dataclasses.replace(report, local_error="engine refused the weights")
        report = dataclasses.replace(report, timings={"pull_s": clock.t % 7}, bytes_pulled=int(clock.t))
        store.report_applied("job", version, AGENTS[op[1]], report)
    elif kind == "beat":
        store.heartbeat("job", AGENTS[op[1]], op[2])
    elif kind == "register":
        agent = AGENTS[op[1]]  # registered again by its own process (another would be refused while it lives)
        store.register_agent("job", agent, role="ROLLOUT", endpoint=ENDPOINTS[op[2]], rank=op[3], instance=agent)
    elif kind == "deregister":
        store.deregister_agent("job", AGENTS[op[1]])
    elif kind == "trainer":
        store.register_agent("job", "t0", role="TRAINER", endpoint=ENDPOINTS[1], generation=generation)
    elif kind == "tick":
        clock.t += op[1]
    elif kind == "publish":
        v = published[-1] + 1
        store.publish_part("job", generation=generation, version=v, idempotency_key=f"k{v}", part=part)
        published.append(v)
    elif kind == "release_and_prune" and len(published) > 2:
        store.release_version("job", published[-2], generation=generation, force=True)
        store.prune()
    elif kind == "sweep":
        store.sweep()
    elif kind == "forget":
        store.forget_agents()


def test_a_replaced_report_in_the_same_instant_is_seen(tmp_path: Path) -> None:
    """A report sent again (the outbox retrying) replaces the row in the same clock tick:
    the kept list must not serve the first one."""
    clock = Clock()
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock)
    try:
        replies = StatusReplies(store)
        s, _ = store.open_session("job", trainer=True, incarnation="run-1", trainer_ranks=1)
        store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint())
        store.register_agent("job", "r1", role="ROLLOUT", endpoint=Endpoint())
        part, _ = make_part(sample_arrays())
        store.publish_part("job", generation=s.generation, version=1, idempotency_key="k", part=part)
        request = pb.GetStatusRequest(session="job")
        first: AppliedReport = dataclasses.replace(good_report(store, 1), bytes_pulled=1)
        store.report_applied("job", 1, "r0", first)
        assert [h.bytes_pulled for h in replies.reply(request).handshakes] == [1]
        store.report_applied("job", 1, "r0", dataclasses.replace(first, bytes_pulled=2))
        assert [h.bytes_pulled for h in replies.reply(request).handshakes] == [2]
        assert replies.reply(request) == built_whole(store, request)
    finally:
        store.close()


def test_rows_of_a_database_from_before_the_marks_are_listed(tmp_path: Path) -> None:
    """Rows written before reports and agents had a `written` mark (0) are read on the first
    call, and the marks go on from the newest one stored after a restart."""
    clock = Clock()
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock)
    s, _ = store.open_session("job", trainer=True, incarnation="run-1", trainer_ranks=1)
    store.register_agent("job", "r0", role="ROLLOUT", endpoint=Endpoint())
    part, _ = make_part(sample_arrays())
    store.publish_part("job", generation=s.generation, version=1, idempotency_key="k", part=part)
    store.report_applied("job", 1, "r0", good_report(store, 1))
    store.register_agent("job", "r1", role="ROLLOUT", endpoint=Endpoint())
    with store.db.tx() as db:
        db.execute("UPDATE reports SET written=0")
        db.execute("UPDATE agents SET written=0 WHERE agent_id='r0'")
    store.close()
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock)
    try:
        request = pb.GetStatusRequest(session="job")
        replies = StatusReplies(store)
        reply = replies.reply(request)
        assert [h.agent_id for h in reply.handshakes] == ["r0"] and reply == built_whole(store, request)
        assert [a.agent_id for a in reply.agents] == ["r0", "r1"]
        clock.t += 1
        store.heartbeat("job", "r1", 1)  # a mark past the stored ones: the kept list sees it
        assert [a.current_version for a in replies.reply(request).agents] == [0, 1]
        assert replies.reply(request) == built_whole(store, request)
    finally:
        store.close()
