"""AuditBoard: the last audit each rollout reported of the weights it serves, and each
session's newest audit request.

Rollouts send their last audit with every heartbeat (`HeartbeatRequest.audit`); the
board keeps it in memory, where a restarted coordinator has it again within a beat, and
writes nothing to the store (a beat stays one short statement). `AuditSession` reads it
beside the store's live rollouts. A fresh audit is a request number every beat answer
carries (`HeartbeatResponse.audit_request`): each rollout audits once per new number and
answers with it, so the coordinator never dials a rollout (vLLM workers have no server
of their own, and rollouts may sit behind a network the coordinator cannot reach).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

from coordinator.records import AgentRecord
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import InvalidArgument

MAX_MISMATCHES = 64  # named in one reported audit (rollouts name at most 16)
MAX_TEXT_CHARS = 4096  # of a tensor name or a mismatch's detail
MAX_METHOD_CHARS = 64


def check_audit(audit: tpb.AuditResult) -> None:
    """InvalidArgument naming the field of a reported audit that is out of bounds."""
    if len(audit.mismatches) > MAX_MISMATCHES:
        raise InvalidArgument(f"{len(audit.mismatches)} named; at most {MAX_MISMATCHES}", field="audit.mismatches")
    for m in audit.mismatches:
        if len(m.tensor) > MAX_TEXT_CHARS or len(m.detail) > MAX_TEXT_CHARS:
            raise InvalidArgument(f"longer than {MAX_TEXT_CHARS} characters", field="audit.mismatches")
    if len(audit.method) > MAX_METHOD_CHARS:
        raise InvalidArgument(f"longer than {MAX_METHOD_CHARS} characters", field="audit.method")
    for name in ("seconds", "age_seconds"):
        value = getattr(audit, name)
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgument(f"{value} is not a finite number of seconds >= 0", field=f"audit.{name}")


class AuditBoard:
    """Thread-safe; in memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._audits: dict[str, dict[str, tuple[tpb.AuditResult, float]]] = {}  # session -> agent -> (audit, at)
        self._requests: dict[str, int] = {}

    def note(self, session: str, agent_id: str, audit: tpb.AuditResult) -> None:
        """A rollout's last audit, as its beat carried it (checked first: `check_audit`)."""
        kept = tpb.AuditResult()
        kept.CopyFrom(audit)
        with self._lock:
            self._audits.setdefault(session, {})[agent_id] = (kept, time.monotonic())

    def requested(self, session: str) -> int:
        """The session's newest audit request (0: none)."""
        return self._requests.get(session, 0)

    def request(self, session: str) -> int:
        """A new audit request of every rollout of `session`: a number no earlier request
        of this coordinator had, and above a restarted one's (milliseconds since the epoch)."""
        with self._lock:
            seq = max(self._requests.get(session, 0) + 1, int(time.time() * 1000))
            self._requests[session] = seq
            return seq

    def answered(self, session: str, agents: Sequence[str], seq: int) -> bool:
        """Whether every one of `agents` reported an audit answering request `seq`."""
        with self._lock:
            audits = self._audits.get(session, {})
            return all(a in audits and audits[a][0].request_seq == seq for a in agents)

    def rows(self, session: str, rollouts: Sequence[AgentRecord], seq: int = 0) -> list[pb.RolloutAudit]:
        """One row per rollout, with its last audit aged to now; audits of agents no
        longer among `rollouts` are dropped."""
        now = time.monotonic()
        with self._lock:
            audits = self._audits.get(session, {})
            for gone in set(audits) - {a.agent_id for a in rollouts}:
                del audits[gone]
            rows = []
            for a in sorted(rollouts, key=lambda r: r.agent_id):
                row = pb.RolloutAudit(agent_id=a.agent_id, current_version=a.current_version)
                if a.agent_id in audits:
                    audit, at = audits[a.agent_id]
                    row.audit.CopyFrom(audit)
                    row.audit.age_seconds = audit.age_seconds + (now - at)
                    row.answered = bool(seq) and audit.request_seq == seq
                rows.append(row)
            return rows

    def forget(self, session: str) -> None:
        """Drops what is kept of `session` (deleted)."""
        with self._lock:
            self._audits.pop(session, None)
            self._requests.pop(session, None)
