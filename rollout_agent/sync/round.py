"""One sync round: pull, verify, assemble, apply, handshake."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rollout_agent.engines.applier import Applier, layer_groups
from rollout_agent.pull.assembly import (
    TensorCheck,
    assemble,
    describe_difference,
    digest_all,
    first_difference,
    grand_total,
    mismatched,
    tensor_digest,
)
from rollout_agent.pull.lanes import PullPlan
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.flip import FlipBoard, undecided_atomic
from rollout_agent.sync.host_budget import check_host_memory
from rollout_agent.sync.outbox import UNDELIVERED, ReportOutbox, send_report
from rollout_agent.sync.streaming import stream_verified_groups
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import (
    TRANSIENT_ERRORS,
    DataLoss,
    DigestMismatch,
    InternalError,
    InvalidArgument,
    PullAbandoned,
    WeightsyncError,
)
from weightsync.failpoints import Failpoints
from weightsync.manifest import Manifest
from weightsync.metrics import Metrics
from weightsync.wire import ManifestUnchecked

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
    # transient, local, mismatch, refused or abandoned; empty when ok or the verdict is pending.
    failure: str = ""
    delta_base: int = 0  # the version rebuilt from by a delta (0: pulled whole)
    manifest_digest: str = ""  # the version's, as its manifest header gave it ("" before one came)
    # What the applier said of an apply it committed (`ApplyReport` as a dict: its mode,
    # pause, memory high-water mark); empty where it says nothing.
    apply: dict[str, Any] = field(default_factory=dict)


APPLY_MODES = ("atomic", "streaming")


@dataclass
class _Progress:
    """What one round verified so far (goes into the handshake even when it fails)."""

    digests: dict[str, tuple[int, float]] = field(default_factory=dict)
    elements: int = 0
    consumed: list[str] = field(default_factory=list)


@dataclass
class Prefetched:
    """A version pulled and checked, waiting in the puller's receive buffer for its apply;
    or the error that stopped the pull or a check (reported when it is applied)."""

    header: pb.ManifestHeader
    manifest: Manifest
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    progress: _Progress = field(default_factory=_Progress)
    timings: dict[str, float] = field(default_factory=dict)
    bytes_pulled: int = 0
    chunk_retries: int = 0
    error: WeightsyncError | None = None
    started: float = field(default_factory=time.perf_counter)
    fetched: float = field(default_factory=time.perf_counter)  # the manifest's header came (made right after)
    delta_base: int = 0  # rebuilt from this version's bytes by its delta (0: pulled whole)
    # The applier built it aside (`Applier.stage`): its update round is open, the apply only
    # commits it. Whoever drops a staged version aborts that round (`discard`).
    staged: bool = False
    flipped_at: float = 0.0  # this host's wall clock when the apply took effect (0: not applied)
    prepared: bool = False  # an ATOMIC version reported PREPARED (`report_prepared`)

    def discard(self, applier: Applier | None) -> None:
        """Lets go of it unapplied: a staged version's open round is aborted."""
        if self.staged and applier is not None:
            applier.abort_update()
        self.staged = False

    @property
    def version(self) -> int:
        return self.manifest.version


def prefetch(
    puller: WeightPuller,
    version: int = 0,
    failpoints: Failpoints | None = None,
    applier: Applier | None = None,
    *,
    stage: bool = False,
) -> Prefetched:
    """Fetches `version`'s manifest (0 = newest servable; the lease is taken), pulls every
    chunk and checks every assembled tensor; the live weights are not touched. A version
    `applier` refuses from its manifest (`Applier.check`: another model's names or shapes),
    or whose pull and apply would take this process past its host memory limit
    (`host_budget`), fails before a byte of it is pulled or a receive buffer sized for it.

    One hash pass per byte: the chunks land unchecked (relays excepted) and the tensor
    check covers them, since a tensor's digest is made of its chunks' digests. A tensor
    that fails has the chunks under it located and re-fetched (`WeightPuller.repair`),
    then is checked once more. A version published as a delta against the version the
    receive buffers hold is rebuilt there from its delta (`WeightPuller.pull`), then
    checked the same way: a wrong base or a bad decode fails the check, and the chunks
    that differ are fetched whole. Once every tensor checked, the buffers are the base
    of the next delta (`WeightPuller.holds`). With `stage`, the applier then builds the
    version aside where it can (`Applier.stage`; `staged`): the engine serves on, and the
    apply only commits.

    Raises:
        WeightsyncError: the manifest could not be had (nothing was pulled). A failed pull
        or check is kept in `error` instead, for the handshake, as is a manifest that came
        but does not check.
    """
    p = _fetch_manifest(puller, version, failpoints)
    if p.error is not None:
        return p
    return _pull_verified(p, puller, failpoints, applier, stage=stage)


