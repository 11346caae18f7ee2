"""The event log: every version state change, in order per session, with a snapshot of the
version as it was (what WatchVersions streams and replays from `since_seq`)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Callable

from coordinator.records import Event, VersionRecord
from coordinator.states import VersionState


def append(db: sqlite3.Connection, rec: VersionRecord, state: VersionState, at: float) -> None:
    """Records that `rec`'s version entered `state` (inside the writer's transaction)."""
    record = json.dumps(dataclasses.asdict(rec) | {"state": state.value})
    db.execute(
        "INSERT INTO events (session, version, state, at, record) VALUES (?,?,?,?,?)",
        (rec.session, rec.version, state.value, at, record),
    )


def since(
    db: sqlite3.Connection, session: str, seq: int, limit: int, current: Callable[[int], VersionRecord]
) -> list[Event]:
    """Events after `seq`, oldest first. Each carries the version as it was when recorded;
    an event from before snapshots existed gets the state it recorded and `current(version)`'s
    other fields."""
    rows = db.execute(
        "SELECT seq, version, state, record FROM events WHERE session=? AND seq>? ORDER BY seq LIMIT ?",
        (session, seq, limit),
    ).fetchall()
    return [
        Event(
            r["seq"],
            _record_from_json(r["record"])
            if r["record"]
            else dataclasses.replace(current(r["version"]), state=VersionState(r["state"])),
        )
        for r in rows
    ]


def latest_seq(db: sqlite3.Connection, session: str) -> int:
    """The newest event sequence number of a session (0 when none)."""
    return db.execute("SELECT MAX(seq) AS s FROM events WHERE session=?", (session,)).fetchone()["s"] or 0


def states_since(db: sqlite3.Connection, session: str, seq: int) -> list[tuple[int, int, str]]:
    """(seq, version, state at that event) after `seq`: the raw log."""
    rows = db.execute(
        "SELECT seq, version, state FROM events WHERE session=? AND seq>? ORDER BY seq", (session, seq)
    ).fetchall()
    return [(r["seq"], r["version"], r["state"]) for r in rows]


def _record_from_json(text: str) -> VersionRecord:
    fields = json.loads(text)
    return VersionRecord(**fields | {"state": VersionState(fields["state"])})
