"""Agent lease keeper: registers, heartbeats at the TTL's pace, re-registers when the lease was lost."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from weightsync._proto import coordinator_pb2 as pb
from weightsync.client import CoordinatorClient
from weightsync.errors import (
    TRANSIENT_ERRORS,
    AgentIdHeld,
    AgentNotFound,
    DeadlineExceeded,
    SessionNotFound,
    TransportUnavailable,
    WeightsyncError,
)
from weightsync.lease import heartbeat_interval_s
from weightsync.rpc import error_from_status

log = logging.getLogger(__name__)


class Heartbeat:
    """A daemon thread renewing one agent's lease.

    Beats travel on one `Heartbeats` stream (a message per beat costs the coordinator a
    third of a unary call: 1,000 agents beat 400 times a second), reopened after any
    error; a coordinator without that method gets unary `Heartbeat` calls. A beat left
    unanswered for two intervals (a stalled coordinator or a dead connection; answers to
    carried calls count as signs of life) ends the stream and counts as a failed beat.

    `carry()` sends a rollout's per-version calls on the same stream once the coordinator
    said it answers them (`weightsync.carried_calls`); a `CoordinatorClient` whose
    `carrier` is this object routes its leased GetManifest and ReportApplied through it.

    The interval derives from the lease TTL the coordinator returns with every
    registration and beat (`weightsync.lease`), so agents follow `--lease-ttl-s`.

    Args:
        current_version: what the agent holds now (reported with every beat).
        register: registers the agent (again) and returns the lease TTL in seconds;
            called by `start()` and whenever the coordinator forgot the agent (expired
            lease, a coordinator outage longer than the TTL).
        on_generation: called with the session generation every answer carries (a
            trainer learns from it that a newer incarnation fenced it).
        audit: a rollout's last audit of the weights it serves (`AuditResult`, None
            before the first), sent with every beat on the stream.
        on_audit_request: called with the coordinator's newest audit request, which
            every beat answer carries (0: none).
    """

    def __init__(
        self,
        client: CoordinatorClient,
        session: str,
        agent_id: str,
        *,
        current_version: Callable[[], int],
        register: Callable[[], float],
        on_generation: Callable[[int], None] | None = None,
        audit: Callable[[], Any] | None = None,
        on_audit_request: Callable[[int], None] | None = None,
    ) -> None:
        self._client = client
        self._session = session
        self._agent_id = agent_id
        self._current_version = current_version
        self._register = register
        self._on_generation = on_generation
        self._audit = audit
        self._on_audit_request = on_audit_request
        self._interval_s = heartbeat_interval_s(10.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{agent_id}", daemon=True)
        self._failing = False
        self._streams = True  # False once the coordinator answered UNIMPLEMENTED
        self._cancel: Callable[[], None] | None = None
        self._open: _OpenStream | None = None  # the stream beating now

    @property
    def interval_s(self) -> float:
        return self._interval_s

    def start(self) -> Heartbeat:
        """Registers and starts beating. Raises what registration raises, except a
        coordinator not reachable yet (pods start in any order): the beats then find the
        agent unknown and register it once the coordinator answers. (An agent that raised
        it ended its process when the coordinator came up ~9 s after it.)"""
        try:
            self._set_ttl(self._register())
        except TRANSIENT_ERRORS as e:
            log.warning("agent %s: coordinator not reachable (%s); registering once it answers", self._agent_id, e)
            self._failing = True
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        cancel, open_stream = self._cancel, self._open
        if open_stream is not None:
            open_stream.outgoing.put(None)  # wakes the request iterator
        if cancel is not None:
            cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _set_ttl(self, ttl_s: float) -> None:
        if ttl_s > 0:
            self._interval_s = heartbeat_interval_s(ttl_s)

    def _request(self) -> pb.HeartbeatRequest:
        req = self._client.keyed(
            pb.HeartbeatRequest(session=self._session, agent_id=self._agent_id, current_version=self._current_version())
        )
        audit = self._audit() if self._audit is not None else None
        if audit is not None:
            req.audit.CopyFrom(audit)
        return req

    def beat_soon(self) -> None:
        """Sends a beat now on the open stream, if there is one (a new audit result
        reaches the coordinator without waiting for the next interval)."""
        open_stream = self._open
        if open_stream is not None:
            open_stream.outgoing.put(self._request())

    def _answer_within_s(self) -> float:
        return max(1.0, 2 * self._interval_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                try:
                    if self._streams:
                        self._beat_on_stream()
                    else:
                        self._beat_once()
                except (AgentNotFound, SessionNotFound):  # the latter: a coordinator that lost its database
                    log.warning(
                        "agent %s: lease lost (expired or coordinator restarted); registering again", self._agent_id
                    )
                    self._set_ttl(self._register())
                    self._renewed()
                except AgentIdHeld as e:
                    # Another process registered the id after this one's lease lapsed (paused,
                    # partitioned): registering is refused while it lives, and takes the id
                    # back once its lease lapses too.
                    if not self._failing:
                        log.warning("agent %s: %s; registering again", self._agent_id, e.message)
                    self._set_ttl(self._register())
                    self._renewed()
            except Exception as e:  # noqa: BLE001 - the lease lives on this thread: it outlives a bug as an outage
                if self._stop.is_set():
                    return
                if self._streams and getattr(e, "grpc_code", "") == "UNIMPLEMENTED":
                    log.info("agent %s: the coordinator has no Heartbeats stream; unary beats", self._agent_id)
                    self._streams = False
                    continue
                if not self._failing:  # once per outage, not every beat
                    log.warning(
                        "agent %s: heartbeat failed (%s); retrying every %.2fs",
                        self._agent_id,
                        e,
                        self._interval_s,
                        exc_info=None if isinstance(e, WeightsyncError) else e,
                    )
                self._failing = True
                self._stop.wait(self._interval_s)

    def _beat_once(self) -> None:
        if self._stop.wait(self._interval_s):
            return
        resp = self._client.heartbeat(
            self._session, self._agent_id, self._current_version(), timeout_s=self._answer_within_s()
        )
        self._answered(resp)

    def carry(self, call: str, request: Any, timeout_s: float) -> list[pb.HeartbeatResponse] | None:
        """The answers to `request` sent as the HeartbeatRequest field `call` on the open
        stream; None when no open stream carries calls (make the RPC instead). Raises the
        error the RPC would have (mapped from the answer's status), DeadlineExceeded after
        `timeout_s`, TransportUnavailable when the stream ended first."""
        open_stream = self._open
        if open_stream is not None:  # a fresh stream's first beat says whether it carries
            open_stream.carries_known.wait(min(timeout_s, self._answer_within_s()))
        if open_stream is None or not open_stream.carries:
            return None
        pending = open_stream.submit(call, request)
        if not pending.done.wait(timeout_s):
            open_stream.forget(pending)
            raise DeadlineExceeded(f"{call}: no answer on the heartbeat stream within {timeout_s:.1f}s")
        if pending.error is not None:
            raise pending.error
        return pending.answers

    def _beat_on_stream(self) -> None:
        """Beats on one stream until stopped (returns) or an error (raises)."""
        open_stream = _OpenStream(self._answer_within_s())
        unanswered = threading.Event()

        def requests() -> Iterator[pb.HeartbeatRequest]:  # run by gRPC's request thread
            next_beat = time.monotonic()  # the first answer says whether calls may be carried
            while not self._stop.is_set():
                now = time.monotonic()
                if open_stream.overdue(now):
                    unanswered.set()
                    cancel()
                    return
                if now >= next_beat:
                    open_stream.beat_sent(now)
                    next_beat = now + self._interval_s
                    yield self._request()
                    continue
                try:
                    item = open_stream.outgoing.get(timeout=open_stream.wake_in(now, next_beat))
                except queue.Empty:
                    continue
                if item is not None:
                    yield item

        responses, cancel = self._client.heartbeats(requests())
        self._cancel = cancel
        self._open = open_stream
        try:
            for resp in responses:
                if open_stream.answered(resp):
                    self._answered(resp)
        except WeightsyncError:
            if unanswered.is_set():
                raise TransportUnavailable(
                    f"no answer to a heartbeat within {self._answer_within_s():.1f}s", field="heartbeat"
                ) from None
            raise
        finally:
            self._cancel = None
            self._open = None
            open_stream.close()
        if not self._stop.is_set():  # the coordinator ended the stream (shutting down)
            raise TransportUnavailable("the coordinator ended the heartbeat stream")

    def _answered(self, resp: pb.HeartbeatResponse) -> None:
        self._set_ttl(resp.lease_ttl_seconds)
        self._renewed()
        if resp.generation and self._on_generation is not None:
            self._on_generation(resp.generation)
        if resp.audit_request and self._on_audit_request is not None:
            self._on_audit_request(resp.audit_request)

    def _renewed(self) -> None:
        if self._failing:
            log.info("agent %s: lease renewed", self._agent_id)
            self._failing = False


class _Pending:
    """A carried call waiting for its answers."""

    def __init__(self, call_id: int) -> None:
        self.call_id = call_id
        self.answers: list[pb.HeartbeatResponse] = []
        self.error: WeightsyncError | None = None
        self.done = threading.Event()


class _OpenStream:
    """One Heartbeats stream's bookkeeping, shared by the thread reading its answers, gRPC's
    thread iterating its requests and the threads carrying calls on it."""

    def __init__(self, answer_within_s: float) -> None:
        self.outgoing: queue.SimpleQueue[pb.HeartbeatRequest | None] = queue.SimpleQueue()
        self.carries = False
        self.carries_known = threading.Event()  # a beat was answered
        self._answer_within_s = answer_within_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        self._beat_since: float | None = None  # a beat is unanswered since then
        self._heard_at = 0.0  # the last answer of any kind

    def submit(self, call: str, request: Any) -> _Pending:
        with self._lock:
            if self._closed:
                raise TransportUnavailable("the heartbeat stream ended", field="heartbeat")
            pending = _Pending(next(self._ids))
            self._pending[pending.call_id] = pending
        self.outgoing.put(pb.HeartbeatRequest(call_id=pending.call_id, **{call: request}))
        return pending

    def forget(self, pending: _Pending) -> None:
        with self._lock:
            self._pending.pop(pending.call_id, None)

    def beat_sent(self, now: float) -> None:
        with self._lock:
            if self._beat_since is None:
                self._beat_since = now

    def overdue(self, now: float) -> bool:
        """A beat went unanswered for answer_within_s, and nothing else was heard since."""
        with self._lock:
            since = self._beat_since
            return since is not None and now - max(since, self._heard_at) > self._answer_within_s

    def wake_in(self, now: float, next_beat: float) -> float:
        """Seconds the request iterator may sleep: until the next beat or the overdue check."""
        with self._lock:
            check = self._beat_since
        until = next_beat if check is None else min(next_beat, check + self._answer_within_s)
        return max(0.01, until - now)

    def answered(self, resp: pb.HeartbeatResponse) -> bool:
        """Files one answer; True when it answers a beat."""
        with self._lock:
            self._heard_at = time.monotonic()
            if not resp.call_id:
                self._beat_since = None
                self.carries = resp.carries_calls
                self.carries_known.set()
                return True
            pending = self._pending.get(resp.call_id)
            if pending is None:  # forgotten: its caller gave up waiting
                return False
            pending.answers.append(resp)
            if not resp.last:
                return False
            del self._pending[resp.call_id]
        if resp.HasField("error"):
            pending.error = error_from_status(resp.error)
        pending.done.set()
        return False

    def close(self) -> None:
        """Fails every unanswered call: its caller makes the RPC instead."""
        with self._lock:
            self._closed = True
            self.carries = False
            pending, self._pending = list(self._pending.values()), {}
        self.carries_known.set()  # nobody waits for a stream that ended
        for p in pending:
            p.error = TransportUnavailable("the heartbeat stream ended before the call was answered", field="heartbeat")
            p.done.set()
