"""Publishing off the training step: one background worker per publisher, latest wins.

`PublishQueue` runs publishes on a worker thread while the caller trains on. At most one
publish runs and one waits; a newer version offered while one waits replaces it, and the
replaced version's future fails with `PublishSuperseded`. So at most two versions of the
parameters are referenced at any time (`held_bytes` says how many bytes). A failure is
kept until the next call on the queue raises it, unless the caller already read it from
the version's future.

`held_params` takes what a version needs held: references to immutable JAX arrays, or an
on-device copy (`snapshot`) where the caller's training step donates its parameters.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from trainer_agent.stage import torch_tensors
from trainer_agent.stage.params import check_param
from trainer_agent.stage.staging import HostShard, tensor_spec
from weightsync.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, WeightsyncError
from weightsync.signal_wait import future_done

log = logging.getLogger(__name__)
T = TypeVar("T")


class PublishSuperseded(WeightsyncError):
    """An async publish that never started: a newer version was offered while it waited
    (latest wins). `version` is the skipped one, `by` the one that replaced it."""

    def __init__(self, version: int, by: int) -> None:
        super().__init__(f"version {version} was superseded by version {by} before its publish started")
        self.version = version
        self.by = by


class PublishFuture(Future, Generic[T]):
    """The outcome of one `publish_async`: a `concurrent.futures.Future` of its
    PublishResult, with the `version` it publishes. Reading a failure here (`result()`,
    `exception()`) means the publisher's next call does not raise it again."""

    def __init__(self, version: int) -> None:
        super().__init__()
        self.version = version
        self.failure_seen = False

    def result(self, timeout: float | None = None) -> T:
        try:
            return super().result(timeout)
        except BaseException:
            if self.done():
                self.failure_seen = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        e = super().exception(timeout)
        self.failure_seen = self.failure_seen or e is not None
        return e


