"""Groups of version states by name, one home for the coordinator, agents, client and demo.

The states themselves are `weightsync.v1.VersionState` (proto) and `coordinator.states.
VersionState` (with the transition table); these are the sets every side asks about.
"""

from __future__ import annotations

# Rollouts may pull the manifest and report a handshake.
SERVABLE = frozenset({"READY", "COMMITTED", "PARTIAL"})
# What `version=0` ("latest") names, the newest of: a PARTIAL version, which a live rollout
# could not verify, is served by its number (followers retry it) but is nobody's default.
LATEST = frozenset({"READY", "COMMITTED"})
# The handshakes decided the version's outcome for now (PARTIAL can still commit: the
# rollout that failed verifies it on a later try, or its lease lapses).
SETTLED = frozenset({"COMMITTED", "PARTIAL", "FAILED"})
# No rollout pulls it again: its records may be summarized and its stored bytes removed.
RETIRED = frozenset({"RELEASED", "FAILED"})
# Decided, or gone: what `wait_for_version` waits for by default.
DECIDED = SETTLED | {"RELEASED"}
# Nothing a handshake does changes it any more: what a trainer waits for (`wait_committed`).
FINAL = frozenset({"COMMITTED", "FAILED", "RELEASED"})
# How a session's rollouts take a version (weightsync.v1.FlipPolicy), and what an ATOMIC
# version does when a rollout that prepared it is lost before the flip was decided
# (weightsync.v1.PreparedLoss); docs/design.md "Atomic flips".
FLIP_POLICIES = ("INDEPENDENT", "ATOMIC")
PREPARED_LOSSES = ("FLIP_WITHOUT", "ABORT_FLIP")
