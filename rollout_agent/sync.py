"""One sync round: pull, verify, assemble, apply, handshake."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rollout_agent.appliers import Applier, layer_groups
from rollout_agent.assembly import assemble, digest_all, first_difference, grand_total
from rollout_agent.puller import WeightPuller
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import DataLoss, WeightsyncError
from weightsync.failpoints import Failpoints
from weightsync.metrics import Metrics

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


def sync_version(
    puller: WeightPuller,
    applier: Applier,
    version: int = 0,
    *,
    failpoints: Failpoints | None = None,
    metrics: Metrics | None = None,
) -> SyncResult:
    """Syncs `version` (0 = newest servable) into `applier` and reports the handshake.

    Atomic: every chunk and every assembled tensor is verified before the applier's
    `begin_update`, so a bad version never touches the live weights. The handshake
    carries digests over the assembled tensors handed to the applier.

    Raises:
        WeightsyncError: the manifest could not be fetched (nothing was applied).
    """
    started = time.perf_counter()
    header, manifest = puller.fetch_manifest(version)
    v = manifest.version
    report = pb.ReportAppliedRequest(
        session=puller.session, version=v, agent_id=puller.agent_id, manifest_digest=header.version.manifest_digest
    )
    timings: dict[str, float] = {}
    result = SyncResult(v, ok=False)
    try:
        pulled = puller.pull(header, manifest)
        result.bytes_pulled, result.chunk_retries = pulled.bytes_pulled, pulled.chunk_retries
        timings["pull_seconds"] = pulled.pull_seconds
        t0 = time.perf_counter()
        tensors = assemble(manifest, pulled.buffers, puller.assembly_buffers)
        if failpoints is not None and failpoints.fire("puller.corrupt_assembled"):
            first = next(iter(tensors.values()))
            first.reshape(-1).view("uint8")[0] ^= 0xFF
        digests = digest_all(manifest, tensors)
        timings["verify_seconds"] = time.perf_counter() - t0
        report.tensors.extend(tpb_digest(name, d) for name, d in digests.items())
        report.aggregates.CopyFrom(
            tpb.Aggregates(
                grand_total=grand_total(digests),
                tensor_count=len(tensors),
                element_count=sum(int(t.size) for t in tensors.values()),
            )
        )
        problem = first_difference(manifest, digests)
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
        consumed = applier.commit_update(v)
        timings["apply_seconds"] = time.perf_counter() - t1
        report.consumed_names.extend(consumed)
    except WeightsyncError as e:
        report.local_error = e.message
        log.error("version %d not applied: %s", v, e.message)
    timings["total_seconds"] = time.perf_counter() - started
    report.timings.CopyFrom(pb.Timings(**timings))
    report.bytes_pulled = result.bytes_pulled
    result.timings = timings
    if metrics is not None:
        for phase in ("verify", "apply"):
            if f"{phase}_seconds" in timings:
                metrics.observe_phase(phase, timings[f"{phase}_seconds"])
    try:
        puller.client.report_applied(report)
        result.ok = not report.local_error
        result.mismatch = report.local_error
    except DataLoss as e:
        result.ok, result.mismatch = False, e.message
    if result.ok and metrics is not None:
        metrics.current_version.labels(role=metrics.role).set(v)
    return result


def tpb_digest(name: str, d: tuple[int, float]) -> pb.TensorDigest:
    return pb.TensorDigest(name=name, xxh3=d[0], sum=d[1])

