"""Watch fan-out: wakes every WatchVersions stream of a session when events are appended,
and reads each new event from the store once for all of them.

Watch streams are coroutines on the server's event loop (no thread each); the store is
called from handler threads, so `notify` is thread-safe and hands wake-ups to the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.records import Event

# Events of a session kept in memory for its watchers; one further behind reads the store.
FEED_EVENTS = 1024
EVENT_PAGE = 256  # events per store read (and per batch a watcher sends)


class WatchHub:
    """A per-session change counter ("tick") that watch coroutines await.

    Events themselves live in the store (durable, replayable by seq); the hub only says
    "something changed", so a slow watcher never holds memory for others.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ticks: dict[str, int] = {}
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        self._closed = False
        self._calls: set[asyncio.Task[Any]] = set()

    def end_on_close(self, task: asyncio.Task[Any]) -> None:
        """A long-lived call (a heartbeat or watch stream) that may wait on something other
        than the hub: its task is cancelled when the hub closes, so shutdown does not wait
        out its grace."""
        with self._lock:
            if not self._closed:
                self._calls.add(task)
                task.add_done_callback(self._call_ended)
                return
        task.cancel()

    def _call_ended(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._calls.discard(task)

    def notify(self, session: str) -> None:
        """Called by the store after a commit that may have appended events (any thread)."""
        with self._lock:
            self._ticks[session] = self._ticks.get(session, 0) + 1
            waiters = self._waiters.pop(session, set())
        _wake(waiters)

    def tick(self, session: str) -> int:
        with self._lock:
            return self._ticks.get(session, 0)

    async def wait(self, session: str, seen_tick: int) -> int:
        """Returns once the session's tick passes `seen_tick` or the hub closes."""
        loop = asyncio.get_running_loop()
        with self._lock:
            tick = self._ticks.get(session, 0)
            if self._closed or tick != seen_tick:
                return tick
            waiter = (loop, loop.create_future())
            self._waiters.setdefault(session, set()).add(waiter)
        try:
            await waiter[1]
        finally:
            with self._lock:
                self._waiters.get(session, set()).discard(waiter)
        return self.tick(session)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiters = {w for ws in self._waiters.values() for w in ws}
            self._waiters.clear()
            calls, self._calls = self._calls, set()
        _wake(waiters)
        for task in calls:
            loop = task.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)


def _wake(waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for loop, fut in waiters:
        by_loop.setdefault(loop, []).append(fut)
    for loop, futs in by_loop.items():  # one hop per loop, not one per watcher
        if not loop.is_closed():
            loop.call_soon_threadsafe(_resolve, futs)


def _resolve(futs: list[asyncio.Future[None]]) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_result(None)


@dataclass
class _SessionFeed:
    """The session's events after `base`, in memory (seqs are global, so not contiguous)."""

    base: int
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=FEED_EVENTS))
    tick: int = -1
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def last(self) -> int:
        return self.events[-1].seq if self.events else self.base


class EventFeed:
    """Serves WatchVersions reads: one store read per session change, shared by all watchers.

    `read(session, after_seq, limit)` and `latest(session)` are blocking store calls;
    `offload` runs one off the event loop.
    """

    def __init__(
        self,
        hub: WatchHub,
        read: Callable[[str, int, int], list[Event]],
        latest: Callable[[str], int],
        offload: Callable[..., Awaitable[object]],
    ) -> None:
        self._hub = hub
        self._read = read
        self._latest = latest
        self._offload = offload
        self._feeds: dict[str, _SessionFeed] = {}

    def forget(self, session: str) -> None:
        """Drops the events kept for `session` (deleted: a new one under its name starts
        from the store). Called on the event loop."""
        self._feeds.pop(session, None)

    async def after(self, session: str, seq: int) -> list[Event]:
        """Up to EVENT_PAGE events of `session` after `seq`, oldest first."""
        feed = self._feeds.get(session)
        if feed is None:
            base = await self._offload(self._latest, session)
            feed = self._feeds.setdefault(session, _SessionFeed(base=int(base)))  # type: ignore[call-overload]
        if seq < feed.base:  # a replay from further back than memory holds
            return await self._offload(self._read, session, seq, EVENT_PAGE)  # type: ignore[return-value]
        if feed.tick != self._hub.tick(session):  # else up to date: no lock (a thousand watchers
            await self._refresh(session, feed)  # would take it in turn, a loop turn each)
        if seq < feed.base:  # fell out of the window while we read
            return await self._offload(self._read, session, seq, EVENT_PAGE)  # type: ignore[return-value]
        newer: list[Event] = []
        for ev in reversed(feed.events):  # watchers are near the tail: walk only what is new
            if ev.seq <= seq:
                break
            newer.append(ev)
        return newer[::-1][:EVENT_PAGE]

    async def _refresh(self, session: str, feed: _SessionFeed) -> None:
        async with feed.lock:
            tick = self._hub.tick(session)
            if feed.tick != tick:  # the first watcher to wake reads for everyone
                while True:
                    page: list[Event] = await self._offload(self._read, session, feed.last, EVENT_PAGE)  # type: ignore[assignment]
                    for ev in page:
                        if len(feed.events) == feed.events.maxlen:
                            feed.base = feed.events[0].seq
                        feed.events.append(ev)
                    if len(page) < EVENT_PAGE:
                        break
                feed.tick = tick
