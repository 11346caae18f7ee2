"""LaneLoop: urgent callbacks and I/O first, asyncio's order otherwise (weightsync.event_loop)."""

from __future__ import annotations

import asyncio
import contextvars
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from weightsync.event_loop import POLL_EVERY, POLL_S, URGENT, LaneLoop, run_in_thread


@pytest.fixture
def loop():  # noqa: ANN201
    lp = LaneLoop()
    yield lp
    lp.close()


def urgent_context() -> contextvars.Context:
    ctx = contextvars.copy_context()
    ctx.run(URGENT.set, True)
    return ctx


def test_urgent_callbacks_run_first_in_their_own_order_and_the_rest_keep_theirs(loop: LaneLoop) -> None:
    ran: list[str] = []
    urgent = urgent_context()
    for i in range(5):
        loop.call_soon(ran.append, f"n{i}")
    for i in range(3):
        loop.call_soon(ran.append, f"u{i}", context=urgent)
    cancelled = loop.call_soon(ran.append, "u-cancelled", context=urgent)
    cancelled.cancel()
    loop.call_soon(loop.stop)
    loop.run_forever()
    assert ran == ["u0", "u1", "u2", "n0", "n1", "n2", "n3", "n4"]


def test_a_task_in_the_urgent_lane_overtakes_a_long_queue(loop: LaneLoop) -> None:
    order: list[str] = []

    async def busy(i: int) -> None:
        await asyncio.sleep(0)
        order.append(f"busy{i}")

    async def operator() -> None:
        URGENT.set(True)  # as rpc.StatusInterceptor does for GetStatus
        for step in range(3):
            await asyncio.sleep(0)
            order.append(f"op{step}")

    async def main() -> None:
        tasks = [asyncio.ensure_future(busy(i)) for i in range(200)]
        op = asyncio.ensure_future(operator())
        await asyncio.gather(op, *tasks)

    loop.run_until_complete(main())
    assert order.index("op2") < order.index("busy10")  # three steps, each ahead of the 200
    assert [x for x in order if x.startswith("busy")] == [f"busy{i}" for i in range(200)]


def run_with_a_reader(loop: LaneLoop, callbacks: int, step_s: float) -> list[str]:
    """Queues `callbacks` callbacks at once from one callback, as a burst of completions is;
    each takes `step_s` and queues nothing, and the first makes a reader ready. Returns
    what ran, in order ("io" for the reader)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    ran: list[str] = []

    def readable() -> None:
        a.recv(16)
        ran.append("io")
        loop.remove_reader(a)

    def callback(i: int) -> None:
        ran.append(f"c{i}")
        if i == 0:
            b.send(b"x")
        if step_s:
            time.sleep(step_s)

    loop.add_reader(a, readable)

    def schedule() -> None:
        for i in range(callbacks):
            loop.call_soon(callback, i)
        loop.call_soon(loop.stop)

    loop.call_soon(schedule)
    loop.run_forever()
    a.close()
    b.close()
    assert [x for x in ran if x != "io"] == [f"c{i}" for i in range(callbacks)]
    return ran


def test_io_is_polled_within_a_long_turn(loop: LaneLoop) -> None:
    """A reader becomes ready while thousands of callbacks wait: it runs within a few
    dozen of them, not at the end of the turn."""
    assert run_with_a_reader(loop, 2000, 0.0).index("io") < 3 * POLL_EVERY


def test_io_is_polled_within_poll_s_when_callbacks_are_slow(loop: LaneLoop) -> None:
    """Callbacks that each take a millisecond and queue nothing (task steps that run a store
    call and await grpc, as in a burst): a reader that becomes ready is run within about
    POLL_S of work, long before POLL_EVERY of them have passed."""
    ran = run_with_a_reader(loop, 3 * POLL_EVERY, POLL_S / 2)
    assert ran.index("io") <= 6  # POLL_S is two of them; the count rule alone: 32


def test_run_in_thread_resumes_an_urgent_caller_urgently_and_carries_errors(loop: LaneLoop) -> None:
    """300 tasks keep the loop busy; the worker's result resumes the urgent caller within
    a few callbacks (run_in_executor would hand it back behind a whole turn of them)."""
    pool = ThreadPoolExecutor(max_workers=1)
    steps = [0]
    stop = asyncio.Event()

    def work() -> int:
        return steps[0]  # the loop's progress when the result was handed back

    async def busy() -> None:
        while not stop.is_set():
            steps[0] += 1
            await asyncio.sleep(0)

    async def operator() -> int:
        URGENT.set(True)
        await asyncio.sleep(0.05)  # the busy tasks are spinning
        at_handback = await run_in_thread(pool, work)
        return steps[0] - at_handback

    async def main() -> int:
        tasks = [asyncio.ensure_future(busy()) for _ in range(300)]
        waited = await operator()
        stop.set()
        await asyncio.gather(*tasks)
        with pytest.raises(ZeroDivisionError):
            await run_in_thread(pool, lambda: 1 / 0)
        return waited

    assert loop.run_until_complete(main()) < 100
    pool.shutdown()


def test_callbacks_from_other_threads_keep_working(loop: LaneLoop) -> None:
    got: list[int] = []

    async def main() -> None:
        done = asyncio.Event()

        def worker(n: int) -> None:
            for i in range(n):
                loop.call_soon_threadsafe(got.append, i)
            loop.call_soon_threadsafe(done.set, context=urgent_context())

        threading.Thread(target=worker, args=(500,)).start()
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.01)

    loop.run_until_complete(main())
    assert got == list(range(500))
