"""RolloutAgent: registration, heartbeats, the watch loop and the RolloutAgent servicer."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import grpc

from rollout_agent.audit.auditor import Auditor
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sampling import SampledCompletion, SampleSpec, sample_spec
from rollout_agent.sync.engine_version import EngineVersion
from rollout_agent.sync.flip import FlipBoard
from rollout_agent.sync.follow import (
    FollowStop,
    NewestAnnounced,
    StaleWatch,
    follow_servable,
    latest_version,
    newest_servable,
)
from rollout_agent.sync.host_budget import memory_status
from rollout_agent.sync.outbox import ReportOutbox
from rollout_agent.sync.readiness import Readiness
from rollout_agent.sync.round import SyncResult
from rollout_agent.wiring import RolloutWiring
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import rollout_agent_pb2 as pb
from weightsync._proto import rollout_agent_pb2_grpc as pb_grpc
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import (
    TRANSIENT_ERRORS,
    AgentIdHeld,
    AgentNotFound,
    FailedPrecondition,
    VersionNotFound,
    WeightsyncError,
)
from weightsync.heartbeat import Heartbeat
from weightsync.logs import version_context
from weightsync.metrics import Metrics
from weightsync.validation import INT64_MAX, check_int_arg

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutAgent"].full_name


class RolloutAgent:
    """Keeps one applier in sync with a session, and heals by itself.

    Following (`start(follow=True)`): a watch thread learns of new servable versions and
    a sync thread pulls the newest one. A round that failed for a transient reason (a
    source or the coordinator unreachable) is retried with backoff while its version is
    still the newest; one whose bytes did not verify gets `AUTO_RETRIES` more tries. A
    handshake the coordinator did not receive waits in the outbox, which sends it again
    until the coordinator answers. The heartbeat registers again when the lease was lost.

    Lock order: `_sync_lock` (one sync at a time) before `_state_lock` and any puller lock.
    """

    AUTO_RETRIES = 2  # more automatic tries of a version whose bytes did not verify
    MAX_BACKOFF_S = 8.0

    def __init__(
        self,
        wiring: RolloutWiring,
        syncer: Callable[[int], SyncResult],
        *,
        metrics: Metrics,
        completion: Callable[[], str] | None = None,
        sampler: Callable[[SampleSpec], list[SampledCompletion]] | None = None,
        outbox: ReportOutbox | None = None,
        no_version_warn_s: float = 60.0,
        auditor: Auditor | None = None,
        owns_auditor: bool = True,
        flips: FlipBoard | None = None,
    ) -> None:
        """`wiring` (`rollout_agent.wiring`) gives the client, registers the agent and
        keeps its lease; `syncer(version)` runs one round (the NumPy applier's
        `sync_version`, or a vLLM engine's weight-transfer API); `completion()` shows what
        the engine now says; `sampler(spec)` samples completions from the engine (`Sample`;
        None: the engine does not generate); `outbox` re-sends handshakes `syncer` could not deliver (its
        verdicts must reach `on_verdict`); a following rollout with nothing to sync after
        `no_version_warn_s` logs why once (a mistyped session would otherwise wait in silence);
        `auditor` audits the engine's weights (`Audit`), and a mismatch it finds makes this
        rollout serve no version until it re-applied one (`heal`); `owns_auditor` False:
        another part runs it and reports its audits (a vLLM engine's worker); `flips`: the
        board `syncer` waits on for ATOMIC versions' flips, fed by this agent's watch."""
        self.wiring = wiring
        self.client = wiring.client
        self.session = wiring.settings.session
        self.agent_id = wiring.agent_id
        self.syncer = syncer
        self.completion_fn = completion
        self.sampler = sampler
        self.outbox = outbox
        self.last_completion = ""
        self.recent_completions: dict[int, str] = {}
        self.metrics = metrics
        self.engine = EngineVersion()
        # From the start, so a rollout that never syncs shows as version 0 (alerts see it behind).
        metrics.current_version.labels(role=metrics.role, session=self.session).set(0)
        self.syncs_ok = 0
        self.syncs_failed = 0
        self.chunk_retries = 0
        self.last_error = ""
        self._sync_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._stop = FollowStop()
        self._wanted = 0  # newest servable version the watch has seen
        self._announced = NewestAnnounced()  # and its generation: abandons a pull it made stale
        self._rebase = threading.Event()  # the session was made again: ask for its newest
        self._wake = threading.Event()
        self._heartbeat: Heartbeat | None = None
        self._threads: list[threading.Thread] = []
        self._stale_watch: StaleWatch | None = None
        self.follows = False
        self.no_version_warn_s = no_version_warn_s
        self._no_version_since: float | None = time.monotonic()  # None once warned, or a version came
        self.auditor = auditor
        self._owns_auditor = owns_auditor
        self.flips = flips
        # Ready once it serves the session's newest committed version (health: `SERVICE_NAME`).
        self.readiness = Readiness(lambda: self.current_version)
        if auditor is not None:
            auditor.on_mismatch.append(self.heal)
            auditor.audited.on_commit.append(self.engine.applied_whole)

    def start(self, follow: bool) -> None:
        """Registers, starts heartbeats and, when following, the watch and sync threads.
        Without following, its callers choose the versions, and a `StaleWatch` still ends
        a pull that a newer trainer generation's version made stale (a `Sync` of a version
        from a frozen trainer would hold the rollout for `timeout_s` per read, three reads,
        and every `Sync` after it would wait behind it)."""
        self.follows = follow
        self.wiring.on_new_session.append(self._session_made_again)
        if self.wiring.puller is not None:
            if follow:
                self.wiring.puller.stale_rules.append(self._announced.stale)
            else:
                self._stale_watch = StaleWatch(self.wiring.puller, self._note_record, self.readiness.learn)
        owned = self.auditor if self._owns_auditor else None
        self._heartbeat = self.wiring.heartbeat(lambda: self.current_version, owned)
        if owned is not None:
            owned.start()
        if follow:
            self._threads = [
                threading.Thread(target=self._watch_loop, name="watch", daemon=True),
                threading.Thread(target=self._follow_loop, name="follow", daemon=True),
            ]
            for t in self._threads:
                t.start()

    @property
    def current_version(self) -> int:
        """The version this rollout says it serves (`EngineVersion.current`)."""
        return self.engine.current

    def stop(self) -> None:
        """Stops following and heartbeats, then ends the lease at the coordinator (so the
        rollout stops counting as required at once, not when its lease runs out)."""
        self._stop.set()
        self._wake.set()
        if self.flips is not None:
            self.flips.close()  # a round waiting for a flip gives its version up
        if self.auditor is not None and self._owns_auditor:
            self.auditor.stop()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        for t in self._threads:  # daemons: a pull in flight does not hold up the exit (the watch ends at once)
            t.join(timeout=1)
        if self._stale_watch is not None:
            self._stale_watch.close()
        if self.outbox is not None:
            self.outbox.close()
        try:
            self.client.deregister_agent(self.session, self.agent_id)
        except WeightsyncError as e:
            log.info("deregistering %s: %s (its lease ends by itself)", self.agent_id, e)

    def sync(self, version: int = 0) -> SyncResult:
        """Syncs a version (0 = the newest READY or COMMITTED one); one at a time. A following rollout does not
        go back: a version older than the applied one is FailedPrecondition (the follow loop
        would apply the newest again at once). Without following, it is applied and becomes
        the current version."""
        version = check_int_arg(version, "version", 0, INT64_MAX)
        with self._sync_lock:
            if version == 0:
                version = latest_version(self.client, self.session)
            applied = self.engine.newest
            if self.follows and version < applied:
                # Applying it would leave the engine on an older version while current_version,
                # the heartbeats and the coordinator say the newer one, for good.
                raise FailedPrecondition(
                    f"{version} is older than the applied version {applied}: a following rollout does not go "
                    "back (start it with --follow false to choose its versions)",
                    field="version",
                )
            try:
                with version_context(version):
                    result = self.syncer(version)
            except WeightsyncError as e:  # the manifest could not be had: nothing was pulled
                self._count_failure("transient" if isinstance(e, TRANSIENT_ERRORS) else "refused")
                raise
            with self._state_lock:
                self.chunk_retries += result.chunk_retries
            self.metrics.chunk_retries.labels(role=self.metrics.role, session=self.session).inc(result.chunk_retries)
            if result.failure:
                self._count_failure(result.failure)
            self.engine.after_round(result)
            if result.ok:
                self.on_verdict(result.version, True, "")
                log.info(
                    "applied version=%d bytes=%d pull_s=%.3f apply_s=%.3f retries=%d",
                    result.version,
                    result.bytes_pulled,
                    result.timings.get("pull_seconds", 0),
                    result.timings.get("apply_seconds", 0),
                    result.chunk_retries,
                )
            elif result.handshake_pending:
                log.warning("version %d applied; its handshake waits for the coordinator", result.version)
            elif result.failure != "abandoned":  # (abandoned: no handshake was sent, nothing failed)
                self.on_verdict(result.version, False, result.mismatch)
            return result

    def audit(self) -> tpb.AuditResult:
        """Audits the weights the engine serves now (`Auditor.audit`)."""
        if self.auditor is None:
            raise FailedPrecondition("this rollout's engine has no audit")
        return self.auditor.audit()

    def heal(self, version: int) -> None:
        """An audit found the engine not serving `version` exactly: it says it serves none
        until a version is applied whole again, and re-applies: a following rollout syncs
        the newest version it wants (this one, or newer), another this one, on a thread."""
        if self.engine.unserve(version):
            self.metrics.current_version.labels(role=self.metrics.role, session=self.session).set(0)
            self.readiness.update()
        if self.follows:
            with self._state_lock:
                self._wanted = max(self._wanted, version)
            self._wake.set()
            return

        def resync() -> None:
            try:
                result = self.sync(version)
                if not result.ok:
                    log.error("re-applying version %d after the audit's mismatch failed: %s", version, result.mismatch)
            except WeightsyncError as e:
                log.error("re-applying version %d after the audit's mismatch failed: %s", version, e.message)

        threading.Thread(target=resync, name="heal", daemon=True).start()

    def sample(self, spec: SampleSpec) -> list[SampledCompletion]:
        """Completions from the engine, each tagged with the version that sampled it."""
        if self.sampler is None:
            raise FailedPrecondition(
                "this rollout's engine holds weights but does not generate (the JAX applier): "
                "start it with --engine vllm to sample, or --engine numpy for a readout of its arrays"
            )
        return self.sampler(spec)

    def _count_failure(self, reason: str) -> None:
        self.metrics.sync_failures.labels(role=self.metrics.role, session=self.session, reason=reason).inc()

    def on_verdict(self, version: int, ok: bool, mismatch: str) -> None:
        """The coordinator's answer to a handshake (now, or later through the outbox). An OK
        makes `version` current only while the engine holds it: a verdict that arrives after
        another version was applied changes nothing."""
        if ok:
            with self._state_lock:
                self.syncs_ok += 1
            if not self.engine.confirmable(version):
                return
            if self.completion_fn is not None:  # before current_version: readers poll on it
                completion = self.completion_fn()
                with self._state_lock:
                    self.last_completion = completion
                    self.recent_completions[version] = completion
                    for old in sorted(self.recent_completions)[:-16]:
                        del self.recent_completions[old]
            if self.engine.confirm(version):
                self.metrics.current_version.labels(role=self.metrics.role, session=self.session).set(version)
                self.readiness.update()
        else:
            with self._state_lock:
                self.syncs_failed += 1
                self.last_error = mismatch
            log.error("version %d handshake failed: %s", version, mismatch)

    def _session_made_again(self) -> None:
        """Its version numbers start over: what the engine holds is no version of it (0,
        and the coordinator sees this rollout behind), and the follow loop asks for the
        newest servable one (the watch may have announced it before this registration)."""
        self.engine.forget()
        if self.flips is not None:
            self.flips.forget()
        with self._state_lock:
            self._wanted = 0
        self._announced.forget()
        if self._stale_watch is not None:
            self._stale_watch.announced.forget()
        self.metrics.current_version.labels(role=self.metrics.role, session=self.session).set(0)
        self.readiness.forget()
        self._rebase.set()
        self._wake.set()

    def _want(self, version: int, generation: int = 0) -> None:
        self._announced.note(version, generation)
        if version > self._wanted:
            self._wanted = version
            self._wake.set()
        if self.wiring.puller is not None:  # (also when only the version's generation became known)
            self.wiring.puller.recheck()

    def _watch_loop(self) -> None:
        """Learns of servable versions: the newest on (re)connect, then each new one."""
        follow_servable(self.client, self.session, self._want, self._stop, self._note_record, self.readiness.learn)

    def _note_record(self, info: tpb.VersionInfo) -> None:
        """A version's record from the watch: its flip (`flips`), the committed version (`readiness`)."""
        if self.flips is not None:
            self.flips.note(info)
        self.readiness.note(info)

    def _follow_loop(self) -> None:
        """Syncs the newest wanted version until it is applied or given up on."""
        tries: dict[int, int] = {}  # version -> failed tries whose bytes did not verify
        backoff, last_target = 0.5, 0
        while not self._stop.is_set():
            if self._rebase.is_set():
                tries.clear()
                try:
                    self._want(newest_servable(self.client, self.session))
                    self._rebase.clear()
                except VersionNotFound:  # none yet: the watch announces the first
                    self._rebase.clear()
                except WeightsyncError as e:
                    log.warning("asking for the newest version: %s; retrying", e.message)
                    self._stop.wait(1.0)
                    continue
            target = self._wanted
            if target != last_target:
                backoff, last_target = 0.5, target
                tries = {v: n for v, n in tries.items() if v >= target}  # else one entry per failed version piles up
            done = (
                target <= self.current_version
                or target == self._handshake_waiting()
                or tries.get(target, 0) > self.AUTO_RETRIES
            )
            if done:
                self._warn_if_no_version()
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            transient = False
            try:
                result = self.sync(target)
                transient = result.transient
                if not result.ok and not result.handshake_pending and not transient:
                    tries[target] = tries.get(target, 0) + 1
            except TRANSIENT_ERRORS as e:
                transient = True
                self.last_error = e.message
                log.warning("sync of version %d failed (%s); retrying", target, e.message)
            except AgentNotFound:  # the lease lapsed (paused, partitioned): take one and go on
                transient = True
                log.warning("sync of version %d found no lease; registering again", target)
                try:
                    self.wiring.register()
                except WeightsyncError as e:
                    self.last_error = e.message
            except AgentIdHeld as e:  # another process holds the id, or a registration was in flight
                transient = True  # the heartbeat takes the id back once that process's lease lapses
                self.last_error = e.message
                log.warning("sync of version %d waits for this rollout's agent id: %s", target, e.message)
            except WeightsyncError as e:  # released, gone, or refused: nothing to retry
                self.last_error = e.message
                log.warning("sync of version %d skipped: %s", target, e.message)
                tries[target] = self.AUTO_RETRIES + 1
            except Exception as e:  # noqa: BLE001 - this thread keeps the engine current: it must outlive a bug
                self.last_error = f"{type(e).__name__}: {e}"
                log.exception("sync of version %d failed unexpectedly; trying again", target)
                tries[target] = tries.get(target, 0) + 1
            if transient or tries.get(target, 0):
                # the wait ends early when a newer version arrives
                self._wake.wait(backoff * (0.5 + random.random()))
                self._wake.clear()
                backoff = min(self.MAX_BACKOFF_S, backoff * 2)
            else:
                backoff = 0.5

    def _warn_if_no_version(self) -> None:
        """Once: nothing to sync `no_version_warn_s` after the start, and why."""
        since = self._no_version_since
        if since is None:
            return
        if self._wanted or self.current_version:
            self._no_version_since = None
            return
        waited = time.monotonic() - since
        if waited < self.no_version_warn_s:
            return
        try:
            st = self.client.status(self.session, 1)
        except WeightsyncError:
            return  # the coordinator's outage is logged by the watch: asked again in a second
        self._no_version_since = None
        if st.generation == 0:
            why = "no trainer has opened it: is --session the name the trainer publishes under?"
        elif not st.versions:
            why = f"its trainer (generation {st.generation}) has published no version yet"
        else:
            newest = st.versions[0]
            why = f"its newest version, {newest.version}, is {tpb.VersionState.Name(newest.state)}"
        message = f"no version of session {self.session!r} to sync {waited:.0f} s after the start: {why}"
        log.warning(message)
        with self._state_lock:
            self.last_error = message

    def _handshake_waiting(self) -> int:
        return self.outbox.pending_version if self.outbox is not None else 0


class RolloutAgentServicer(pb_grpc.RolloutAgentServicer):
    """Sync, Sample, Audit and GetStatus over gRPC."""

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

    def Sample(self, request: pb.SampleRequest, context: grpc.ServicerContext) -> pb.SampleResponse:
        spec = sample_spec(request.prompt_token_ids, request.n, request.max_tokens, request.seed)
        return pb.SampleResponse(completions=[_sampled(c) for c in self._agent.sample(spec)])

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
            host_memory=_host_memory(a.wiring.puller),
            audit=a.auditor.summary() if a.auditor is not None else None,
            unserved_version=a.auditor.unserved if a.auditor is not None else 0,
            ready=a.readiness.ready,
            committed_version=a.readiness.committed,
        )

    def Audit(self, request: pb.AuditRequest, context: grpc.ServicerContext) -> tpb.AuditResult:
        return self._agent.audit()


def _sampled(c: SampledCompletion) -> pb.SampledCompletion:
    return pb.SampledCompletion(
        token_ids=c.token_ids,
        logprobs=c.logprobs,
        version=c.version,
        manifest_digest=c.spans[0].manifest_digest if c.spans else "",
        spans=[
            pb.VersionSpan(version=s.version, manifest_digest=s.manifest_digest, start=s.start, end=s.end)
            for s in c.spans
        ],
        fingerprint=c.fingerprint,
    )


def _host_memory(puller: WeightPuller | None) -> pb.HostMemory:
    m = memory_status(puller)
    return pb.HostMemory(
        rss=m["rss"], anon=m["anon"], file=m["file"], shmem=m["shmem"], peak=m["peak"],
        limit=m.get("limit", 0), receive_bytes=m.get("held", {}).get("receive", 0),
    )  # fmt: skip
