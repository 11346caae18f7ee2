"""The coordinator's records as wire messages, and a handshake request as the store's
AppliedReport (checked field by field): the servicer's conversions, in one place."""

from __future__ import annotations

import functools
from typing import Any

from coordinator.handshake import AppliedReport
from coordinator.records import AgentRecord, ReportRecord, VersionRecord
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import InvalidArgument
from weightsync.manifest import Aggregates, Endpoint
from weightsync.validation import Limits, check_agent_id, check_tensor_name, good_tensor_name
from weightsync.wire import endpoint_to_proto, timestamp, unix_seconds

ROLE_NAMES = {tpb.TRAINER: "TRAINER", tpb.ROLLOUT: "ROLLOUT"}
# A flip time later than this (the year 2200) is no clock's reading.
MAX_FLIPPED_AT_S = 7_258_118_400.0
TIMINGS = (
    "pull_seconds",
    "verify_seconds",
    "apply_seconds",
    "total_seconds",
    "pause_seconds",
    "ready_to_serving_seconds",
)


def version_info(rec: VersionRecord) -> tpb.VersionInfo:
    return tpb.VersionInfo(
        session=rec.session,
        version=rec.version,
        state=tpb.VersionState.Value(rec.state.value),
        generation=rec.generation,
        manifest_digest=rec.manifest_digest,
        total_bytes=rec.total_bytes,
        sealed_ranks=rec.sealed_ranks,
        trainer_ranks=rec.trainer_ranks,
        created_at=timestamp(rec.created_at),
        ready_at=timestamp(rec.ready_at),
        committed_at=timestamp(rec.committed_at),
        reason=rec.reason,
        leases=rec.leases,
        stage_seconds=rec.stage_seconds,
        flip_policy=tpb.FlipPolicy.Value(rec.flip_policy),
        flip_decided_at=timestamp(rec.flip_decided_at),
        prepared=rec.prepared,
        flip_skew_seconds=rec.flip_skew_s,
    )


def enum_name(enum: Any, value: int, field: str) -> str:
    """A request's enum field as the store names it: "" for its UNSPECIFIED (0, keep);
    InvalidArgument naming `field` for a number the enum does not have."""
    if value == 0:
        return ""
    try:
        return str(enum.Name(value))
    except ValueError:
        names = ", ".join(n for n in enum.keys() if enum.Value(n))
        raise InvalidArgument(f"enum {value} is not one of {names}", field=field) from None


def timings_to_proto(t: dict[str, float]) -> pb.Timings:
    return pb.Timings(**{k: t.get(k, 0.0) for k in TIMINGS})


@functools.lru_cache(maxsize=4096)
def endpoint_proto(e: Endpoint) -> tpb.Endpoint:
    """Shared, never mutated: message constructors copy it into each AgentInfo."""
    return endpoint_to_proto(e)


def role_name(value: int) -> str:
    try:
        return ROLE_NAMES[value]
    except KeyError:
        raise InvalidArgument(f"must be TRAINER or ROLLOUT, got enum {value}", field="role") from None


def agent_info(a: AgentRecord) -> pb.AgentInfo:
    return pb.AgentInfo(
        agent_id=a.agent_id,
        role=tpb.Role.Value(a.role),
        endpoint=endpoint_proto(a.endpoint),
        rank=a.rank,
        alive=a.alive,
        lease_expires_at=timestamp(a.lease_expires_at),
        current_version=a.current_version,
        generation=a.generation,
    )


def handshake_info(r: ReportRecord) -> pb.HandshakeInfo:
    return pb.HandshakeInfo(
        version=r.version,
        agent_id=r.agent_id,
        ok=r.ok,
        mismatch=r.mismatch,
        timings=timings_to_proto(r.timings),
        bytes_pulled=r.bytes_pulled,
        reported_at=timestamp(r.reported_at),
        flipped_at=timestamp(r.flipped_at),
    )


def applied_report(request: pb.ReportAppliedRequest, limits: Limits) -> AppliedReport:
    """The handshake as the store compares it; InvalidArgument names the first bad field."""
    check_agent_id(request.agent_id)
    if len(request.consumed_names) > limits.max_tensors:
        raise InvalidArgument(f"more than {limits.max_tensors} names", field="consumed_names")
    # Checked in bulk, and field by field only to name the first bad one: a fleet's
    # handshakes carry a model's 300+ names twice each, a thousand times per version.
    if not all(map(good_tensor_name, request.consumed_names)):
        for i, name in enumerate(request.consumed_names):
            check_tensor_name(name, f"consumed_names[{i}]")
    digests = {t.name: (t.xxh3, t.sum) for t in request.tensors}
    if len(digests) != len(request.tensors) or not all(map(good_tensor_name, digests)):
        seen: set[str] = set()
        for i, t in enumerate(request.tensors):
            check_tensor_name(t.name, f"tensors[{i}].name")
            if t.name in seen:
                raise InvalidArgument(f"duplicate digest for {t.name!r}", field=f"tensors[{i}].name")
            seen.add(t.name)
    flipped_at = 0.0
    if request.HasField("flipped_at"):
        if request.prepared:
            raise InvalidArgument("a PREPARED report flipped nothing yet; leave it unset", field="flipped_at")
        if not 0 <= request.flipped_at.nanos < 1_000_000_000:
            raise InvalidArgument(f"nanos {request.flipped_at.nanos} is not in [0, 1e9)", field="flipped_at")
        flipped_at = unix_seconds(request.flipped_at)
        if not 0 < flipped_at < MAX_FLIPPED_AT_S:
            raise InvalidArgument(f"{flipped_at} is not a time since the epoch", field="flipped_at")
    if request.prepared and request.consumed_names:
        raise InvalidArgument(
            "a PREPARED report names none: no engine consumed the version yet", field="consumed_names"
        )
    return AppliedReport(
        manifest_digest=request.manifest_digest,
        tensor_digests=digests,
        aggregates=Aggregates(
            request.aggregates.grand_total, request.aggregates.tensor_count, request.aggregates.element_count
        ),
        consumed_names=tuple(request.consumed_names),
        timings={k: getattr(request.timings, k) for k in TIMINGS},
        bytes_pulled=request.bytes_pulled,
        local_error=request.local_error[:2000],
        prepared=request.prepared,
        flipped_at=flipped_at,
    )
