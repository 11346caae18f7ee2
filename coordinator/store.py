"""SQLite-backed session store: sessions, agents, versions, parts, handshakes, events.

Every mutating method validates first and writes in one transaction, so a refused
request leaves stored state unchanged. Lock order: `_lock` only (one connection).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import hmac
import json
import os
import queue
import random
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from coordinator import retention
from coordinator.handshake import AppliedReport, compare_report
from coordinator.records import (
    AgentRecord,
    Event,
    EventListener,
    PublishOutcome,
    ReportOutcome,
    ReportRecord,
    SessionRecord,
    VersionRecord,
)
from coordinator.states import SERVABLE, VersionState, check_transition
from weightsync.digests import access_token
from weightsync.errors import (
    AgentNotFound,
    FailedPrecondition,
    InvalidArgument,
    SessionNotFound,
    StaleGeneration,
    VersionConflict,
    VersionNotFound,
    WrongState,
)
from weightsync.lease import relay_fresh_s
from weightsync.manifest import Endpoint, Manifest, Part
from weightsync.modes import normalize_mode
from weightsync.validation import (
    DEFAULT_LIMITS,
    Limits,
    check_agent_id,
    check_session_name,
    check_version,
    validate_against_parts,
    validate_part,
)

S = VersionState
# A new session's mode unless its trainer says otherwise: tcp (measured fastest across hosts;
# a rank without it, or a rollout without the native shim, is read over grpc).
DEFAULT_MODE = "tcp"
SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
  name TEXT PRIMARY KEY, generation INTEGER NOT NULL, incarnation TEXT NOT NULL,
  trainer_ranks INTEGER NOT NULL, min_rollouts INTEGER NOT NULL, created_at REAL NOT NULL,
  weight_sync_mode TEXT NOT NULL DEFAULT 'grpc');
CREATE TABLE IF NOT EXISTS agents (
  session TEXT NOT NULL, agent_id TEXT NOT NULL, role TEXT NOT NULL, endpoint TEXT NOT NULL,
  rank INTEGER NOT NULL, lease_expires_at REAL NOT NULL, current_version INTEGER NOT NULL,
  generation INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (session, agent_id));
CREATE TABLE IF NOT EXISTS versions (
  session TEXT NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL, generation INTEGER NOT NULL,
  chunk_bytes INTEGER NOT NULL, manifest_digest TEXT NOT NULL, created_at REAL NOT NULL,
  ready_at REAL NOT NULL, committed_at REAL NOT NULL, reason TEXT NOT NULL, required TEXT NOT NULL,
  pruned INTEGER NOT NULL DEFAULT 0, pruned_bytes INTEGER NOT NULL DEFAULT 0, pruned_ranks INTEGER NOT NULL DEFAULT 0,
  pruned_stage_seconds REAL NOT NULL DEFAULT 0,
  PRIMARY KEY (session, version));
CREATE TABLE IF NOT EXISTS parts (
  session TEXT NOT NULL, version INTEGER NOT NULL, rank INTEGER NOT NULL,
  idempotency_key TEXT NOT NULL, part_digest TEXT NOT NULL, body TEXT NOT NULL,
  PRIMARY KEY (session, version, rank));
CREATE TABLE IF NOT EXISTS reports (
  session TEXT NOT NULL, version INTEGER NOT NULL, agent_id TEXT NOT NULL, ok INTEGER NOT NULL,
  mismatch TEXT NOT NULL, body TEXT NOT NULL, reported_at REAL NOT NULL,
  PRIMARY KEY (session, version, agent_id));
CREATE TABLE IF NOT EXISTS leases (
  session TEXT NOT NULL, version INTEGER NOT NULL, agent_id TEXT NOT NULL,
  PRIMARY KEY (session, version, agent_id));
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL, version INTEGER NOT NULL,
  state TEXT NOT NULL, at REAL NOT NULL, record TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS events_by_session ON events (session, seq);
-- relay_chain's candidates, in chain order: every leased GetManifest asks for them, and a
-- scan of a fleet's agents per lease is O(n^2) per version.
CREATE INDEX IF NOT EXISTS relay_candidates ON agents (session, rank, agent_id)
  WHERE role='ROLLOUT' AND endpoint LIKE '%"relay"%';
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
MIGRATIONS = (
    ("sessions", "weight_sync_mode", "TEXT NOT NULL DEFAULT 'grpc'"),
    ("agents", "generation", "INTEGER NOT NULL DEFAULT 0"),
    ("events", "record", "TEXT NOT NULL DEFAULT ''"),
    ("versions", "pruned", "INTEGER NOT NULL DEFAULT 0"),
    ("versions", "pruned_bytes", "INTEGER NOT NULL DEFAULT 0"),
    ("versions", "pruned_ranks", "INTEGER NOT NULL DEFAULT 0"),
    ("versions", "pruned_stage_seconds", "REAL NOT NULL DEFAULT 0"),
)
DEFAULT_RETAIN_VERSIONS = 50
READERS = 4  # read connections (reads run beside the writer in WAL mode)
# "{agent} is a live rollout of session ?1 at time ?3": a primary-key lookup per row, so
# per-handshake checks stay cheap for a fleet of thousands.
_LIVE_ROLLOUT = (
    "EXISTS (SELECT 1 FROM agents a WHERE a.session=?1 AND a.agent_id={agent} AND a.role='ROLLOUT' "
    "AND a.lease_expires_at>=?3)"
)


class StoreBusy(Exception):
    """Within `SessionStore.nonblocking()`: the call would have waited for a connection
    (the writer's lock or a free reader) and did nothing; run it on a thread instead."""


class SessionStore:
    """The coordinator's persistent state. Thread-safe; raises `weightsync.errors`."""

    def __init__(
        self,
        db_path: str | Path,
        *,
        lease_ttl_s: float = 10.0,
        limits: Limits = DEFAULT_LIMITS,
        clock: Callable[[], float] = time.time,
        listener: EventListener | None = None,
        retain_versions: int = DEFAULT_RETAIN_VERSIONS,
    ) -> None:
        """`retain_versions`: per session, the newest versions whose descriptors and
        handshakes are kept; older RELEASED / FAILED ones keep a summary row
        (`coordinator.retention`)."""
        if retain_versions < 1:
            raise InvalidArgument(f"must be >= 1, got {retain_versions}", field="retain_versions")
        self.retain_versions = retain_versions
        self.lease_ttl_s = lease_ttl_s
        self.limits = limits
        self._clock = clock
        self._listener = listener
        self._lock = threading.Lock()
        self._nowait = threading.local()  # set on a thread inside nonblocking()
        # Called (on the releasing thread) each time a write lets go of the writer's lock:
        # how an event loop waiting to run a short write on itself learns it may try again.
        self.on_writer_free: Callable[[], None] | None = None
        self._lock_fd = -1
        if str(db_path) != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock_database(Path(db_path))
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        # WAL + synchronous=NORMAL: a committed transaction survives a killed process
        # (the WAL is in the OS page cache); only a host crash may lose the last commits.
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # takes effect on a new file only
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        for table, column, decl in MIGRATIONS:  # databases from before the column existed
            if column not in {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
        self._manifests: dict[tuple[str, int], Manifest] = {}
        self._cache_lock = threading.Lock()
        # The key of per-version access tokens; persistent, so tokens survive restarts.
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('token_key', ?)", (secrets.token_hex(32),))
        self._token_key = bytes.fromhex(self._db.execute("SELECT value FROM meta WHERE key='token_key'").fetchone()[0])
        # Reads (GetStatus, watches, manifests) use connections of their own: in WAL mode
        # they see the last commit without waiting for the writer's lock, so a fleet's
        # heartbeats and a big publish do not queue every status call behind them.
        self._readers: queue.SimpleQueue[sqlite3.Connection] | None = None
        if str(db_path) != ":memory:":
            self._readers = queue.SimpleQueue()
            for _ in range(READERS):
                reader = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None, timeout=30)
                reader.row_factory = sqlite3.Row
                reader.execute("PRAGMA query_only=ON")
                self._readers.put(reader)

    def close(self) -> None:
        with self._lock:
            while self._readers is not None and not self._readers.empty():
                self._readers.get().close()
            self._db.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # another coordinator may open the database now
                self._lock_fd = -1

    # -- transactions -------------------------------------------------------------
    def _tx(self) -> _Tx:
        return _Tx(self)

    @contextmanager
    def nonblocking(self) -> Iterator[None]:
        """Within, on this thread: a call that would wait for the writer's lock or a reader
        raises StoreBusy before it changed anything. For an event loop, which runs short
        store calls itself (a thread hop costs more than they do, and threads convoy on
        the GIL) but must never block."""
        self._nowait.on = True
        try:
            yield
        finally:
            self._nowait.on = False

    def _acquire_writer(self) -> None:
        if not self._lock.acquire(blocking=not getattr(self._nowait, "on", False)):
            raise StoreBusy

    def _release_writer(self) -> None:
        self._lock.release()
        if (free := self.on_writer_free) is not None:
            free()

    @contextmanager
    def _writer(self) -> Iterator[sqlite3.Connection]:
        """The writer connection for one autocommit statement (no BEGIN/COMMIT round trips)."""
        self._acquire_writer()
        try:
            yield self._db
        finally:
            self._release_writer()

    def _read(self) -> _Read | _Tx:
        """A read-only snapshot (a reader connection; the writer's for ":memory:")."""
        return _Tx(self) if self._readers is None else _Read(self._readers, getattr(self._nowait, "on", False))

    def _notify(self, session: str) -> None:
        if self._listener is not None:
            self._listener.notify(session)

    # -- sessions -----------------------------------------------------------------
    def open_session(
        self,
        name: str,
        *,
        trainer: bool,
        incarnation: str = "",
        trainer_ranks: int = 0,
        min_rollouts: int = 0,
        weight_sync_mode: str = "",
        next_version: int = 0,
    ) -> tuple[SessionRecord, bool]:
        """Opens or creates a session; a trainer with a new incarnation bumps the generation.

        Returns (session, created). Versions still STAGING under an older generation
        become FAILED (they can never be completed). A trainer that says which version it
        will publish first (`next_version`) is refused, generation untouched, when that
        version is not newer than the session's latest.
        """
        check_session_name(name)
        mode = normalize_mode(weight_sync_mode, allow_empty=True) if trainer else ""
        if trainer_ranks > self.limits.max_trainer_ranks:
            raise InvalidArgument(f"{trainer_ranks} exceeds {self.limits.max_trainer_ranks}", field="trainer_ranks")
        if min_rollouts > 100_000:
            raise InvalidArgument(f"{min_rollouts} is implausibly large", field="min_rollouts")
        now = self._clock()
        with self._tx() as db:
            row = db.execute("SELECT * FROM sessions WHERE name=?", (name,)).fetchone()
            created = row is None
            if created:
                gen = 1 if trainer else 0
                db.execute(
                    "INSERT INTO sessions VALUES (?,?,?,?,?,?,?)",
                    (
                        name,
                        gen,
                        incarnation if trainer else "",
                        trainer_ranks or 1,
                        max(min_rollouts, 0) or 1,
                        now,
                        mode or DEFAULT_MODE,
                    ),
                )
            elif trainer:
                same = bool(incarnation) and incarnation == row["incarnation"]
                latest = db.execute("SELECT MAX(version) AS v FROM versions WHERE session=?", (name,)).fetchone()["v"]
                if not same and next_version and latest is not None and next_version <= latest:
                    raise FailedPrecondition(
                        f"next_version {next_version} is not newer than the session's latest version {latest}; "
                        f"start at {latest + 1} (the generation was not bumped)"
                    )
                if same and trainer_ranks and trainer_ranks != row["trainer_ranks"]:
                    raise FailedPrecondition(
                        f"incarnation {incarnation!r} already attached with trainer_ranks={row['trainer_ranks']}, "
                        f"not {trainer_ranks}; use a new incarnation to change it"
                    )
                if mode:
                    db.execute("UPDATE sessions SET weight_sync_mode=? WHERE name=?", (mode, name))
                if not same:
                    gen = row["generation"] + 1
                    db.execute(
                        "UPDATE sessions SET generation=?, incarnation=?, trainer_ranks=?, min_rollouts=? WHERE name=?",
                        (
                            gen,
                            incarnation,
                            trainer_ranks or row["trainer_ranks"],
                            min_rollouts or row["min_rollouts"],
                            name,
                        ),
                    )
                    for v in db.execute(
                        "SELECT version FROM versions WHERE session=? AND state=?", (name, S.STAGING.value)
                    ).fetchall():
                        self._set_state(db, name, v["version"], S.FAILED, f"superseded by generation {gen}")
            session = self._session(db, name)
        self._notify(name)
        return session, created

    def session(self, name: str) -> SessionRecord:
        check_session_name(name)
        with self._read() as db:
            return self._session(db, name)

    def _session(self, db: sqlite3.Connection, name: str) -> SessionRecord:
        row = db.execute("SELECT * FROM sessions WHERE name=?", (name,)).fetchone()
        if row is None:
            raise SessionNotFound(f"session {name!r} not found; open it with OpenSession first")
        return SessionRecord(**dict(row))

    # -- agents -------------------------------------------------------------------
    def register_agent(
        self, session: str, agent_id: str, *, role: str, endpoint: Endpoint, rank: int = 0, generation: int = 0
    ) -> SessionRecord:
        """Registers (or re-registers) an agent and grants a lease of lease_ttl_s.

        A trainer's `generation` (0: the current one) is stored with it; an older one is
        StaleGeneration, so a fenced trainer cannot come back.
        """
        check_session_name(session)
        check_agent_id(agent_id)
        if role not in ("TRAINER", "ROLLOUT"):
            raise InvalidArgument(f"must be TRAINER or ROLLOUT, got {role!r}", field="role")
        with self._tx() as db:
            s = self._session(db, session)
            if role == "TRAINER" and not 0 <= rank < s.trainer_ranks:
                raise InvalidArgument(f"{rank} is not in [0, trainer_ranks={s.trainer_ranks})", field="rank")
            if role == "TRAINER":
                _check_generation(generation or s.generation, s)
            db.execute(
                "INSERT OR REPLACE INTO agents VALUES (?,?,?,?,?,?,COALESCE((SELECT current_version FROM agents "
                "WHERE session=? AND agent_id=?), 0),?)",
                (
                    session,
                    agent_id,
                    role,
                    json.dumps(endpoint.to_dict()),
                    rank,
                    self._clock() + self.lease_ttl_s,
                    session,
                    agent_id,
                    s.generation if role == "TRAINER" else 0,
                ),
            )
            return s

    def deregister_agent(self, session: str, agent_id: str) -> bool:
        """Ends an agent's lease now (graceful exit); False when it was not registered.

        Its version leases go with it, and versions awaiting handshakes are re-evaluated
        (a departed rollout is no longer required).
        """
        check_session_name(session)
        check_agent_id(agent_id)
        with self._tx() as db:
            self._session(db, session)
            removed = db.execute("DELETE FROM agents WHERE session=? AND agent_id=?", (session, agent_id)).rowcount > 0
            db.execute("DELETE FROM leases WHERE session=? AND agent_id=?", (session, agent_id))
            for r in db.execute(
                "SELECT version FROM versions WHERE session=? AND state IN (?,?)",
                (session, S.READY.value, S.PARTIAL.value),
            ).fetchall():
                self._evaluate(db, session, r["version"])
        self._notify(session)
        return removed

    def heartbeat(self, session: str, agent_id: str, current_version: int = 0) -> int:
        """Renews a lease; returns the session's generation. AgentNotFound when unknown or
        expired (register again).

        The commonest call of a fleet (every agent, four times a TTL): one statement, no
        explicit transaction, so it holds the writer's lock for the shortest time."""
        check_session_name(session)
        check_agent_id(agent_id)
        now = self._clock()
        with self._writer() as db:
            rows = db.execute(
                "UPDATE agents SET lease_expires_at=?, current_version=? WHERE session=? AND agent_id=? "
                "AND lease_expires_at>=? RETURNING (SELECT generation FROM sessions WHERE name=agents.session)",
                (now + self.lease_ttl_s, current_version, session, agent_id, now),
            ).fetchall()  # stepped to the end: the autocommit ends here, not when the cursor dies
        if rows:
            return int(rows[0][0])
        self.session(session)  # SessionNotFound first
        raise AgentNotFound(f"agent {agent_id!r} is not registered or its lease expired; call RegisterAgent")

    def _renew(self, db: sqlite3.Connection, session: str, agent_id: str) -> None:
        """A live agent's lease renewed by a call other than Heartbeat (a lease, a handshake):
        a fleet's burst of those can delay its heartbeats past the TTL, and an agent that is
        taking a lease or reporting is plainly alive."""
        now = self._clock()
        db.execute(
            "UPDATE agents SET lease_expires_at=MAX(lease_expires_at, ?) "
            "WHERE session=? AND agent_id=? AND lease_expires_at>=?",
            (now + self.lease_ttl_s, session, agent_id, now),
        ).fetchall()

    def token_key(self, session: str) -> str:
        """The session's token key (given to trainers): HMAC of the name under the store's key."""
        return hmac.new(self._token_key, session.encode(), hashlib.sha256).hexdigest()

    def access_token(self, session: str, version: int) -> str:
        """The per-version token tcp and relay servers require of readers."""
        return access_token(self.token_key(session), version)

    def relay_chain(self, session: str) -> list[AgentRecord]:
        """Rollouts that re-serve versions (endpoint offers "relay"), in chain order.

        A relay must have renewed its lease within `lease.relay_fresh_s` (two heartbeats
        at the interval agents derive from the TTL), not merely hold one: a killed relay
        leaves new chains after a few missed
        heartbeats instead of a whole lease, so its children stop paying a fallback to the
        trainer for every version meanwhile.
        """
        fresh_after = self._clock() - relay_fresh_s(self.lease_ttl_s)
        check_session_name(session)
        with self._read() as db:
            self._session(db, session)
            rows = db.execute(  # filtered in SQL: GetManifest asks for it on every lease
                "SELECT * FROM agents WHERE session=? AND role='ROLLOUT' AND lease_expires_at-?>=? "
                "AND endpoint LIKE '%\"relay\"%' "  # the terms of the relay_candidates index
                "AND EXISTS (SELECT 1 FROM json_each(endpoint, '$.transports') WHERE value='relay') "
                "AND json_extract(endpoint, '$.tcp_address')!='' ORDER BY rank, agent_id",
                (session, self.lease_ttl_s, fresh_after),
            ).fetchall()
            return [_agent_record(r, self._clock()) for r in rows]

    def _live_agents(self, db: sqlite3.Connection, session: str, role: str) -> list[str]:
        rows = db.execute(
            "SELECT agent_id FROM agents WHERE session=? AND role=? AND lease_expires_at>=? ORDER BY agent_id",
            (session, role, self._clock()),
        ).fetchall()
        return [r[0] for r in rows]

    def _is_live_rollout(self, db: sqlite3.Connection, session: str, agent_id: str) -> bool:
        return (
            db.execute(
                "SELECT 1 FROM agents WHERE session=? AND agent_id=? AND role='ROLLOUT' AND lease_expires_at>=?",
                (session, agent_id, self._clock()),
            ).fetchone()
            is not None
        )

    # -- versions -----------------------------------------------------------------
    def publish_part(
        self, session: str, *, generation: int, version: int, idempotency_key: str, part: Part
    ) -> PublishOutcome:
        """Stores one rank's sealed part; the version is READY once every rank sealed.

        Raises:
            StaleGeneration: generation is not the session's current one.
            VersionConflict: this rank already sealed other content (or another key).
            WrongState / FailedPrecondition: version not STAGING, or not newer than the latest.
            InvalidArgument / ResourceExhausted: from part validation.
        """
        check_session_name(session)
        check_version(version, "header.version")
        if len(idempotency_key) > 256:
            raise InvalidArgument("longer than 256 characters", field="header.idempotency_key")
        digest = part.digest()
        body = json.dumps(part.to_dict())
        # Validation runs before the store's lock is taken: a part of 10^5 tensors takes a
        # while, and every session's calls wait on that lock. The transaction then checks
        # that what the validation relied on still holds (the generation, the sealed ranks).
        s = self.session(session)
        _check_generation(generation, s)
        validate_part(part, trainer_ranks=s.trainer_ranks, limits=self.limits)
        checked = self._check_against_sealed(session, version, generation, part, s.trainer_ranks)
        with self._tx() as db:
            s = self._session(db, session)
            _check_generation(generation, s)  # same generation: same trainer_ranks as validated
            existing = db.execute(
                "SELECT idempotency_key, part_digest FROM parts WHERE session=? AND version=? AND rank=?",
                (session, version, part.rank),
            ).fetchone()
            if existing is not None:
                if existing["idempotency_key"] == idempotency_key and existing["part_digest"] == digest:
                    return PublishOutcome(self._version(db, session, version), duplicate=True)
                raise VersionConflict(
                    f"version {version} rank {part.rank} was already published with other content or another "
                    "idempotency key; publish a new version"
                )
            vrow = db.execute("SELECT * FROM versions WHERE session=? AND version=?", (session, version)).fetchone()
            now = self._clock()
            if vrow is None:
                latest = db.execute("SELECT MAX(version) AS v FROM versions WHERE session=?", (session,)).fetchone()[
                    "v"
                ]
                if latest is not None and version <= latest:
                    raise FailedPrecondition(
                        f"version {version} is not newer than the session's latest version {latest}"
                    )
            else:
                state = VersionState(vrow["state"])
                if state is not S.STAGING or vrow["generation"] != generation:
                    raise WrongState(f"version {version} is {state.value}; only STAGING versions accept parts")
            ranks = {
                r["rank"]
                for r in db.execute("SELECT rank FROM parts WHERE session=? AND version=?", (session, version))
            }
            if checked is None or ranks != checked.ranks:  # another rank sealed meanwhile (rare): check again
                checked = _SealCheck.of(
                    self._parts(db, session, version), session, version, generation, part, s.trainer_ranks
                )
            if vrow is None:
                db.execute(
                    "INSERT INTO versions (session, version, state, generation, chunk_bytes, manifest_digest, "
                    "created_at, ready_at, committed_at, reason, required) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (session, version, S.STAGING.value, generation, part.chunk_bytes, "", now, 0.0, 0.0, "", "[]"),
                )
            db.execute(
                "INSERT INTO parts VALUES (?,?,?,?,?,?)", (session, version, part.rank, idempotency_key, digest, body)
            )
            if vrow is None:
                self._event(db, session, version, S.STAGING)
            if checked.manifest_digest:  # this part completes the version
                required = self._live_agents(db, session, "ROLLOUT")
                # Shuffled: `_owed` scans it for the first rollout still owed, which takes a
                # few steps per handshake whatever order the fleet reports in (sorted: n).
                random.shuffle(required)
                db.execute(
                    "UPDATE versions SET manifest_digest=?, ready_at=?, required=? WHERE session=? AND version=?",
                    (checked.manifest_digest, now, json.dumps(required), session, version),
                )
                self._set_state(db, session, version, S.READY, "")
            outcome = PublishOutcome(self._version(db, session, version), duplicate=False)
        self._notify(session)
        return outcome

    def _check_against_sealed(
        self, session: str, version: int, generation: int, part: Part, trainer_ranks: int
    ) -> _SealCheck | None:
        """Cross-rank checks against the parts sealed so far, outside the lock; None when
        this rank already sealed (the transaction answers duplicate or conflict)."""
        sealed = self.parts(session, version)
        if any(p.rank == part.rank for p in sealed):
            return None
        return _SealCheck.of(sealed, session, version, generation, part, trainer_ranks)

    def _parts(self, db: sqlite3.Connection, session: str, version: int) -> list[Part]:
        rows = db.execute(
            "SELECT body FROM parts WHERE session=? AND version=? ORDER BY rank", (session, version)
        ).fetchall()
        return [Part.from_dict(json.loads(r["body"])) for r in rows]

    def manifest(self, session: str, version: int = 0, *, lease_for: str = "") -> tuple[VersionRecord, Manifest]:
        """A servable version's manifest (0 = newest servable); optionally takes a lease.

        Read on a reader connection; the lease is then one conditional statement under the
        writer's lock (a fleet takes a thousand at once on each new version, and a
        transaction of reads per lease queued every heartbeat behind them)."""
        check_session_name(session)
        if lease_for:
            check_agent_id(lease_for)
        with self._read() as db:
            self._session(db, session)
            if version == 0:
                marks = ",".join("?" * len(SERVABLE))
                row = db.execute(
                    f"SELECT MAX(version) AS v FROM versions WHERE session=? AND state IN ({marks})",
                    (session, *[s.value for s in SERVABLE]),
                ).fetchone()
                if row["v"] is None:
                    raise VersionNotFound(f"session {session!r} has no READY version yet")
                version = row["v"]
            rec = self._version(db, session, version)
            _check_servable(rec)
            if lease_for and not self._is_live_rollout(db, session, lease_for):
                raise _no_live_lease(lease_for)
            manifest = self._manifest(db, rec)
        if lease_for:
            rec = self._take_lease(rec, lease_for)
        return rec, manifest

    def _take_lease(self, rec: VersionRecord, agent_id: str) -> VersionRecord:
        """Records `agent_id`'s lease on `rec`'s version if it is still servable and the
        agent still a live rollout (both re-checked in the statement: either may have
        changed since the caller read them); the record as of after the lease."""
        marks = ",".join("?" * len(SERVABLE))
        with self._writer() as db:
            db.execute(
                "INSERT OR IGNORE INTO leases SELECT ?1, ?2, ?4 WHERE "
                f"EXISTS (SELECT 1 FROM versions WHERE session=?1 AND version=?2 AND state IN ({marks})) "
                f"AND {_LIVE_ROLLOUT.format(agent='?4')}",
                (rec.session, rec.version, self._clock(), agent_id, *[s.value for s in SERVABLE]),
            ).fetchall()
            self._renew(db, rec.session, agent_id)
        with self._read() as db:
            rec = self._version(db, rec.session, rec.version)
            held = db.execute(
                "SELECT 1 FROM leases WHERE session=? AND version=? AND agent_id=?",
                (rec.session, rec.version, agent_id),
            ).fetchone()
            if held is None:  # the version moved on, or the agent's lease lapsed, meanwhile
                _check_servable(rec)
                raise _no_live_lease(agent_id)
        return rec

    def _manifest(self, db: sqlite3.Connection, rec: VersionRecord) -> Manifest:
        key = (rec.session, rec.version)
        m = self._manifests.get(key)
        if m is None:
            parts = tuple(self._parts(db, rec.session, rec.version))
            m = Manifest(rec.session, rec.version, rec.generation, rec.chunk_bytes, parts)
            with self._cache_lock:  # readers fill it too, outside the writer's lock
                while len(self._manifests) > 16:
                    self._manifests.pop(next(iter(self._manifests)))
                self._manifests[key] = m
        return m

    def report_applied(self, session: str, version: int, agent_id: str, report: AppliedReport) -> ReportOutcome:
        """Records a rollout's handshake, compares it to the source, re-evaluates the state."""
        check_session_name(session)
        check_version(version)
        check_agent_id(agent_id)
        with self._tx() as db:
            self._session(db, session)
            rec = self._version(db, session, version)
            if rec.state not in SERVABLE:
                raise WrongState(f"version {version} is {rec.state.value}; handshakes are accepted for READY versions")
            mismatch = compare_report(self._manifest(db, rec), rec.manifest_digest, report)
            db.execute(
                "INSERT OR REPLACE INTO reports VALUES (?,?,?,?,?,?,?)",
                (
                    session,
                    version,
                    agent_id,
                    int(mismatch is None),
                    mismatch or "",
                    json.dumps(report.to_dict()),
                    self._clock(),
                ),
            )
            db.execute("DELETE FROM leases WHERE session=? AND version=? AND agent_id=?", (session, version, agent_id))
            self._renew(db, session, agent_id)
            self._evaluate(db, session, version)
            outcome = ReportOutcome(self._version(db, session, version), mismatch)
        self._notify(session)
        return outcome

    def _evaluate(self, db: sqlite3.Connection, session: str, version: int) -> None:
        """COMMITTED when every live required rollout reported OK and at least min_rollouts did.

        Runs on every handshake, so it is counted in SQL, stopping at the first required
        rollout still owed (a fleet of 1,000 would otherwise cost O(n) Python per report)."""
        rec = self._version(db, session, version)
        if rec.state not in (S.READY, S.PARTIAL):
            return
        s = self._session(db, session)
        counts = db.execute(
            "SELECT COUNT(*) AS n, COALESCE(SUM(ok), 0) AS ok FROM reports WHERE session=? AND version=?",
            (session, version),
        ).fetchone()
        if counts["ok"] >= s.min_rollouts and not self._owed(db, session, version, ok_only=True):
            self._set_state(db, session, version, S.COMMITTED, "")
        elif (  # PARTIAL needs a failed report (with none, "all reported" is "all OK" above)
            rec.state is S.READY
            and counts["ok"] < counts["n"] >= s.min_rollouts
            and not self._owed(db, session, version, ok_only=False)
        ):
            failed = [
                r[0]
                for r in db.execute(
                    "SELECT agent_id FROM reports WHERE session=? AND version=? AND ok=0 ORDER BY agent_id LIMIT 11",
                    (session, version),
                )
            ]
            named = ", ".join(failed[:10]) + (" and more" if len(failed) > 10 else "")
            self._set_state(db, session, version, S.PARTIAL, f"handshake failed for {named}")

    def _owed(self, db: sqlite3.Connection, session: str, version: int, *, ok_only: bool) -> bool:
        """Whether a live required rollout has not reported (with ok_only: not reported OK)."""
        return (
            db.execute(
                "SELECT 1 FROM json_each((SELECT required FROM versions WHERE session=?1 AND version=?2)) r "
                f"WHERE {_LIVE_ROLLOUT.format(agent='r.value')} AND NOT EXISTS ("
                "  SELECT 1 FROM reports p WHERE p.session=?1 AND p.version=?2 AND p.agent_id=r.value"
                f"  {'AND p.ok=1' if ok_only else ''}) LIMIT 1",
                (session, version, self._clock()),
            ).fetchone()
            is not None
        )

    def abort_version(self, session: str, *, generation: int, version: int, reason: str) -> VersionRecord:
        """STAGING/READY/PARTIAL -> FAILED, by the current generation only."""
        check_session_name(session)
        check_version(version)
        with self._tx() as db:
            _check_generation(generation, self._session(db, session))
            rec = self._version(db, session, version)
            check_transition(version, rec.state, S.FAILED)
            self._set_state(db, session, version, S.FAILED, reason[:500] or "aborted")
            rec = self._version(db, session, version)
        self._notify(session)
        return rec

    def release_version(self, session: str, version: int, *, generation: int, force: bool = False) -> VersionRecord:
        """-> RELEASED; refused while a live rollout holds a lease, unless forced, and from
        any generation but the session's current one (a fenced trainer releases nothing)."""
        check_session_name(session)
        check_version(version)
        with self._tx() as db:
            _check_generation(generation, self._session(db, session))
            rec = self._version(db, session, version)
            if rec.state is S.RELEASED:
                return rec
            check_transition(version, rec.state, S.RELEASED)
            holders = self._lease_holders(db, session, version, limit=11)
            if holders and not force:
                named = ", ".join(holders[:10]) + (" and more" if len(holders) > 10 else "")
                raise FailedPrecondition(
                    f"version {version} is leased by {named}; wait for their handshake or pass force"
                )
            db.execute("DELETE FROM leases WHERE session=? AND version=?", (session, version))
            self._set_state(db, session, version, S.RELEASED, "")
            rec = self._version(db, session, version)
        self._manifests.pop((session, version), None)
        self._notify(session)
        return rec

    def _lease_holders(self, db: sqlite3.Connection, session: str, version: int, limit: int = -1) -> list[str]:
        """Live rollouts holding a lease on the version (sorted; at most `limit`)."""
        rows = db.execute(
            "SELECT agent_id FROM leases l WHERE session=?1 AND version=?2 "
            f"AND {_LIVE_ROLLOUT.format(agent='l.agent_id')} ORDER BY agent_id LIMIT ?4",
            (session, version, self._clock(), limit),
        ).fetchall()
        return [r[0] for r in rows]

    def _lease_count(self, db: sqlite3.Connection, session: str, version: int) -> int:
        """Leases held on the version: an index count (every VersionRecord carries it), so
        a holder whose own lease expired counts until the next sweep drops its leases."""
        return db.execute("SELECT COUNT(*) FROM leases WHERE session=? AND version=?", (session, version)).fetchone()[0]

    def sweep(self) -> None:
        """Drops leases of expired agents and re-evaluates versions awaiting handshakes."""
        touched = set()
        with self._tx() as db:
            now = self._clock()
            db.execute(
                "DELETE FROM leases WHERE EXISTS (SELECT 1 FROM agents a WHERE a.session=leases.session "
                "AND a.agent_id=leases.agent_id AND a.lease_expires_at<?) OR NOT EXISTS (SELECT 1 FROM agents a "
                "WHERE a.session=leases.session AND a.agent_id=leases.agent_id)",
                (now,),
            )
            rows = db.execute(
                "SELECT session, version, state FROM versions WHERE state IN (?,?)", (S.READY.value, S.PARTIAL.value)
            )
            for r in rows.fetchall():
                before = r["state"]
                self._evaluate(db, r["session"], r["version"])
                if self._version(db, r["session"], r["version"]).state.value != before:
                    touched.add(r["session"])
        for session in touched:
            self._notify(session)

    def prune(self) -> int:
        """Applies the retention window (see `coordinator.retention`); returns the number
        of versions summarized. Each call frees a bounded number of pages."""
        with self._tx() as db:
            pruned = retention.prune(db, self.retain_versions)
        with self._writer() as db:  # incremental_vacuum cannot run inside a transaction
            retention.vacuum(db)
        return pruned

    def database_bytes(self) -> int:
        with self._writer() as db:
            return retention.database_bytes(db)

    # -- reads --------------------------------------------------------------------
    def version(self, session: str, version: int) -> VersionRecord:
        check_session_name(session)
        with self._read() as db:
            return self._version(db, session, version)

    def _version(self, db: sqlite3.Connection, session: str, version: int) -> VersionRecord:
        row = db.execute("SELECT * FROM versions WHERE session=? AND version=?", (session, version)).fetchone()
        if row is None:
            raise VersionNotFound(f"version {version} of session {session!r} not found")
        agg = db.execute(retention.PART_SUMMARY_SQL, (session, version)).fetchone()
        s = self._session(db, session)
        if row["pruned"]:  # its parts are gone: the summary kept when they went
            agg = {"b": row["pruned_bytes"], "n": row["pruned_ranks"], "st": row["pruned_stage_seconds"]}
        return VersionRecord(
            session=session,
            version=version,
            state=VersionState(row["state"]),
            generation=row["generation"],
            chunk_bytes=row["chunk_bytes"],
            manifest_digest=row["manifest_digest"],
            created_at=row["created_at"],
            ready_at=row["ready_at"],
            committed_at=row["committed_at"],
            reason=row["reason"],
            total_bytes=agg["b"],
            sealed_ranks=agg["n"],
            trainer_ranks=s.trainer_ranks,
            leases=self._lease_count(db, session, version),
            stage_seconds=agg["st"],
        )

    def versions(self, session: str, limit: int = 20) -> list[VersionRecord]:
        """Newest first."""
        check_session_name(session)
        with self._read() as db:
            self._session(db, session)
            rows = db.execute(
                "SELECT version FROM versions WHERE session=? ORDER BY version DESC LIMIT ?", (session, limit)
            ).fetchall()
            return [self._version(db, session, r["version"]) for r in rows]

    def parts(self, session: str, version: int) -> list[Part]:
        check_session_name(session)
        with self._read() as db:
            return self._parts(db, session, version)

    def agents(self, session: str) -> list[AgentRecord]:
        check_session_name(session)
        now = self._clock()
        with self._read() as db:
            self._session(db, session)
            rows = db.execute(
                "SELECT * FROM agents WHERE session=? ORDER BY role, rank, agent_id", (session,)
            ).fetchall()
            return [_agent_record(r, now) for r in rows]

    def reports(self, session: str, versions: list[int]) -> list[ReportRecord]:
        check_session_name(session)
        if not versions:
            return []
        with self._read() as db:
            marks = ",".join("?" * len(versions))
            rows = db.execute(
                f"SELECT * FROM reports WHERE session=? AND version IN ({marks}) ORDER BY version DESC, agent_id",
                (session, *versions),
            ).fetchall()
        out = []
        for r in rows:
            body = json.loads(r["body"])
            out.append(
                ReportRecord(
                    r["version"],
                    r["agent_id"],
                    bool(r["ok"]),
                    r["mismatch"],
                    body["timings"],
                    body["bytes_pulled"],
                    r["reported_at"],
                )
            )
        return out

    def events_since(self, session: str, seq: int, limit: int = 256) -> list[Event]:
        """Version events after seq, oldest first (for WatchVersions replay)."""
        with self._read() as db:
            self._session(db, session)
            rows = db.execute(
                "SELECT seq, version, state, record FROM events WHERE session=? AND seq>? ORDER BY seq LIMIT ?",
                (session, seq, limit),
            ).fetchall()
            # Each event carries the version as it was when recorded (events from before
            # snapshots existed: the state it recorded, the other fields current).
            return [
                Event(
                    r["seq"],
                    _record_from_json(r["record"])
                    if r["record"]
                    else dataclasses.replace(self._version(db, session, r["version"]), state=VersionState(r["state"])),
                )
                for r in rows
            ]

    def latest_seq(self, session: str) -> int:
        """The newest event sequence number of a session (0 when none)."""
        with self._read() as db:
            row = db.execute("SELECT MAX(seq) AS s FROM events WHERE session=?", (session,)).fetchone()
            return row["s"] or 0

    def event_states_since(self, session: str, seq: int) -> list[tuple[int, int, str]]:
        """(seq, version, state at that event) after seq: the raw event log."""
        with self._read() as db:
            rows = db.execute(
                "SELECT seq, version, state FROM events WHERE session=? AND seq>? ORDER BY seq", (session, seq)
            ).fetchall()
            return [(r["seq"], r["version"], r["state"]) for r in rows]

    # -- internals ----------------------------------------------------------------
    def _set_state(self, db: sqlite3.Connection, session: str, version: int, target: VersionState, reason: str) -> None:
        row = db.execute("SELECT state FROM versions WHERE session=? AND version=?", (session, version)).fetchone()
        check_transition(version, VersionState(row["state"]), target)
        committed_at = self._clock() if target is S.COMMITTED else None
        db.execute(
            "UPDATE versions SET state=?, reason=?, committed_at=COALESCE(?, committed_at) "
            "WHERE session=? AND version=?",
            (target.value, reason, committed_at, session, version),
        )
        self._event(db, session, version, target)

    def _event(self, db: sqlite3.Connection, session: str, version: int, state: VersionState) -> None:
        record = json.dumps(dataclasses.asdict(self._version(db, session, version)) | {"state": state.value})
        db.execute(
            "INSERT INTO events (session, version, state, at, record) VALUES (?,?,?,?,?)",
            (session, version, state.value, self._clock(), record),
        )


@dataclasses.dataclass(frozen=True)
class _SealCheck:
    """A part checked against the ranks sealed before it; `manifest_digest` is set when
    it completes the version."""

    ranks: frozenset[int]
    manifest_digest: str

    @classmethod
    def of(
        cls, others: list[Part], session: str, version: int, generation: int, part: Part, trainer_ranks: int
    ) -> _SealCheck:
        others = [p for p in others if p.rank != part.rank]
        final = len(others) + 1 == trainer_ranks
        validate_against_parts(part, others, final=final)
        digest = ""
        if final:
            parts = tuple(sorted([*others, part], key=lambda p: p.rank))
            digest = Manifest(session, version, generation, part.chunk_bytes, parts).digest()
        return cls(frozenset(p.rank for p in others), digest)


def _lock_database(db_path: Path) -> int:
    """Takes `<db>.lock` exclusively for this store's lifetime: two coordinators writing
    one database would each believe their own leases and generations."""
    lock_path = db_path.with_name(db_path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FailedPrecondition(
            f"database {db_path} is in use by another coordinator ({lock_path} is locked); "
            "stop it first, or give this one its own --db-path"
        ) from None
    return fd


@functools.lru_cache(maxsize=4096)
def _endpoint(text: str) -> Endpoint:
    """Endpoints rarely change and a fleet's status lists them all: parse each text once."""
    return Endpoint.from_dict(json.loads(text))


def _agent_record(r: sqlite3.Row, now: float) -> AgentRecord:
    return AgentRecord(
        agent_id=r["agent_id"],
        role=r["role"],
        endpoint=_endpoint(r["endpoint"]),
        rank=r["rank"],
        lease_expires_at=r["lease_expires_at"],
        current_version=r["current_version"],
        alive=r["lease_expires_at"] >= now,
        generation=r["generation"],
    )


def _record_from_json(text: str) -> VersionRecord:
    fields = json.loads(text)
    return VersionRecord(**fields | {"state": VersionState(fields["state"])})


def _check_generation(generation: int, s: SessionRecord) -> None:
    """Writers must carry the session's current generation (fencing, DESIGN "Concepts")."""
    if generation != s.generation:
        raise StaleGeneration(
            f"generation {generation} is not the session's current generation {s.generation}; "
            "this writer was fenced by a newer incarnation (re-attach with OpenSession)"
        )


def _check_servable(rec: VersionRecord) -> None:
    if rec.state not in SERVABLE:
        raise WrongState(f"version {rec.version} is {rec.state.value}; manifests are served once READY")


def _no_live_lease(agent_id: str) -> AgentNotFound:
    return AgentNotFound(f"agent {agent_id!r} holds no live rollout lease; call RegisterAgent")


class _Read:
    """`with store._read() as db`: a reader connection from the pool, in one snapshot."""

    def __init__(self, readers: queue.SimpleQueue[sqlite3.Connection], nowait: bool) -> None:
        self._readers = readers
        self._nowait = nowait
        self._db: sqlite3.Connection | None = None

    def __enter__(self) -> sqlite3.Connection:
        try:
            self._db = self._readers.get(block=not self._nowait)
        except queue.Empty:
            raise StoreBusy from None
        self._db.execute("BEGIN")
        return self._db

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._db is not None
        try:
            self._db.execute("COMMIT")
        finally:
            self._readers.put(self._db)


class _Tx:
    """`with store._tx() as db`: takes the lock, BEGIN IMMEDIATE, COMMIT or ROLLBACK."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    def __enter__(self) -> sqlite3.Connection:
        self._store._acquire_writer()
        try:
            self._store._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._store._release_writer()
            raise
        return self._store._db

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._store._db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self._store._release_writer()
