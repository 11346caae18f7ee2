"""Plain records the session store returns (no SQL, no grpc)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from coordinator.states import VersionState
from weightsync.manifest import Endpoint


@dataclass(frozen=True)
class FleetGauges:
    """One session's fleet as metrics see it at a scrape."""

    session: str
    agents: dict[tuple[str, bool], int]  # (role, alive) -> count
    leases: int
    published: int  # newest version past STAGING (0: none)
    committed: int  # newest COMMITTED version (0: none)


@dataclass(frozen=True)
class SessionRecord:
    name: str
    generation: int
    incarnation: str
    trainer_ranks: int
    min_rollouts: int
    created_at: float
    weight_sync_mode: str = "grpc"
    uid: str = ""
    flip_policy: str = "INDEPENDENT"  # INDEPENDENT | ATOMIC (weightsync.v1.FlipPolicy)
    prepare_timeout_s: float = 300.0
    prepared_loss: str = "FLIP_WITHOUT"  # FLIP_WITHOUT | ABORT_FLIP (weightsync.v1.PreparedLoss)
    rollout_ids: str = ""  # JSON list of the ids that may join ("": any)
    max_rollouts: int = 0  # live rollouts a new id may join (0: any number)

    def expected_ids(self) -> tuple[str, ...]:
        """The rollout ids that may join (empty: any)."""
        return tuple(json.loads(self.rollout_ids)) if self.rollout_ids else ()


@dataclass(frozen=True)
class Registration:
    """What registering an agent answers: its session, and the key its later calls carry."""

    session: SessionRecord
    agent_key: str


@dataclass(frozen=True)
class VersionRecord:
    session: str
    version: int
    state: VersionState
    generation: int
    chunk_bytes: int
    manifest_digest: str
    created_at: float
    ready_at: float
    committed_at: float
    reason: str
    total_bytes: int
    sealed_ranks: int
    trainer_ranks: int
    leases: int
    stage_seconds: float
    flip_policy: str = "INDEPENDENT"
    flip_decided_at: float = 0.0  # ATOMIC: when the flip was decided (0: undecided)
    prepared: int = 0  # ATOMIC: rollouts that PREPARED it with matching digests
    flip_skew_s: float | None = None  # once COMMITTED: first to last reported flip time


class AgentRecord(NamedTuple):
    """An agent row. A tuple, not a dataclass: a fleet's status builds 1,000 per call."""

    agent_id: str
    role: str
    endpoint: Endpoint
    rank: int
    lease_expires_at: float
    current_version: int
    alive: bool
    generation: int = 0  # trainers: the generation they registered with


class ReportRecord(NamedTuple):
    """A stored handshake (its verdict, timings and bytes; not the digests it carried)."""

    version: int
    agent_id: str
    ok: bool
    mismatch: str
    timings: dict[str, float]
    bytes_pulled: int
    reported_at: float
    flipped_at: float = 0.0  # the rollout's clock at the swap (0: not said)


class WrittenStamp(NamedTuple):
    """Rows' count and newest `written` mark: a version's reports (`SessionStore.report_stamps`)
    or a session's agents (`status_snapshot`). A new or rewritten row raises the mark, a
    removed one lowers the count."""

    count: int
    newest: int


@dataclass(frozen=True)
class ReportsSince:
    """`SessionStore.reports_since`: the reports after a mark, and the stamp of them all."""

    stamp: WrittenStamp
    reports: list[ReportRecord]


@dataclass(frozen=True)
class Event:
    seq: int
    version: VersionRecord


@dataclass(frozen=True)
class PublishOutcome:
    version: VersionRecord
    duplicate: bool


@dataclass(frozen=True)
class ReportOutcome:
    version: VersionRecord
    mismatch: str | None


class EventListener(Protocol):
    """Called (outside the store's lock) after events were appended: the watch fan-out."""

    def notify(self, session: str) -> None: ...


class StatusSnapshot(NamedTuple):
    """What a GetStatus reply lists, read in one snapshot of the store."""

    session: SessionRecord
    event_seq: int  # newest event: following from it misses nothing in this snapshot
    versions: list[VersionRecord]  # newest first
    agent_rows: list[tuple[Any, ...]]  # rows of AGENT_COLUMNS written after the mark asked for
    agent_stamp: WrittenStamp  # all of the session's agents
    now: float  # the clock the rows' liveness is judged by
    report_stamps: dict[int, WrittenStamp]  # per listed version with reports
    part_digests: list[tuple[int, str]]  # the newest version's parts: (rank, part_digest)
