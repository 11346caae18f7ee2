"""A signal another thread takes runs the main thread's Python handler within a slice of
`StopEvent.wait` and `future_done` (weightsync.signal_wait), where a plain `Event.wait`
holds it to the wait's end: how a rollout agent's `stop.wait()` slept through a SIGTERM."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from weightsync.server import wait_for_signal
from weightsync.signal_wait import SLICE_S, StopEvent, future_done


class Stopped(Exception):
    pass


def _taken_by_another_thread(sig: signal.Signals, after_s: float) -> threading.Thread:
    """A thread that sends `sig` to itself after `after_s`: its C handler runs there, as
    where the kernel gives a process's signal to a thread other than the main one."""

    def send() -> None:
        time.sleep(after_s)
        signal.pthread_kill(threading.get_ident(), sig)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


@pytest.fixture
def handler_ran() -> Iterator[list[float]]:
    """SIGUSR1's handler records when it ran (on the main thread, as Python runs them)."""
    assert threading.current_thread() is threading.main_thread()
    ran: list[float] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: ran.append(time.monotonic()))
    yield ran
    signal.signal(signal.SIGUSR1, old)


def test_a_plain_wait_holds_the_handler_to_its_end(handler_ran: list[float]) -> None:
    start = time.monotonic()
    sender = _taken_by_another_thread(signal.SIGUSR1, 0.1)
    assert not threading.Event().wait(1.0)
    sender.join()
    assert handler_ran and handler_ran[0] - start >= 1.0  # not while the wait ran


def test_a_stop_event_lets_the_handler_run_within_a_slice(handler_ran: list[float]) -> None:
    stop = StopEvent()
    sent = time.monotonic() + 0.1
    sender = _taken_by_another_thread(signal.SIGUSR1, 0.1)
    assert not stop.wait(3.0)
    sender.join()
    assert handler_ran and handler_ran[0] - sent < 1.0  # a slice is 0.1 s; 1 s on a loaded machine


def test_a_stop_event_waits_its_timeout_and_answers_a_set() -> None:
    stop = StopEvent()
    start = time.monotonic()
    assert not stop.wait(3 * SLICE_S)
    assert time.monotonic() - start >= 3 * SLICE_S
    assert not stop.wait(0) and not stop.wait(-1)
    threading.Timer(0.05, stop.set).start()
    assert stop.wait() and stop.wait(0)


def test_the_servers_stop_event_ends_an_unbounded_wait_on_a_sigterm_another_thread_took() -> None:
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = wait_for_signal()
        sender = _taken_by_another_thread(signal.SIGTERM, 0.1)
        start = time.monotonic()
        assert stop.wait(10.0)  # a plain Event: set only once its wait had ended (unbounded: never)
        sender.join()
        assert time.monotonic() - start < 5.0
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_future_done_lets_a_handler_unwind_the_wait() -> None:
    def stop(*_: object) -> None:
        raise Stopped

    old = signal.signal(signal.SIGUSR1, stop)
    pending: Future[int] = Future()
    try:
        sender = _taken_by_another_thread(signal.SIGUSR1, 0.1)
        start = time.monotonic()
        with pytest.raises(Stopped):
            future_done(pending, 30.0)
        sender.join()
        assert time.monotonic() - start < 5.0
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert not future_done(pending, 2 * SLICE_S)
    pending.set_result(1)
    assert future_done(pending, None)
