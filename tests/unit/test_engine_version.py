"""The one rule of what a rollout says it serves (sidecar and vLLM worker alike)."""

from __future__ import annotations

from rollout_agent.sync.engine_version import EngineVersion
from rollout_agent.sync.round import SyncResult


def test_a_late_verdict_makes_a_version_current_only_while_the_engine_holds_it() -> None:
    engine = EngineVersion()
    engine.after_round(SyncResult(1, ok=False, handshake_pending=True))  # applied; verdict to come
    assert (engine.applied, engine.current, engine.newest) == (1, 0, 1)
    engine.after_round(SyncResult(2, ok=True))
    assert engine.confirm(2) and engine.current == 2
    assert not engine.confirmable(1) and not engine.confirm(1)  # version 1's verdict, delivered late
    assert engine.current == 2
    engine.after_round(SyncResult(3, ok=False, failure="data_loss"))  # not applied: the engine still holds 2
    assert (engine.applied, engine.current) == (2, 2) and not engine.confirm(3)
    engine.forget()  # the session was made again
    assert (engine.applied, engine.current, engine.newest) == (0, 0, 0)


def test_a_version_an_audit_found_damaged_is_served_again_only_after_an_apply() -> None:
    engine = EngineVersion()
    engine.after_round(SyncResult(4, ok=False, handshake_pending=True))
    assert engine.unserve(4) is False  # said it served none yet
    assert not engine.confirm(4)  # the verdict for the damaged weights arrives late: still none served
    assert engine.current == 0 and engine.newest == 4  # a following rollout does not go back past it
    engine.applied_whole(4)  # re-applied
    engine.after_round(SyncResult(4, ok=True))
    assert engine.confirm(4) and engine.current == 4
    assert engine.unserve(4) is True and engine.current == 0


def test_a_version_s_digest_is_known_from_its_manifest_before_its_round_ends() -> None:
    """A response sampled once the engine holds a version, before its round recorded it,
    still names the version's manifest digest; a held version's digest is not replaced."""
    engine = EngineVersion()
    engine.after_round(SyncResult(1, ok=True, manifest_digest="a" * 64))
    engine.knows(2, "b" * 64)  # its manifest came; not applied yet
    assert engine.provenance(2).manifest_digest == "b" * 64
    assert engine.provenance().version == 1 and engine.provenance().manifest_digest == "a" * 64
    engine.knows(1, "c" * 64)  # held: what its round applied stands
    assert engine.provenance(1).manifest_digest == "a" * 64
    engine.forget()
    assert engine.provenance(2).manifest_digest == ""
