"""The servers' event loop, with a lane for calls that must answer during a fleet's burst.

On every READY a thousand rollouts lease, report and beat at once. grpc.aio completes each
stream message as a callback on the one event loop, and asyncio runs callbacks first in,
first out, polling I/O only between turns: a burst's turns held ~200 message callbacks
(60-230 ms), and an operator's GetStatus, which waits for a few completions (accept,
read, reply), waited behind them (p50 1.2 s, p99 2.1 s during a burst in bench/control.py;
118-195 ms with this loop).

`LaneLoop` keeps asyncio's order for everything else and adds three rules:

1. Callbacks scheduled from a context where `URGENT` is set (operator and probe RPCs:
   `rpc.StatusInterceptor` sets it per method) and I/O callbacks (the grpc completion
   queue's socket) run before the rest of the turn, first in, first out among themselves.
2. While many callbacks wait, I/O is polled every POLL_EVERY callbacks rather than once a
   turn, and after any callback that ends POLL_S or more after the last poll, so a
   completion an urgent call waits for is seen within a few milliseconds. The count alone
   did not bound the time: in a burst the loop runs leases and handshakes itself
   (`CoordinatorServicer._soon`), and a traced run at 500 agents found 20-59 ms between
   polls (15-65 callbacks), while a Health.Check waits for three completions.
3. grpc.aio's completion queue wakes the loop with one byte per completion on a socket
   pair, and its reader consumes one byte per call. Once a few hundred completions wait,
   the socket is full: grpc's poller thread blocks writing, and completions reach the loop
   one per I/O poll (py-spy: the poller thread sat in write() 60% of a burst; a GetStatus
   waited 0.5-1.5 s to be accepted). Here the reader first takes every byte but one, so
   each call delivers everything queued (`_drain_first`). Of the three, this one moved
   the burst's tail most.

It builds on asyncio's selector loop internals (`_call_soon`, `_add_callback`, `_ready`,
`_selector`, `_process_events`), unchanged from Python 3.8 to 3.13;
tests/unit/test_event_loop.py pins the behaviour this module relies on.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import socket
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")
URGENT: contextvars.ContextVar[bool] = contextvars.ContextVar("weightsync_urgent", default=False)
POLL_EVERY = 32  # callbacks between I/O polls while a turn is long
POLL_S = 0.002  # and at most this long between polls while callbacks wait
_PLAIN = contextvars.Context()  # the trampolines' own context: nothing to copy


class LaneLoop(asyncio.SelectorEventLoop):
    """A selector event loop with an urgent lane (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._urgent: deque[asyncio.Handle] = deque()
        self._since_poll = 0
        self._polled_at = time.monotonic()
        self._inline: list[asyncio.Handle] | None = None  # I/O callbacks found by a mid-turn poll

    def _call_soon(self, callback: Callable[..., Any], args: Any, context: contextvars.Context | None) -> Any:
        urgent = context.get(URGENT, False) if context is not None else URGENT.get()
        if urgent:
            handle = asyncio.Handle(callback, args, self, context)
            self._queue_urgent(handle)
            return handle
        handle = super()._call_soon(self._run_ordinary, (callback, *args), context)  # type: ignore[misc]
        self._since_poll += 1
        if self._since_poll >= POLL_EVERY and len(self._ready) > POLL_EVERY:  # type: ignore[attr-defined]
            self._since_poll = 0
            self._ready.append(asyncio.Handle(self._poll_io, (), self, _PLAIN))  # type: ignore[attr-defined]
        return handle

    def _run_ordinary(self, callback: Callable[..., Any], *args: Any) -> None:
        """Runs an ordinary callback; if the turn has gone POLL_S since the last poll and
        more callbacks wait, polls next. Checked as callbacks run, not as they are queued:
        a burst's callbacks are mostly task steps that await grpc, and queue nothing."""
        callback(*args)
        if time.monotonic() - self._polled_at > POLL_S and self._ready:  # type: ignore[attr-defined]
            self._polled_at = time.monotonic()  # one poll queued per lapse
            self._ready.appendleft(asyncio.Handle(self._poll_io, (), self, _PLAIN))  # type: ignore[attr-defined]

    def add_reader(self, fd: Any, callback: Callable[..., Any], *args: Any) -> None:
        if _is_grpc_completion_reader(fd, callback):
            callback = functools.partial(_drain_first, fd, callback)
        super().add_reader(fd, callback, *args)

    def _add_callback(self, handle: asyncio.Handle) -> None:
        """I/O callbacks (and signal handlers) go first."""
        if handle.cancelled():
            return
        if self._inline is not None:
            self._inline.append(handle)
        else:
            self._queue_urgent(handle)

    def _queue_urgent(self, handle: asyncio.Handle) -> None:
        # Both deque operations are atomic, so other threads may call this (call_soon_threadsafe).
        # Trampolines are alike, so the order they run in does not matter: each runs the
        # oldest urgent callback, and urgent callbacks keep their order.
        self._urgent.append(handle)
        self._ready.appendleft(asyncio.Handle(self._run_urgent, (), self, _PLAIN))  # type: ignore[attr-defined]

    def _run_urgent(self) -> None:
        handle = self._urgent.popleft()
        if not handle.cancelled():
            handle._run()  # type: ignore[attr-defined]

    def _process_events(self, event_list: Any) -> None:
        self._polled_at = time.monotonic()  # after every poll: the turn's own and _poll_io's
        super()._process_events(event_list)  # type: ignore[misc]

    def _poll_io(self) -> None:
        """Polls I/O without blocking and runs what is ready now, within the turn. Run
        inline, not queued: queued, a reader could be found ready again by the turn's own
        poll before it ran, and run twice."""
        self._inline = found = []
        try:
            self._process_events(self._selector.select(0))  # type: ignore[attr-defined]
        finally:
            self._inline = None
        for handle in found:
            if not handle.cancelled():
                handle._run()  # type: ignore[attr-defined]


def _is_grpc_completion_reader(fd: Any, callback: Callable[..., Any]) -> bool:
    """grpc.aio's reader: functools.partial(PollerCompletionQueue._handle_events, loop) on
    its socket pair's read end."""
    func = getattr(callback, "func", None)
    return isinstance(fd, socket.socket) and getattr(func, "__name__", "") == "_handle_events"


def _drain_first(sock: socket.socket, handle_events: Callable[[], None]) -> None:
    """Takes every waiting wake-up byte but one, then lets grpc read that one and run every
    completion queued so far (each was queued before its byte was written, so none is
    left without a byte to wake for it)."""
    try:
        waiting = len(sock.recv(1 << 16, socket.MSG_PEEK))
        if waiting > 1:
            sock.recv(waiting - 1)
    except BlockingIOError:
        pass
    handle_events()


async def run_in_thread(executor: Executor, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on `executor`; the caller resumes in its own lane (an urgent caller
    urgently: `run_in_executor` would hand the result back as an ordinary callback)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)

    def work() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
            value, error = None, e
        loop.call_soon_threadsafe(settle, value, error, context=context)

    executor.submit(work)
    return await future
