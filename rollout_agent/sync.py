"""One sync round: pull, verify, assemble, apply, handshake."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rollout_agent.appliers import Applier, layer_groups
from rollout_agent.assembly import assemble, digest_all, first_difference, grand_total, tensor_digest
from rollout_agent.outbox import ReportOutbox, send_report
from rollout_agent.puller import PullPlan, WeightPuller
from rollout_agent.streaming import stream_verified_groups
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import TRANSIENT_ERRORS, DataLoss, DigestMismatch, InvalidArgument, WeightsyncError
from weightsync.failpoints import Failpoints
from weightsync.manifest import Manifest
from weightsync.metrics import Metrics
from weightsync.wire import unix_seconds

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """Outcome of one sync round as the rollout saw it and the coordinator judged it."""

    version: int
    ok: bool
    mismatch: str = ""
    bytes_pulled: int = 0
    chunk_retries: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    # The round failed for a reason that may pass (a source or the coordinator could not
    # be reached), not because a byte was wrong: the version is worth another try.
    transient: bool = False
    # The coordinator could not be reached with the handshake: it waits in the outbox and
    # the verdict comes later (ok stays False here).
    handshake_pending: bool = False
    # Why a finished round did not apply (weightsync_sync_failures_total's reason): data_loss,
    # transient, local, mismatch or refused; empty when ok or the verdict is pending.
    failure: str = ""


APPLY_MODES = ("atomic", "streaming")


@dataclass
class _Progress:
    """What one round verified so far (goes into the handshake even when it fails)."""

    digests: dict[str, tuple[int, float]] = field(default_factory=dict)
    elements: int = 0
    consumed: list[str] = field(default_factory=list)


def sync_version(
    puller: WeightPuller,
    applier: Applier,
    version: int = 0,
    *,
    apply_mode: str = "atomic",
    failpoints: Failpoints | None = None,
    metrics: Metrics | None = None,
    outbox: ReportOutbox | None = None,
    engine_blocked: bool = False,
) -> SyncResult:
    """Syncs `version` (0 = newest servable) into `applier` and reports the handshake.

    apply_mode "atomic" (default): every chunk and every assembled tensor is verified
    before the applier's `begin_update`, so a bad version never touches the live weights.
    "streaming": one layer group at a time is pulled, verified and applied, so host
    memory stays near one group, but a bad chunk found late leaves earlier groups applied
    (not atomic; the handshake fails and the next good version repairs it).
    The handshake carries digests over the tensors handed to the applier. A handshake
    the coordinator could not be reached with goes to `outbox`, which sends it again
    until the coordinator answers (`handshake_pending`; without an outbox it is lost).

    The handshake's `pause_seconds` is how long the engine could not serve: the apply
    (atomic) or the whole streamed apply, or, with `engine_blocked` (the caller holds the
    engine for the whole call, as vLLM's `update_weights` does), the whole round;
    `ready_to_serving_seconds` runs from the version's READY to the new weights serving.

    Raises:
        WeightsyncError: the manifest could not be fetched (nothing was applied).
    """
    if apply_mode not in APPLY_MODES:
        raise InvalidArgument(f"{apply_mode!r} is not one of {', '.join(APPLY_MODES)}", field="apply_mode")
    started = time.perf_counter()
    header, manifest = puller.fetch_manifest(version)
    v = manifest.version
    report = pb.ReportAppliedRequest(
        session=puller.session, version=v, agent_id=puller.agent_id, manifest_digest=header.version.manifest_digest
    )
    timings: dict[str, float] = {}
    failure = ""  # the weightsync_sync_failures_total reason, when the round fails
    result = SyncResult(v, ok=False)
    progress = _Progress()
    try:
        if apply_mode == "streaming":
            t0 = time.perf_counter()
            _apply_streaming(puller, applier, puller.plan(header), manifest, progress, result, timings)
            timings["pause_seconds"] = time.perf_counter() - t0
        else:
            _apply_atomic(puller, applier, header, manifest, progress, result, timings, failpoints)
            timings["pause_seconds"] = timings["apply_seconds"]
        if engine_blocked:
            timings["pause_seconds"] = time.perf_counter() - started
        if header.version.HasField("ready_at"):
            timings["ready_to_serving_seconds"] = max(0.0, time.time() - unix_seconds(header.version.ready_at))
        report.consumed_names.extend(progress.consumed)
    except WeightsyncError as e:
        report.local_error = e.message
        result.transient = isinstance(e, TRANSIENT_ERRORS)
        failure = "data_loss" if isinstance(e, DataLoss) else "transient" if result.transient else "local"
        if isinstance(e, DataLoss) and not isinstance(e, DigestMismatch) and metrics is not None:
            # an assembled tensor differed (the puller counts the chunks that did)
            metrics.digest_failures.labels(role=metrics.role, session=puller.session).inc()
        if apply_mode == "atomic":  # streaming rounds count their retries as they go
            result.chunk_retries = puller.last_retries
        log.error("version %d not applied: %s", v, e.message, extra={"version": v})
    report.tensors.extend(tpb_digest(name, d) for name, d in progress.digests.items())
    report.aggregates.CopyFrom(
        tpb.Aggregates(
            grand_total=grand_total(progress.digests),
            tensor_count=len(progress.digests),
            element_count=progress.elements,
        )
    )
    timings["total_seconds"] = time.perf_counter() - started
    report.timings.CopyFrom(pb.Timings(**timings))
    report.bytes_pulled = result.bytes_pulled
    result.timings = timings
    if metrics is not None:
        for phase in ("verify", "apply"):
            if f"{phase}_seconds" in timings:
                metrics.observe_phase(phase, timings[f"{phase}_seconds"])
    if failpoints is not None and failpoints.fire("sync.pause_before_report"):
        log.warning("failpoint sync.pause_before_report: pausing 3 s before the handshake of version %d", v)
        time.sleep(3.0)
    if outbox is not None:
        outbox.discard_older_than(v)
    try:
        verdict = send_report(puller.client, report)
        result.ok, result.mismatch = verdict.ok, verdict.mismatch
        failure = failure or verdict.failure
    except TRANSIENT_ERRORS as e:
        result.mismatch = f"handshake not delivered yet ({e.message}); the outbox sends it again"
        if outbox is not None:
            outbox.put(report)
            result.handshake_pending = True
    result.failure = "" if result.ok or result.handshake_pending else failure or "local"
    if result.ok and metrics is not None:
        metrics.current_version.labels(role=metrics.role, session=puller.session).set(v)
    return result


def _apply_atomic(
    puller: WeightPuller,
    applier: Applier,
    header: pb.ManifestHeader,
    manifest: Manifest,
    progress: _Progress,
    result: SyncResult,
    timings: dict[str, float],
    failpoints: Failpoints | None,
) -> None:
    v = manifest.version
    pulled = puller.pull(header, manifest)
    result.bytes_pulled, result.chunk_retries = pulled.bytes_pulled, pulled.chunk_retries
    timings["pull_seconds"] = pulled.pull_seconds
    t0 = time.perf_counter()
    tensors = assemble(manifest, pulled.buffers, puller.assembly_buffers)
    if failpoints is not None and failpoints.fire("puller.corrupt_assembled"):
        first = next(iter(tensors.values()))
        first.reshape(-1).view("uint8")[0] ^= 0xFF
    progress.digests = digest_all(manifest, tensors)
    progress.elements = sum(int(t.size) for t in tensors.values())
    timings["verify_seconds"] = time.perf_counter() - t0
    problem = first_difference(manifest, progress.digests)
    if problem is not None:
        raise DataLoss(f"refusing to apply version {v}: {problem}")
    t1 = time.perf_counter()
    applier.begin_update(v, manifest.tensors)
    try:
        for group in layer_groups(manifest.tensors):
            applier.apply([(name, tensors[name]) for name in group])
    except Exception:
        applier.abort_update()
        raise
    progress.consumed = applier.commit_update(v)
    timings["apply_seconds"] = time.perf_counter() - t1


def _apply_streaming(
    puller: WeightPuller,
    applier: Applier,
    plan: PullPlan,
    manifest: Manifest,
    progress: _Progress,
    result: SyncResult,
    timings: dict[str, float],
) -> None:
    v = manifest.version
    timings.update(pull_seconds=0.0, verify_seconds=0.0, apply_seconds=0.0)
    applier.begin_update(v, manifest.tensors)  # name checks happen here, before any byte moves
    applied = 0
    try:
        for group in stream_verified_groups(puller, plan, manifest, result, timings):
            t0 = time.perf_counter()
            digests = {
                name: tensor_digest(arr, [s for _, s in manifest.shards_of_name(name)], manifest.chunk_bytes)
                for name, arr in group
            }
            problem = first_difference(manifest, digests)
            progress.digests.update(digests)
            progress.elements += sum(int(arr.size) for _, arr in group)
            timings["verify_seconds"] += time.perf_counter() - t0
            if problem is not None:
                raise DataLoss(problem)
            t1 = time.perf_counter()
            applier.apply(group)
            applied += 1
            timings["apply_seconds"] += time.perf_counter() - t1
    except WeightsyncError as e:
        applier.abort_update()
        raise e.with_message(
            f"version {v} stopped after {applied} applied group(s) (streaming, not atomic): {e.message}"
        ) from e
    except Exception:
        applier.abort_update()
        raise
    progress.consumed = applier.commit_update(v)


def tpb_digest(name: str, d: tuple[int, float]) -> pb.TensorDigest:
    return pb.TensorDigest(name=name, xxh3=d[0], sum=d[1])
