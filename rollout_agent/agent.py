"""RolloutAgent: registration, heartbeats, the watch loop and the RolloutAgent servicer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from rollout_agent.sync import SyncResult
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import rollout_agent_pb2 as pb
from weightsync._proto import rollout_agent_pb2_grpc as pb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import VersionNotFound, WeightsyncError
from weightsync.heartbeat import Heartbeat
from weightsync.manifest import Endpoint
from weightsync.metrics import Metrics

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutAgent"].full_name
SERVABLE_STATES = {tpb.READY, tpb.COMMITTED, tpb.PARTIAL}


class RolloutAgent:
    """Keeps one applier in sync with a session.

    Lock order: `_sync_lock` (one sync at a time) before any puller lock.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        session: str,
        agent_id: str,
        syncer: Callable[[int], SyncResult],
        *,
        metrics: Metrics,
        completion: Callable[[], str] | None = None,
    ) -> None:
        """`syncer(version)` runs one round (the NumPy applier's `sync_version`, or a vLLM
        engine's weight-transfer API); `completion()` shows what the engine now says."""
        self.client = client
        self.session = session
        self.agent_id = agent_id
        self.syncer = syncer
        self.completion_fn = completion
        self.last_completion = ""
        self.recent_completions: dict[int, str] = {}
        self.endpoint = Endpoint()  # set to the agent's own server before attach()
        self.metrics = metrics
        self.current_version = 0
        self.syncs_ok = 0
        self.syncs_failed = 0
        self.chunk_retries = 0
        self.last_error = ""
        self._sync_lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: Heartbeat | None = None
        self._watcher: threading.Thread | None = None

    def attach(self) -> None:
        """Opens the session (creating it if needed) and registers this rollout."""
        self.client.open_session(self.session, trainer=False)
        self.client.register_agent(self.session, self.agent_id, trainer=False, endpoint=self.endpoint)

    def start(self, follow: bool) -> None:
        self._heartbeat = Heartbeat(
            self.client, self.session, self.agent_id, current_version=lambda: self.current_version, reattach=self.attach
        ).start()
        if follow:
            self._watcher = threading.Thread(target=self._watch_loop, name="watch", daemon=True)
            self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    def sync(self, version: int = 0) -> SyncResult:
        """Syncs a version (0 = newest servable); one at a time."""
        with self._sync_lock:
            if version == 0:
                version = self._newest_servable()
            result = self.syncer(version)
            self.chunk_retries += result.chunk_retries
            if result.ok:
                self.syncs_ok += 1
                if self.completion_fn is not None:  # before current_version: readers poll on it
                    self.last_completion = self.completion_fn()
                    self.recent_completions[result.version] = self.last_completion
                    for old in sorted(self.recent_completions)[:-16]:
                        del self.recent_completions[old]
                self.current_version = result.version
                self.metrics.current_version.labels(role=self.metrics.role).set(result.version)
                log.info(
                    "applied version=%d bytes=%d pull_s=%.3f apply_s=%.3f retries=%d",
                    result.version, result.bytes_pulled, result.timings.get("pull_seconds", 0),
                    result.timings.get("apply_seconds", 0), result.chunk_retries,
                )
            else:
                self.syncs_failed += 1
                self.last_error = result.mismatch
                log.error("version %d handshake failed: %s", result.version, result.mismatch)
            return result

    def _newest_servable(self) -> int:
        for v in self.client.status(self.session, 20).versions:
            if v.state in SERVABLE_STATES:
                return v.version
        raise VersionNotFound(f"session {self.session!r} has no READY version yet")

    def _watch_loop(self) -> None:
        """Follows the session: catch up to the newest servable version, then each new one.

        Each version is synced automatically at most once: a version whose handshake
        failed stays failed for this rollout (the `Sync` RPC retries it on request).
        """
        seq = -1
        attempted: set[int] = set()
        while not self._stop.is_set():
            try:
                if seq < 0:  # (re)connect: no replay of history, just the newest version
                    st = self.client.status(self.session, 1)
                    seq = st.event_seq
                    if st.versions and st.versions[0].state in SERVABLE_STATES:
                        self._sync_newest(st.versions[0].version, attempted)
                for ev in self.client.watch(self.session, seq):
                    seq = ev.seq
                    if self._stop.is_set():
                        return
                    if ev.version.state in SERVABLE_STATES:
                        self._sync_newest(ev.version.version, attempted)
            except WeightsyncError as e:
                if not self._stop.is_set():
                    log.warning("watch interrupted (%s); reconnecting", e)
                    seq = -1
                    time.sleep(0.5)

    def _sync_newest(self, version: int, attempted: set[int]) -> None:
        if version <= self.current_version or version in attempted:
            return
        attempted.add(version)
        try:
            self.sync(version)
        except WeightsyncError as e:
            self.last_error = e.message
            log.warning("sync of version %d skipped: %s", version, e.message)


class RolloutAgentServicer(pb_grpc.RolloutAgentServicer):
    """Sync and GetStatus over gRPC."""

    def __init__(self, agent: RolloutAgent) -> None:
        self._agent = agent

    def Sync(self, request: pb.SyncRequest, context: grpc.ServicerContext) -> pb.SyncResponse:
        r = self._agent.sync(request.version)
        return pb.SyncResponse(
            version=r.version,
            ok=r.ok,
            mismatch=r.mismatch,
            bytes_pulled=r.bytes_pulled,
            timings=cpb.Timings(**r.timings),
            chunk_retries=r.chunk_retries,
        )

    def GetStatus(self, request: pb.RolloutStatusRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        a = self._agent
        return pb.RolloutStatus(
            session=a.session,
            agent_id=a.agent_id,
            current_version=a.current_version,
            syncs_ok=a.syncs_ok,
            syncs_failed=a.syncs_failed,
            chunk_retries=a.chunk_retries,
            last_error=a.last_error,
            completion=a.last_completion,
            recent_completions=dict(a.recent_completions),
        )
