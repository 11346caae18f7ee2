"""Agent keys: each registered agent id is bound to the process that registered it.

`RegisterAgent` answers a key (`TokenKeys.agent_key` of the session, the id, its role and
the registering process's instance); every later call naming the id carries it. Bearer
tokens say what a caller may call; they do not say which agent it is: a rollout's role
token acted for any agent id, the trainer's included. The key does, whatever the token
(and with no tokens at all).

`AgentKeys` holds the key of every agent row in memory (the store keeps it in step), so the
check costs a dict lookup on the event loop, not a database read per heartbeat.
`AgentKeyCheck` is the one place that applies it: to every message of every call that
names an agent, carried calls included. `RegisterAgent` is checked by the store instead,
where the lease it must look at is read in the same transaction.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterable
from typing import Any

from weightsync.carried_calls import AGENT_METHODS, COORDINATOR, calls_in
from weightsync.errors import AgentIdHeld

REGISTER = COORDINATOR + "RegisterAgent"


class AgentKeys:
    """(session, agent id) -> (role, key) of every agent row. Thread-safe; the store changes
    it in the transactions that change the rows. `changes` counts the changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str], tuple[str, str]] = {}
        self.changes = 0

    def replace(self, entries: Iterable[tuple[str, str, str, str]]) -> None:
        """Every (session, agent id, role, key) at once (read from the rows)."""
        keys = {(session, agent_id): (role, key) for session, agent_id, role, key in entries}
        with self._lock:
            self._keys = keys
            self.changes += 1

    def bind(self, session: str, agent_id: str, role: str, key: str) -> None:
        """The id's registration."""
        with self._lock:
            self._keys[(session, agent_id)] = (role, key)
            self.changes += 1

    def forget(self, ids: Iterable[tuple[str, str]]) -> None:
        """(session, agent id) pairs whose rows were deleted."""
        with self._lock:
            for pair in ids:
                self._keys.pop(pair, None)
            self.changes += 1

    def forget_session(self, session: str) -> None:
        with self._lock:
            for pair in [p for p in self._keys if p[0] == session]:
                del self._keys[pair]
            self.changes += 1

    def matches(self, session: str, agent_id: str, key: str) -> bool:
        """True when `key` is the id's key, or the id is not registered."""
        with self._lock:
            held = self._keys.get((session, agent_id))
        return held is None or hmac.compare_digest(held[1].encode(), key.encode())

    def check(self, session: str, agent_id: str, key: str) -> None:
        """AgentIdHeld (PERMISSION_DENIED) naming agent_id unless `key` is the key of the id's registration.
        An id nobody registered passes: the call answers as it would (NOT_FOUND for a beat)."""
        if self.matches(session, agent_id, key):
            return
        with self._lock:
            role = self._keys.get((session, agent_id), ("another",))[0]
        what = "carries no agent key" if not key else "carries another agent key"
        raise AgentIdHeld(
            f"{agent_id!r} is registered by another {role.lower()} process; this call {what} for it "
            "(RegisterAgentResponse.agent_key)",
            field="agent_id",
        )

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


class AgentKeyCheck:
    """The coordinator's request check (`weightsync.rpc.RequestCheck`): every message that
    names an agent must carry that agent's key. Runs after the bearer-token check."""

    def __init__(self, keys: AgentKeys) -> None:
        self._keys = keys

    def before_read(self, method: str, metadata: Any) -> None:
        """Nothing to check before the request is read."""

    def while_streaming(self, method: str, metadata: Any) -> None:
        """Nothing to check again: a key stays its agent's for the call."""

    def __call__(self, method: str, metadata: Any, request: Any) -> None:
        for name, message in calls_in(method, request):
            if name in AGENT_METHODS and name != REGISTER and message.agent_id:
                self._keys.check(message.session, message.agent_id, message.agent_key)
