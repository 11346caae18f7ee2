"""Agent keys: an agent id is bound to the process that registered it (coordinator.agent_keys)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.agent_keys import AgentKeyCheck
from coordinator.store import SessionStore
from tests.unit.test_store import Clock, attach
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import PermissionDenied
from weightsync.manifest import Endpoint

C = "/weightsync.v1.Coordinator/"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[SessionStore]:
    s = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock, forget_agents_after_s=60)
    yield s
    s.close()


def register(store: SessionStore, agent_id: str, role: str = "ROLLOUT", **kw: object) -> str:
    return store.register_agent("job", agent_id, role=role, endpoint=Endpoint(), **kw).agent_key  # type: ignore[arg-type]


def refused(check: AgentKeyCheck, method: str, request: object) -> PermissionDenied:
    with pytest.raises(PermissionDenied) as e:
        check(C + method, (), request)
    assert e.value.field == "agent_id"
    return e.value


def test_every_call_naming_an_agent_needs_its_key(store: SessionStore) -> None:
    attach(store)
    r0, t0 = register(store, "r0"), register(store, "t0", "TRAINER")
    check = AgentKeyCheck(store.agent_keys)
    calls = {
        "Heartbeat": lambda a, k: pb.HeartbeatRequest(session="job", agent_id=a, agent_key=k),
        "Heartbeats": lambda a, k: pb.HeartbeatRequest(session="job", agent_id=a, agent_key=k),
        "DeregisterAgent": lambda a, k: pb.DeregisterAgentRequest(session="job", agent_id=a, agent_key=k),
        "GetManifest": lambda a, k: pb.GetManifestRequest(session="job", version=1, agent_id=a, agent_key=k),
        "ReportApplied": lambda a, k: pb.ReportAppliedRequest(session="job", version=1, agent_id=a, agent_key=k),
    }
    for method, make in calls.items():
        check(C + method, (), make("r0", r0))  # its own key
        check(C + method, (), make("t0", t0))
        assert "carries no agent key" in refused(check, method, make("t0", "")).message
        assert "another trainer process" in refused(check, method, make("t0", r0)).message  # a rollout as the trainer
        refused(check, method, make("r0", t0))
        refused(check, method, make("r0", r0[:-1] + "0" if r0[-1] != "0" else r0[:-1] + "1"))
        check(C + method, (), make("r9", ""))  # nobody's id: the call answers as it would (NOT_FOUND)
    # calls carried on a Heartbeats stream are checked as their own RPCs; the envelope names no agent
    lease = pb.GetManifestRequest(session="job", version=1, agent_id="t0", agent_key=r0)
    refused(check, "Heartbeats", pb.HeartbeatRequest(call_id=1, get_manifest=lease))
    lease.agent_key = t0
    check(C + "Heartbeats", (), pb.HeartbeatRequest(call_id=1, get_manifest=lease))
    report = pb.ReportAppliedRequest(session="job", version=1, agent_id="r0", agent_key="x" * 64)
    refused(check, "Heartbeats", pb.HeartbeatRequest(call_id=2, report_applied=report))
    check(C + "Heartbeats", (), iter([]))  # a stream's iterator: its messages come one by one
    check(C + "GetManifest", (), pb.GetManifestRequest(session="job", version=1))  # an unleased read names nobody
    # registering is checked by the store, where the lease it looks at is read
    check(C + "RegisterAgent", (), pb.RegisterAgentRequest(session="job", agent_id="r0", role=tpb.ROLLOUT))
    check(C + "GetStatus", (), pb.GetStatusRequest(session="job"))


def test_an_id_keeps_its_role_while_its_row_exists(store: SessionStore, clock: Clock) -> None:
    attach(store)
    register(store, "t0", "TRAINER")
    register(store, "r0")
    before = store.agents("job")
    for agent_id, role in (("t0", "ROLLOUT"), ("r0", "TRAINER")):
        with pytest.raises(PermissionDenied, match=f"'{agent_id}' is registered as a") as e:
            register(store, agent_id, role, instance="x")
        assert e.value.field == "agent_id"
    clock.t += 11  # both leases lapsed: the ids still belong to their roles
    with pytest.raises(PermissionDenied):
        register(store, "t0", "ROLLOUT")
    assert [(a.agent_id, a.role) for a in store.agents("job")] == [(a.agent_id, a.role) for a in before]
    assert store.deregister_agent("job", "t0")
    register(store, "t0", "ROLLOUT")  # free once deregistered
    clock.t += 71  # both leases lapsed over forget_agents_after_s ago
    assert store.forget_agents() == 2  # and once forgotten
    register(store, "r0", "TRAINER")


def test_a_rollout_that_names_no_instance_gets_one_drawn(store: SessionStore) -> None:
    attach(store)
    key = register(store, "r0")
    assert register(store, "r0", agent_key=key) == key  # registered again by its holder
    assert register(store, "r1") != register(store, "r2")
    store.delete_session("job", force=True)
    attach(store)
    assert register(store, "r0") != key  # another drawing: the old key does not come back


def test_one_instance_is_one_key_and_a_trainer_id_s_key_goes_with_the_session(store: SessionStore) -> None:
    """A sidecar and the vLLM engine it drives share an instance, an id and its key. A
    trainer's id is guarded by the trainer's credential and generation: a zombie trainer
    still beats with its key and learns from the answer that it was fenced."""
    attach(store)
    key = register(store, "r0", instance="sidecar")
    assert register(store, "r0", instance="sidecar") == key
    trainer = register(store, "t0", "TRAINER")
    store.open_session("job", trainer=True, incarnation="run-2")
    assert register(store, "t0", "TRAINER") == trainer
    assert store.agent_keys.matches("job", "t0", trainer)


def test_keys_outlive_a_restart_and_go_with_their_rows(tmp_path: Path, clock: Clock) -> None:
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock, forget_agents_after_s=60)
    attach(store)
    keys = {a: register(store, a) for a in ("r0", "r1", "r2")}
    store.close()
    store = SessionStore(tmp_path / "c.db", lease_ttl_s=10, clock=clock, forget_agents_after_s=60)
    try:
        assert all(store.agent_keys.matches("job", a, k) for a, k in keys.items())
        assert not store.agent_keys.matches("job", "r0", keys["r1"])
        store.deregister_agent("job", "r0")
        clock.t += 5
        store.heartbeat("job", "r1")
        clock.t += 66  # r2's lease lapsed 61 s ago, r1's 56 s ago
        assert store.forget_agents() == 1
        assert len(store.agent_keys) == 1 and store.agent_keys.matches("job", "r1", keys["r1"])
        store.delete_session("job", force=True)
        assert len(store.agent_keys) == 0
    finally:
        store.close()


def test_a_refused_registration_changes_no_key(store: SessionStore) -> None:
    attach(store)
    key = register(store, "r0", instance="a")
    with pytest.raises(Exception):  # noqa: B017 - AlreadyExists: another live process
        register(store, "r0", instance="b")
    assert store.agent_keys.matches("job", "r0", key) and store.agent_keys.changes > 0
