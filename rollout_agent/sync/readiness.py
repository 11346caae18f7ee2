"""Whether a rollout is ready to take requests (docs/design.md "Readiness"): it serves the
session's newest COMMITTED version, or a newer one, with its bytes verified. A rollout that
starts, restarts or rejoins is not ready until then; one that a newer committed version
left behind is not ready until it applied that one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import types_pb2 as tpb

log = logging.getLogger(__name__)


def newest_committed(st: cpb.GetStatusResponse) -> int:
    """The newest COMMITTED version among a status's versions (0: none)."""
    return next((v.version for v in st.versions if v.state == tpb.COMMITTED), 0)


class Readiness:
    """Ready once the session's newest committed version is known (read from the
    coordinator: `learn`, then each COMMITTED record the watch brings, `note`) and the
    version the rollout serves (`serving()`: one the coordinator confirmed, so verified
    whole) is that one or newer. A session with no committed version has nothing to wait
    for: a rollout that heard from the coordinator is ready. `on_change(ready)` is called
    at each change (the health service's status); `watch` adds one, told at once. Thread-safe."""

    def __init__(self, serving: Callable[[], int], on_change: Callable[[bool], None] | None = None) -> None:
        self._serving = serving
        self._on_change: list[Callable[[bool], None]] = [on_change] if on_change is not None else []
        self._lock = threading.Lock()
        self._evaluating = threading.Lock()  # one evaluation at a time: callbacks in order
        self._committed = -1  # -1: not known yet
        self._ready = False

    def watch(self, on_change: Callable[[bool], None]) -> None:
        """Adds a callback, called at once with the present verdict."""
        with self._evaluating:
            self._on_change.append(on_change)
            on_change(self._ready)

    @property
    def committed(self) -> int:
        """The session's newest committed version as this rollout knows it (0: none, or not known)."""
        return max(0, self._committed)

    @property
    def ready(self) -> bool:
        return self._ready

    def learn(self, st: cpb.GetStatusResponse) -> None:
        """A status read from the coordinator (on each (re)connect of the watch)."""
        self._set_committed(newest_committed(st), replace=False)

    def note(self, info: tpb.VersionInfo) -> None:
        """A version's record (a watch event, an answer to a report)."""
        if info.state == tpb.COMMITTED:
            self._set_committed(info.version, replace=False)

    def forget(self) -> None:
        """The session was made again: its committed version is not known until read again."""
        self._set_committed(-1, replace=True)

    def update(self) -> None:
        """The served version may have changed: evaluates again."""
        self._evaluate()

    def _set_committed(self, version: int, *, replace: bool) -> None:
        with self._lock:
            self._committed = version if replace else max(self._committed, version)
        self._evaluate()

    def _evaluate(self) -> None:
        with self._evaluating:
            serving = self._serving()
            with self._lock:
                committed = self._committed
            ready = committed >= 0 and serving >= committed
            if ready == self._ready:
                return
            self._ready = ready
            self._tell(ready, serving, committed)

    def _tell(self, ready: bool, serving: int, committed: int) -> None:
        if ready:
            log.info("ready: serving version %d (the session's newest committed: %d)", serving, committed)
        elif committed < 0:
            log.info("not ready: the session's committed version is not known yet")
        else:
            log.info("not ready: serving version %d, the session's newest committed is %d", serving, committed)
        for callback in self._on_change:
            callback(ready)