def _pull_verified(
    p: Prefetched, puller: WeightPuller, failpoints: Failpoints | None, applier: Applier | None, *, stage: bool
) -> Prefetched:
    """`prefetch` once its manifest came: the pull and the tensor check."""
    header, manifest = p.header, p.manifest
    try:
        if applier is not None:
            applier.check(p.version, manifest.tensors)
        check_host_memory(puller, manifest, applier, aside=stage)
        pulled = puller.pull(header, manifest, check_chunks=False)
        p.bytes_pulled, p.chunk_retries, p.delta_base = pulled.bytes_pulled, pulled.chunk_retries, pulled.delta_base
        p.timings["pull_seconds"] = pulled.pull_seconds
        t0 = time.perf_counter()
        # the first check takes the digests a delta's rebuild made of the bytes it rebuilt
        known = dict(pulled.digests)
        for attempt in range(2):  # the tensor check, and once more after a repair
            tensors = assemble(manifest, pulled.buffers, puller.assembly_buffers)
            if failpoints is not None and failpoints.fire("puller.corrupt_assembled"):
                name, first = next(iter(tensors.items()))
                first.reshape(-1).view("uint8")[0] ^= 0xFF
                known.pop(name, None)
            p.progress.digests = digest_all(manifest, tensors, known)
            known = {}
            bad = mismatched(manifest, p.progress.digests)
            if not bad or attempt == 1:
                break
            puller.repair(puller.plan(header), manifest, pulled.buffers, [name for name, _, _ in bad])
        p.chunk_retries = puller.last_retries
        p.progress.elements = sum(int(t.size) for t in tensors.values())
        if bad:
            p.timings["verify_seconds"] = time.perf_counter() - t0
            raise DataLoss(f"refusing to apply version {p.version}: {describe_difference(*bad[0])}")
        if applier is not None:
            # its own reference of the bytes just verified (or this check's digests)
            applier.prepare(p.version, tensors, TensorCheck(manifest))
        p.timings["verify_seconds"] = time.perf_counter() - t0
        p.tensors = tensors
        puller.holds(manifest, header.version.manifest_digest)
        if stage and applier is not None:
            _stage(p, applier)
    except WeightsyncError as e:
        p.error = e
        p.chunk_retries = puller.last_retries
    except Exception as e:  # noqa: BLE001 - this process's own failure (out of memory, a bug): reported, not lost
        p.error = _local_failure(e, p.version, "pulling")
        p.chunk_retries = puller.last_retries
    puller.note_held()
    return p


