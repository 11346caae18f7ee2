"""Watch fan-out: wakes every WatchVersions stream of a session when events are appended."""

from __future__ import annotations

import threading


class WatchHub:
    """A per-session change counter with a condition; watchers poll the store on wake-up.

    Events themselves live in the store (durable, replayable by seq); the hub only says
    "something changed", so a slow watcher never holds memory for others.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ticks: dict[str, int] = {}
        self._closed = False

    def notify(self, session: str) -> None:
        with self._cond:
            self._ticks[session] = self._ticks.get(session, 0) + 1
            self._cond.notify_all()

    def tick(self, session: str) -> int:
        with self._cond:
            return self._ticks.get(session, 0)

    def wait(self, session: str, seen_tick: int, timeout_s: float) -> int:
        """Blocks until the session's tick passes seen_tick, the hub closes, or timeout."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._ticks.get(session, 0) != seen_tick, timeout=timeout_s)
            return self._ticks.get(session, 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