@dataclass
class _Job(Generic[T]):
    version: int
    run: Callable[[], T] | None  # dropped once run: the params it holds go with it
    held_bytes: int
    future: PublishFuture[T]


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Sets a future's outcome unless the caller cancelled it first."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class PublishQueue(Generic[T]):
    """One worker thread running offered jobs in order, newest first among waiting ones.

    Args:
        name: the worker thread's name.
        nice: added to the worker's scheduling niceness when it starts (Linux: a thread's
            own, inherited by the staging threads it spawns); 0 leaves it.
        on_skip: called with (skipped version, newer version) for each superseded one.
        on_held: called with the bytes held by waiting and running jobs after each change.
    """

    def __init__(
        self,
        name: str,
        *,
        nice: int = 0,
        on_skip: Callable[[int, int], None] | None = None,
        on_held: Callable[[int], None] | None = None,
    ) -> None:
        self.name = name
        self.nice = nice
        self.skipped = 0
        self.held_bytes = 0
        self._on_skip = on_skip
        self._on_held = on_held
        self._cond = threading.Condition()
        self._queued: _Job[T] | None = None
        self._running: _Job[T] | None = None
        self._failures: list[tuple[PublishFuture[T], BaseException]] = []  # not yet raised by a call nor read
        self._superseded: dict[int, int] = {}  # the newest skipped versions -> what replaced each
        self._thread: threading.Thread | None = None
        self._closing = False
        # where a superseded job's params are dropped: on a thread of its own, or the caller's
        self.release_apart = False
        self._releaser = Releaser(f"{name}-release")

    def submit(self, version: int, run: Callable[[], T], held_bytes: int) -> PublishFuture[T]:
        """Queues `run` as `version`'s publish; a job already waiting is superseded.

        Raises FailedPrecondition (field `version`) for a version not newer than one
        already offered and not finished, and once the queue is closed."""
        job = _Job(version, run, held_bytes, PublishFuture[T](version))
        with self._cond:
            if self._closing:
                raise FailedPrecondition("this publisher is closed")
            pending = [j.version for j in (self._queued, self._running) if j is not None]
            if pending and version <= max(pending):
                raise FailedPrecondition(
                    f"{version} is not newer than version {max(pending)}, offered before and not yet published",
                    field="version",
                )
            replaced, self._queued = self._queued, job
            self._held_changed()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if replaced is not None:
            self._supersede(replaced, version)
        return job.future

    def supersede_older(self, version: int) -> None:
        """Drops a waiting job older than `version` (a blocking publish of it comes first)."""
        with self._cond:
            job = self._queued
            if job is None or job.version >= version:
                return
            self._queued = None
            self._held_changed()
        self._supersede(job, version)

    def future_of(self, version: int) -> PublishFuture[T] | None:
        """The future of `version`'s job while it waits or runs."""
        with self._cond:
            jobs = (self._running, self._queued)
            return next((j.future for j in jobs if j is not None and j.version == version), None)

    def superseded_by(self, version: int) -> int | None:
        """The version that replaced `version`, if it was skipped (among the last 64 skipped)."""
        with self._cond:
            return self._superseded.get(version)

    def wait_version(self, version: int, timeout_s: float) -> float:
        """Waits for `version`'s job while it waits or runs (its failure raised, and
        PublishSuperseded for a version that was skipped); the part of `timeout_s` left.
        DeadlineExceeded where the job did not end within `timeout_s`."""
        if (by := self.superseded_by(version)) is not None:
            raise PublishSuperseded(version, by)
        if (pending := self.future_of(version)) is None:
            return timeout_s
        started = time.monotonic()
        if not future_done(pending, timeout_s):  # in slices: a trainer's SIGTERM is not held
            raise DeadlineExceeded(f"version {version}'s async publish did not end within {timeout_s}s")
        pending.result()
        return max(0.001, timeout_s - (time.monotonic() - started))

    def drain(self, timeout_s: float | None = None) -> bool:
        """Waits until no job waits or runs; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued is None and self._running is None, timeout_s)

    def raise_failure(self) -> None:
        """Raises the oldest failure that neither a call raised nor its future reported
        (the ones after it stay in their futures)."""
        if (failure := self.take_failure()) is not None:
            raise failure

    def take_failure(self) -> BaseException | None:
        """The failure `raise_failure` would raise, marked reported."""
        with self._cond:
            unseen = [(f, e) for f, e in self._failures if not f.failure_seen]
            self._failures.clear()
            if not unseen:
                return None
            future, error = unseen[0]
            future.failure_seen = True
            return error

    def close(self, *, cancel_pending: bool, timeout_s: float | None = None) -> None:
        """Stops taking jobs. `cancel_pending` cancels a waiting job (its future is
        cancelled), else it still runs; then waits up to `timeout_s` for the worker."""
        with self._cond:
            self._closing = True
            job = self._queued if cancel_pending else None
            if job is not None:
                self._queued = None
                self._held_changed()
            self._cond.notify_all()
            thread = self._thread
        if job is not None:
            job.future.cancel()
            log.info("version %d: its async publish was cancelled by close()", job.version)
        self._releaser.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    @property
    def busy(self) -> bool:
        """Whether a job runs now."""
        return self._running is not None

    @property
    def waiting(self) -> bool:
        """Whether a job waits for the running one (the next submit supersedes it)."""
        return self._queued is not None

    def _supersede(self, job: _Job[T], by: int) -> None:
        box, job.run = [job.run], None  # the box holds the params' last reference
        if self.release_apart:
            self._releaser.release(box)
        del box
        with self._cond:
            self.skipped += 1
            self._superseded[job.version] = by
            while len(self._superseded) > 64:
                del self._superseded[next(iter(self._superseded))]
        if self._on_skip is not None:
            self._on_skip(job.version, by)
        log.info("version %d skipped: superseded by version %d before its publish started", job.version, by)
        _settle(job.future, error=PublishSuperseded(job.version, by))

    def _held_changed(self) -> None:  # under the lock
        self.held_bytes = sum(j.held_bytes for j in (self._queued, self._running) if j is not None)
        if self._on_held is not None:
            self._on_held(self.held_bytes)

    def _work(self) -> None:
        if self.nice:
            lower_priority(self.nice)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closing)
                job, self._queued = self._queued, None
                if job is None:
                    return
                self._running = job
            run, job.run = job.run, None
            result: Any = None
            error: BaseException | None = None
            try:
                if run is not None and job.future.set_running_or_notify_cancel():
                    result = run()
            except BaseException as e:  # noqa: BLE001 - kept for the next call, and in the future
                log.warning("version %d: async publish failed: %s", job.version, e)
                error = e
            finally:
                del run  # the params it holds go before the held bytes are counted down
                with self._cond:
                    if error is not None:
                        self._failures.append((job.future, error))
                    self._running = None
                    self._held_changed()
                    self._cond.notify_all()
            _settle(job.future, result=result, error=error)


class Releaser:
    """Drops what it is handed on a thread of its own (started at the first), so the
    caller does not wait for the destructors (a device buffer's free can wait for the
    runtime). Each item is a list holding the only references: the thread clears it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._items: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def release(self, box: list[Any]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._items.put(box)

    def close(self) -> None:
        """Ends the thread once what it was handed is dropped (not waited for)."""
        with self._lock:
            if self._thread is not None:
                self._items.put(None)
                self._thread = None

    def _run(self) -> None:
        while (box := self._items.get()) is not None:
            box.clear()
            del box


def lower_priority(nice: int) -> None:
    """Raises the calling thread's niceness by `nice` (Linux schedules threads by their
    own; threads it starts later inherit it). Where that is refused, logs and goes on."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError) as e:
        log.info("the publish worker keeps its priority: %s", e)


def _device_bytes(value: Any) -> int:
    """Bytes a JAX array holds on this host's devices (every replica), else its nbytes."""
    sharding = getattr(value, "sharding", None)
    if sharding is None:
        nbytes = getattr(value, "nbytes", None)
        return int(nbytes if nbytes is not None else np.asarray(value).nbytes)
    shard = math.prod(sharding.shard_shape(value.shape))
    return len(sharding.addressable_devices) * shard * np.dtype(value.dtype).itemsize


def held_bytes(params: Mapping[str, Any]) -> int:
    """Bytes the values of `params` hold: device memory for JAX arrays, host memory else."""
    return sum(_device_bytes(v.data if isinstance(v, HostShard) else v) for v in params.values())


def check_names(params: Mapping[str, Any]) -> None:
    """What `publish` refuses before staging, refused at the call: names and values."""
    for name, value in params.items():
        tensor_spec(name, "float32", ())  # the name alone
        check_param(name, value)


def check_not_deleted(params: Mapping[str, Any]) -> None:
    """InvalidArgument naming the first JAX array deleted (donated to a jitted step, or
    deleted) since it was offered."""
    for name, value in params.items():
        deleted = getattr(value, "is_deleted", None)
        if deleted is not None and deleted():
            raise InvalidArgument(
                "was deleted before its async publish read it (donated to a jitted step?): "
                "publish_async(..., snapshot=True) copies the parameters on their device first",
                field=f"params[{name!r:.200}]",
            )


def held_params(
    params: Mapping[str, Any], *, snapshot: bool, weight_dtype: str = "", block_bytes: int = 0
) -> dict[str, Any]:
    """What an async publish holds of `params`: the values themselves (JAX arrays are
    immutable), or with `snapshot` copies of them that the caller cannot delete or change:
    JAX arrays copied on their devices by one jitted call (cast to `weight_dtype` in the
    same pass, so the copy is no larger than what is staged; with `block_bytes`, arrays on
    one device of an accelerator come as the device path's blocks, `CutArray`), torch
    tensors on their own devices, host arrays on the host."""
    if not snapshot:
        return dict(params)
    held: dict[str, Any] = {}
    device: dict[str, Any] = {}
    for name, value in params.items():
        if hasattr(type(value), "addressable_shards"):  # a JAX array (read on the class: a deleted one raises)
            device[name] = value
        elif isinstance(value, HostShard):
            held[name] = HostShard(value.name, np.array(value.data, copy=True), value.global_shape, value.start)
        elif torch_tensors.is_tensor(value):  # copied on its device, as a JAX array is
            held[name] = torch_tensors.snapshot(value)
        else:
            held[name] = np.array(value, copy=True)
    if device:
        check_not_deleted(device)
        held |= _device_copy(device, weight_dtype, block_bytes)
    return {name: held[name] for name in params}


def _device_copy(arrays: dict[str, Any], weight_dtype: str, block_bytes: int) -> dict[str, Any]:
    from trainer_agent.device.snapshot import device_copy  # imports JAX; host-only publishers skip it

    return device_copy(arrays, weight_dtype, block_bytes)