def _stage(p: Prefetched, applier: Applier) -> None:
    """Has the applier build a verified version aside (`Applier.stage`). A build that
    fails here (the engine's memory taken by what it serves) is left to the apply, which
    may free that memory first: the version itself is good."""
    t0 = time.perf_counter()
    groups = [[(n, p.tensors[n]) for n in group] for group in layer_groups(p.manifest.tensors)]
    try:
        p.staged = applier.stage(p.version, p.manifest.tensors, groups)
    except Exception as e:  # noqa: BLE001 - the apply builds it again, as without staging
        log.warning("version %d: building it aside failed (%s: %s); the apply builds it", p.version,
                    type(e).__name__, e)  # fmt: skip
        return
    if p.staged:
        log.info("version %d built aside in %.3f s", p.version, time.perf_counter() - t0)


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
    flips: FlipBoard | None = None,
    on_manifest: Callable[[int, str], None] | None = None,
) -> SyncResult:
    """Syncs `version` (0 = newest servable) into `applier` and reports the handshake.

    apply_mode "atomic" (default): every chunk and every assembled tensor is verified
    before the applier's `begin_update`, so a bad version never touches the live weights
    (`prefetch`, then `apply_prefetched`).
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

    A version of an ATOMIC session whose flip is not decided yet, with `flips` (the
    rollout's `FlipBoard`), is pulled whole and verified whatever the mode, held ready
    (built aside where the applier can) and reported PREPARED; it is applied once the
    coordinator decides its flip, and dropped if it aborts it (`_prepare_and_flip`).

    `on_manifest(version, manifest_digest)` is told the version's manifest digest as soon
    as its manifest came, before anything is applied: a response sampled the moment the
    engine holds the version already finds its digest.

    Raises:
        WeightsyncError: the manifest could not be fetched (nothing was applied).
    """
    if apply_mode not in APPLY_MODES:
        raise InvalidArgument(f"{apply_mode!r} is not one of {', '.join(APPLY_MODES)}", field="apply_mode")
    started = time.perf_counter()
    blocked_since = started if engine_blocked else None
    p = _fetch_manifest(puller, version, failpoints)
    if on_manifest is not None and p.header.version.manifest_digest:
        on_manifest(p.version, p.header.version.manifest_digest)
    if flips is not None and undecided_atomic(p.header.version):
        if p.error is None:
            _pull_verified(p, puller, failpoints, applier, stage=True)
        return _prepare_and_flip(
            p, puller, applier, flips, metrics=metrics, outbox=outbox, failpoints=failpoints,
            blocked_since=blocked_since,
        )  # fmt: skip
    if apply_mode == "atomic":
        if p.error is None:
            _pull_verified(p, puller, failpoints, applier, stage=False)
        return apply_prefetched(
            p, puller, applier, metrics=metrics, outbox=outbox, failpoints=failpoints, blocked_since=blocked_since
        )
    header, manifest = p.header, p.manifest
    result = SyncResult(p.version, ok=False)
    failure = ""
    try:
        if p.error is not None:
            raise p.error
        _engine_failpoint(failpoints)
        with puller.pulling(header):
            in_flux = _apply_streaming(puller, applier, puller.plan(header), manifest, p.progress, result, p.timings)
        p.flipped_at = time.time()
        pause = _applier_pause(applier, result, metrics, puller, in_flux)
        p.timings["pause_seconds"] = time.perf_counter() - started if engine_blocked else pause
    except WeightsyncError as e:
        failure = _failed(e, p, result, puller, metrics)
    except Exception as e:  # noqa: BLE001 - the applier's own failure (_local_failure)
        failure = _failed(_local_failure(e, p.version), p, result, puller, metrics)
    p.bytes_pulled, p.chunk_retries = result.bytes_pulled, result.chunk_retries
    return _report(p, puller, result, failure, metrics=metrics, outbox=outbox, failpoints=failpoints)


def _prepare_and_flip(
    p: Prefetched,
    puller: WeightPuller,
    applier: Applier,
    flips: FlipBoard,
    *,
    metrics: Metrics | None,
    outbox: ReportOutbox | None,
    failpoints: Failpoints | None,
    blocked_since: float | None,
) -> SyncResult:
    """An ATOMIC version pulled and checked (or not): reports it PREPARED (or that it
    could not be: the coordinator then aborts it), waits for the flip's decision, and
    applies it (`apply_prefetched`) or drops it.

    A pull that failed for a reason that may pass, or was left for a newer version, is
    not reported: the rollout tries the version again while it is the newest, and the
    coordinator's prepare deadline bounds the wait. A report the coordinator could not be
    reached with goes to the outbox, and the wait goes on: the fleet's other reports may
    decide the flip, and this one is delivered after an outage."""
    result = SyncResult(
        p.version, ok=False, bytes_pulled=p.bytes_pulled, chunk_retries=p.chunk_retries, delta_base=p.delta_base
    )
    failure = ""
    if p.error is not None:
        failure = _failed(p.error, p, result, puller, metrics)
        if failure in ("transient", "abandoned"):
            result.failure, result.mismatch, result.timings = failure, p.error.message, p.timings
            return result
    refused = report_prepared(p, puller, result, flips, outbox=outbox, failpoints=failpoints, failure=failure)
    if refused is not None:
        return _not_flipped(p, applier, result, *refused)
    log.info("version %d prepared; waiting for its flip", p.version)
    decided = flips.wait(p.version)
    if not decided.flip:
        return _not_flipped(p, applier, result, "aborted", decided.why)
    return apply_prefetched(
        p, puller, applier, metrics=metrics, outbox=outbox, failpoints=failpoints, blocked_since=blocked_since
    )


