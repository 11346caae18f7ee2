"""Bounded history: old versions keep a one-row summary, their bulky rows go.

A 0.6b-shaped version stores ~89 KB of descriptors plus ~37 KB of handshake per rollout;
kept forever, a 1 GiB volume fills within a few thousand steps. Per session, versions
beyond the newest `retain` that are RELEASED or FAILED (never one still servable) lose
their parts, handshakes, leases and events; the version row stays, with the bytes, ranks
and staging time it had, so history reads the same and no COMMITTED record is lost.
Pages freed go back to the file system through SQLite's incremental vacuum.

Agents whose lease lapsed long ago are forgotten the same way: rollout pods come and go
under new names (a Deployment's pods, preemptible nodes), and each would leave its row in
every GetStatus reply and in the database for good. So are sessions no trainer ever opened
once nothing is left in them: a rollout's registration makes its session, so a mistyped
`--session` makes one, which would otherwise count against `--max-sessions` for good.
"""

from __future__ import annotations

import sqlite3

from coordinator.rows import PART_SUMMARY_COLUMNS, delete_session_rows
from coordinator.states import VersionState
from weightsync import version_states

PRUNABLE = tuple(sorted(VersionState(name).value for name in version_states.RETIRED))
PART_SUMMARY_SQL = f"SELECT {PART_SUMMARY_COLUMNS} FROM versions v WHERE v.session=? AND v.version=?"
VACUUM_PAGES = 2048  # per sweep: 8 MiB of 4 KiB pages, so one sweep never holds the lock long


def prune(db: sqlite3.Connection, retain: int) -> int:
    """Summarizes and drops the bulky rows of versions outside the window; returns how
    many versions were pruned. Runs inside the caller's transaction."""
    pruned = 0
    for (session,) in db.execute("SELECT name FROM sessions").fetchall():
        rows = db.execute(
            "SELECT version FROM versions WHERE session=? AND pruned=0 AND state IN (?,?) AND version < "
            "COALESCE((SELECT MIN(version) FROM (SELECT version FROM versions WHERE session=? "
            "ORDER BY version DESC LIMIT ?)), 0)",
            (session, *PRUNABLE, session, retain),
        ).fetchall()
        for (version,) in rows:
            summary = db.execute(PART_SUMMARY_SQL, (session, version)).fetchone()
            db.execute(
                "UPDATE versions SET pruned=1, pruned_bytes=?, pruned_ranks=?, pruned_stage_seconds=? "
                "WHERE session=? AND version=?",
                (summary["b"], summary["n"], summary["st"], session, version),
            )
            for table in ("parts", "reports", "prepares", "leases", "events"):
                db.execute(f"DELETE FROM {table} WHERE session=? AND version=?", (session, version))
            pruned += 1
    return pruned


def forget_agents(db: sqlite3.Connection, expired_before: float) -> list[tuple[str, str]]:
    """Deletes the agents whose lease ended before `expired_before` (seconds since the
    epoch; their version leases were dropped when it ended); returns their (session, agent
    id). Handshakes they sent stay with their versions."""
    rows = db.execute("DELETE FROM agents WHERE lease_expires_at<? RETURNING session, agent_id", (expired_before,))
    return [(r[0], r[1]) for r in rows.fetchall()]


def forget_empty_sessions(db: sqlite3.Connection, made_before: float) -> list[str]:
    """Deletes the sessions made before `made_before` (seconds since the epoch) that no
    trainer ever opened (generation 0) and that hold no agent and no version; returns their
    names. A rollout that comes back makes its session again as it registers."""
    names = [
        name
        for (name,) in db.execute(
            "SELECT name FROM sessions s WHERE generation=0 AND created_at<? "
            "AND NOT EXISTS (SELECT 1 FROM agents a WHERE a.session=s.name) "
            "AND NOT EXISTS (SELECT 1 FROM versions v WHERE v.session=s.name)",
            (made_before,),
        ).fetchall()
    ]
    for name in names:
        delete_session_rows(db, name)
    return names


def vacuum(db: sqlite3.Connection) -> None:
    """Returns up to VACUUM_PAGES free pages to the file system (auto_vacuum=INCREMENTAL
    databases; a no-op for older files made without it)."""
    db.execute(f"PRAGMA incremental_vacuum({VACUUM_PAGES})").fetchall()


def database_bytes(db: sqlite3.Connection) -> int:
    """Bytes the database file holds (pages x page size; the WAL is not counted)."""
    return db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]
