"""The async publish worker (`PublishQueue`): latest wins, failures surface once, close, and
what a version holds (`held_params`: references, or on-device snapshots)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_agent.publish.async_publish import (
    PublishQueue,
    PublishSuperseded,
    check_not_deleted,
    held_bytes,
    held_params,
)
from weightsync.errors import FailedPrecondition, InvalidArgument

CPU = jax.devices("cpu")[0]


def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def queue() -> Iterator[PublishQueue[int]]:
    skips: list[tuple[int, int]] = []
    held: list[int] = []
    q: PublishQueue[int] = PublishQueue("test-publish", nice=3, on_skip=lambda *a: skips.append(a), on_held=held.append)
    q.skips, q.held_seen = skips, held  # type: ignore[attr-defined]
    yield q
    q.close(cancel_pending=True, timeout_s=10)


def _job(ran: list[int], version: int, gate: threading.Event | None = None) -> Callable[[], int]:
    def run() -> int:
        if gate is not None:
            assert gate.wait(10)
        ran.append(version)
        return version * 10

    return run


def test_a_version_offered_while_one_waits_replaces_it(queue: PublishQueue[int]) -> None:
    gate, ran, nice = threading.Event(), [], []

    def first() -> int:
        nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return _job(ran, 1, gate)()

    f1 = queue.submit(1, first, 100)
    _until(lambda: queue.busy)
    assert not queue.waiting  # one runs, none waits: an offer now supersedes nothing
    f2 = queue.submit(2, _job(ran, 2), 200)
    assert queue.held_bytes == 300 and queue.waiting
    f3 = queue.submit(3, _job(ran, 3), 400)
    assert queue.held_bytes == 500  # the running version and the newest waiting one: never three
    assert isinstance(e := f2.exception(0), PublishSuperseded) and (e.version, e.by) == (2, 3)
    assert "superseded by version 3" in str(e)
    assert queue.skipped == 1 and queue.skips == [(2, 3)] and queue.superseded_by(2) == 3  # type: ignore[attr-defined]
    gate.set()
    assert (f1.result(10), f3.result(10)) == (10, 30)
    assert queue.drain(10) and ran == [1, 3] and not queue.waiting
    assert queue.held_bytes == 0 and queue.held_seen[-1] == 0  # type: ignore[attr-defined]
    assert f1.version == 1 and not queue.busy
    assert nice == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)]  # the worker's own, not the caller's


class _Held:
    """Stands for what a job holds: records the thread its destructor ran on."""

    def __init__(self, dropped: list[str]) -> None:
        self.dropped = dropped

    def __del__(self) -> None:
        self.dropped.append(threading.current_thread().name)


@pytest.mark.parametrize("apart", [False, True])
def test_a_superseded_versions_params_are_dropped_where_the_queue_says(queue: PublishQueue[int], apart: bool) -> None:
    gate, ran, dropped = threading.Event(), [], []
    queue.release_apart = apart
    queue.submit(1, _job(ran, 1, gate), 100)
    _until(lambda: queue.busy)
    held = _Held(dropped)
    queue.submit(2, lambda held=held: held and 2, 200)
    del held  # the job's closure holds the only reference now
    f3 = queue.submit(3, _job(ran, 3), 300)  # supersedes 2, which never runs
    _until(lambda: bool(dropped))
    assert dropped == ["test-publish-release" if apart else threading.current_thread().name]
    gate.set()
    assert f3.result(10) == 30
    assert ran == [1, 3]


def test_a_version_not_newer_than_one_pending_is_refused(queue: PublishQueue[int]) -> None:
    gate, ran = threading.Event(), []
    queue.submit(5, _job(ran, 5, gate), 1)
    _until(lambda: queue.busy)
    for version in (4, 5):
        with pytest.raises(FailedPrecondition) as refused:
            queue.submit(version, _job(ran, version), 1)
        assert refused.value.field == "version" and "not newer than version 5" in refused.value.message
    gate.set()
    assert queue.drain(10)
    assert queue.submit(4, _job(ran, 4), 1).result(10) == 40  # below a finished one: the coordinator's call


def test_a_failure_is_raised_by_the_next_call_unless_its_future_reported_it(queue: PublishQueue[int]) -> None:
    def fail() -> int:
        raise InvalidArgument("bad bytes", field="params['w']")

    failed = queue.submit(1, fail, 1)
    assert queue.drain(10)
    with pytest.raises(InvalidArgument, match="bad bytes"):
        queue.raise_failure()  # what the publisher's next call does first
    assert isinstance(failed.exception(), InvalidArgument)  # the future has it too
    queue.raise_failure()  # raised once
    assert queue.submit(2, _job([], 2), 1).result(10) == 20

    read = queue.submit(3, fail, 1)
    with pytest.raises(InvalidArgument):
        read.result(10)
    queue.raise_failure()  # read from its future: not raised again
    assert queue.submit(4, _job([], 4), 1).result(10) == 40


@pytest.mark.parametrize("cancel", [False, True])
def test_close_runs_what_waits_or_cancels_it(cancel: bool) -> None:
    q: PublishQueue[int] = PublishQueue("test-close")
    gate, ran = threading.Event(), []
    f1 = q.submit(1, _job(ran, 1, gate), 1)
    _until(lambda: q.busy)
    f2 = q.submit(2, _job(ran, 2), 1)
    threading.Timer(0.2, gate.set).start()
    q.close(cancel_pending=cancel, timeout_s=None if not cancel else 0)
    assert f1.result(10) == 10
    if cancel:
        assert f2.cancelled() and ran == [1]
        with pytest.raises(CancelledError):
            f2.result(0)
    else:  # close() returned after both ran
        assert f2.done() and f2.result(0) == 20 and ran == [1, 2]
    assert q.drain(10) and q.held_bytes == 0
    with pytest.raises(FailedPrecondition, match="closed"):
        q.submit(3, _job(ran, 3), 1)


def test_a_held_version_is_the_arrays_or_a_copy_the_caller_cannot_delete() -> None:
    with jax.default_device(CPU):
        params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}
    host = np.arange(4, dtype=np.float32)
    same = held_params({**params, "h": host}, snapshot=False)
    assert same["w"] is params["w"] and same["h"] is host
    copy = held_params({**params, "h": host}, snapshot=True)
    assert list(copy) == ["w", "b", "h"]
    assert copy["w"].unsafe_buffer_pointer() != params["w"].unsafe_buffer_pointer()
    assert copy["w"].sharding == params["w"].sharding
    assert copy["h"] is not host and np.array_equal(copy["h"], host)
    cast = held_params(params, snapshot=True, weight_dtype="bfloat16")
    assert cast["w"].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(cast["w"], np.float32), np.asarray(params["w"]))
    assert held_bytes(cast) == 2 * 6 + 2 * 3

    donate = jax.jit(lambda p: {k: v * 2 for k, v in p.items()}, donate_argnums=0)
    before = {k: np.asarray(v).copy() for k, v in params.items()}  # a view would keep the buffer from donation
    snap = held_params(params, snapshot=True)
    after = donate(params)
    assert params["w"].is_deleted()  # donation really happened on this platform
    check_not_deleted(snap)
    assert all(np.array_equal(np.asarray(snap[k]), before[k]) for k in before)
    with pytest.raises(InvalidArgument, match="snapshot=True") as deleted:
        check_not_deleted(params)
    assert deleted.value.field == "params['w']"
    with pytest.raises(InvalidArgument, match="donated"):
        held_params(params, snapshot=True)
    assert np.array_equal(np.asarray(after["w"]), 2 * before["w"])