def report_prepared(
    p: Prefetched,
    puller: WeightPuller,
    result: SyncResult,
    flips: FlipBoard,
    *,
    outbox: ReportOutbox | None,
    failpoints: Failpoints | None,
    failure: str = "",
) -> tuple[str, str] | None:
    """Reports an ATOMIC version PREPARED (its digests), or that this rollout could not
    prepare it (`p.error`); None when it holds it prepared and the coordinator took the
    report (or it waits in the outbox), else (failure, why). The answer's record of the
    version goes to `flips` (the report that completed the fleet says the flip is decided)."""
    request = _handshake(p, puller, result)
    request.prepared = True
    if failpoints is not None and failpoints.fire("flip.wrong_prepared_digest") and request.tensors:
        request.tensors[0].xxh3 ^= 1
        log.warning("failpoint flip.wrong_prepared_digest: version %d's PREPARED report changed", p.version)
    if failpoints is not None and failpoints.fire("flip.pause_before_prepared"):
        log.warning("failpoint flip.pause_before_prepared: pausing 5 s before reporting version %d PREPARED", p.version)
        time.sleep(5.0)
    if outbox is not None:
        outbox.discard_older_than(p.version)
    try:
        verdict = send_report(puller.client, request)
    except UNDELIVERED as e:
        log.warning("version %d's PREPARED report not delivered (%s); the outbox sends it again", p.version, e.message)
        if outbox is not None:
            outbox.put(request)
        verdict = None
    if verdict is not None and verdict.version is not None:
        flips.note(verdict.version)  # the report that decided the flip says so in its answer
    if p.error is not None or (verdict is not None and not verdict.ok):
        why = verdict.mismatch if verdict is not None else p.error.message  # type: ignore[union-attr]
        return failure or (verdict.failure if verdict is not None else "local"), why
    p.prepared = True
    return None


def _not_flipped(p: Prefetched, applier: Applier, result: SyncResult, failure: str, why: str) -> SyncResult:
    """An ATOMIC version this rollout will not apply: what it held is dropped."""
    p.discard(applier)
    log.warning("version %d not flipped: %s", p.version, why)
    result.failure, result.mismatch, result.timings = failure, why, p.timings
    return result


def apply_prefetched(
    p: Prefetched,
    puller: WeightPuller,
    applier: Applier,
    *,
    metrics: Metrics | None = None,
    outbox: ReportOutbox | None = None,
    failpoints: Failpoints | None = None,
    blocked_since: float | None = None,
) -> SyncResult:
    """Loads a prefetched version into `applier` (only bytes that verified; a prefetch that
    failed is reported, not applied; one staged aside is committed) and sends the
    handshake. The pause is the apply, or from `blocked_since` (perf_counter) where the
    caller held the engine since then."""
    result = SyncResult(
        p.version, ok=False, bytes_pulled=p.bytes_pulled, chunk_retries=p.chunk_retries, delta_base=p.delta_base
    )
    failure = ""
    try:
        if p.error is not None:
            raise p.error
        t1 = time.perf_counter()
        if not p.staged:
            _engine_failpoint(failpoints)
            applier.begin_update(p.version, p.manifest.tensors)
            try:
                for group in layer_groups(p.manifest.tensors):
                    applier.apply([(name, p.tensors[name]) for name in group])
            except Exception:
                applier.abort_update()
                raise
        else:
            p.staged = False  # committed or discarded by the commit, whichever it comes to
            try:
                _engine_failpoint(failpoints)
            except Exception:
                applier.abort_update()
                raise
        p.progress.consumed = applier.commit_update(p.version)
        p.flipped_at = time.time()  # the rollout's own clock: the fleet's skew compares these
        now = time.perf_counter()
        p.timings["apply_seconds"] = now - t1
        pause = _applier_pause(applier, result, metrics, puller, now - t1)
        p.timings["pause_seconds"] = pause if blocked_since is None else now - blocked_since
    except WeightsyncError as e:
        failure = _failed(e, p, result, puller, metrics)
    except Exception as e:  # noqa: BLE001 - the applier's own failure (_local_failure)
        failure = _failed(_local_failure(e, p.version), p, result, puller, metrics)
    return _report(p, puller, result, failure, metrics=metrics, outbox=outbox, failpoints=failpoints)


