"""Garbage collection for a long-running server: what survives a collection is frozen.

CPython's full (generation 2) collection walks every tracked object. A coordinator serving
a fleet holds ~200 objects per open stream (grpc.aio's tasks, coroutines, call state):
~190,000 at 1,000 agents, and a full collection of them takes 180-230 ms of CPU here, every
~6 s, with the event loop answering nobody meanwhile (the steady-state `GetStatus` p99).
Those objects live as long as their streams, so walking them again finds nothing.

After each collection of the middle or the oldest generation this moves the survivors to
the permanent generation (`gc.freeze()`, which splices lists: no walk), so the next
collections walk only what was made since. Freezing only after full collections would
leave one long pause: the first full collection after a fleet connects walks every new
stream's objects (56-63 ms at 500 agents, once a run in bench/control.py, the steady-state
p99 of GetStatus and Health). What survived a middle collection has outlived two collections and
is as good as old. A frozen object freed by reference counting goes as usual; only
reference cycles that die while frozen wait, and `refresh()` (every `refresh_s`, called by
the owner from a thread of its own) unfreezes, collects everything once and freezes again,
so they cannot pile up. The refresh is the one long pause left (as long as a full
collection: ~200 ms at 1,000 agents); it runs on its clock, not early whenever the frozen
set grows, which would put that pause exactly where a fleet connects or a large manifest
is published. Such cycles are rare here: full collections of the coordinator under a fleet
found 0-150 objects.
"""

from __future__ import annotations

import collections
import gc
import logging
import time
from typing import Any

from prometheus_client import Gauge, Histogram

log = logging.getLogger(__name__)
FREEZE_FROM_GENERATION = 1  # freeze after collections of this generation and older


class FreezingCollector:
    """Installs the freeze-after-collection policy; `pauses` times every collection
    (observed by `flush()`: a collection starts at any allocation, in any thread, maybe
    one holding the histogram's own lock, so the callback only appends to a deque);
    `frozen` is set to the frozen objects' count at each `flush()`."""

    def __init__(self, refresh_s: float, pauses: Histogram | None = None, frozen: Gauge | None = None) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.refresh_s = refresh_s
        self._pauses = pauses
        self._frozen = frozen
        self._started: float | None = None
        self._last_refresh = time.monotonic()
        self._timed: collections.deque[tuple[int, float]] = collections.deque(maxlen=100_000)
        self.freezes = 0

    def install(self) -> FreezingCollector:
        gc.collect()
        gc.freeze()  # what the process built to start (modules, servicers) is never garbage
        gc.callbacks.append(self._on_collect)
        return self

    def uninstall(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)
        gc.unfreeze()

    def _on_collect(self, phase: str, info: dict[str, Any]) -> None:
        # Runs in whichever thread allocated past the threshold, holding the GIL.
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is not None:
            self._timed.append((info["generation"], time.perf_counter() - self._started))
        self._started = None
        if info["generation"] >= FREEZE_FROM_GENERATION:
            # The collection is over and its survivors moved a generation up: what is
            # tracked now has outlived a collection (all but what callbacks allocated).
            gc.freeze()
            self.freezes += 1

    def flush(self) -> None:
        """Observes the collections timed since the last flush (never from a callback)."""
        while self._timed:
            generation, seconds = self._timed.popleft()
            if self._pauses is not None:
                self._pauses.labels(generation=str(generation)).observe(seconds)
        if self._frozen is not None:
            self._frozen.set(gc.get_freeze_count())  # walks the frozen list: ~1 ms per 200,000

    def refresh_due(self) -> bool:
        return time.monotonic() - self._last_refresh >= self.refresh_s

    def refresh(self) -> float:
        """Unfreezes, collects everything (reclaiming cycles that died frozen), freezes again;
        returns the seconds it took. Blocks every thread of the process for that long."""
        t0 = time.perf_counter()
        gc.unfreeze()
        reclaimed = gc.collect()  # its "stop" callback freezes the survivors
        gc.freeze()  # (uninstalled meanwhile: no callback)
        self._last_refresh = time.monotonic()
        seconds = time.perf_counter() - t0
        log.info("gc refresh: %d objects reclaimed in %.1f ms", reclaimed, seconds * 1000)
        return seconds
