"""The version state machine (docs/design.md "Version lifecycle"): states and allowed transitions."""

from __future__ import annotations

from enum import StrEnum

from weightsync import version_states
from weightsync.errors import WrongState


class VersionState(StrEnum):
    """Names equal the proto enum names of weightsync.v1.VersionState."""

    STAGING = "STAGING"
    READY = "READY"
    COMMITTED = "COMMITTED"
    PARTIAL = "PARTIAL"
    FAILED = "FAILED"
    RELEASED = "RELEASED"


S = VersionState
TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    S.STAGING: frozenset({S.READY, S.FAILED}),
    S.READY: frozenset({S.COMMITTED, S.PARTIAL, S.FAILED, S.RELEASED}),
    # A rollout that failed may re-sync and report OK: PARTIAL can still commit.
    S.PARTIAL: frozenset({S.COMMITTED, S.FAILED, S.RELEASED}),
    S.COMMITTED: frozenset({S.RELEASED}),
    S.FAILED: frozenset({S.RELEASED}),
    S.RELEASED: frozenset(),
}
# States in which rollouts may pull and report.
SERVABLE = frozenset(VersionState(name) for name in version_states.SERVABLE)
# States `version=0` may name (the newest of them).
LATEST = frozenset(VersionState(name) for name in version_states.LATEST)


def check_transition(version: int, current: VersionState, target: VersionState) -> None:
    """Raises WrongState (FAILED_PRECONDITION) unless current -> target is allowed."""
    if target not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none (terminal)"
        raise WrongState(f"version {version} is {current.value}; cannot become {target.value} (allowed: {allowed})")