def _applier_pause(
    applier: Applier, result: SyncResult, metrics: Metrics | None, puller: WeightPuller, whole: float
) -> float:
    """How long the engine could not serve for an apply that took `whole` seconds: what the
    applier reports (one that built the new weights aside pauses for the swap alone), else
    all of it. Its report goes into the result and its mode and memory peak into metrics."""
    report = applier.last_report()
    if report is None:
        return whole
    result.apply = asdict(report)
    if metrics is not None:
        metrics.observe_apply(puller.session, report.mode, report.hbm_peak_bytes, len(report.repaired_leaves))
    return whole if report.pause_seconds is None else report.pause_seconds


def _fetch_manifest(puller: WeightPuller, version: int, failpoints: Failpoints | None) -> Prefetched:
    """The round's start: `version`'s manifest (0 = newest servable), leased. One whose
    header came but whose body does not check is the round's failure, kept in `error` for
    the handshake: raised on, it would leave the version waiting READY for a handshake
    this rollout never sends (its follow loop giving the version up)."""
    started = time.perf_counter()
    try:
        header, manifest = puller.fetch_manifest(version)
        if failpoints is not None and failpoints.fire("puller.unchecked_manifest"):
            raise ManifestUnchecked(
                f"manifest of version {header.version.version} does not check: failpoint puller.unchecked_manifest",
                header=header,
            )
    except ManifestUnchecked as e:
        v = e.header.version  # (logged where the round's failure is: `_failed`)
        unchecked = Manifest(v.session, v.version, v.generation, e.header.chunk_bytes, ())
        return Prefetched(e.header, unchecked, error=e, started=started)
    return Prefetched(header, manifest, started=started)


def _engine_failpoint(failpoints: Failpoints | None) -> None:
    if failpoints is not None and failpoints.fire("applier.raise"):
        raise RuntimeError("failpoint applier.raise: the engine failed to take the weights")


def _local_failure(e: Exception, version: int, doing: str = "applying") -> InternalError:
    """This process's own exception while `doing` the version (the engine out of memory, a
    shape it does not take, a full disk; a receive buffer that cannot be allocated) as the
    round's local failure: reported in the handshake and the result, and retried by a
    following agent. Raised on, it would end the agent's sync thread for good (an
    applier's), or leave the version waiting on a handshake that never comes, this rollout
    still required (a pull's)."""
    log.warning("version %d: an exception while %s it", version, doing, exc_info=e)
    return InternalError(f"{doing} version {version} failed: {type(e).__name__}: {e}")


def _failed(
    e: WeightsyncError, p: Prefetched, result: SyncResult, puller: WeightPuller, metrics: Metrics | None
) -> str:
    """Records why a round did not apply; the weightsync_sync_failures_total reason."""
    p.error = e
    result.transient = isinstance(e, TRANSIENT_ERRORS)
    if isinstance(e, DataLoss) and not isinstance(e, DigestMismatch) and metrics is not None:
        # an assembled tensor differed (the puller counts the chunks that did)
        metrics.digest_failures.labels(role=metrics.role, session=puller.session).inc()
    if isinstance(e, PullAbandoned):  # nothing failed: another version made it stale
        log.warning("version %d not applied: %s", p.version, e.message, extra={"version": p.version})
        return "abandoned"
    log.error("version %d not applied: %s", p.version, e.message, extra={"version": p.version})
    return "data_loss" if isinstance(e, DataLoss) else "transient" if result.transient else "local"


