"""SQLite rows as the store's records, and the grouped reads behind the fleet gauges."""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.records import AgentRecord, FleetGauges, ReportRecord, VersionRecord
from coordinator.states import VersionState
from weightsync.manifest import Endpoint

SESSION_TABLES = ("leases", "reports", "prepares", "parts", "events", "versions", "agents")  # rows keyed by session


def delete_session_rows(db: sqlite3.Connection, name: str) -> dict[str, int]:
    """Deletes a session and every row keyed by it; returns the rows deleted per table."""
    counts = {t: db.execute(f"DELETE FROM {t} WHERE session=?", (name,)).rowcount for t in SESSION_TABLES}
    db.execute("DELETE FROM sessions WHERE name=?", (name,))
    return counts


# What a version's parts add up to (ranks sealed "n", bytes "b", slowest staging "st"), as
# columns of a query over `versions v`: read live from the parts while they exist; a pruned
# row keeps its own copy (`version_record`, `retention.prune`).
PART_SUMMARY_COLUMNS = (
    "(SELECT COUNT(*) FROM parts p WHERE p.session=v.session AND p.version=v.version) AS n, "
    "(SELECT COALESCE(SUM(total_bytes), 0) FROM parts p WHERE p.session=v.session AND p.version=v.version) AS b, "
    "(SELECT COALESCE(MAX(stage_seconds), 0.0) FROM parts p WHERE p.session=v.session AND p.version=v.version) AS st"
)
# Version rows with their part summary, lease count and the session's trainer_ranks in one
# statement (index range scans each), not four per record: leases, handshakes and status
# calls read several records each, a fleet a thousand times a second. Leases held count
# even when the holder's own lease expired, until a sweep drops them.
_VERSION_ROWS_SQL = (
    f"SELECT v.*, s.trainer_ranks AS trainer_ranks, {PART_SUMMARY_COLUMNS}, "
    "(SELECT COUNT(*) FROM leases l WHERE l.session=v.session AND l.version=v.version) AS leases, "
    "(SELECT COUNT(*) FROM prepares p WHERE p.session=v.session AND p.version=v.version AND p.ok=1) AS prepared "
    "FROM versions v JOIN sessions s ON s.name=v.session WHERE v.session=? "
)
VERSION_SQL = _VERSION_ROWS_SQL + "AND v.version=?"
NEWEST_VERSIONS_SQL = _VERSION_ROWS_SQL + "ORDER BY v.version DESC LIMIT ?"


def version_record(row: sqlite3.Row) -> VersionRecord:
    """A row of VERSION_SQL or NEWEST_VERSIONS_SQL; once its parts were pruned, the
    summary the row kept stands for them."""
    parts: Mapping[str, Any] = row
    if row["pruned"]:
        parts = {"b": row["pruned_bytes"], "n": row["pruned_ranks"], "st": row["pruned_stage_seconds"]}
    return VersionRecord(
        session=row["session"],
        version=row["version"],
        state=VersionState(row["state"]),
        generation=row["generation"],
        chunk_bytes=row["chunk_bytes"],
        manifest_digest=row["manifest_digest"],
        created_at=row["created_at"],
        ready_at=row["ready_at"],
        committed_at=row["committed_at"],
        reason=row["reason"],
        total_bytes=parts["b"],
        sealed_ranks=parts["n"],
        trainer_ranks=row["trainer_ranks"],
        leases=row["leases"],
        stage_seconds=parts["st"],
        flip_policy=row["flip_policy"],
        flip_decided_at=row["flip_decided_at"],
        prepared=row["prepared"],
        flip_skew_s=row["flip_skew_s"],
    )


@functools.lru_cache(maxsize=4096)
def _endpoint(text: str) -> Endpoint:
    """Endpoints rarely change and a fleet's status lists them all: parse each text once."""
    return Endpoint.from_dict(json.loads(text))


AGENT_COLUMNS = "agent_id, role, endpoint, rank, lease_expires_at, current_version, generation"
LEASE_EXPIRES_AT = 4  # its index in a row of AGENT_COLUMNS
REPORT_COLUMNS = "version, agent_id, ok, mismatch, body, reported_at, flipped_at"


def agent_record(r: Sequence[Any], now: float) -> AgentRecord:
    """A row of AGENT_COLUMNS (positional: a fleet's status reads 1,000 per call)."""
    expires = r[LEASE_EXPIRES_AT]
    return AgentRecord(r[0], r[1], _endpoint(r[2]), r[3], expires, r[5], expires >= now, r[6])


def report_record(r: Sequence[Any]) -> ReportRecord:
    """A row of REPORT_COLUMNS."""
    body = json.loads(r[4])
    return ReportRecord(r[0], r[1], bool(r[2]), r[3], body["timings"], body["bytes_pulled"], r[5], r[6])


def fleet_gauges(db: sqlite3.Connection, now: float) -> list[FleetGauges]:
    """Agents alive and expired by role, leases held, and the newest published (past
    STAGING) and committed versions, per session: three grouped reads."""
    gauges = {r[0]: FleetGauges(r[0], {}, 0, 0, 0) for r in db.execute("SELECT name FROM sessions")}
    for r in db.execute(
        "SELECT session, role, lease_expires_at>=? AS alive, COUNT(*) FROM agents GROUP BY 1, 2, 3", (now,)
    ):
        if r[0] in gauges:
            gauges[r[0]].agents[(r[1].lower(), bool(r[2]))] = r[3]
    leases = dict(db.execute("SELECT session, COUNT(*) FROM leases GROUP BY session").fetchall())
    newest = {
        r[0]: (r[1] or 0, r[2] or 0)
        for r in db.execute(
            "SELECT session, MAX(CASE WHEN state!=? THEN version ELSE 0 END), "
            "MAX(CASE WHEN state=? THEN version ELSE 0 END) FROM versions GROUP BY session",
            (VersionState.STAGING.value, VersionState.COMMITTED.value),
        )
    }
    return [FleetGauges(name, g.agents, leases.get(name, 0), *newest.get(name, (0, 0))) for name, g in gauges.items()]
