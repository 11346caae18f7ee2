"""Agent lease keeper: registers, heartbeats at the TTL's pace, re-registers when the lease was lost."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from weightsync._proto import coordinator_pb2 as pb
from weightsync.client import CoordinatorClient
from weightsync.errors import AgentNotFound, TransportUnavailable, WeightsyncError
from weightsync.lease import heartbeat_interval_s

log = logging.getLogger(__name__)


class Heartbeat:
    """A daemon thread renewing one agent's lease.

    Beats travel on one `Heartbeats` stream (a message per beat costs the coordinator a
    third of a unary call: 1,000 agents beat 400 times a second), reopened after any
    error; a coordinator without that method gets unary `Heartbeat` calls. A beat left
    unanswered for two intervals (a stalled coordinator or a dead connection) ends the
    stream and counts as a failed beat.

    The interval derives from the lease TTL the coordinator returns with every
    registration and beat (`weightsync.lease`), so agents follow `--lease-ttl-s`.

    Args:
        current_version: what the agent holds now (reported with every beat).
        register: registers the agent (again) and returns the lease TTL in seconds;
            called by `start()` and whenever the coordinator forgot the agent (expired
            lease, a coordinator outage longer than the TTL).
        on_generation: called with the session generation every answer carries (a
            trainer learns from it that a newer incarnation fenced it).
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
    ) -> None:
        self._client = client
        self._session = session
        self._agent_id = agent_id
        self._current_version = current_version
        self._register = register
        self._on_generation = on_generation
        self._interval_s = heartbeat_interval_s(10.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{agent_id}", daemon=True)
        self._failing = False
        self._streams = True  # False once the coordinator answered UNIMPLEMENTED
        self._cancel: Callable[[], None] | None = None

    @property
    def interval_s(self) -> float:
        return self._interval_s

    def start(self) -> Heartbeat:
        """Registers (raises what registration raises) and starts beating."""
        self._set_ttl(self._register())
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        cancel = self._cancel
        if cancel is not None:
            cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _set_ttl(self, ttl_s: float) -> None:
        if ttl_s > 0:
            self._interval_s = heartbeat_interval_s(ttl_s)

    def _request(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(
            session=self._session, agent_id=self._agent_id, current_version=self._current_version()
        )

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
                except AgentNotFound:
                    log.warning(
                        "agent %s: lease lost (expired or coordinator restarted); registering again", self._agent_id
                    )
                    self._set_ttl(self._register())
                    self._renewed()
            except WeightsyncError as e:
                if self._stop.is_set():
                    return
                if self._streams and getattr(e, "grpc_code", "") == "UNIMPLEMENTED":
                    log.info("agent %s: the coordinator has no Heartbeats stream; unary beats", self._agent_id)
                    self._streams = False
                    continue
                if not self._failing:  # once per outage, not every beat
                    log.warning(
                        "agent %s: heartbeat failed (%s); retrying every %.2fs", self._agent_id, e, self._interval_s
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

    def _beat_on_stream(self) -> None:
        """Beats on one stream until stopped (returns) or an error (raises)."""
        answered = threading.Event()
        unanswered = threading.Event()

        def beats() -> Iterator[pb.HeartbeatRequest]:  # run by gRPC's request thread
            while not self._stop.wait(self._interval_s):
                answered.clear()
                yield self._request()
                if not answered.wait(self._answer_within_s()) and not self._stop.is_set():
                    unanswered.set()
                    cancel()
                    return

        responses, cancel = self._client.heartbeats(beats())
        self._cancel = cancel
        try:
            for resp in responses:
                answered.set()
                self._answered(resp)
        except WeightsyncError:
            if unanswered.is_set():
                raise TransportUnavailable(
                    f"no answer to a heartbeat within {self._answer_within_s():.1f}s", field="heartbeat"
                ) from None
            raise
        finally:
            self._cancel = None
        if not self._stop.is_set():  # the coordinator ended the stream (shutting down)
            raise TransportUnavailable("the coordinator ended the heartbeat stream")

    def _answered(self, resp: pb.HeartbeatResponse) -> None:
        self._set_ttl(resp.lease_ttl_seconds)
        self._renewed()
        if resp.generation and self._on_generation is not None:
            self._on_generation(resp.generation)

    def _renewed(self) -> None:
        if self._failing:
            log.info("agent %s: lease renewed", self._agent_id)
            self._failing = False