def _report(
    p: Prefetched,
    puller: WeightPuller,
    result: SyncResult,
    failure: str,
    *,
    metrics: Metrics | None,
    outbox: ReportOutbox | None,
    failpoints: Failpoints | None,
) -> SyncResult:
    """The handshake of a finished round: digests of what was handed to the engine,
    timings, and the verdict (or its place in the outbox)."""
    v, timings = p.version, p.timings
    if isinstance(p.error, PullAbandoned):
        # Nothing failed here: the version was left for a newer one, so no handshake (a
        # failed one would make it PARTIAL and page someone for a version nobody wants).
        result.failure, result.mismatch, result.timings = "abandoned", p.error.message, timings
        return result
    result.manifest_digest = p.header.version.manifest_digest
    report = _handshake(p, puller, result)
    if metrics is not None:
        for phase in ("verify", "apply"):
            if f"{phase}_seconds" in timings:
                metrics.observe_phase(phase, timings[f"{phase}_seconds"])
    if failpoints is not None and failpoints.fire("sync.pause_before_report"):
        log.warning("failpoint sync.pause_before_report: pausing 3 s before the handshake of version %d", v)
        time.sleep(3.0)
    if outbox is not None:
        outbox.discard_older_than(v)
        outbox.discard_prepared(v)  # applied: its PREPARED report, if still undelivered, says nothing new
    try:
        verdict = send_report(puller.client, report)
        result.ok, result.mismatch = verdict.ok, verdict.mismatch
        failure = failure or verdict.failure
    except UNDELIVERED as e:
        result.mismatch = f"handshake not delivered yet ({e.message}); the outbox sends it again"
        if outbox is not None:
            outbox.put(report)
            result.handshake_pending = True
    result.failure = "" if result.ok or result.handshake_pending else failure or "local"
    if result.ok and metrics is not None:
        metrics.current_version.labels(role=metrics.role, session=puller.session).set(v)
    return result


def _handshake(p: Prefetched, puller: WeightPuller, result: SyncResult) -> pb.ReportAppliedRequest:
    """A round's report: digests of the verified bytes (handed to the engine, or held
    ready), the names the engine consumed, timings; or the round's local error."""
    timings = p.timings
    report = pb.ReportAppliedRequest(
        session=puller.session,
        version=p.version,
        agent_id=puller.agent_id,
        manifest_digest=p.header.version.manifest_digest,
    )
    if p.error is not None:
        report.local_error = p.error.message
    else:
        report.consumed_names.extend(p.progress.consumed)
        if p.flipped_at:
            report.flipped_at.FromNanoseconds(round(p.flipped_at * 1e9))
        if p.flipped_at and p.header.version.HasField("ready_at"):
            # the header's age of READY on the coordinator's clock, then this process's own
            # clock: two hosts' wall clocks differ by any skew (and the coordinator's by
            # any step since it started: weightsync's steady wall clock)
            timings["ready_to_serving_seconds"] = p.header.ready_age_seconds + time.perf_counter() - p.fetched
    report.tensors.extend(tpb_digest(name, d) for name, d in p.progress.digests.items())
    report.aggregates.CopyFrom(
        tpb.Aggregates(
            grand_total=grand_total(p.progress.digests),
            tensor_count=len(p.progress.digests),
            element_count=p.progress.elements,
        )
    )
    timings["total_seconds"] = time.perf_counter() - p.started
    report.timings.CopyFrom(pb.Timings(**timings))
    report.bytes_pulled = result.bytes_pulled
    result.timings = timings
    return report


def _apply_streaming(
    puller: WeightPuller,
    applier: Applier,
    plan: PullPlan,
    manifest: Manifest,
    progress: _Progress,
    result: SyncResult,
    timings: dict[str, float],
) -> float:
    v = manifest.version
    timings.update(pull_seconds=0.0, verify_seconds=0.0, apply_seconds=0.0)
    t_begin = time.perf_counter()
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
    return time.perf_counter() - t_begin  # the engine's weights were in flux throughout


def tpb_digest(name: str, d: tuple[int, float]) -> pb.TensorDigest:
    return pb.TensorDigest(name=name, xxh3=d[0], sum=d[1])
