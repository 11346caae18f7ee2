"""The process's one device-to-host thread: where the device path's copies are issued and
land, whichever thread publishes.

Why one thread (measured on a TPU v5e host, docs/performance.md): each block's copy lands in
a host buffer from malloc, allocated by the thread that issues and reads the copy. glibc
gives each thread an arena of its own, and with its freed heap held (`host_heap`, so blocks
reuse warm pages) each arena a thread copied blocks in keeps about a window of them. A
trainer that publishes its first version blocking (its main thread) and the next ones with
`publish_async` (the publisher's worker), or that makes a new publisher, would keep a window
per thread. Here every publish's copies run on one thread, so the process keeps one.

`blocks_on_d2h_thread(make)` runs the generator `make()` on that thread and yields what it
yields, in order, as it comes; the thread's exceptions are raised in the caller. When the
caller stops early (an error while staging, a closed generator), the generator on the
thread is closed and the caller waits for it to end: nothing is left reading device arrays
the caller may delete or donate next. One publish's copies run at a time; another
process-wide caller waits for the thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

THREAD_NAME = "weightsync-d2h"

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _thread() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        return _executor


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: its first copies start one anew."""
    global _executor, _lock
    _executor, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def blocks_on_d2h_thread(make: Callable[[], Iterator[T]], on_stop: Callable[[], None] | None = None) -> Iterator[T]:
    """What the generator `make()` yields, run on the process's D2H thread. `on_stop` is
    called (on the caller's thread) when the caller stops before the generator's end, to
    wake the generator where it waits for the caller (a window waiting for room)."""
    handed: queue.SimpleQueue[object] = queue.SimpleQueue()
    stop = threading.Event()

    def run() -> None:
        try:
            gen = make()
            try:
                for item in gen:
                    handed.put(item)
                    del item
                    if stop.is_set():
                        break
            finally:
                if close := getattr(gen, "close", None):  # a generator: its finally runs here
                    close()
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            handed.put(_Failed(e))
        finally:
            handed.put(_END)

    if threading.current_thread().name.startswith(THREAD_NAME):  # already on it: no handing over
        yield from make()
        return
    done = _thread().submit(run)
    ended = False
    try:
        while True:
            item = handed.get()
            if item is _END:
                ended = True
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item  # type: ignore[misc]
            del item
    finally:
        if not ended:
            stop.set()
            if on_stop is not None:
                on_stop()
            done.result()  # run() catches everything: it ends once its generator stops
