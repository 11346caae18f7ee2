"""Groups of version states by name, one home for the coordinator, agents, client and demo.

The states themselves are `weightsync.v1.VersionState` (proto) and `coordinator.states.
VersionState` (with the transition table); these are the sets every side asks about.
"""

from __future__ import annotations

# Rollouts may pull the manifest and report a handshake.
SERVABLE = frozenset({"READY", "COMMITTED", "PARTIAL"})
# The handshakes decided the version's outcome.
SETTLED = frozenset({"COMMITTED", "PARTIAL", "FAILED"})
# No rollout pulls it again: its records may be summarized and its stored bytes removed.
RETIRED = frozenset({"RELEASED", "FAILED"})
# Nothing more will happen to the version on its own (what `wait_for_version` waits for).
FINAL = SETTLED | {"RELEASED"}
