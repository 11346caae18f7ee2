"""Waits a process's main thread can be stopped in by a signal.

A signal sent to a process may be taken by any of its threads that does not block it
(on Linux 6.18 here, 4 and 15 of 40 SIGTERMs in two runs, to a process whose main thread
slept, went to another thread), and CPython runs a Python handler only on the main thread,
when it next runs bytecode. A main thread parked in one unbounded wait (`Event.wait()`,
`Future.result()`) is not woken when another thread (gRPC's, OpenBLAS's) took the signal, so
its handler waits as long as that wait does: for ever, for a server's `stop.wait()`. These
waits wake every `SLICE_S`, so a pending handler runs within that, as grpc's own blocking
calls do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

SLICE_S = 0.1


def wait_in_slices(wait: Callable[[float], bool], timeout_s: float | None) -> bool:
    """Calls `wait(seconds)` for at most `SLICE_S` at a time until it answers True or
    `timeout_s` has passed (None: no end); its last answer."""
    deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
    while True:
        left = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
        if left <= 0:
            return wait(0)
        if wait(left):
            return True


class StopEvent(threading.Event):
    """A `threading.Event` whose `wait` lets the main thread's signal handlers run (above)."""

    def wait(self, timeout: float | None = None) -> bool:
        return wait_in_slices(super().wait, timeout)


def future_done(future: futures.Future[Any], timeout_s: float | None) -> bool:
    """Waits for `future` in slices (above); whether it is done."""
    return wait_in_slices(lambda s: bool(futures.wait([future], s).done), timeout_s)
