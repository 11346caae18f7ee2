"""CoordinatorClient: typed calls to the Coordinator with deadlines and mapped errors."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeVar

import grpc

from weightsync import rpc, version_states
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import coordinator_pb2_grpc as pb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import AgentIdHeld, DeadlineExceeded, InvalidArgument, TransportUnavailable
from weightsync.manifest import Endpoint, Manifest, Part
from weightsync.publish_sender import PUBLISH_METHOD, LoopSender
from weightsync.security import Security, with_credential
from weightsync.wire import delta_to_proto, endpoint_to_proto, manifest_from_pieces, part_to_batches, publish_requests

log = logging.getLogger(__name__)
#: CoordinatorClient.publish_requests: how PublishVersion's requests are built and sent
PUBLISH_REQUESTS = ("first", "lazy", "loop")
DECIDED_STATES = tuple(sorted(version_states.DECIDED))
R = TypeVar(
    "R",
    pb.RegisterAgentRequest,
    pb.HeartbeatRequest,
    pb.DeregisterAgentRequest,
    pb.GetManifestRequest,
    pb.ReportAppliedRequest,
)
T = TypeVar("T")


class CallCarrier(Protocol):
    """Sends a call on a stream already open (weightsync.heartbeat.Heartbeat.carry)."""

    def carry(self, call: str, request: Any, timeout_s: float) -> list[pb.HeartbeatResponse] | None: ...


class CoordinatorClient:
    """One channel to a coordinator. Every call has a deadline (`timeout_s`).

    Idempotent calls retry UNAVAILABLE `retries` times with backoff, which rides out a
    coordinator restart of a few seconds. With a `carrier` (a rollout's heartbeat), the
    leased GetManifest and ReportApplied travel on its stream while it carries calls, and
    as RPCs otherwise (weightsync.carried_calls).

    The agent key each registration answers is kept, and every later call naming that
    agent carries it (`keyed`): the coordinator refuses calls for an agent without it.
    """

    def __init__(
        self, address: str, *, timeout_s: float = 30.0, retries: int = 8, security: Security | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        # Given no security, the default credential of the coordinator at `address`, if it
        # made one for this user, as admin (an operator's or a test's client).
        security = with_credential(security, address, "admin") if security is None else security
        self._channel = rpc.channel(address, security)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        # PublishVersion's requests serialized by the caller (see publish_part)
        self._publish_bytes = self._channel.stream_unary(
            PUBLISH_METHOD,
            request_serializer=None,
            response_deserializer=pb.PublishResponse.FromString,
        )
        #: how PublishVersion's requests go (the benches compare): "first", serialized in the
        #: calling thread before the call; "lazy", built as gRPC's per-call thread reads them;
        #: "loop", serialized first and sent from a loop thread that lives with this client
        #: (`LoopSender`: no thread started per call)
        self.publish_requests = "first"
        self._security = security
        self._sender: LoopSender | None = None
        self._sender_lock = threading.Lock()
        self.carrier: CallCarrier | None = None
        self._agent_keys: dict[tuple[str, str], str] = {}  # (session, agent id) -> its key

    def close(self) -> None:
        self._channel.close()
        if self._sender is not None:
            self._sender.close()

    def _loop_sender(self) -> LoopSender:
        with self._sender_lock:
            if self._sender is None:
                self._sender = LoopSender(self.address, self._security)
            return self._sender

    def keyed(self, request: R) -> R:
        """`request` (any message naming `session` and `agent_id`) carrying the key the
        agent's last registration through this client answered; as it was without one."""
        key = self._agent_keys.get((request.session, request.agent_id))
        if key:
            request.agent_key = key
        return request

    def _send_keyed(self, request: R, send: Callable[[R], T]) -> T:
        """`send(request)` keyed, and once more with the new key when it was refused for
        want of one a registration through this client answered while it was in flight
        (keyed before the answer came, checked after the coordinator bound the id)."""
        request = self.keyed(request)
        try:
            return send(request)
        except AgentIdHeld:
            sent = request.agent_key
            if self.keyed(request).agent_key == sent:
                raise
            log.info("agent %s registered while a call for it was in flight: sent again with its key", request.agent_id)
            return send(request)

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Blocks until the channel connects, or TransportUnavailable."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise TransportUnavailable(f"coordinator at {self.address} not reachable after {timeout_s}s") from None

    def open_session(
        self,
        session: str,
        *,
        trainer: bool,
        incarnation: str = "",
        trainer_ranks: int = 0,
        min_rollouts: int = 0,
        weight_sync_mode: str = "",
        next_version: int = 0,
        flip_policy: str = "",
        prepare_timeout_s: float = 0.0,
        prepared_loss: str = "",
        rollout_ids: Sequence[str] = (),
        max_rollouts: int = 0,
    ) -> pb.OpenSessionResponse:
        """`flip_policy` (INDEPENDENT, ATOMIC), `prepare_timeout_s` and `prepared_loss`
        (FLIP_WITHOUT, ABORT_FLIP): a trainer's flip settings ("" and 0 keep the session's).
        `rollout_ids`, `max_rollouts` (a trainer's): which rollout ids may join the session
        (empty and 0 keep the session's; a new session lets any id join)."""
        req = pb.OpenSessionRequest(
            session=session,
            role=tpb.TRAINER if trainer else tpb.ROLLOUT,
            incarnation=incarnation,
            trainer_ranks=trainer_ranks,
            min_rollouts=min_rollouts,
            weight_sync_mode=weight_sync_mode,
            next_version=next_version,
            flip_policy=tpb.FlipPolicy.Value(flip_policy.upper()) if flip_policy else 0,
            prepare_timeout_seconds=prepare_timeout_s,
            prepared_loss=tpb.PreparedLoss.Value(prepared_loss.upper()) if prepared_loss else 0,
            rollout_ids=rollout_ids,
            max_rollouts=max_rollouts,
        )
        # Retrying a trainer attach without an incarnation would bump twice: only retry
        # when the call is idempotent.
        retries = self.retries if (incarnation or not trainer) else 0
        return rpc.unary(self._stub.OpenSession, req, timeout_s=self.timeout_s, retries=retries)

    def register_agent(
        self,
        session: str,
        agent_id: str,
        *,
        trainer: bool,
        endpoint: Endpoint,
        rank: int = 0,
        generation: int = 0,
        instance: str = "",
    ) -> pb.RegisterAgentResponse:
        """`instance`: a rollout process's own token (AlreadyExists while another instance
        holds the id's live lease)."""
        req = pb.RegisterAgentRequest(
            session=session,
            agent_id=agent_id,
            role=tpb.TRAINER if trainer else tpb.ROLLOUT,
            endpoint=endpoint_to_proto(endpoint),
            rank=rank,
            generation=generation,
            instance=instance,
        )
        resp = rpc.unary(self._stub.RegisterAgent, self.keyed(req), timeout_s=self.timeout_s, retries=self.retries)
        if resp.agent_key:
            self._agent_keys[(session, agent_id)] = resp.agent_key
        return resp

    def heartbeat(
        self, session: str, agent_id: str, current_version: int = 0, *, timeout_s: float | None = None
    ) -> pb.HeartbeatResponse:
        req = pb.HeartbeatRequest(session=session, agent_id=agent_id, current_version=current_version)
        timeout_s = timeout_s or self.timeout_s
        return self._send_keyed(req, lambda r: rpc.unary(self._stub.Heartbeat, r, timeout_s=timeout_s))

    def heartbeats(
        self, requests: Iterator[pb.HeartbeatRequest]
    ) -> tuple[Iterator[pb.HeartbeatResponse], Callable[[], None]]:
        """Heartbeats on one call: (the answers, errors raised as weightsync errors; a
        cancel function, safe from any thread). The call ends when `requests` does; they
        are sent as they are (`keyed` adds an agent's key)."""
        call = self._stub.Heartbeats(requests)
        return rpc.answers(call), call.cancel

    def deregister_agent(self, session: str, agent_id: str, *, timeout_s: float = 2.0) -> bool:
        """Ends the agent's lease now (graceful exit); short deadline, no retries."""
        req = pb.DeregisterAgentRequest(session=session, agent_id=agent_id)
        return self._send_keyed(req, lambda r: rpc.unary(self._stub.DeregisterAgent, r, timeout_s=timeout_s)).removed

    def publish_part(
        self, session: str, *, generation: int, version: int, idempotency_key: str, part: Part
    ) -> pb.PublishResponse:
        """Streams one rank's part; safe to retry thanks to the idempotency key.

        The requests are built and serialized here, before the call: gRPC reads a request
        stream on a thread it starts for each call, and on a TPU host that thread, building
        a part's descriptors (thousands of messages), was found holding the interpreter
        lock through a training loop's stalled step (docs/performance.md). Here it only
        sends bytes; with `publish_requests` "loop" no thread is started at all (the
        client's `LoopSender` sends them). A part's descriptors are bounded by the
        coordinator's limits; serialized they are tens of bytes each."""
        header = pb.PublishHeader(
            session=session,
            generation=generation,
            version=version,
            rank=part.rank,
            idempotency_key=idempotency_key,
            total_bytes=part.total_bytes,
            chunk_bytes=part.chunk_bytes,
            tensor_count=len(part.tensors),
            shard_count=len(part.shards),
            chunk_count=len(part.chunks),
            endpoint=endpoint_to_proto(part.endpoint),
            stage_seconds=part.stage_seconds,
            delta=delta_to_proto(part.delta),
        )

        def requests() -> Iterator[pb.PublishRequest]:
            yield pb.PublishRequest(header=header)
            yield from publish_requests(part, part_to_batches(part))

        if self.publish_requests not in PUBLISH_REQUESTS:
            raise InvalidArgument(f"one of {', '.join(PUBLISH_REQUESTS)}", field="publish_requests")
        lazy = self.publish_requests == "lazy"
        serialized = None if lazy else [r.SerializeToString() for r in requests()]
        attempt = 0
        while True:
            try:
                if self.publish_requests == "loop":
                    return self._loop_sender().publish(serialized, timeout_s=self.timeout_s)
                if serialized is not None:
                    return rpc.unary(self._publish_bytes, iter(serialized), timeout_s=self.timeout_s)
                return rpc.unary(self._stub.PublishVersion, requests(), timeout_s=self.timeout_s)
            except TransportUnavailable:
                attempt += 1
                if attempt > self.retries:
                    raise
                time.sleep(min(2.0, 0.1 * 2**attempt))

    def get_manifest(self, session: str, version: int = 0, *, agent_id: str = "") -> tuple[pb.ManifestHeader, Manifest]:
        req = pb.GetManifestRequest(session=session, version=version, agent_id=agent_id)
        return self._send_keyed(req, self._get_manifest)

    def _get_manifest(self, req: pb.GetManifestRequest) -> tuple[pb.ManifestHeader, Manifest]:
        answers = self._carried("get_manifest", req) if req.agent_id else None
        if answers is not None:
            return manifest_from_pieces(a.manifest_piece for a in answers)
        return manifest_from_pieces(rpc.stream(self._stub.GetManifest, req, timeout_s=self.timeout_s))

    def _carried(self, call: str, request: Any) -> list[pb.HeartbeatResponse] | None:
        """The carrier's answers to `request`; None: make the RPC (no carrier, none carrying
        now, or the stream ended before answering: both calls may be sent again)."""
        carrier = self.carrier
        if carrier is None:
            return None
        try:
            return carrier.carry(call, request, self.timeout_s)
        except TransportUnavailable as e:
            log.info("%s: %s; calling the RPC instead", call, e.message)
            return None

    def watch(self, session: str, since_seq: int = 0, *, timeout_s: float | None = None) -> Iterator[pb.VersionEvent]:
        """Version events after since_seq; runs until cancelled, the deadline, or an error."""
        req = pb.WatchVersionsRequest(session=session, since_seq=since_seq)
        return rpc.stream(self._stub.WatchVersions, req, timeout_s=timeout_s)

    def open_watch(self, session: str, since_seq: int = 0) -> tuple[Iterator[pb.VersionEvent], Callable[[], None]]:
        """`watch` without a deadline, and a cancel function (safe from any thread) that ends
        it where it waits: a follower stopping need not wait for the next event."""
        call = self._stub.WatchVersions(pb.WatchVersionsRequest(session=session, since_seq=since_seq))
        return rpc.answers(call), call.cancel

    def report_applied(
        self, request: pb.ReportAppliedRequest, *, retries: int | None = None
    ) -> pb.ReportAppliedResponse:
        retries = self.retries if retries is None else retries

        def send(request: pb.ReportAppliedRequest) -> pb.ReportAppliedResponse:
            answers = self._carried("report_applied", request)
            if answers is not None:
                return answers[-1].report_applied
            return rpc.unary(self._stub.ReportApplied, request, timeout_s=self.timeout_s, retries=retries)

        return self._send_keyed(request, send)

    def status(
        self, session: str, version_limit: int = 0, *, timeout_s: float | None = None, retries: int | None = None
    ) -> pb.GetStatusResponse:
        """The session's status; `timeout_s` and `retries` in place of the client's (a probe's: short, none)."""
        req = pb.GetStatusRequest(session=session, version_limit=version_limit)
        return rpc.unary(
            self._stub.GetStatus,
            req,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            retries=self.retries if retries is None else retries,
        )

    def audit_session(self, session: str, *, fresh: bool = False, wait_s: float = 0.0) -> pb.AuditSessionResponse:
        """The session's live rollouts with their last audits; `fresh`: each audits now,
        waited for up to `wait_s` (0: the coordinator's default, 15 s)."""
        req = pb.AuditSessionRequest(session=session, fresh=fresh, wait_seconds=wait_s)
        timeout_s = self.timeout_s + ((wait_s or 15.0) if fresh else 0.0)
        return rpc.unary(self._stub.AuditSession, req, timeout_s=timeout_s, retries=0 if fresh else self.retries)

    def abort_version(self, session: str, *, generation: int, version: int, reason: str) -> tpb.VersionInfo:
        req = pb.AbortVersionRequest(session=session, generation=generation, version=version, reason=reason)
        return rpc.unary(self._stub.AbortVersion, req, timeout_s=self.timeout_s, retries=self.retries)

    def release_version(
        self, session: str, version: int, *, generation: int, force: bool = False, unpin: bool = False
    ) -> tpb.VersionInfo:
        """Releases a version (see the RPC: refused while leased unless `force`, and for the
        session's newest COMMITTED version unless `unpin` or `force`)."""
        req = pb.ReleaseVersionRequest(
            session=session, version=version, force=force, generation=generation, unpin=unpin
        )
        return rpc.unary(self._stub.ReleaseVersion, req, timeout_s=self.timeout_s, retries=self.retries)

    def delete_session(self, session: str, *, force: bool = False) -> pb.DeleteSessionResponse:
        """Deletes a session and all stored for it (admin); see the RPC. Not retried: a
        retry after a lost answer would be NOT_FOUND."""
        req = pb.DeleteSessionRequest(session=session, force=force)
        return rpc.unary(self._stub.DeleteSession, req, timeout_s=self.timeout_s)

    def wait_for_version(
        self, session: str, version: int, *, states: tuple[str, ...] = DECIDED_STATES, timeout_s: float = 60.0
    ) -> tpb.VersionInfo:
        """Watches until `version` reaches one of `states`; survives coordinator restarts."""
        deadline = time.monotonic() + timeout_s
        seq = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"version {version} did not reach {'/'.join(states)} within {timeout_s}s")
            try:
                for ev in self.watch(session, seq, timeout_s=remaining):
                    seq = ev.seq
                    if ev.version.version == version and tpb.VersionState.Name(ev.version.state) in states:
                        return ev.version
            except DeadlineExceeded:
                continue
            except TransportUnavailable:
                time.sleep(0.2)
