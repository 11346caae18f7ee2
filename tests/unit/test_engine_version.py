"""The one rule of what a rollout says it serves (sidecar and vLLM worker alike)."""

from __future__ import annotations

from rollout_agent.engine_version import EngineVersion
from rollout_agent.sync import SyncResult


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
