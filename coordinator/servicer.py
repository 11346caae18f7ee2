"""gRPC Coordinator servicer: the only coordinator module that touches pb2 or grpc."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from coordinator.agent_keys import AgentKeyCheck, AgentKeys
from coordinator.audit import AuditBoard, check_audit
from coordinator.database import NotOnLoop, StoreBusy
from coordinator.fleet_metrics import FleetCollector
from coordinator.messages import applied_report, endpoint_proto, enum_name, role_name, version_info
from coordinator.recent import Recent
from coordinator.records import AgentRecord, PublishOutcome, VersionRecord
from coordinator.states import VersionState
from coordinator.status_view import StatusReplies
from coordinator.store import SessionStore
from coordinator.watch import EVENT_PAGE, EventFeed, WatchHub
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import coordinator_pb2_grpc as pb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.carried_calls import carried_call
from weightsync.digests import DIGEST_ALGORITHM
from weightsync.errors import DigestMismatch, InvalidArgument, ResourceExhausted
from weightsync.event_loop import run_in_thread
from weightsync.manifest import Manifest
from weightsync.metrics import Metrics
from weightsync.rpc import check_int64_range, code_name, status_for
from weightsync.server import Service
from weightsync.transports.fs import check_part_uri
from weightsync.transports.shm import check_arena_path
from weightsync.validation import check_address, check_session_name, check_version
from weightsync.wire import (
    PartBuilder,
    endpoint_from_proto,
    manifest_batches,
    part_to_proto,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
LOOP_REPORT_TENSORS = 4096  # larger handshakes are checked on a thread, not on the loop
STORE_WAIT_S = 0.25  # how long a short store call waits on the loop for a busy store
BURST_CALLS = 2
MANIFEST_BODIES = 4  # versions whose reader-independent pieces are kept built
AUDIT_WAIT_S = 15.0  # how long a fresh AuditSession waits for the rollouts' answers by default
MAX_AUDIT_WAIT_S = 120.0
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
# Streams a rollout keeps for as long as it runs; the hub ends them at shutdown.
ENDLESS_STREAMS = ("WatchVersions", "Heartbeats")


@dataclass(frozen=True)
class _ManifestBody:
    """A version's manifest pieces that do not depend on the reader. Shared, never mutated:
    gRPC only serializes them."""

    parts: tuple[tpb.RankPart, ...]
    aggregates: tpb.Aggregates
    batches: tuple[pb.ManifestPiece, ...]

    @classmethod
    def of(cls, manifest: Manifest) -> _ManifestBody:
        agg = manifest.aggregates()
        return cls(
            parts=tuple(part_to_proto(p) for p in manifest.parts),
            aggregates=tpb.Aggregates(
                grand_total=agg.grand_total, tensor_count=agg.tensor_count, element_count=agg.element_count
            ),
            batches=tuple(manifest_batches(manifest)),
        )


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Translates RPCs to SessionStore calls; errors map to statuses in the interceptor."""

    def __init__(self, store: SessionStore, hub: WatchHub, metrics: Metrics) -> None:
        self._store = store
        self._hub = hub
        self._metrics = metrics
        self._last_sweep = 0.0
        self._feed = EventFeed(hub, store.events_since, store.latest_seq, asyncio.to_thread)
        self._status_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="status")
        self._manifest_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="manifest")
        self._bodies: Recent[tuple[str, int, str], _ManifestBody] = Recent(MANIFEST_BODIES)
        self._status = StatusReplies(store)
        self._audits = AuditBoard()
        # Leases and handshakes come as a fleet-wide burst on every READY; at most this many
        # at a time, so heartbeats and watches never queue behind a thousand of them.
        self._burst = asyncio.Semaphore(BURST_CALLS)
        self._store_free = asyncio.Event()
        self._store_waiters = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        store.on_free = self._store_freed
        store.on_transition = self._count_transition
        metrics.registry.register(FleetCollector(store))

    @property
    def agent_keys(self) -> AgentKeys:
        """The store's agent keys, which calls naming an agent are checked against."""
        return self._store.agent_keys

    def sweep(self) -> None:
        """Drops the leases of rollouts that stopped heartbeating (counted per session)."""
        for session, dropped in self._store.sweep().items():
            self._metrics.leases_dropped.labels(session=session).inc(dropped)

    def _count_transition(self, rec: VersionRecord) -> None:
        self._metrics.versions_total.labels(session=rec.session, state=rec.state.value).inc()
        if rec.state in (VersionState.COMMITTED, VersionState.PARTIAL) and rec.ready_at:
            self._metrics.ready_to_commit_seconds.labels(session=rec.session).observe(
                max(0.0, (rec.committed_at or self._store.now()) - rec.ready_at)  # one clock: the store's
            )
        if rec.state is VersionState.COMMITTED and rec.flip_skew_s is not None:
            self._metrics.flip_skew_seconds.labels(session=rec.session, flip_policy=rec.flip_policy.lower()).observe(
                rec.flip_skew_s
            )

    def close(self) -> None:
        """Stops the servicer's own executors (after the server stopped)."""
        self._status_pool.shutdown(wait=False, cancel_futures=True)
        self._manifest_pool.shutdown(wait=False, cancel_futures=True)

    async def _soon(self, executor: Executor | None, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the event loop once the store can serve it without waiting; on
        `executor` (None: the loop's default) if it stays busy past STORE_WAIT_S.

        For short store calls that a fleet makes in bursts (leases, handshakes,
        heartbeats): a thread hop costs more than the call, and handler threads convoy on
        the GIL with the loop (a fleet's 500 leases took 8 s from a pool, 3 s here). A
        busy store is waited for rather than handed to a thread at once: calls on threads
        hold the lock longer, so more calls would find it busy and the burst would tip
        onto threads."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + STORE_WAIT_S
        while True:
            self._store_free.clear()
            try:
                with self._store.nonblocking():
                    return fn(*args)
            except NotOnLoop:
                return await loop.run_in_executor(executor, fn, *args)
            except StoreBusy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return await loop.run_in_executor(executor, fn, *args)
            self._store_waiters += 1
            self._loop = loop
            try:  # woken when a connection is let go (on_free); the timeout covers a missed wake
                await asyncio.wait_for(self._store_free.wait(), min(left, 0.05))
            except TimeoutError:
                pass
            finally:
                self._store_waiters -= 1

    def _store_freed(self) -> None:
        """The store's on_free, on whichever thread let go of the writer's lock or a reader."""
        if self._store_waiters and self._loop is not None:  # read off the loop: a stale
            self._loop.call_soon_threadsafe(self._store_free.set)  # 0 costs one timeout

    def _sweep_due(self) -> bool:
        """True once a second: expired leases are dropped between the main loop's sweeps."""
        now = time.monotonic()
        if now - self._last_sweep > 1.0:
            self._last_sweep = now
            return True
        return False

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.OpenSessionResponse:
        role = role_name(request.role)
        if len(request.incarnation) > 128:
            raise InvalidArgument("longer than 128 characters", field="incarnation")
        s, created = self._store.open_session(
            request.session,
            trainer=role == "TRAINER",
            incarnation=request.incarnation,
            trainer_ranks=request.trainer_ranks,
            min_rollouts=request.min_rollouts,
            weight_sync_mode=request.weight_sync_mode,
            next_version=request.next_version,
            flip_policy=enum_name(tpb.FlipPolicy, request.flip_policy, "flip_policy"),
            prepare_timeout_s=request.prepare_timeout_seconds,
            prepared_loss=enum_name(tpb.PreparedLoss, request.prepared_loss, "prepared_loss"),
            rollout_ids=tuple(request.rollout_ids),
            max_rollouts=request.max_rollouts,
        )
        latest = self._store.versions(s.name, 1)
        return pb.OpenSessionResponse(
            session=s.name,
            generation=s.generation,
            trainer_ranks=s.trainer_ranks,
            min_rollouts=s.min_rollouts,
            created=created,
            latest_version=latest[0].version if latest else 0,
            weight_sync_mode=s.weight_sync_mode,
            token_key=self._store.tokens.session_key(s.name) if role == "TRAINER" else "",
            lease_ttl_seconds=self._store.lease_ttl_s,
            flip_policy=tpb.FlipPolicy.Value(s.flip_policy),
            prepare_timeout_seconds=s.prepare_timeout_s,
            prepared_loss=tpb.PreparedLoss.Value(s.prepared_loss),
            rollout_ids=s.expected_ids(),
            max_rollouts=s.max_rollouts,
        )

    def RegisterAgent(
        self, request: pb.RegisterAgentRequest, context: grpc.ServicerContext
    ) -> pb.RegisterAgentResponse:
        role = role_name(request.role)
        if request.endpoint.address:
            check_address(request.endpoint.address, "endpoint.address")
        if request.endpoint.tcp_address:  # a rollout's relay may serve its host on a unix socket
            check_address(request.endpoint.tcp_address, "endpoint.tcp_address", unix=role == "ROLLOUT")
        r = self._store.register_agent(
            request.session,
            request.agent_id,
            role=role,
            endpoint=endpoint_from_proto(request.endpoint),
            rank=request.rank,
            generation=request.generation,
            instance=request.instance,
            agent_key=request.agent_key,
        )
        return pb.RegisterAgentResponse(
            generation=r.session.generation,
            lease_ttl_seconds=self._store.lease_ttl_s,
            session_uid=r.session.uid,
            agent_key=r.agent_key,
        )

    def DeregisterAgent(
        self, request: pb.DeregisterAgentRequest, context: grpc.ServicerContext
    ) -> pb.DeregisterAgentResponse:
        return pb.DeregisterAgentResponse(removed=self._store.deregister_agent(request.session, request.agent_id))

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        return await self._beat(request)

    async def Heartbeats(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        # Each request was checked as it arrived (rpc.StatusInterceptor); an error ends the
        # stream, and so does shutdown.
        with self._ended_at_shutdown():
            async for request in request_iterator:
                carried = carried_call(request)
                if carried is None:
                    yield await self._beat(request)
                else:
                    async for answer in self._carried(request.call_id, *carried):
                        yield answer

    @contextlib.contextmanager
    def _ended_at_shutdown(self) -> Iterator[None]:
        """Around a long-lived stream's body: the hub cancels it when it closes, wherever it
        waits (on its client, or on a store read), and it ends as a return, so its call
        completes at once. Ended by the cancel (raised), a heartbeat stream would stay open
        until its client gives up on it (~2 s per shutdown), and a watch waiting on a store
        read would get the server's whole grace (5 s)."""
        task = asyncio.current_task()
        if task is not None:
            self._hub.end_on_close(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self._hub.closed:
                raise

    async def _carried(self, call_id: int, method: str, request: Any) -> AsyncIterator[pb.HeartbeatResponse]:
        """Answers a call carried on a Heartbeats stream as its own RPC would (see
        weightsync.carried_calls); a failure is an answer, and the stream goes on."""
        name = f"/{SERVICE_NAME}/Heartbeats.{method}"  # counted apart from the RPC itself
        started = time.perf_counter()
        try:
            if method == "GetManifest":
                answers = [pb.HeartbeatResponse(manifest_piece=p) for p in await self._leased_pieces(request)]
            else:
                answers = [pb.HeartbeatResponse(report_applied=await self._report(request))]
        except Exception as e:  # noqa: BLE001 - mapped as rpc.StatusInterceptor maps the RPC's
            status = status_for(e, name)
            self._metrics.observe_rpc(name, code_name(status), time.perf_counter() - started)
            yield pb.HeartbeatResponse(call_id=call_id, last=True, error=status)
            return
        self._metrics.observe_rpc(name, "OK", time.perf_counter() - started)
        answers[-1].last = True
        for answer in answers:
            answer.call_id = call_id
            yield answer

    async def _beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        # A fleet's commonest call: one short statement.
        audited = request.HasField("audit")
        if audited:
            check_audit(request.audit)
        generation = await self._soon(
            None, self._store.heartbeat, request.session, request.agent_id, request.current_version
        )
        if audited:
            self._audits.note(request.session, request.agent_id, request.audit)
        if self._sweep_due():
            await asyncio.to_thread(self.sweep)
        return pb.HeartbeatResponse(
            generation=generation, lease_ttl_seconds=self._store.lease_ttl_s, carries_calls=True,
            audit_request=self._audits.requested(request.session),
        )  # fmt: skip

    def PublishVersion(
        self, request_iterator: Iterator[pb.PublishRequest], context: grpc.ServicerContext
    ) -> pb.PublishResponse:
        started = time.perf_counter()
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("the first message of PublishVersion must be a header", field="header")
        h = first.header
        check_session_name(h.session, "header.session")
        check_version(h.version, "header.version")
        check_int64_range(h, "header.")
        if not (math.isfinite(h.stage_seconds) and h.stage_seconds >= 0):
            raise InvalidArgument(
                f"{h.stage_seconds} is not a finite number of seconds >= 0", field="header.stage_seconds"
            )
        if h.endpoint.address:
            check_address(h.endpoint.address, "header.endpoint.address")
        if h.endpoint.tcp_address:
            check_address(h.endpoint.tcp_address, "header.endpoint.tcp_address", unix=False)
        if h.endpoint.fs_uri:
            check_part_uri(h.endpoint.fs_uri, h.session, h.version, h.rank, "header.endpoint.fs_uri")
        if h.endpoint.shm_path:
            try:
                check_arena_path(h.endpoint.shm_path)
            except InvalidArgument as e:
                raise InvalidArgument(e.message.split(": ", 1)[-1], field="header.endpoint.shm_path") from None
        limits = self._store.limits
        delta = h.delta if h.HasField("delta") else None
        announced = (
            h.tensor_count,
            h.shard_count,
            h.chunk_count,
            delta.chunk_count if delta else 0,
            delta.raw_count if delta else 0,
        )
        for what, n, cap in zip(
            ("tensor_count", "shard_count", "chunk_count", "delta.chunk_count", "delta.raw_count"),
            announced,
            (limits.max_tensors, limits.max_shards, limits.max_chunks, limits.max_chunks, limits.max_chunks),
        ):
            if n > cap:  # refused before a single descriptor is read or kept
                raise ResourceExhausted(f"header.{what}: {n} exceed the limit of {cap}", field=f"header.{what}")
        builder = PartBuilder(
            h.rank, max_items=sum(announced), max_counts=announced, max_name_chars=limits.max_name_chars
        )
        seal = None
        for msg in request_iterator:
            if msg.HasField("header"):
                raise InvalidArgument("sent twice in one PublishVersion stream", field="header")
            if seal is not None:
                raise InvalidArgument("messages after the seal", field="seal")
            if msg.HasField("batch"):
                builder.add(msg.batch)
            elif msg.HasField("seal"):
                seal = msg.seal
        if seal is None:
            raise InvalidArgument("stream ended without a seal; nothing was stored", field="seal")
        counts = builder.counts()
        if counts != announced:
            raise InvalidArgument(
                "header announced tensors/shards/chunks/delta chunks/raw chunks "
                f"{'/'.join(map(str, announced))}, stream carried {'/'.join(map(str, counts))}",
                field="header.tensor_count",
            )
        part = builder.build(
            total_bytes=h.total_bytes,
            chunk_bytes=h.chunk_bytes,
            endpoint=endpoint_from_proto(h.endpoint),
            stage_seconds=h.stage_seconds,
            delta=delta,
        )
        if seal.part_digest != part.digest():
            raise InvalidArgument(
                f"{seal.part_digest!r} does not match the received descriptors", field="seal.part_digest"
            )
        outcome: PublishOutcome = self._store.publish_part(
            h.session, generation=h.generation, version=h.version, idempotency_key=h.idempotency_key, part=part
        )
        self._metrics.observe_phase("publish", time.perf_counter() - started)
        return pb.PublishResponse(version=version_info(outcome.version), duplicate=outcome.duplicate)

    async def GetManifest(
        self, request: pb.GetManifestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ManifestPiece]:
        # A fleet takes its leases all at once on each READY: short store calls, so on the
        # loop when the store is free; the pieces then stream from the loop (a generator on
        # the handler pool costs a thread hop per piece).
        for piece in await self._leased_pieces(request):
            yield piece

    async def _leased_pieces(self, request: pb.GetManifestRequest) -> list[pb.ManifestPiece]:
        async with self._burst:
            return await self._soon(self._manifest_pool, self._manifest_pieces, request)

    def _manifest_pieces(self, request: pb.GetManifestRequest) -> list[pb.ManifestPiece]:
        rec, manifest = self._store.manifest(request.session, request.version, lease_for=request.agent_id)
        body = self._body(rec, manifest)  # on the loop only when built (else NotOnLoop; a lease
        # taken again on the thread is the same lease)
        header = pb.ManifestHeader(
            version=version_info(rec),
            chunk_bytes=manifest.chunk_bytes,
            digest_algorithm=DIGEST_ALGORITHM,
            parts=body.parts,
            aggregates=body.aggregates,
            weight_sync_mode=self._store.session(request.session).weight_sync_mode,
            ready_age_seconds=max(0.0, self._store.now() - rec.ready_at) if rec.ready_at else 0.0,
        )
        if request.agent_id:  # leased readers only: they may read chunks over tcp / relays
            header.access_token = self._store.tokens.access_token(request.session, rec.version)
            header.relay_chain.extend(
                pb.RelayPeer(agent_id=a.agent_id, endpoint=endpoint_proto(a.endpoint))
                for a in self._store.relay_chain(request.session)
            )
        return [pb.ManifestPiece(header=header), *body.batches]

    def _body(self, rec: VersionRecord, manifest: Manifest) -> _ManifestBody:
        """What every reader of a version gets alike, built once per version: a fleet asks
        for it a thousand times within a second of READY."""
        key = (rec.session, rec.version, rec.manifest_digest)
        body = self._bodies.get(key)
        if body is None:
            if self._store.db.is_nonblocking():
                raise NotOnLoop
            body = _ManifestBody.of(manifest)
            self._bodies.put(key, body)
        return body

    async def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.VersionEvent]:
        # A coroutine on the server's loop: a thousand watchers hold no thread.
        await asyncio.to_thread(self._store.session, request.session)  # NOT_FOUND before streaming anything
        seq = request.since_seq
        with self._ended_at_shutdown():
            while not self._hub.closed:
                tick = self._hub.tick(request.session)  # read first: an event appended meanwhile wakes us
                events = await self._feed.after(request.session, seq)
                for ev in events:
                    seq = ev.seq
                    yield pb.VersionEvent(seq=ev.seq, version=version_info(ev.version))
                if len(events) < EVENT_PAGE:
                    await self._hub.wait(request.session, tick)

    async def ReportApplied(
        self, request: pb.ReportAppliedRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportAppliedResponse:
        return await self._report(request)

    async def _report(self, request: pb.ReportAppliedRequest) -> pb.ReportAppliedResponse:
        async with self._burst:
            return await self._soon(None, self._report_applied, request)

    def _report_applied(self, request: pb.ReportAppliedRequest) -> pb.ReportAppliedResponse:
        if len(request.tensors) > LOOP_REPORT_TENSORS and self._store.db.is_nonblocking():
            raise NotOnLoop  # checking every tensor's name and digest is long for a large model
        report = applied_report(request, self._store.limits)
        record = self._store.report_prepared if report.prepared else self._store.report_applied
        outcome = record(request.session, request.version, request.agent_id, report)
        if report.local_error:
            # Recorded as a failed handshake, but no digest differed: the rollout failed on its
            # side and knows it. Answered, not DATA_LOSS, so nobody diagnoses a corruption.
            self._metrics.handshakes.labels(session=request.session, outcome="local_error").inc()
            return pb.ReportAppliedResponse(
                ok=False, version=version_info(outcome.version), mismatch=outcome.mismatch or ""
            )
        if outcome.mismatch is not None:
            self._metrics.handshakes.labels(session=request.session, outcome="mismatch").inc()
            self._metrics.digest_failures.labels(role="coordinator", session=request.session).inc()
            what = "PREPARED report" if report.prepared else "handshake"
            raise DigestMismatch(f"{what} for version {request.version} from {request.agent_id!r}: {outcome.mismatch}")
        self._metrics.handshakes.labels(session=request.session, outcome="ok").inc()
        if report.prepared:
            return pb.ReportAppliedResponse(ok=True, version=version_info(outcome.version))
        if report.timings["pause_seconds"]:
            self._metrics.pause_seconds.labels(session=request.session).observe(report.timings["pause_seconds"])
        if report.timings["ready_to_serving_seconds"]:
            self._metrics.ready_to_serving_seconds.labels(session=request.session).observe(
                report.timings["ready_to_serving_seconds"]
            )
        return pb.ReportAppliedResponse(ok=True, version=version_info(outcome.version))

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        # On threads of its own, not the handler pool nor the executor manifests use: an
        # operator's status call does not queue behind a fleet's burst of handshakes.
        # Resumed in the urgent lane when the reply is built (weightsync.event_loop).
        return await run_in_thread(self._status_pool, self._status.reply, request)

    async def AuditSession(
        self, request: pb.AuditSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.AuditSessionResponse:
        check_session_name(request.session, "session")
        wait_s = request.wait_seconds or AUDIT_WAIT_S
        if not (math.isfinite(wait_s) and 0 < wait_s <= MAX_AUDIT_WAIT_S):
            raise InvalidArgument(f"{wait_s} is not in (0, {MAX_AUDIT_WAIT_S}] seconds", field="wait_seconds")
        rollouts = await asyncio.to_thread(self._live_rollouts, request.session)  # NOT_FOUND first
        seq = self._audits.request(request.session) if request.fresh else 0
        deadline, next_read = time.monotonic() + wait_s, time.monotonic() + 1.0
        while seq and time.monotonic() < deadline and not self._hub.closed:
            if self._audits.answered(request.session, [a.agent_id for a in rollouts], seq):
                break
            await asyncio.sleep(0.05)
            if time.monotonic() >= next_read:  # once a second: a rollout may have left (or come)
                rollouts = await asyncio.to_thread(self._live_rollouts, request.session)
                next_read += 1.0
        rollouts = await asyncio.to_thread(self._live_rollouts, request.session)
        committed = await asyncio.to_thread(self._store.versions, request.session, 50)
        return pb.AuditSessionResponse(
            session=request.session,
            committed_version=next((v.version for v in committed if v.state is VersionState.COMMITTED), 0),
            rollouts=self._audits.rows(request.session, rollouts, seq),
            request_seq=seq,
        )

    def _live_rollouts(self, session: str) -> list[AgentRecord]:
        return [a for a in self._store.agents(session) if a.alive and a.role == "ROLLOUT"]

    def AbortVersion(self, request: pb.AbortVersionRequest, context: grpc.ServicerContext) -> tpb.VersionInfo:
        rec = self._store.abort_version(
            request.session, generation=request.generation, version=request.version, reason=request.reason
        )
        return version_info(rec)

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteSessionResponse:
        versions, agents = await asyncio.to_thread(self._store.delete_session, request.session, force=request.force)
        # What was kept of it must not outlive it: a session made again under the name
        # starts from nothing (its event seqs go on from the store's, never reused).
        self._feed.forget(request.session)
        self._status.forget(request.session)
        self._audits.forget(request.session)
        self._metrics.forget_session(request.session)
        log.info("session %r deleted: %d version(s), %d agent(s)", request.session, versions, agents)
        return pb.DeleteSessionResponse(versions=versions, agents=agents)

    def ReleaseVersion(self, request: pb.ReleaseVersionRequest, context: grpc.ServicerContext) -> tpb.VersionInfo:
        if not request.generation:
            raise InvalidArgument(
                "required: the caller's session generation (fenced writers release nothing)", field="generation"
            )
        rec = self._store.release_version(
            request.session, request.version, generation=request.generation, force=request.force, unpin=request.unpin
        )
        return version_info(rec)


def coordinator_service(servicer: CoordinatorServicer) -> Service:
    """The servicer as `weightsync.server.start_server` mounts it: calls naming an agent
    must carry its key (`coordinator.agent_keys`)."""
    return Service(
        pb_grpc.add_CoordinatorServicer_to_server,
        servicer,
        SERVICE_NAME,
        ENDLESS_STREAMS,
        checks=(AgentKeyCheck(servicer.agent_keys),),
    )
