"""WeightPublisher: the library a trainer calls after each step (`publish(params, version)`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from trainer_agent.arena import Arena
from trainer_agent.async_publish import (
    PublishFuture,
    PublishQueue,
    PublishSuperseded,
    check_names,
    check_not_deleted,
    held_bytes,
    held_params,
)
from trainer_agent.chunk_server import (
    SERVICE_NAME,
    SlotEntry,
    SlotTable,
    TrainerAgentServicer,
    add_trainer_agent_service,
)
from trainer_agent.delta import StagedDelta, pack_delta
from trainer_agent.params import device_stream
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage_plan import StagePlan, Stager, StreamSpec, follow_plan, plan_staging, plan_stream
from trainer_agent.staging import Layout
from trainer_agent.store_leftovers import remove_released_parts
from trainer_agent.stream_staging import stage_streamed
from weightsync import native, version_states
from weightsync._proto import coordinator_pb2 as _cpb
from weightsync._proto import types_pb2 as _tpb
from weightsync.addresses import inet_unusable
from weightsync.arena_files import reclaim_orphans
from weightsync.client import CoordinatorClient
from weightsync.config import advertised
from weightsync.digests import access_token, canonical_json
from weightsync.errors import (
    TRANSIENT_ERRORS,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NewestCommitted,
    ResourceExhausted,
    SessionNotFound,
    SlotBusy,
    StaleGeneration,
    WeightsyncError,
    WrongState,
)
from weightsync.failpoints import Failpoints
from weightsync.heartbeat import Heartbeat
from weightsync.logs import version_context
from weightsync.manifest import ChunkSpec, Endpoint, Part, ShardSpec, TensorSpec
from weightsync.metrics import Metrics, build_metrics
from weightsync.server import SMALL_REQUEST_BYTES, RunningServer, Service, start_server
from weightsync.transports.fs import FsStore, content_id
from weightsync.transports.fs_options import parse_fs_options
from weightsync.transports.tcp import TcpChunkServer
from weightsync.validation import INT64_MAX, MAX_KEY_CHARS, check_int_arg, check_version_arg

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PublishResult:
    """What one publish did."""

    version: int
    state: str
    duplicate: bool
    total_bytes: int
    stage_seconds: float
    publish_seconds: float
    slot: int
    delta_bytes: int = 0  # bytes a rollout holding the base pulls (0: published without a delta)
    delta_base: int = 0  # the base version of the delta


@dataclass
class _StagedPart:
    """A rank's part staged into a slot and not yet taken by the coordinator: what `_seal`
    sends, again as it is while sending fails for a while (the bytes stay in their slot)."""

    version: int
    key: str
    slot: int
    tensors: tuple[TensorSpec, ...]
    shard_specs: list[ShardSpec]
    chunks: list[ChunkSpec]
    total_bytes: int
    stage_s: float
    path: str
    delta: StagedDelta | None = None
    fs_uri: str = ""  # the fs store's copy, once written
    fs_written: bool = False  # by this publish (not a copy of the same bytes found there)


def _content_id(staged: _StagedPart) -> str:
    """Names the fs store directory of a staged part by what it holds (`fs.content_id`)."""
    chunks = [c.to_dict() for c in staged.chunks]
    delta = staged.delta.part.to_dict() if staged.delta is not None else None
    return content_id(canonical_json({"chunks": chunks, "delta": delta}))


# Fields of a ResourceExhausted that space freed elsewhere may end.
FULL_DISK_FIELDS = ("database", "fs_root", "arena")
CLOSE_WAIT_S = 10.0  # beyond the calls' deadlines, what close() waits for another thread's publish
# Niceness added to the async publish worker (and the staging threads it starts), so that
# the training loop's own host threads win the cores when both want them.
ASYNC_WORKER_NICE = 10


def _may_pass(e: WeightsyncError) -> bool:
    """Whether a publish that failed with `e` may succeed later unchanged."""
    if isinstance(e, ResourceExhausted):
        return e.field in FULL_DISK_FIELDS
    return isinstance(e, (*TRANSIENT_ERRORS, SlotBusy))


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


def _refuses_content(e: WeightsyncError) -> bool:
    """Whether the coordinator refused a publish for good without storing it, so that the
    fs copy written for it is read by no one: not a fenced publisher (an earlier try may
    have been taken, its answer lost) and not a failure that may pass."""
    refused = isinstance(e, (AlreadyExists, InvalidArgument, FailedPrecondition, ResourceExhausted))
    return refused and not isinstance(e, StaleGeneration) and not _may_pass(e)


FINAL_STATES = tuple(sorted(version_states.FINAL))


def _some(agents: list[str], shown: int = 5) -> str:
    """Up to `shown` agent ids, quoted, and how many more."""
    more = f" and {len(agents) - shown} more" if len(agents) > shown else ""
    return ", ".join(repr(a) for a in agents[:shown]) + more


def _ride_out(what: str, wait_s: float, call: Callable[[], T], may_pass: Callable[[WeightsyncError], bool]) -> T:
    """`call()`, tried again with backoff (0.5 s doubling to 5 s) while it fails with an
    error `may_pass` accepts, for up to `wait_s`; one warning per outage, one line once
    it went through."""
    deadline, delay, failed_at = time.monotonic() + wait_s, 0.5, 0.0
    while True:
        try:
            result = call()
        except WeightsyncError as e:
            left = deadline - time.monotonic()
            if left <= 0 or not may_pass(e):
                raise
            if not failed_at:
                failed_at = time.monotonic()
                log.warning("%s failed (%s); trying again for up to %.0fs", what, e.message, left)
            time.sleep(min(delay, left))
            delay = min(2 * delay, 5.0)
            continue
        if failed_at:
            log.info("%s went through after %.1fs", what, time.monotonic() - failed_at)
        return result


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
        self.generation = 0
        self.attached_latest_version = 0  # the session's newest version when start() attached
        self.fenced_by = 0  # the newer generation that fenced this publisher
        self._stager = Stager(settings)
        self._layouts: dict[int, Layout] = {}  # slot -> layout its version was staged with (`publish`)
        self._manifest_digests: dict[int, str] = {}  # versions this rank published -> their digest
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
        self._incarnation = s.incarnation or uuid.uuid4().hex
        self._attach_waiting(next_version)
        self.metrics.fenced.labels(session=s.session).set(0)
        reclaim_orphans()  # arenas of trainers killed on this host before they could clean up
        self.arena = Arena(f"{s.session}-r{s.rank}", slots=s.slots)
        self._resources.callback(self.arena.close)
        fps = Failpoints(s.failpoints)
        self.table = SlotTable(self.arena, s.session, s.rank, fps)
        self._servicer = TrainerAgentServicer(self.table, self.metrics, fps, lambda: self.generation)
        transports = ("grpc", "shm")
        self.tcp_server: TcpChunkServer | None = None
        if why := inet_unusable(host=s.host):
            log.info("the tcp transport is not offered: %s", why)
        elif native.available():  # the native bulk path ("tcp"): sends from the mapped arena
            self.tcp_server = TcpChunkServer(
                self.table, host=s.host, port=s.tcp_port, on_sent=self._servicer.count_served, failpoints=fps
            )
            self._resources.callback(self.tcp_server.close)
            transports += ("tcp",)
        else:
            log.warning("native shim missing (%s): the tcp transport is not offered", native.missing_reason())
        self.server: RunningServer = start_server(
            [Service(add_trainer_agent_service, self._servicer, SERVICE_NAME)],
            host=s.host,
            port=s.port,
            metrics=self.metrics,
            metrics_port=s.metrics_port,
            metrics_host=s.metrics_host,
            security=security,
            max_request_bytes=SMALL_REQUEST_BYTES,
        )
        self._resources.callback(self._stop_serving)
        self.endpoint = Endpoint(
            advertised(self.server.address, s.advertise_host),
            transports,
            s.host_id or socket.gethostname(),
            tcp_address=advertised(self.tcp_server.address, s.advertise_host) if self.tcp_server else "",
        )
        self._heartbeat = Heartbeat(
            self._client,
            s.session,
            self.agent_id,
            current_version=self._latest_version,
            register=self._register,
            on_generation=self._notice_generation,
        ).start()
        self._resources.callback(self._heartbeat.stop)
        log.info(
            "publisher rank=%d session=%s generation=%d serving %s",
            s.rank,
            s.session,
            self.generation,
            self.server.address,
        )

    def _attach_waiting(self, next_version: int) -> None:
        """Opens the session, waiting up to `attach_wait_s` for a coordinator that is not
        reachable yet: pods start in any order, and giving up after the client's few
        retries (~9 s) would end a sidecar before its coordinator is up. The
        incarnation makes the attach idempotent, so trying it again bumps nothing twice."""
        _ride_out(
            f"attaching to coordinator {self.settings.coordinator}",
            self.settings.attach_wait_s,
            lambda: self._open_session(next_version),
            lambda e: isinstance(e, TRANSIENT_ERRORS),
        )

    def _open_session(self, next_version: int) -> None:
        s = self.settings
        opened = self._client.open_session(
            s.session,
            trainer=True,
            incarnation=self._incarnation,
            trainer_ranks=s.world_size,
            min_rollouts=s.min_rollouts,
            weight_sync_mode=s.weight_sync_mode,
            next_version=next_version,
        )
        self.generation = opened.generation
        self.attached_latest_version = opened.latest_version
        self._token_key = opened.token_key

    def _reattach(self, next_version: int) -> None:
        """Opens the session again, as the same incarnation, where the coordinator does not
        know it: it lost its database (a volume gone, a pod rescheduled with emptyDir). No
        session can be deleted otherwise, so this fences nobody; the rollouts register again
        once it exists, and versions go on from `next_version`. A fenced publisher never does:
        a newer incarnation may have opened the session there since."""
        if self.fenced:
            raise StaleGeneration(f"this publisher was fenced by generation {self.fenced_by}; it does not re-attach")
        log.warning(
            "the coordinator does not know session %s (its database was lost?); opening it again as incarnation %s",
            self.session,
            self._incarnation,
        )
        self._open_session(next_version)

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

    def _stop_serving(self) -> None:
        self.server.enter_graceful_shutdown()  # health first: nobody new is sent here
        if not self.fenced:
            try:
                self._client.deregister_agent(self.session, self.agent_id)
            except WeightsyncError as e:
                log.info("deregistering %s: %s (its lease ends by itself)", self.agent_id, e)
        self.server.stop(grace_s=1.0)

    def __enter__(self) -> WeightPublisher:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._close(cancel_pending=e is not None)

    def _latest_version(self) -> int:
        return max((e.version for e in self.table.entries().values()), default=0)

    @property
    def fenced(self) -> bool:
        """True once a newer incarnation attached: every write of this publisher is refused."""
        return self.fenced_by > 0

    def _register(self) -> float:
        with self._refused_as_stale_means_fenced():
            try:
                resp = self._register_once()
            except SessionNotFound:
                self._reattach(self._latest_version() + 1)
                resp = self._register_once()
        return resp.lease_ttl_seconds

    def _register_once(self) -> _cpb.RegisterAgentResponse:
        return self._client.register_agent(
            self.session,
            self.agent_id,
            trainer=True,
            endpoint=self.endpoint,
            rank=self.rank,
            generation=self.generation,
        )

    @contextlib.contextmanager
    def _refused_as_stale_means_fenced(self) -> Iterator[None]:
        """A write refused with StaleGeneration: a newer incarnation fenced this publisher."""
        try:
            yield
        except StaleGeneration:
            self._notice_generation(self.generation + 1)
            raise

    def _notice_generation(self, generation: int) -> None:
        if generation > self.generation and not self.fenced:
            self.fenced_by = generation
            self.metrics.fenced.labels(session=self.session).set(1)
            log.error(
                "fenced: session %s moved to generation %d, this publisher holds %d; its writes are refused "
                "(another incarnation of the trainer attached)",
                self.session,
                generation,
                self.generation,
            )

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
        if not self._started or self._closed:
            raise FailedPrecondition(
                "this publisher is closed" if self._closed else "start() it (or enter `with`) before publishing"
            )
        check_names(params)
        # an older version still waiting goes before the copy is made: two versions held at most
        self._async.supersede_older(version)
        held = held_params(params, snapshot=snapshot, weight_dtype=self.settings.weight_dtype)

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
            staged = _ride_out(
                f"staging version {version}",
                self.settings.publish_wait_s,
                lambda: self._stage(params, version, idempotency_key),
                self._may_pass,
            )
            return self._send(staged, deadline)

    def _stage(self, params: Mapping[str, Any], version: int, idempotency_key: str | None) -> _StagedPart:
        if not params:
            raise InvalidArgument("must contain at least one tensor", field="params")
        started = time.perf_counter()
        plan = plan_staging(params, self.settings)
        claim_started = time.perf_counter()
        slot = self._claim_slot(version)  # may wait for leases: not staging time
        started += time.perf_counter() - claim_started
        self._fit_arena(plan.layout.total_bytes)
        return self._stage_planned(plan, params, version, slot, idempotency_key, started)

    def _stage_planned(
        self,
        plan: StagePlan,
        params: Mapping[str, Any] | Iterable[tuple[str, Any]],
        version: int,
        slot: int,
        idempotency_key: str | None,
        started: float,
    ) -> _StagedPart:
        """Stages by `plan` into `slot` (claimed, and fitted to the layout), encoding a delta
        against the previous version where it can; `started` is when staging time began."""
        key = idempotency_key or f"{self.agent_id}:{version}"
        layout = plan.layout
        base = self._delta_base(plan, slot, version)
        path, shard_specs, chunks, encodings = self._stager.stage(
            plan,
            params,
            self.arena.buffer(),
            slot * self.arena.slot_bytes,
            self.arena.slot(slot),
            base=self.arena.slot(base[0]) if base is not None else None,
        )
        delta = None
        if base is not None:
            delta = pack_delta(chunks, encodings, base[1], base[2])
            if delta.wire_bytes > self.settings.delta_max_ratio * layout.total_bytes:
                log.info(
                    "version %d without a delta: it would move %.1f%% of the bytes (delta_max_ratio %.2f)",
                    version,
                    100 * delta.wire_bytes / max(1, layout.total_bytes),
                    self.settings.delta_max_ratio,
                )
                delta = None
        self._layouts[slot] = layout
        return self._staged(_StagedPart(version, key, slot, layout.tensors, shard_specs, chunks, layout.total_bytes,
                                        time.perf_counter() - started, path, delta))  # fmt: skip

    def _staged(self, staged: _StagedPart) -> _StagedPart:
        self.metrics.observe_phase("stage", staged.stage_s)
        self.metrics.add_bytes("staged", staged.total_bytes)
        return staged

    def _fit_arena(self, slot_bytes: int) -> None:
        """Makes every arena slot hold `slot_bytes`. A reallocation leaves no slot's bytes,
        so their versions are forgotten first: a reader then finds the version gone
        (NOT_FOUND) or holds a view of the old mapping, which outlives it; never a slot of an
        arena being made or of the new one. Raises ResourceExhausted
        (`arena`) when there is no room."""
        if self.arena.fits(slot_bytes):
            return
        for slot in range(self.arena.slots):
            self.table.set(slot, None)
        self.arena.ensure_slot_bytes(slot_bytes)

    def _delta_base(self, plan: StagePlan, slot: int, version: int) -> tuple[int, int, str] | None:
        """(slot, version, manifest digest) of the version to encode this one against: the
        newest older one in another slot, staged with the same layout; None with the
        reason logged when there is none or delta is off."""
        if self.settings.delta == "off":
            return None
        why = plan.can_delta(self.settings.chunk_bytes)
        if not why:
            older = {s: e for s, e in self.table.entries().items() if s != slot and e.version < version}
            if not older:
                why = "no older version in the arena"
            else:
                base_slot, entry = max(older.items(), key=lambda kv: kv[1].version)
                if self._layouts.get(base_slot) != plan.layout:
                    why = f"version {entry.version} was staged with another layout"
                elif digest := self._manifest_digest(entry.version):
                    return base_slot, entry.version, digest
                else:
                    why = f"version {entry.version} has no manifest digest (it never became READY)"
        log.info("version %d without a delta: %s", version, why)
        return None

    def _manifest_digest(self, version: int) -> str:
        """A version's manifest digest: from its publish when that made it READY, else asked."""
        digest = self._manifest_digests.get(version, "")
        if not digest:
            try:
                found = [v for v in self._client.status(self.session, 8).versions if v.version == version]
            except WeightsyncError as e:
                log.info("cannot learn version %d's manifest digest: %s", version, e)
                return ""
            digest = found[0].manifest_digest if found else ""
            if digest:
                self._manifest_digests[version] = digest
        return digest

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
            slot = _ride_out(
                f"finding a slot for version {version}",
                self.settings.publish_wait_s,
                lambda: self._fitted_slot(version, capacity_bytes),
                self._may_pass,
            )
            if specs is None:
                return self._send(self._stage_stream(items, version, slot, idempotency_key), deadline)
            checked = follow_plan(items, plan, self.settings.weight_dtype)
            return self._send(
                self._stage_planned(plan, checked, version, slot, idempotency_key, time.perf_counter()), deadline
            )

    def _may_pass(self, e: WeightsyncError) -> bool:
        return not self._closed and _may_pass(e)

    def _fitted_slot(self, version: int, slot_bytes: int) -> int:
        slot = self._claim_slot(version)
        self._fit_arena(slot_bytes)
        return slot

    def _stage_stream(
        self, items: Iterable[tuple[str, Any]], version: int, slot: int, idempotency_key: str | None
    ) -> _StagedPart:
        key = idempotency_key or f"{self.agent_id}:{version}"
        started = time.perf_counter()
        self._layouts.pop(slot, None)  # staged in arrival order: never a delta base
        stream = device_stream(items, self.settings.weight_dtype, self.settings.d2h_window_bytes)
        staged, chunks = stage_streamed(self.arena.slot(slot), stream, self.settings.chunk_bytes)
        path = "stream-native" if native.available() else "stream-python"
        return self._staged(_StagedPart(version, key, slot, tuple(staged.tensors.values()), staged.shards, chunks,
                                        staged.total_bytes, time.perf_counter() - started, path))  # fmt: skip

    def _send(self, staged: _StagedPart, deadline: float) -> PublishResult:
        """Publishes a staged part (`_seal`), sending it again as it is (its bytes, slot and
        idempotency key) while a failure may pass, until `deadline`; frees the slot when
        it gives up."""
        try:
            return _ride_out(
                f"publishing version {staged.version}",
                deadline - time.monotonic(),
                lambda: self._seal(staged),
                self._may_pass,
            )
        except Exception as e:  # any: a slot left set would be served, and released, as that version
            self.table.set(staged.slot, None)
            if isinstance(e, WeightsyncError) and staged.fs_written and _refuses_content(e):
                self._remove_refused_copy(staged)
            raise

    def _remove_refused_copy(self, staged: _StagedPart) -> None:
        """A refused publish's fs copy (other bytes under an existing version, a version not
        newer than the session's): written before the publish, it would stay in the store
        for good where its version number is never the coordinator's."""
        assert self.fs_store is not None
        try:
            self.fs_store.remove_content(self.session, staged.version, self.rank, staged.fs_uri.rsplit("/", 1)[-1])
        except OSError as e:
            log.warning("version %d: the refused publish's fs copy was not removed (%s)", staged.version, e)
        staged.fs_uri, staged.fs_written = "", False

    def _seal(self, staged: _StagedPart) -> PublishResult:
        """Serves the staged slot (and its delta, fetch indices after its chunks; the fs
        store gets both, once) and streams its descriptors. A delta the coordinator
        refuses (its base unknown there, e.g. pruned) is dropped and the part published
        without it."""
        version, slot, total_bytes, delta = staged.version, staged.slot, staged.total_bytes, staged.delta
        self.last_path = staged.path
        endpoint = dataclasses.replace(
            # Same-host rollouts may map this slot of the arena directly ("shm" transport).
            self.endpoint,
            shm_path=str(self.arena.path),
            shm_offset=slot * self.arena.slot_bytes,
        )
        if self.fs_store is not None:
            if not staged.fs_uri:
                t_fs = time.perf_counter()
                staged.fs_uri, staged.fs_written = self.fs_store.write_part(
                    self.session,
                    version,
                    self.rank,
                    memoryview(self.arena.slot(slot)[:total_bytes]),
                    delta=memoryview(delta.data) if delta is not None else None,
                    content=_content_id(staged),
                )
                self.metrics.observe_phase("fs_write", time.perf_counter() - t_fs)
            endpoint = dataclasses.replace(endpoint, transports=(*endpoint.transports, "fs"), fs_uri=staged.fs_uri)
        entry = SlotEntry(version, tuple(staged.chunks), total_bytes, access_token(self._token_key, version))
        if delta is not None:
            entry.delta_chunks = tuple(c.as_chunk() for c in delta.part.chunks)
            entry.delta_bytes = delta.data
        self.table.set(slot, entry)
        part = Part(
            rank=self.rank,
            total_bytes=total_bytes,
            chunk_bytes=self.settings.chunk_bytes,
            tensors=staged.tensors,
            shards=tuple(staged.shard_specs),
            chunks=tuple(staged.chunks),
            endpoint=endpoint,
            stage_seconds=staged.stage_s,
            delta=delta.part if delta is not None else None,
        )
        t0 = time.perf_counter()
        try:
            resp = self._publish_part(version, staged.key, part)
        except FailedPrecondition as e:
            if part.delta is None or not e.message.startswith("header.delta"):
                raise
            log.warning("version %d: the delta was refused (%s); publishing it without one", version, e.message)
            staged.delta = delta = None  # (a try after this one sends none either)
            resp = self._publish_part(version, staged.key, dataclasses.replace(part, delta=None))
        if resp.duplicate:
            # The same version and bytes again (a retried call): the slot that held them
            # first serves them (the manifest names it); this copy goes, or both slots held
            # one version and the next publish released it from under the other.
            held = [s for s, e in self.table.entries().items() if s != slot and e.version == version]
            if held:
                self.table.set(slot, None)
                slot = held[0]
        if resp.version.manifest_digest:
            self._manifest_digests = {v: d for v, d in self._manifest_digests.items() if v >= version - 4} | {
                version: resp.version.manifest_digest
            }
        publish_s = time.perf_counter() - t0
        self.metrics.observe_phase("publish", publish_s)
        self.metrics.current_version.labels(role="trainer", session=self.session).set(version)
        state = _tpb.VersionState.Name(resp.version.state)
        log.info(
            "published version=%d rank=%d bytes=%d path=%s stage_s=%.3f publish_s=%.3f state=%s slot=%d%s",
            version,
            self.rank,
            total_bytes,
            staged.path,
            staged.stage_s,
            publish_s,
            state,
            slot,
            f" delta_bytes={delta.wire_bytes} base={delta.part.base_version}" if delta is not None else "",
        )
        return PublishResult(
            version, state, resp.duplicate, total_bytes, staged.stage_s, publish_s, slot,
            delta.wire_bytes if delta is not None else 0, delta.part.base_version if delta is not None else 0,
        )  # fmt: skip

    def _publish_part(self, version: int, key: str, part: Part) -> _cpb.PublishResponse:
        def once() -> _cpb.PublishResponse:  # with the generation of the moment
            return self._client.publish_part(
                self.session, generation=self.generation, version=version, idempotency_key=key, part=part
            )

        try:
            return once()
        except SessionNotFound:
            self._reattach(version)
            return once()

    def _claim_slot(self, version: int) -> int:
        """A slot to stage into: an empty one, else the oldest whose version can be released.

        A slot holding `version` itself is never chosen, so a retried or conflicting
        publish cannot overwrite bytes rollouts may be reading. The old version is
        released at the coordinator first, which is refused while a rollout holds a lease
        on it (we wait, bounded, rather than tear its bytes) and for the session's newest
        COMMITTED version until a newer one commits: another slot free to take is taken,
        so a version that fails its handshakes does not cost the session its last
        committed one; where the others are leased, that version is given up rather than
        waited on (a lease may be a prefetch that only a newer version ends).
        """
        if not self._started or self._closed:
            raise FailedPrecondition(
                "this publisher is closed" if self._closed else "start() it (or enter `with`) before publishing"
            )
        if self.fenced:  # refused before any byte of the arena is touched
            raise StaleGeneration(
                f"this publisher (generation {self.generation}) was fenced by generation {self.fenced_by}; "
                "a newer incarnation of the trainer owns the session"
            )
        entries = self.table.entries()
        if self.fs_store is not None:
            remove_released_parts(
                self.fs_store, self._client, self.session, keep={e.version for e in entries.values()}, below=version
            )
        for slot in range(self.arena.slots):
            if slot not in entries:
                return slot
        candidates = sorted(((s, e) for s, e in entries.items() if e.version != version), key=lambda kv: kv[1].version)
        if not candidates:
            raise FailedPrecondition(f"every slot holds version {version}; use slots >= 2")
        # One slot: staging overwrites its version's bytes, whatever that version is.
        unpin = self.arena.slots == 1
        pinned = None
        for slot, entry in candidates:  # the oldest slot free to take now
            released = self._release_for_reuse(slot, entry.version, unpin=unpin, wait=False)
            if released:
                break
            if released is False and pinned is None:  # the session's newest COMMITTED version
                pinned = slot, entry
        else:
            # Every other slot is leased or holds the newest COMMITTED version. A lease may be a
            # prefetch waiting on its engine, which only a newer version ends: that version is
            # given up rather than waited on; else the oldest slot's leases are waited out.
            slot, entry = pinned or candidates[0]
            self._release_for_reuse(slot, entry.version, unpin=True if pinned else unpin, wait=True)
        self.table.set(slot, None)
        if self.fs_store is not None:
            try:
                self.fs_store.remove_part(self.session, entry.version, self.rank)
            except OSError as e:  # the store's trouble: an old part left behind costs space, not this publish
                log.warning("version %d: its part was not removed from the fs store (%s)", entry.version, e)
        return slot

    def _release_for_reuse(self, slot: int, version: int, *, unpin: bool, wait: bool) -> bool | None:
        """Releases (or, still STAGING, aborts) the version in `slot` so it can be reused:
        True. False where it is the session's newest COMMITTED version (and not `unpin`);
        None where rollouts lease it and not `wait`, else their leases are waited out for
        up to slot_wait_s (SlotBusy after)."""
        deadline = time.monotonic() + (self.settings.slot_wait_s if wait else 0.0)
        with self._refused_as_stale_means_fenced():
            while True:
                try:
                    self._client.release_version(self.session, version, generation=self.generation, unpin=unpin)
                    return True
                except NewestCommitted:  # (these two before FailedPrecondition, their base)
                    return False
                except StaleGeneration:
                    raise
                except WrongState:
                    # Still STAGING (another rank never sealed) or otherwise unreleasable: abort it.
                    try:
                        self._client.abort_version(
                            self.session, generation=self.generation, version=version, reason="slot reused"
                        )
                    except StaleGeneration:
                        raise
                    except WeightsyncError:
                        pass
                    return True
                except FailedPrecondition as e:
                    if not wait:
                        return None
                    if time.monotonic() > deadline or self._closed:
                        raise SlotBusy(f"cannot reuse slot {slot}: {e.message}; raise slots or slot_wait_s") from None
                    time.sleep(0.05)
                except WeightsyncError as e:  # NOT_FOUND etc.: nothing to protect
                    log.info("releasing version %d: %s", version, e)
                    return True

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
        if (by := self._async.superseded_by(version)) is not None:
            raise PublishSuperseded(version, by)
        if (pending := self._async.future_of(version)) is not None:
            started = time.monotonic()
            try:
                pending.result(timeout_s)
            except FutureTimeout:
                raise DeadlineExceeded(f"version {version}'s async publish did not end within {timeout_s}s") from None
            timeout_s = max(0.001, timeout_s - (time.monotonic() - started))
        try:
            info = self._client.wait_for_version(self.session, version, states=FINAL_STATES, timeout_s=timeout_s)
        except DeadlineExceeded as e:
            raise DeadlineExceeded(f"{e.message}: {self._waiting_for(version)}") from None
        return _tpb.VersionState.Name(info.state)

    def _waiting_for(self, version: int) -> str:
        """Who a version that has not committed waits for, from the session's status: no
        rollout at all (none started, or they follow another session), or the live rollouts
        that have not reported it."""
        try:
            st = self._client.status(self.session, 20)
        except WeightsyncError as e:
            return f"the session's status could not be read ({e.message})"
        info = next((v for v in st.versions if v.version == version), None)
        state = _tpb.VersionState.Name(info.state) if info is not None else "not among the newest 20"
        live = sorted(a.agent_id for a in st.agents if a.role == _tpb.ROLLOUT and a.alive)
        if not live:
            return (
                f"it is {state} and no live rollout is registered in session {self.session!r} "
                "(none started, or they follow another session)"
            )
        reports = {h.agent_id: h for h in st.handshakes if h.version == version}
        waiting = [a for a in live if a not in reports]
        failed = [a for a in live if a in reports and not reports[a].ok]
        leases = info.leases if info is not None else 0
        return (
            f"it is {state}; {len(live) - len(waiting)} of {len(live)} live rollouts reported it"
            + (f", not yet {_some(waiting)}" if waiting else "")
            + (
                f"; failed on {_some(failed)} (first: {reports[failed[0]].mismatch[:200]}), retried by them"
                if failed
                else ""
            )
            + f" ({leases} hold a lease on it; min_rollouts {st.min_rollouts})"
        )

    @property
    def client(self) -> CoordinatorClient:
        return self._client
