"""GetStatus replies that stay cheap for a fleet: 1,000 agents and 1,000 handshakes per
version, asked for by dashboards every second.

Built message by message, such a reply takes 55-65 ms of the coordinator's one Python core
(1,000 agents and handshakes; most of it copying nested messages), and a prober's status
calls alone keep it half busy. Two things make it cheap:

- A version's handshakes change only by new or replaced reports (each written with a
  larger store-wide mark) and by pruning, so each version's list is kept, encoded, with
  its stamp (count, newest mark; read in the reply's one snapshot,
  `SessionStore.status_snapshot`): an unchanged stamp serves the kept bytes, reports past
  the kept mark top them up, and a count that then disagrees (a report was pruned)
  rebuilds it.
- An agent's AgentInfo is kept encoded while its row is unchanged (between two status
  calls a second apart, a heartbeat every 2.5 s has moved 40% of the leases; at 10 calls a
  second, 4%), and the part that heartbeats do not move is kept beside it. Only the rows
  written since the kept ones are read (each write of an agent takes a store-wide mark,
  like reports): sqlite3 hands the GIL over around every row it steps to, and 1,000 rows
  read on a status thread beside a busy event loop take ten times as long as alone.

The encoded repeated fields are merged into the reply (protobuf's wire format: a message
followed by more fields of it parses as their merge, and repeated fields append).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from coordinator.messages import agent_info, handshake_info, version_info
from coordinator.recent import Recent
from coordinator.records import AgentRecord, ReportRecord, WrittenStamp
from coordinator.rows import LEASE_EXPIRES_AT, agent_record
from coordinator.store import SessionStore
from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import InvalidArgument
from weightsync.manifest import Endpoint
from weightsync.wire import part_to_proto, timestamp

KEPT_VERSIONS = 64  # a status call lists 20 versions by default
KEPT_SESSIONS = 16
KEPT_PARTS = 1024  # newest versions' parts across sessions (a rank's summary is ~100 bytes)
MAX_VERSION_LIMIT = 1000
_NONE = WrittenStamp(0, 0)
_AGENTS = pb.GetStatusResponse.DESCRIPTOR.fields_by_name["agents"].number
_HANDSHAKES = pb.GetStatusResponse.DESCRIPTOR.fields_by_name["handshakes"].number


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes([i]) for i in range(0x80)]
_AGENTS_TAG = _varint(_AGENTS << 3 | 2)
_HANDSHAKES_TAG = _varint(_HANDSHAKES << 3 | 2)


@functools.lru_cache(maxsize=16384)
def _agent_stable(agent_id: str, role: str, endpoint: Endpoint, rank: int, version: int, generation: int) -> bytes:
    """AgentInfo without its lease fields, which change with every heartbeat."""
    return agent_info(AgentRecord(agent_id, role, endpoint, rank, 0.0, version, False, generation)).SerializeToString()


def _agent_order(row: tuple[Any, ...]) -> tuple[str, int, str]:
    """Role, rank and id: the order GetStatus lists agents in."""
    return row[1], row[3], row[0]


def _agent_field(a: AgentRecord) -> bytes:
    info = _agent_stable(a.agent_id, a.role, a.endpoint, a.rank, a.current_version, a.generation)
    info += pb.AgentInfo(alive=a.alive, lease_expires_at=timestamp(a.lease_expires_at)).SerializeToString()
    return _AGENTS_TAG + _varint(len(info)) + info


@dataclass(frozen=True)
class _KeptAgents:
    stamp: WrittenStamp  # of the session's agents when `entries` was read
    entries: dict[str, tuple[tuple[Any, ...], bool | None, bytes]]  # agent -> (row, alive, field); never mutated
    order: tuple[str, ...]  # agent ids by role, rank and id, as the reply lists them


@dataclass(frozen=True)
class _Kept:
    stamp: WrittenStamp
    by_agent: dict[str, bytes]  # agent -> its encoded handshakes field; never mutated once kept
    encoded: bytes  # the version's handshakes field, by agent id


class StatusReplies:
    """Builds GetStatus replies; keeps each version's encoded handshakes. Thread-safe: a
    call tops up its own copy and puts the finished list."""

    def __init__(self, store: SessionStore, keep: int = KEPT_VERSIONS) -> None:
        self._store = store
        self._kept: Recent[tuple[str, int], _Kept] = Recent(keep)
        self._agents: Recent[str, _KeptAgents] = Recent(KEPT_SESSIONS)
        self._part_summaries: Recent[tuple[str, int, int, str], tpb.RankPart] = Recent(KEPT_PARTS)

    def forget(self, session: str) -> None:
        """Drops what is kept of `session` (deleted)."""
        self._agents.discard(session)
        self._kept.discard_where(lambda key: key[0] == session)
        self._part_summaries.discard_where(lambda key: key[0] == session)

    def reply(self, request: pb.GetStatusRequest) -> pb.GetStatusResponse:
        limit = request.version_limit or 20
        if limit > MAX_VERSION_LIMIT:
            raise InvalidArgument(f"{limit} exceeds {MAX_VERSION_LIMIT}", field="version_limit")
        kept = self._agents.get(request.session)
        snap = self._store.status_snapshot(request.session, limit, kept.stamp.newest if kept else -1)
        s, versions = snap.session, snap.versions
        handshakes = self._handshakes(s.name, [v.version for v in versions], snap.report_stamps)
        reply = pb.GetStatusResponse(
            session=s.name,
            generation=s.generation,
            trainer_ranks=s.trainer_ranks,
            min_rollouts=s.min_rollouts,
            versions=[version_info(v) for v in versions],
            parts=self._parts(s.name, versions[0].version, snap.part_digests) if versions else [],
            event_seq=snap.event_seq,
            flip_policy=tpb.FlipPolicy.Value(s.flip_policy),
            prepare_timeout_seconds=s.prepare_timeout_s,
            prepared_loss=tpb.PreparedLoss.Value(s.prepared_loss),
        )
        agents = self._agent_fields(s.name, kept, snap.agent_rows, snap.agent_stamp, snap.now)
        reply.MergeFromString(agents + handshakes)
        return reply

    def _parts(self, session: str, version: int, digests: list[tuple[int, str]]) -> list[tpb.RankPart]:
        """The newest version's part summaries; a sealed part never changes, so each is
        decoded once (a 100,000-tensor part's stored body takes most of a second)."""
        keys = {rank: (session, version, rank, digest) for rank, digest in digests}
        if any(k not in self._part_summaries for k in keys.values()):
            for part in self._store.parts(session, version):  # a part sealed meanwhile waits a call
                if (k := keys.get(part.rank)) is not None:
                    self._part_summaries.put(k, part_to_proto(part))
        return [p for k in keys.values() if (p := self._part_summaries.get(k)) is not None]

    def _agent_fields(
        self,
        session: str,
        kept: _KeptAgents | None,
        changed: list[tuple[Any, ...]],
        stamp: WrittenStamp,
        now: float,
    ) -> bytes:
        """The encoded agents field: the kept agents topped up with the rows written since
        (`changed`); each agent's field is kept while its row and liveness are unchanged."""
        entries = dict(kept.entries) if kept else {}
        reorder = kept is None
        for r in changed:
            old = entries.get(r[0])
            reorder = reorder or old is None or (old[0][1], old[0][3]) != (r[1], r[3])
            entries[r[0]] = (r, None, b"")
        if len(entries) != stamp.count:  # an agent left since: read them all
            rows, stamp, now = self._store.agent_rows(session)
            entries, reorder = {r[0]: (r, None, b"") for r in rows}, True
        order = tuple(sorted(entries, key=lambda a: _agent_order(entries[a][0]))) if reorder else kept.order
        out = []
        for agent in order:
            row, alive, field = entries[agent]
            if (alive_now := row[LEASE_EXPIRES_AT] >= now) is not alive:  # a new row, or its lease lapsed
                field = _agent_field(agent_record(row, now))
                entries[agent] = (row, alive_now, field)
            out.append(field)
        self._agents.put(session, _KeptAgents(stamp, entries, order))
        return b"".join(out)

    def _handshakes(self, session: str, versions: list[int], stamps: dict[int, WrittenStamp]) -> bytes:
        """The encoded handshakes field of `versions`, in that order, each by agent id."""
        out = []
        for v in versions:
            kept = self._kept.get((session, v))
            if kept is None or kept.stamp != stamps.get(v, _NONE):
                kept = self._refresh(session, v, kept)
            out.append(kept.encoded)
        return b"".join(out)

    def _refresh(self, session: str, version: int, kept: _Kept | None) -> _Kept:
        got = self._store.reports_since(session, version, kept.stamp.newest if kept else -1)
        by_agent = dict(kept.by_agent) if kept else {}
        by_agent.update((r.agent_id, _handshake_field(r)) for r in got.reports)
        if len(by_agent) != got.stamp.count:  # a kept report was pruned: read the version whole
            got = self._store.reports_since(session, version, -1)
            by_agent = {r.agent_id: _handshake_field(r) for r in got.reports}
        fresh = _Kept(got.stamp, by_agent, b"".join(by_agent[a] for a in sorted(by_agent)))
        self._kept.put((session, version), fresh)
        return fresh


def _handshake_field(r: ReportRecord) -> bytes:
    info = handshake_info(r).SerializeToString()
    return _HANDSHAKES_TAG + _varint(len(info)) + info
