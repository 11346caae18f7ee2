"""The rollout agent as it lives inside a vLLM worker: shared by the weight-transfer
backend and the worker extension. Only plain data crosses vLLM's RPCs: the worker pulls
the bytes itself."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import asdict
from typing import Any

from google.protobuf.json_format import MessageToDict

from rollout_agent.audit.audited import Audited
from rollout_agent.audit.auditor import Auditor
from rollout_agent.engines.applier import Applier
from rollout_agent.engines.vllm.applier import VllmApplier
from rollout_agent.engines.vllm.loader_check import check_taken_whole
from rollout_agent.settings import InitInfo
from rollout_agent.sync.engine_version import EngineVersion
from rollout_agent.sync.flip import FlipBoard, undecided_atomic
from rollout_agent.sync.follow import StaleWatch, latest_version
from rollout_agent.sync.host_budget import memory_status
from rollout_agent.sync.prefetch import Prefetcher
from rollout_agent.sync.readiness import newest_committed
from rollout_agent.sync.round import (
    Prefetched,
    SyncResult,
    apply_prefetched,
    prefetch,
    report_prepared,
    sync_version,
)
from rollout_agent.vllm_worker.workers import EngineWorkers, Verdict
from rollout_agent.wiring import wire_rollout
from weightsync.errors import FailedPrecondition, InvalidArgument, WeightsyncError
from weightsync.validation import INT64_MAX, check_agent_id, check_int_arg

log = logging.getLogger("vllm.plugins.weightsync")
READY_TIMEOUT_S = 2.0  # a readiness probe's read of the session's committed version


def readiness_of(rollout: VllmRollout | None, missing: str) -> dict[str, Any]:
    """A worker's answer to vLLM's server's readiness route (`ready_route`): its rollout's
    `readiness`, or not ready saying why (`missing`: what was not called, where it has
    none). Never raises: vLLM 0.32 queues the replies after a failed one for the next call."""
    if rollout is None:
        return {"ready": False, "reason": f"no weightsync rollout yet: {missing}"}
    try:
        return rollout.readiness()
    except Exception as e:  # noqa: BLE001 - an answer, whatever happened (see above)
        return {"agent_id": rollout.agent_id, "ready": False, "reason": f"{type(e).__name__}: {e}"}


def parse_version(version: Any) -> int:
    """`latest` (or 0) -> 0, else a positive integer (a string of digits too); 1.5, True or
    2^64 are refused, not taken as 1, 1 and a failure once the pull began."""
    if version in ("latest", None):
        return 0
    if isinstance(version, str):
        if not version.isascii() or not version.isdigit():
            raise InvalidArgument(f"{version!r:.40} is neither 'latest' nor an integer", field="update_info.version")
        version = int(version)
    return check_int_arg(version, "update_info.version", 0, INT64_MAX)


def worker_index(parallel_config: Any) -> int:
    """This worker's index among every worker of a vLLM deployment (its data-parallel
    replica's offset plus its TP/PP rank), as vLLM indexes a list of update_infos."""
    world = getattr(parallel_config, "world_size", 1) or 1
    return getattr(parallel_config, "data_parallel_index", 0) * world + getattr(parallel_config, "rank", 0)


def worker_agent_id(agent_id: str, index: int) -> str:
    """The agent id worker `index` registers under an `init_info.agent_id` every worker of
    an engine is given: worker 0 the id itself, worker r `<id>-r<r>` (TP, PP and DP workers
    are rollouts of their own; under one id each registration would fence the last)."""
    return agent_id if index == 0 else f"{agent_id}-r{index}"


_IN_PROCESS: dict[str, VllmRollout] = {}  # agent id -> the rollout of a worker in this process


def in_process(agent_id: str) -> VllmRollout | None:
    """The rollout of the weightsync backend in this process's engine (a sidecar's in-process
    vLLM), if there is one for `agent_id`."""
    return _IN_PROCESS.get(agent_id)


