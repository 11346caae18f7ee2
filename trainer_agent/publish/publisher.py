"""WeightPublisher: the library a trainer calls after each step (`publish(params, version)`).

A facade over the publish pipeline, one module per step: plan the slot (`slots`), stage
(`staged_part`), seal (`seal`) and send (`send`), with the session's standing at the
coordinator in `session_link` and what is tried again in `retry`."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from trainer_agent.device.device_blocks import block_size
from trainer_agent.publish.async_publish import (
    PublishFuture,
    PublishQueue,
    check_names,
    check_not_deleted,
    held_bytes,
    held_params,
)
from trainer_agent.publish.commit_wait import wait_final
from trainer_agent.publish.retry import may_pass, ride_out
from trainer_agent.publish.seal import Sealer
from trainer_agent.publish.send import PublishResult, Sender
from trainer_agent.publish.session_link import SessionLink
from trainer_agent.publish.slots import SlotPlanner
from trainer_agent.publish.stage_plan import StreamSpec, follow_plan, plan_staging, plan_stream
from trainer_agent.publish.staged_part import ManifestDigests, PartStager, StagedPart
from trainer_agent.serve.arena import Arena
from trainer_agent.serve.chunk_server import SlotTable, start_chunk_servers
from trainer_agent.settings import PublisherSettings
from weightsync import native
from weightsync.arena_files import reclaim_orphans
from weightsync.client import CoordinatorClient
from weightsync.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, WeightsyncError
from weightsync.failpoints import Failpoints
from weightsync.logs import version_context
from weightsync.metrics import Metrics, build_metrics
from weightsync.transports.fs import FsStore
from weightsync.transports.fs_options import parse_fs_options
from weightsync.validation import INT64_MAX, MAX_KEY_CHARS, check_int_arg, check_version_arg

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0  # beyond the calls' deadlines, what close() waits for another thread's publish
# Niceness added to the async publish worker (and the staging threads it starts), so that
# the training loop's own host threads win the cores when both want them.
ASYNC_WORKER_NICE = 10


def _checked_args(version: Any, idempotency_key: str | None) -> int:
    """What a publish call names, checked before anything is staged."""
    if idempotency_key is not None and (not isinstance(idempotency_key, str) or len(idempotency_key) > MAX_KEY_CHARS):
        raise InvalidArgument(f"must be a string of at most {MAX_KEY_CHARS} characters", field="idempotency_key")
    return check_version_arg(version)


def _check_mapping(params: Any) -> None:
    if not isinstance(params, Mapping):
        raise InvalidArgument(
            f"must map tensor names to arrays, got {type(params).__name__} (publish_stream takes (name, array) pairs)",
            field="params",
        )


class WeightPublisher:
    """Stages parameters into a persistent arena, publishes descriptors, serves chunks.

    One publisher per trainer rank, described by `PublisherSettings`. Constructing one
    checks the settings and does no I/O; `start()` (or entering `with`) attaches to the
    session, maps the arena and starts this rank's chunk servers and heartbeat:

        with WeightPublisher(PublisherSettings(coordinator="c:50051", session="s")) as pub:
            pub.publish(params, version)

    All ranks of one trainer run pass the same `incarnation`; a new incarnation bumps the
    session generation, fencing older writers: their writes are refused (StaleGeneration),
    and the heartbeat notices within one beat: `fenced` turns True, it is logged once and
    the `weightsync_fenced` gauge reads 1.
    """

    def __init__(self, settings: PublisherSettings, *, metrics: Metrics | None = None) -> None:
        if settings.use_ffi is True and not native.ffi_available():
            raise RuntimeError(
                f"use_ffi=True but the FFI staging handler is unavailable: {native.ffi_missing_reason()}"
            )
        self.settings = settings
        self.session = settings.session
        self.rank = settings.rank
        self.agent_id = settings.agent_id or f"trainer-{settings.rank}-{uuid.uuid4().hex[:8]}"
        self.metrics = metrics or build_metrics("trainer")
        self.fs_store = FsStore(settings.fs_root, parse_fs_options(settings.fs_option)) if settings.fs_root else None
        self.last_path = ""
        self._link = SessionLink(settings, self.metrics)
        self._digests = ManifestDigests(self._link)  # versions this rank published -> their digest
        self._started = self._closed = False
        self._resources = contextlib.ExitStack()  # closes what start() opened, in reverse
        # One publish at a time: two on two threads claimed the same free slot, staged over
        # each other and both reported READY (one version unservable, its arena leaked).
        self._publishing = threading.Lock()
        self._publishing_thread = 0  # the thread holding it, so a close() from it never waits
        self._async: PublishQueue[PublishResult] = PublishQueue(
            f"weightsync-publish-r{settings.rank}",
            nice=ASYNC_WORKER_NICE,
            on_skip=lambda version, by: self.metrics.publish_skipped.labels(session=self.session).inc(),
            on_held=lambda n: self.metrics.publish_held_bytes.labels(session=self.session).set(n),
        )

    def start(self, *, next_version: int = 0) -> WeightPublisher:
        """Attaches to the session and starts serving; returns self. Idempotent.

        Args:
            next_version: the first version this publisher will publish (0: not said); a
                new incarnation whose next_version is not newer than the session's latest
                is refused (FailedPrecondition) before it fences anyone.

        Raises:
            FailedPrecondition (field `weight_sync_mode`): the mode needs inet sockets and
                this host has no usable ones (`PublisherSettings.check_host`).
        """
        if self._started:
            return self
        next_version = check_int_arg(next_version, "next_version", 0, INT64_MAX)
        self.settings.check_host()
        self._started = True
        try:
            self._start(next_version)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, next_version: int) -> None:
        s = self.settings
        security = s.security()
        self._client = CoordinatorClient(s.coordinator, timeout_s=s.timeout_s, security=security)
        self._resources.callback(self._client.close)
        self._link.attach(self._client, next_version)
        reclaim_orphans()  # arenas of trainers killed on this host before they could clean up
        self.arena = Arena(f"{s.session}-r{s.rank}", slots=s.slots)
        self._resources.callback(self.arena.close)
        self.table = SlotTable(self.arena, s.session, s.rank, Failpoints(s.failpoints))
        servers = start_chunk_servers(
            self.table,
            s,
            self.metrics,
            lambda: self.generation,
            security,
            self._resources,
            leave=lambda: self._link.leave(self.agent_id),
        )
        self._servicer, self.tcp_server, self.server = servers.servicer, servers.tcp_server, servers.server
        self.endpoint = servers.endpoint
        # The pipeline, in the order a publish runs it.
        self._slots = SlotPlanner(self.arena, self.table, self._link, s, self.fs_store, closed=lambda: self._closed)
        self._parts = PartStager(s, self.arena, self.table, self._digests, self.agent_id, self.metrics)
        sealer = Sealer(self.arena, self.table, self._link, self.endpoint, s.rank, s.chunk_bytes, self.fs_store,
                        self.metrics)  # fmt: skip
        self._sender = Sender(sealer, self.table, self._link, self._digests, self.metrics, self._may_pass)
        self._heartbeat = self._link.start_heartbeat(self.agent_id, self.endpoint, s.rank, self.table.latest_version)
        self._resources.callback(self._heartbeat.stop)
        log.info(
            "publisher rank=%d session=%s generation=%d serving %s",
            s.rank,
            s.session,
            self.generation,
            self.server.address,
        )

    # -- lifecycle ------------------------------------------------------------------
    def close(self, *, cancel_pending: bool = False) -> None:
        """Stops heartbeats and serving, deregisters, frees the arena; idempotent. A publish
        running on another thread is waited for first (it stops trying again once closed):
        the arena it stages into and serves from is unmapped here.

        Async publishes (`publish_async`) still pending run to their end first, and a
        failure of one that nothing reported yet is raised once everything is closed. With
        `cancel_pending` (and when `with` is left on an exception) the one waiting is
        cancelled (its future too), the one running stops trying again, and their failures
        stay in their futures (logged)."""
        self._close(cancel_pending=cancel_pending)

    def _close(self, *, cancel_pending: bool) -> None:
        if not self._closed:
            self._async.close(cancel_pending=cancel_pending, timeout_s=0 if cancel_pending else None)
        self._closed = True
        waited = self._publishing_thread != threading.get_ident() and self._publishing.acquire(
            timeout=2 * self.settings.timeout_s + CLOSE_WAIT_S
        )
        try:
            self._resources.close()
        finally:
            if waited:
                self._publishing.release()
        self._async.close(cancel_pending=True, timeout_s=CLOSE_WAIT_S)  # a cancelled one's end, once closed
        if not cancel_pending:
            self._async.raise_failure()
        elif failure := self._async.take_failure():
            log.warning("an async publish failed, and nothing read it: %s", failure)

    @contextlib.contextmanager
    def _one_publish(self) -> Iterator[None]:
        """Publishes run one at a time, in call order of the lock: versions must still rise."""
        with self._publishing:
            self._publishing_thread = threading.get_ident()
            try:
                yield
            finally:
                self._publishing_thread = 0

    def __enter__(self) -> WeightPublisher:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._close(cancel_pending=e is not None)

    @property
    def fenced(self) -> bool:
        """True once a newer incarnation attached: every write of this publisher is refused."""
        return self._link.fenced

    @property
    def fenced_by(self) -> int:
        """The newer generation that fenced this publisher (0: none)."""
        return self._link.fenced_by

    @property
    def generation(self) -> int:
        """The session's generation this publisher attached as."""
        return self._link.generation

    @property
    def attached_latest_version(self) -> int:
        """The session's newest version when start() attached."""
        return self._link.attached_latest_version

    @property
    def client(self) -> CoordinatorClient:
        return self._client

    @property
    def _manifest_digests(self) -> dict[int, str]:
        return self._digests.known

    # -- publishing -----------------------------------------------------------------
    def publish(self, params: Mapping[str, Any], version: int, *, idempotency_key: str | None = None) -> PublishResult:
        """Stages `params` (HF name -> array or HostShard) into a free slot and publishes it.

        Re-publishing the same version with the same key returns the first result. A call
        while another thread's publish runs waits for it to end.

        A failure that may pass by itself is tried again, with backoff, for up to
        `publish_wait_s` (the same version and key: nothing is published twice): the
        coordinator unreachable (restarting, rescheduled: a training loop should not end
        at an outage of a few seconds), a full disk (its
        database, the fs store, /dev/shm) or every slot leased past `slot_wait_s`. Once
        staged, the version is not staged again: its part is sent again as it is.

        Raises:
            InvalidArgument: bad names, dtypes or shapes, a version that is not an integer
                in [1, 2^63-1] (checked before anything is staged; nothing is published).
            StaleGeneration: another incarnation attached since; this publisher is fenced.
            SlotBusy (FailedPrecondition): no slot could be freed within slot_wait_s, still
                after publish_wait_s.
            ResourceExhausted: no room for the arena (field `arena`), still after
                publish_wait_s, or a limit exceeded.
            TransportUnavailable, DeadlineExceeded: the coordinator stayed unreachable
                for publish_wait_s.
        """
        self._async.raise_failure()
        version = _checked_args(version, idempotency_key)
        _check_mapping(params)
        self._after_async(version)
        return self._publish_now(params, version, idempotency_key)

    def publish_async(
        self, params: Mapping[str, Any], version: int, *, idempotency_key: str | None = None, snapshot: bool = False
    ) -> PublishFuture[PublishResult]:
        """Publishes `params` as `version` on a background thread; returns once they are held.

        The device-to-host copy, staging and publish run while the caller goes on (the next
        training steps). JAX arrays are immutable, so holding them is enough, unless the
        caller's jitted step donates them: `snapshot=True` first copies JAX arrays on their
        devices (cast to `weight_dtype` in the same pass), torch tensors on theirs (torch
        tensors change in place: an optimizer step rewrites them, so hold them with
        `snapshot=True`) and host arrays on the host. A held version costs its bytes of device
        memory until its publish ends.

        Latest wins: one publish runs at a time and one waits; a newer version offered while
        one waits replaces it, and the replaced one's future raises `PublishSuperseded`
        (counted in `publish_skipped` and `weightsync_publish_skipped_total`). So at most two
        versions are held (`publish_held_bytes`, `weightsync_publish_held_bytes`).

        Returns a `concurrent.futures.Future` of the PublishResult, with its `version`. A
        failure is in that future, and unless it was read there, the next call of this
        publisher (`publish_async`, `publish`, `publish_stream`, `wait_committed`,
        `close`) raises it. `publish` and `publish_stream` supersede a waiting older
        version and wait for the rest, so versions go out in call order.

        Raises (at the call): InvalidArgument for bad arguments, as `publish`;
        FailedPrecondition for a version not newer than one still pending, or a publisher
        not started or closed.
        """
        self._async.raise_failure()
        version = _checked_args(version, idempotency_key)
        _check_mapping(params)
        self._check_open()
        check_names(params)
        # an older version still waiting goes before the copy is made: two versions held at most
        self._async.supersede_older(version)
        s = self.settings
        block = block_size(s.d2h_block_bytes, s.chunk_bytes)  # the snapshot cuts the device path's blocks
        held = held_params(params, snapshot=snapshot, weight_dtype=s.weight_dtype, block_bytes=block)

        def run() -> PublishResult:
            return self._publish_now(held, version, idempotency_key, check=check_not_deleted)

        return self._async.submit(version, run, held_bytes(held))

    @property
    def publish_skipped(self) -> int:
        """Async publishes superseded by a newer version before they started."""
        return self._async.skipped

    @property
    def publish_held_bytes(self) -> int:
        """Bytes of parameters held by async publishes running or waiting."""
        return self._async.held_bytes

    @property
    def publish_waiting(self) -> bool:
        """Whether an async publish waits for the running one: a `publish_async` now would
        supersede it, its snapshot taken for nothing. A loop that offers a version only
        where none waits keeps the worker busy with one snapshot per publish instead of one
        per step (`bench/train_overlap.py --variant offer=unqueued`)."""
        return self._async.waiting

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until no async publish runs or waits, then raises a failure nothing
        reported yet; DeadlineExceeded after `timeout_s`."""
        if not self._async.drain(timeout_s):
            raise DeadlineExceeded(f"async publishes still pending after {timeout_s}s")
        self._async.raise_failure()

    def _after_async(self, version: int) -> None:
        """A blocking publish of `version` goes after the async ones offered before it; an
        older one still waiting is superseded by it."""
        self._async.supersede_older(version)
        self._async.drain()

    def _publish_now(
        self,
        params: Mapping[str, Any],
        version: int,
        idempotency_key: str | None,
        check: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> PublishResult:
        with self._one_publish(), version_context(version):
            if check is not None:  # once it is this publish's turn: what was held may be gone since
                check(params)
            deadline = time.monotonic() + self.settings.publish_wait_s
            staged = ride_out(
                f"staging version {version}",
                self.settings.publish_wait_s,
                lambda: self._stage(params, version, idempotency_key),
                self._may_pass,
            )
            return self._send(staged, deadline)

    def _stage(self, params: Mapping[str, Any], version: int, idempotency_key: str | None) -> StagedPart:
        """Plans the staging, claims a slot fitted to its layout, stages into it."""
        if not params:
            raise InvalidArgument("must contain at least one tensor", field="params")
        started = time.perf_counter()
        plan = plan_staging(params, self.settings)
        claim_started = time.perf_counter()
        slot = self._claim_slot(version)  # may wait for leases: not staging time
        started += time.perf_counter() - claim_started
        self._slots.fit(plan.layout.total_bytes)
        return self._parts.stage(plan, params, version, slot, idempotency_key, started)

    def publish_stream(
        self,
        items: Iterable[tuple[str, Any]],
        version: int,
        *,
        capacity_bytes: int = 0,
        specs: Sequence[StreamSpec] | None = None,
        idempotency_key: str | None = None,
    ) -> PublishResult:
        """Stages tensors one by one as `items` yields them (e.g. a MaxText converter, or a
        trainer's parameters materialized one at a time).

        Peak host memory is the arena plus one converted tensor (with `specs`, plus the
        device-to-host window for tensors off the host): nothing is collected first.

        Args:
            capacity_bytes: without `specs`: slot size to reserve (the converted model's
                bytes, padded by 256 per tensor); ResourceExhausted when the stream
                outgrows it. Chunk digests are then computed in a second read pass.
            specs: (name, dtype, shape) of every item, in order, known before the first is
                read: the layout is planned from them, and the stream is staged as fast as
                `publish` stages (fused batches; a delta where `delta` is on). Each item
                must be the whole tensor its spec names (InvalidArgument naming it).

        A failure that may pass by itself is tried again as in `publish`: finding a slot
        before the first item is taken, and sending the staged part (`items` is read once).
        """
        self._async.raise_failure()
        version = _checked_args(version, idempotency_key)
        if specs is not None:
            if capacity_bytes:
                raise InvalidArgument("give specs or capacity_bytes, not both", field="capacity_bytes")
            plan = plan_stream(specs, self.settings)
            capacity_bytes = plan.layout.total_bytes
        else:
            capacity_bytes = check_int_arg(capacity_bytes, "capacity_bytes", 1, INT64_MAX)
        self._after_async(version)
        with self._one_publish(), version_context(version):
            deadline = time.monotonic() + self.settings.publish_wait_s
            slot = ride_out(
                f"finding a slot for version {version}",
                self.settings.publish_wait_s,
                lambda: self._fitted_slot(version, capacity_bytes),
                self._may_pass,
            )
            if specs is None:
                return self._send(self._parts.stage_stream(items, version, slot, idempotency_key), deadline)
            checked = follow_plan(items, plan, self.settings.weight_dtype)
            return self._send(
                self._parts.stage(plan, checked, version, slot, idempotency_key, time.perf_counter()), deadline
            )

    def _may_pass(self, e: WeightsyncError) -> bool:
        return not self._closed and may_pass(e)

    def _check_open(self) -> None:
        if not self._started or self._closed:
            raise FailedPrecondition(
                "this publisher is closed" if self._closed else "start() it (or enter `with`) before publishing"
            )

    def _claim_slot(self, version: int) -> int:
        self._check_open()
        self._link.check_not_fenced()
        return self._slots.claim(version)

    def _fitted_slot(self, version: int, slot_bytes: int) -> int:
        slot = self._claim_slot(version)
        self._slots.fit(slot_bytes)
        return slot

    def _send(self, staged: StagedPart, deadline: float) -> PublishResult:
        self.last_path = staged.path
        return self._sender.send(staged, deadline)

    def wait_committed(self, version: int, timeout_s: float = 120.0) -> str:
        """Blocks until the version is COMMITTED, FAILED or RELEASED; returns the state name.

        PARTIAL is not an end: a rollout that could not verify the version retries it
        (this publisher serves its chunks meanwhile) and the version commits once it
        verifies, or once that rollout's lease lapses. DeadlineExceeded after `timeout_s`
        says what the version waits for (the rollouts whose handshakes failed, for a
        PARTIAL one). An async publish of `version` still pending is waited for first (its
        failure raised, and PublishSuperseded for a version that was skipped)."""
        self._async.raise_failure()
        version = check_version_arg(version)
        timeout_s = self._async.wait_version(version, timeout_s)
        return wait_final(self._client, self.session, version, timeout_s)