class VllmRollout:
    """Coordinator registration, heartbeats, pull + verify + apply, handshake; its parts
    come from `rollout_agent.wiring`, as the sidecar's do."""

    def __init__(
        self,
        info: InitInfo,
        model: Any,
        model_config: Any,
        rank: int = 0,
        applier: Applier | None = None,
        workers: EngineWorkers | None = None,
    ) -> None:
        """`applier` writes the engine's weights: by default a `VllmApplier` over `model`'s
        torch parameters; a JAX engine's worker passes a `JaxApply` over its state. `rank`:
        this worker's index in the deployment (`worker_index`), which tells its agent id
        apart (`worker_agent_id`). `workers`: the engine's workers, which agree on each
        version before any applies it (a worker alone by default)."""
        self.info = info
        default = f"vllm-{socket.gethostname().lower()}-{os.getpid()}-r{rank}"
        agent_id = worker_agent_id(info.agent_id, rank) if info.agent_id else default
        check_agent_id(agent_id, "init_info.agent_id")
        self.wiring = wire_rollout(info, agent_id, on_verdict=self._on_verdict)
        self.agent_id = agent_id
        self.workers = workers if workers is not None else EngineWorkers()
        self.applier = applier if applier is not None else VllmApplier(model, model_config, self.workers.size)
        self.engine = EngineVersion()
        self.last: SyncResult | None = None
        self.echoed = 0  # the version the last sync refused only because another worker did
        # Every apply goes through `audited`: audits never overlap one (`audit.auditor`).
        self.audited = Audited(self.applier, self.wiring.failpoints)
        self.auditor = Auditor(self.audited, session=info.session, interval_s=info.audit_interval_s)
        self.audited.on_commit.append(self.engine.applied_whole)
        self.auditor.on_mismatch.append(self._unserve)
        self._heartbeat = self.wiring.heartbeat(lambda: self.current_version, self.auditor)
        self.auditor.start()
        # Pulls and checks each new version while the engine serves (a thread of this worker):
        # an update then only applies. Streaming applies hold no whole version to keep.
        self.prefetcher: Prefetcher | None = None
        self._stale_watch: StaleWatch | None = None  # (a prefetcher abandons stale pulls itself)
        # ATOMIC versions' flips: the prefetch reports each PREPARED, an update applies it once decided.
        self.flips = FlipBoard(self.wiring.client, info.session, poll_s=1.0)
        if info.prefetch and info.apply_mode == "atomic" and self.wiring.puller is not None:
            self.prefetcher = Prefetcher(
                self.wiring.puller, applier=self.audited, failpoints=self.wiring.failpoints, nice=info.prefetch_nice,
                stage=True,  # where the applier can build aside (a JAX engine that swaps): the sync only commits
                flips=self.flips, outbox=self.wiring.outbox,
            )  # fmt: skip
        elif self.wiring.puller is not None:
            self._stale_watch = StaleWatch(self.wiring.puller, self.flips.note)
        self.wiring.on_new_session.append(self._session_made_again)
        _IN_PROCESS[agent_id] = self

    @property
    def current_version(self) -> int:
        """The version this worker says it serves (`EngineVersion.current`)."""
        return self.engine.current

    def _session_made_again(self) -> None:
        """Its version numbers start over: the engine holds no version of it."""
        self.engine.forget()
        self.flips.forget()
        if self.prefetcher is not None:
            self.prefetcher.forget_versions()
        if self._stale_watch is not None:
            self._stale_watch.announced.forget()

    def _unserve(self, version: int) -> None:
        """An audit found the engine not serving `version` exactly: it serves none until a
        version is applied whole again. The worker cannot pause the engine it lives in to
        re-apply: its driver does (the sidecar by itself; else the next update_weights)."""
        self.engine.unserve(version)

    def audit(self) -> dict[str, Any]:
        """Audits the weights the engine serves now, on the engine's own thread (vLLM's
        `collective_rpc`, or a caller that holds the engine), so every layer is read,
        repacked ones through their kernels; the result as a plain dict."""
        return MessageToDict(self.auditor.audit(on_engine_thread=True), preserving_proto_field_name=True)

    def _on_verdict(self, version: int, ok: bool, mismatch: str) -> None:
        if ok:
            self.engine.confirm(version)  # not when another version was applied since
            log.info("weightsync version %d: handshake delivered late, ok", version)
        else:
            log.error("weightsync version %d: handshake delivered late, refused: %s", version, mismatch)

    def sync(self, version: Any = "latest") -> SyncResult:
        """Pulls, verifies, applies and reports; the live weights change only when every
        chunk and tensor verified, every name matched the model, the model's own loaders
        took every tensor (a dry run), and every other worker of the engine got as far
        (`workers`: all of them apply, or none).

        Raises:
            WeightsyncError: `version` is no version, or its manifest could not be had
            (nothing was applied, on any worker).
        """
        w = self.wiring
        assert w.puller is not None
        blocked_since = time.perf_counter()  # update_weights / collective_rpc hold the engine from here
        self.echoed = 0
        if self.info.apply_mode != "atomic":  # streamed layer by layer: neither atomic nor agreed
            result = sync_version(
                w.puller, self.audited, parse_version(version), apply_mode=self.info.apply_mode,
                failpoints=w.failpoints, outbox=w.outbox, engine_blocked=True,
            )  # fmt: skip
            return self._after(result)
        with contextlib.ExitStack() as held:
            p, before = None, None
            try:  # whatever fails here, this worker still meets the others (`_agree`)
                v = parse_version(version)
                if self.prefetcher is not None:
                    v = v or latest_version(w.client, self.info.session)
                    # a version prepared by the prefetch: its flip waited for before the buffer is taken,
                    # so one refused as undecided stays prepared for the next update
                    self._await_flip(v, known_only=True)
                    p = held.enter_context(self.prefetcher.hold(v))  # pulled and checked while the engine served
                if p is None:
                    p = prefetch(w.puller, v, w.failpoints, self.audited)
                self._flip_ready(p)
            except Exception as e:  # noqa: BLE001 - raised once every worker knows
                before = e
            self._agree(p, before)
            if before is not None:
                raise before
            assert p is not None
            result = apply_prefetched(
                p, w.puller, self.audited, outbox=w.outbox, failpoints=w.failpoints, blocked_since=blocked_since
            )
        return self._after(result)

    def _await_flip(self, version: int, *, known_only: bool = False) -> None:
        """Under ATOMIC an update applies a version only once its flip is decided: waits up
        to `flip_wait_s` for the decision. `known_only`: only where this worker knows the
        version as an undecided ATOMIC one (the prefetch reported it PREPARED).

        Raises:
            FailedPrecondition: not decided in time, or aborted (naming the flip's state).
        """
        if self.flips.decided(version) or (known_only and not self.flips.undecided(version)):
            return
        verdict = self.flips.wait(version, self.info.flip_wait_s)
        if not verdict.flip:
            raise FailedPrecondition(
                f"version {version} is in an ATOMIC session and applies only once its flip is decided: {verdict.why}",
                field="update_info.version",
            )

    def _flip_ready(self, p: Prefetched) -> None:
        """A version this update pulled itself (no prefetch of it): an undecided ATOMIC one is
        reported PREPARED here, and its decision waited for (`_await_flip`)."""
        if p.error is not None or not undecided_atomic(p.header.version) or self.flips.decided(p.version):
            return
        if not p.prepared:
            result = SyncResult(p.version, ok=False, bytes_pulled=p.bytes_pulled, chunk_retries=p.chunk_retries)
            refused = report_prepared(
                p, self.wiring.puller, result, self.flips, outbox=self.wiring.outbox, failpoints=self.wiring.failpoints
            )
            if refused is not None:
                raise FailedPrecondition(f"version {p.version} could not be prepared: {refused[1]}")
        self._await_flip(p.version)

    def _agree(self, p: Prefetched | None, before: BaseException | None) -> None:
        """Meets the engine's other workers with this one's verdict on `p`; where any of
        them cannot apply it (or the workers' shards do not take a tensor whole), `p`
        fails here too, before a weight changes."""
        refusal, taken = "", None
        if before is not None:
            refusal = f"{type(before).__name__}: {before}"
        elif p is not None and p.error is not None:
            refusal = p.error.message
        elif p is not None:
            try:
                taken = self.audited.taken(p.version, p.manifest.tensors)
            except WeightsyncError as e:
                p.error, refusal = e, e.message
        version = p.version if p is not None else 0
        names = list(p.manifest.tensors) if p is not None else []
        agreed = self.workers.agree(Verdict(version, refusal, taken), names)
        if p is None or p.error is not None:
            return
        if agreed.refusal:
            self.echoed = version
            p.error = FailedPrecondition(
                f"version {version} not applied by any of the engine's {agreed.workers} workers: {agreed.refusal}"
            )
        elif taken is not None:
            try:
                check_taken_whole(version, p.manifest.tensors, agreed.taken, agreed.workers)
            except InvalidArgument as e:
                p.error = e

    def _after(self, result: SyncResult) -> SyncResult:
        self.last = result
        self.engine.after_round(result)
        if result.ok:
            self.engine.confirm(result.version)
            log.info("weightsync applied version %d (%d bytes)", result.version, result.bytes_pulled)
        else:
            log.warning("weightsync version %d not applied: %s", result.version, result.mismatch)
        return result

    def prefetch(self, version: Any = "latest") -> dict[str, Any]:
        """Starts pulling `version` in the background (the prefetcher also follows the
        session by itself); returns at once."""
        if self.prefetcher is None:
            raise InvalidArgument("prefetch is off (init_info.prefetch, or a streaming apply_mode)", field="prefetch")
        self.prefetcher.request(parse_version(version) or latest_version(self.wiring.client, self.info.session))
        return self.status()

    def wait_ready(self, version: Any, timeout_s: float) -> bool:
        """Waits until `version` (or a newer one) was prefetched, verified and, where the
        applier builds aside, built (False after `timeout_s`, or where prefetch is off):
        a sync then only applies what is ready, and the engine pauses for no pull."""
        if self.prefetcher is None:
            return False
        v = parse_version(version) or latest_version(self.wiring.client, self.info.session)
        return self.prefetcher.wait_ready(v, timeout_s)

    def readiness(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Whether this worker serves the session's newest committed version, or a newer
        one, verified (the version the coordinator confirmed; an audit's mismatch serves
        none): the rule of the sidecar's readiness (`sync.readiness`), the committed
        version read from the coordinator now (one call, `timeout_s`, no retries). A
        coordinator that does not answer makes it not ready, saying so."""
        serving = self.current_version
        out: dict[str, Any] = {"agent_id": self.agent_id, "session": self.info.session, "serving": serving}
        try:
            st = self.wiring.client.status(self.info.session, timeout_s=timeout_s, retries=0)
        except WeightsyncError as e:
            return {**out, "committed": None, "ready": False, "reason": f"the coordinator did not answer: {e.message}"}
        committed = newest_committed(st)
        ready = serving >= committed
        reason = "" if ready else f"serves version {serving}; the session's newest committed version is {committed}"
        return {**out, "committed": committed, "ready": ready, "reason": reason}

    def provenance(self, version: int | None = None) -> dict[str, Any]:
        """The weights this worker's engine holds (None), or held as `version`: its session,
        agent id, the version and its manifest digest, as a plain dict for vLLM's RPCs."""
        p = self.engine.provenance(version)
        return {
            "session": self.info.session,
            "agent_id": self.agent_id,
            "version": p.version,
            "manifest_digest": p.manifest_digest,
        }

    def status(self) -> dict[str, Any]:
        audit = self.auditor.summary()
        return {
            "agent_id": self.agent_id,
            "session": self.info.session,
            "current_version": self.current_version,
            "last": asdict(self.last) if self.last else None,
            "prefetch": self.prefetcher.status() if self.prefetcher is not None else None,
            "audit": MessageToDict(audit, preserving_proto_field_name=True) if audit is not None else None,
            "unserved_version": self.auditor.unserved,
            "host_memory": memory_status(self.wiring.puller),
        }

    def close(self) -> None:
        w = self.wiring
        if _IN_PROCESS.get(self.agent_id) is self:
            del _IN_PROCESS[self.agent_id]
        self.auditor.stop()
        self.flips.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self._stale_watch is not None:
            self._stale_watch.close()
        self._heartbeat.stop()
        if w.outbox is not None:
            w.outbox.close()
        try:
            w.client.deregister_agent(self.info.session, self.agent_id)
        except WeightsyncError as e:
            log.info("weightsync: deregistering %s: %s", self.agent_id, e)
        w.close_data_plane()
        w.client.close()
