"""SQLite-backed session store: sessions, agents, versions, parts, handshakes, events.

Every mutating method validates first and writes in one transaction, so a refused
request leaves stored state unchanged. Lock order: the database's writer lock, then the
manifest cache's.
"""

from __future__ import annotations

import hmac
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

from coordinator import events, retention
from coordinator.agent_keys import AgentKeys
from coordinator.database import Database
from coordinator.flips import DEFAULT_PREPARE_TIMEOUT_S, check_flip_settings
from coordinator.recent import Recent
from coordinator.records import (
    AgentRecord,
    Event,
    EventListener,
    FleetGauges,
    Registration,
    ReportRecord,
    ReportsSince,
    SessionRecord,
    StatusSnapshot,
    VersionRecord,
    WrittenStamp,
)
from coordinator.rows import (
    AGENT_COLUMNS,
    NEWEST_VERSIONS_SQL,
    REPORT_COLUMNS,
    VERSION_SQL,
    agent_record,
    delete_session_rows,
    fleet_gauges,
    report_record,
    version_record,
)
from coordinator.states import VersionState
from coordinator.tokens import TokenKeys
from coordinator.versions import VersionLifecycle, check_generation
from weightsync.errors import (
    AgentNotFound,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    SessionNotFound,
    VersionNotFound,
)
from weightsync.lease import relay_fresh_s
from weightsync.manifest import Endpoint, Manifest, Part
from weightsync.modes import normalize_mode
from weightsync.validation import (
    DEFAULT_LIMITS,
    MAX_INSTANCE_CHARS,
    Limits,
    check_agent_id,
    check_session_name,
)

S = VersionState
# A new session's mode unless its trainer says otherwise: tcp (measured fastest across hosts;
# a rank without it, or a rollout without the native shim, is read over grpc).
DEFAULT_MODE = "tcp"
DEFAULT_RETAIN_VERSIONS = 50
DEFAULT_FORGET_AGENTS_AFTER_S = 3600.0
DEFAULT_MAX_SESSIONS = 1000
DECODED_MANIFESTS = 16  # versions whose decoded manifest is kept (a fleet reads one at a time)


def steady_wall_clock() -> Callable[[], float]:
    """Seconds since the epoch that advance with the monotonic clock. Leases and timestamps
    in the database stay comparable across restarts (each start reads the wall clock once),
    while a step of the wall clock (NTP, an operator's `date -s`) under a running coordinator
    neither expires every lease at once (forward) nor keeps a dead agent's lease for as long
    as the step (backward), as `time.time` did."""
    wall, mono = time.time(), time.monotonic()
    return lambda: wall + (time.monotonic() - mono)


class SessionStore(VersionLifecycle):
    """The coordinator's persistent state. Thread-safe; raises `weightsync.errors`.

    Sessions, agents and reads live here; the version lifecycle in `coordinator.versions`,
    connections and transactions in `coordinator.database`, the event log in
    `coordinator.events`."""

    def __init__(
        self,
        db_path: str | Path,
        *,
        lease_ttl_s: float = 10.0,
        limits: Limits = DEFAULT_LIMITS,
        clock: Callable[[], float] | None = None,
        listener: EventListener | None = None,
        retain_versions: int = DEFAULT_RETAIN_VERSIONS,
        forget_agents_after_s: float = DEFAULT_FORGET_AGENTS_AFTER_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        """`retain_versions`: per session, the newest versions whose descriptors and
        handshakes are kept; older RELEASED / FAILED ones keep a summary row
        (`coordinator.retention`). `forget_agents_after_s`: how long an agent whose lease
        lapsed is still listed. `max_sessions`: sessions that may exist at once (a new one
        past it is RESOURCE_EXHAUSTED; `delete_session` frees room). `clock`: seconds since
        the epoch, `steady_wall_clock()` unless given."""
        if retain_versions < 1:
            raise InvalidArgument(f"must be >= 1, got {retain_versions}", field="retain_versions")
        if not forget_agents_after_s >= 0:
            raise InvalidArgument(f"must be >= 0, got {forget_agents_after_s}", field="forget_agents_after_s")
        if max_sessions < 1:
            raise InvalidArgument(f"must be >= 1, got {max_sessions}", field="max_sessions")
        self.retain_versions = retain_versions
        self.forget_agents_after_s = forget_agents_after_s
        self.max_sessions = max_sessions
        self.lease_ttl_s = lease_ttl_s
        self.limits = limits
        self._clock = clock or steady_wall_clock()
        self._listener = listener
        self._appended: set[str] = set()  # sessions with committed events their watchers were not told of
        self._tx_events = threading.local()  # .sessions: those the open transaction appended to
        self.on_transition: Callable[[VersionRecord], None] | None = None  # each version entering a state
        # Each ATOMIC version whose flip was decided, once the decision is committed (before
        # any watcher is told of it).
        self.on_flip_decided: Callable[[VersionRecord], None] | None = None
        self.db = Database(db_path)
        self._manifests: Recent[tuple[str, int], Manifest] = Recent(DECODED_MANIFESTS)
        self.tokens = TokenKeys(bytes.fromhex(self.db.meta("token_key", secrets.token_hex(32))))
        self.agent_keys = AgentKeys()
        self._load_agent_keys()
        with self._read() as db:
            self._report_mark: int = db.execute("SELECT COALESCE(MAX(written), 0) FROM reports").fetchone()[0]
            self._agent_mark: int = db.execute("SELECT COALESCE(MAX(written), 0) FROM agents").fetchone()[0]

    def close(self) -> None:
        self.db.close()

    def now(self) -> float:
        """The store's clock: seconds since the epoch, as its timestamps are written."""
        return self._clock()

    # -- transactions (coordinator.database) ---------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._tx_events.sessions = appended = set()
        self._tx_events.decided = decided = []
        try:
            with self.db.tx() as db:
                yield db
        finally:
            self._tx_events.sessions = self._tx_events.decided = None
        self._appended.update(appended)  # committed: now the watchers may be told
        if self.on_flip_decided is not None:
            for rec in decided:
                self.on_flip_decided(rec)

    def _decided(self, rec: VersionRecord) -> None:
        """`_flip_event` calls this for each decision it writes (always inside `_tx`)."""
        self._tx_events.decided.append(rec)

    @contextmanager
    def _agents_tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that changes agent rows, and with them `agent_keys` (inside
        it, under the writer's lock, so keys change in the order their rows do). One that
        fails to commit after changing keys leaves them ahead of the rows: all are read again."""
        changes = None
        try:
            with self._tx() as db:
                changes = self.agent_keys.changes
                yield db
        except BaseException:
            if changes is not None and changes != self.agent_keys.changes:
                with suppress(Exception):  # the transaction's own error is the one to raise
                    self._load_agent_keys()
            raise

    def _load_agent_keys(self) -> None:
        with self._read() as db:
            rows = db.execute("SELECT session, agent_id, role, instance FROM agents").fetchall()
        self.agent_keys.replace(
            (r["session"], r["agent_id"], r["role"], self.tokens.agent_key(*tuple(r))) for r in rows
        )

    def _appended_event(self, session: str) -> None:
        """`_event` calls this for each event it writes (always inside `_tx`)."""
        self._tx_events.sessions.add(session)

    def _read(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.db.read()

    def _writer(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.db.writer()

    def nonblocking(self) -> AbstractContextManager[None]:
        """See `Database.nonblocking`: StoreBusy instead of waiting, on this thread."""
        return self.db.nonblocking()

    @property
    def on_free(self) -> Callable[[], None] | None:
        """Called each time the writer's lock or a reader is let go (`Database.on_free`)."""
        return self.db.on_free

    @on_free.setter
    def on_free(self, fn: Callable[[], None] | None) -> None:
        self.db.on_free = fn

    def _notify(self, session: str) -> None:
        """Wakes the session's watchers after a write, if it appended events: a handshake
        that commits nothing must not wake a thousand watch streams (each handshake of a
        fleet's burst did, and every watcher re-read the feed a thousand times over)."""
        try:
            self._appended.remove(session)  # atomic: of two writers, one notifies
        except KeyError:
            return
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
        flip_policy: str = "",
        prepare_timeout_s: float = 0.0,
        prepared_loss: str = "",
        rollout_ids: Sequence[str] = (),
        max_rollouts: int = 0,
    ) -> tuple[SessionRecord, bool]:
        """Opens or creates a session; a trainer with a new incarnation bumps the generation.

        Returns (session, created). Versions still STAGING under an older generation
        become FAILED (they can never be completed). A trainer that says which version it
        will publish first (`next_version`) is refused, generation untouched, when that
        version is not newer than the session's latest. The flip settings (docs/design.md
        "Atomic flips"; "" and 0 keep the stored ones) are a trainer's to set, and hold for
        versions that become READY after. A trainer's `rollout_ids` and `max_rollouts`,
        where given, replace the session's (which rollout ids may join).
        """
        check_session_name(name)
        check_flip_settings(flip_policy, prepare_timeout_s, prepared_loss)
        if not trainer:
            flip_policy, prepare_timeout_s, prepared_loss = "", 0.0, ""
        if len(rollout_ids) > 100_000:
            raise InvalidArgument(f"{len(rollout_ids)} ids are implausibly many", field="rollout_ids")
        for agent_id in rollout_ids:
            check_agent_id(agent_id, "rollout_ids")
        if max_rollouts > 100_000:
            raise InvalidArgument(f"{max_rollouts} is implausibly large", field="max_rollouts")
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
                if db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] >= self.max_sessions:
                    raise ResourceExhausted(
                        f"{name!r} would exceed the limit of {self.max_sessions} sessions (--max-sessions); "
                        "delete finished ones (wsctl delete-session)",
                        field="session",
                    )
                gen = 1 if trainer else 0
                db.execute(
                    "INSERT INTO sessions (name, generation, incarnation, trainer_ranks, min_rollouts, created_at, "
                    "weight_sync_mode, uid, flip_policy, prepare_timeout_s, prepared_loss) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        name,
                        gen,
                        incarnation if trainer else "",
                        trainer_ranks or 1,
                        max(min_rollouts, 0) or 1,
                        now,
                        mode or DEFAULT_MODE,
                        secrets.token_hex(8),
                        flip_policy or "INDEPENDENT",
                        prepare_timeout_s or DEFAULT_PREPARE_TIMEOUT_S,
                        prepared_loss or "FLIP_WITHOUT",
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
                db.execute(
                    "UPDATE sessions SET flip_policy=COALESCE(NULLIF(?, ''), flip_policy), "
                    "prepare_timeout_s=COALESCE(NULLIF(?, 0), prepare_timeout_s), "
                    "prepared_loss=COALESCE(NULLIF(?, ''), prepared_loss) WHERE name=?",
                    (flip_policy, prepare_timeout_s, prepared_loss, name),
                )
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
            if trainer and rollout_ids:
                ids = json.dumps(sorted(set(rollout_ids)))
                db.execute("UPDATE sessions SET rollout_ids=? WHERE name=?", (ids, name))
            if trainer and max_rollouts:
                db.execute("UPDATE sessions SET max_rollouts=? WHERE name=?", (max_rollouts, name))
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

    def delete_session(self, name: str, *, force: bool = False) -> tuple[int, int]:
        """Deletes a session and every row stored for it; returns (versions, agents)
        deleted. FailedPrecondition while an agent holds a live lease, unless `force` (a
        live trainer would open it again at its next beat: stop the job first)."""
        check_session_name(name)
        with self._agents_tx() as db:
            self._session(db, name)
            live = self._live_agents(db, name, "TRAINER") + self._live_agents(db, name, "ROLLOUT")
            if live and not force:
                raise FailedPrecondition(
                    f"session {name!r} has {len(live)} agent(s) with a live lease, first {live[0]!r}: stop them "
                    "(or wait out their leases), or force",
                    field="force",
                )
            counts = delete_session_rows(db, name)
            self.agent_keys.forget_session(name)
        self._manifests.discard_where(lambda key: key[0] == name)
        if self._listener is not None:  # its watchers wake, find it gone and end
            self._listener.notify(name)
        return counts["versions"], counts["agents"]

    # -- agents -------------------------------------------------------------------
    def register_agent(
        self,
        session: str,
        agent_id: str,
        *,
        role: str,
        endpoint: Endpoint,
        rank: int = 0,
        generation: int = 0,
        instance: str = "",
        agent_key: str = "",
    ) -> Registration:
        """Registers (or re-registers) an agent and grants a lease of lease_ttl_s; returns
        the session and the agent's key (`coordinator.agent_keys`).

        A trainer's `generation` (0: the current one) is stored with it; an older one is
        StaleGeneration, so a fenced trainer cannot come back. An id keeps its role while
        its row exists: registering it as the other role is PermissionDenied naming agent_id.
        A rollout's id is its registering process's while its lease is live: another
        process (neither its `instance` nor its `agent_key`) is AlreadyExists naming
        agent_id; once the lease lapsed, the id is anyone's to register. A rollout without
        an `instance` gets one drawn here. A trainer's ids go with the session's generation
        (OpenSession as the trainer fenced the one before): its key depends on neither.
        """
        check_session_name(session)
        check_agent_id(agent_id)
        if role not in ("TRAINER", "ROLLOUT"):
            raise InvalidArgument(f"must be TRAINER or ROLLOUT, got {role!r}", field="role")
        if len(instance) > MAX_INSTANCE_CHARS:
            raise InvalidArgument(f"longer than {MAX_INSTANCE_CHARS} characters", field="instance")
        with self._agents_tx() as db:
            s = self._session(db, session)
            if role == "TRAINER" and not 0 <= rank < s.trainer_ranks:
                raise InvalidArgument(f"{rank} is not in [0, trainer_ranks={s.trainer_ranks})", field="rank")
            if role == "TRAINER":
                check_generation(generation or s.generation, s)
            held = self._holder(db, session, agent_id, role, instance, agent_key)
            if role == "ROLLOUT":
                self._check_joins(db, s, agent_id)
            if role == "TRAINER":
                instance = ""
            elif held is not None:
                instance = held  # the same process(es): the same key
            elif not instance:
                instance = secrets.token_hex(16)
            db.execute(
                "INSERT OR REPLACE INTO agents (session, agent_id, role, endpoint, rank, lease_expires_at, "
                "current_version, generation, written, instance) VALUES (?,?,?,?,?,?,COALESCE((SELECT current_version "
                "FROM agents WHERE session=? AND agent_id=?), 0),?,?,?)",
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
                    self._next_agent_mark(),
                    instance,
                ),
            )
            key = self.tokens.agent_key(session, agent_id, role, instance)
            self.agent_keys.bind(session, agent_id, role, key)
        return Registration(s, key)

    def _check_joins(self, db: sqlite3.Connection, s: SessionRecord, agent_id: str) -> None:
        """Whether rollout `agent_id` may join `s` (the session's rollout_ids, max_rollouts):
        PermissionDenied for an id outside its ids, ResourceExhausted for a new id while
        max_rollouts others are live; an id with a row of its own passes the count."""
        expected = s.expected_ids()
        if expected and agent_id not in expected:
            raise PermissionDenied(
                f"{agent_id!r} is not one of session {s.name!r}'s {len(expected)} rollout ids "
                "(OpenSession.rollout_ids)",
                field="agent_id",
            )
        if not s.max_rollouts:
            return
        has_row = db.execute(
            "SELECT 1 FROM agents WHERE session=? AND agent_id=? AND role='ROLLOUT'", (s.name, agent_id)
        ).fetchone()
        if has_row is None and len(self._live_agents(db, s.name, "ROLLOUT")) >= s.max_rollouts:
            raise ResourceExhausted(
                f"{agent_id!r} cannot join session {s.name!r}: {s.max_rollouts} rollouts are live "
                "(OpenSession.max_rollouts)",
                field="agent_id",
            )

    def _holder(
        self, db: sqlite3.Connection, session: str, agent_id: str, role: str, instance: str, agent_key: str
    ) -> str | None:
        """The instance of the id's row when the registering process is its holder (it
        names the row's instance or carries its key); None when the id is free to take.
        PermissionDenied when the row is of the other role, AlreadyExists while another
        rollout process's lease is live."""
        row = db.execute(
            "SELECT role, instance, endpoint, lease_expires_at FROM agents WHERE session=? AND agent_id=?",
            (session, agent_id),
        ).fetchone()
        if row is None:
            return None
        if row["role"] != role:
            raise PermissionDenied(
                f"{agent_id!r} is registered as a {row['role'].lower()}; a {role.lower()} cannot take its id "
                f"(it is free once deregistered, or {self.forget_agents_after_s:.0f}s after its lease lapsed)",
                field="agent_id",
            )
        if role == "TRAINER":
            return None
        own_key = self.tokens.agent_key(session, agent_id, role, row["instance"])
        if (instance and _same(instance, row["instance"])) or _same(agent_key, own_key):
            return str(row["instance"])
        left = row["lease_expires_at"] - self._clock()
        if left < 0:
            return None
        held = json.loads(row["endpoint"])
        where = ", ".join(x for x in (held.get("host_id", ""), held.get("address", "")) if x) or "no address"
        raise AlreadyExists(
            f"{agent_id!r} is registered by another live process ({where}) for {left:.1f}s more unless it beats; "
            "agent ids must be unique (one per rollout process)",
            field="agent_id",
        )

    def deregister_agent(self, session: str, agent_id: str) -> bool:
        """Ends an agent's lease now (graceful exit); False when it was not registered.

        Its version leases go with it, and versions awaiting handshakes are re-evaluated
        (a departed rollout is not required).
        """
        check_session_name(session)
        check_agent_id(agent_id)
        with self._agents_tx() as db:
            self._session(db, session)
            removed = db.execute("DELETE FROM agents WHERE session=? AND agent_id=?", (session, agent_id)).rowcount > 0
            self.agent_keys.forget([(session, agent_id)])
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
                "UPDATE agents SET lease_expires_at=?, current_version=?, written=? WHERE session=? AND agent_id=? "
                "AND lease_expires_at>=? RETURNING (SELECT generation FROM sessions WHERE name=agents.session)",
                (now + self.lease_ttl_s, current_version, self._next_agent_mark(), session, agent_id, now),
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
            "UPDATE agents SET lease_expires_at=MAX(lease_expires_at, ?), written=? "
            "WHERE session=? AND agent_id=? AND lease_expires_at>=?",
            (now + self.lease_ttl_s, self._next_agent_mark(), session, agent_id, now),
        ).fetchall()

    def _next_agent_mark(self) -> int:
        """A mark for an agent row being written; under the writer's lock, so marks commit in
        order (one rolled back is skipped, never reused) and a snapshot holds a prefix of them."""
        self._agent_mark += 1
        return self._agent_mark

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
                f"SELECT {AGENT_COLUMNS} FROM agents WHERE session=? AND role='ROLLOUT' AND lease_expires_at-?>=? "
                "AND endpoint LIKE '%\"relay\"%' "  # the terms of the relay_candidates index
                "AND EXISTS (SELECT 1 FROM json_each(endpoint, '$.transports') WHERE value='relay') "
                "AND json_extract(endpoint, '$.tcp_address')!='' ORDER BY rank, agent_id",
                (session, self.lease_ttl_s, fresh_after),
            ).fetchall()
            return [agent_record(r, self._clock()) for r in rows]

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
    def _parts(self, db: sqlite3.Connection, session: str, version: int) -> list[Part]:
        rows = db.execute(
            "SELECT body FROM parts WHERE session=? AND version=? ORDER BY rank", (session, version)
        ).fetchall()
        return [Part.from_dict(json.loads(r["body"])) for r in rows]

    def prune(self) -> int:
        """Applies the retention window (see `coordinator.retention`); returns the number
        of versions summarized. Each call frees a bounded number of pages."""
        with self._tx() as db:
            pruned = retention.prune(db, self.retain_versions)
        with self._writer() as db:  # incremental_vacuum cannot run inside a transaction
            retention.vacuum(db)
        return pruned

    def forget_agents(self) -> int:
        """Forgets agents whose lease lapsed more than `forget_agents_after_s` ago (see
        `coordinator.retention`); returns how many. One that comes back registers again."""
        with self._agents_tx() as db:
            forgotten = retention.forget_agents(db, self._clock() - self.forget_agents_after_s)
            self.agent_keys.forget(forgotten)
        return len(forgotten)

    def forget_empty_sessions(self) -> list[str]:
        """Forgets sessions made over `forget_agents_after_s` ago (and three lease TTLs:
        a rollout makes its session, then registers in it) that no trainer ever opened and
        that hold no agent and no version (see `coordinator.retention`); returns their names."""
        made_before = self._clock() - max(self.forget_agents_after_s, 3 * self.lease_ttl_s)
        with self._tx() as db:
            names = retention.forget_empty_sessions(db, made_before)
        if self._listener is not None:
            for name in names:  # an operator's watch of it ends, as after delete_session
                self._listener.notify(name)
        return names

    def database_bytes(self) -> int:
        with self._writer() as db:
            return retention.database_bytes(db)

    def fleet_gauges(self) -> list[FleetGauges]:
        """Per session: agents alive and expired, leases, newest published and committed."""
        with self._read() as db:
            return fleet_gauges(db, self._clock())

    # -- reads --------------------------------------------------------------------
    def version(self, session: str, version: int) -> VersionRecord:
        check_session_name(session)
        with self._read() as db:
            return self._version(db, session, version)

    def _version(self, db: sqlite3.Connection, session: str, version: int) -> VersionRecord:
        row = db.execute(VERSION_SQL, (session, version)).fetchone()
        if row is None:
            raise VersionNotFound(f"version {version} of session {session!r} not found")
        return version_record(row)

    def versions(self, session: str, limit: int = 20) -> list[VersionRecord]:
        """Newest first."""
        check_session_name(session)
        with self._read() as db:
            return self._versions(db, self._session(db, session), limit)

    @staticmethod
    def _versions(db: sqlite3.Connection, s: SessionRecord, limit: int) -> list[VersionRecord]:
        return [version_record(r) for r in db.execute(NEWEST_VERSIONS_SQL, (s.name, limit))]

    def status_snapshot(self, session: str, version_limit: int, agents_after: int = -1) -> StatusSnapshot:
        """Session, newest versions, agents written after mark `agents_after` (-1: all) with
        the agents' stamp, report stamps and the newest version's part digests in one read:
        one consistent snapshot (a version listed is never newer than the event seq), and
        one transaction for a call dashboards make every second."""
        check_session_name(session)
        now = self._clock()
        with self._read() as db:
            s = self._session(db, session)
            seq = events.latest_seq(db, session)
            versions = self._versions(db, s, version_limit)
            agents, agent_stamp = self._agent_rows(db, session, agents_after)
            stamps = self._report_stamps(db, session, [v.version for v in versions]) if versions else {}
            digests = (
                db.execute(
                    "SELECT rank, part_digest FROM parts WHERE session=? AND version=? ORDER BY rank",
                    (session, versions[0].version),
                ).fetchall()
                if versions
                else []
            )
        return StatusSnapshot(s, seq, versions, agents, agent_stamp, now, stamps, [(d[0], d[1]) for d in digests])

    def agent_rows(self, session: str) -> tuple[list[tuple[Any, ...]], WrittenStamp, float]:
        """All of a session's agent rows, their stamp and the clock, in one read."""
        check_session_name(session)
        now = self._clock()
        with self._read() as db:
            self._session(db, session)
            rows, stamp = self._agent_rows(db, session, -1)
        return rows, stamp, now

    @staticmethod
    def _agent_rows(db: sqlite3.Connection, session: str, after: int) -> tuple[list[tuple[Any, ...]], WrittenStamp]:
        """Agent rows written after mark `after` and the session's (count, newest mark).
        sqlite3 gives the GIL up around every row it steps to: read on a status thread
        beside a busy event loop, 1,000 rows took 38 ms against 4 ms alone."""
        cursor = db.cursor()
        cursor.row_factory = None  # plain tuples: hashable, and a reply keeps each one's encoding
        count, newest = cursor.execute(
            "SELECT COUNT(*), COALESCE(MAX(written), 0) FROM agents WHERE session=?", (session,)
        ).fetchone()
        rows = cursor.execute(
            f"SELECT {AGENT_COLUMNS} FROM agents WHERE session=? AND written>?", (session, after)
        ).fetchall()
        return rows, WrittenStamp(count, newest)

    def parts(self, session: str, version: int) -> list[Part]:
        check_session_name(session)
        with self._read() as db:
            return self._parts(db, session, version)

    def agents(self, session: str) -> list[AgentRecord]:
        check_session_name(session)
        now = self._clock()
        with self._read() as db:
            self._session(db, session)
            found = db.execute(
                f"SELECT {AGENT_COLUMNS} FROM agents WHERE session=? ORDER BY role, rank, agent_id", (session,)
            ).fetchall()
            return [agent_record(r, now) for r in found]

    def reports(self, session: str, versions: list[int]) -> list[ReportRecord]:
        check_session_name(session)
        if not versions:
            return []
        with self._read() as db:
            marks = ",".join("?" * len(versions))
            rows = db.execute(
                f"SELECT {REPORT_COLUMNS} FROM reports WHERE session=? AND version IN ({marks}) "
                "ORDER BY version DESC, agent_id",
                (session, *versions),
            )
            return [report_record(r) for r in rows]

    def report_stamps(self, session: str, versions: list[int]) -> dict[int, WrittenStamp]:
        """Per version with reports: (count, newest `written` mark), which any new, replaced
        or pruned report changes."""
        if not versions:
            return {}
        with self._read() as db:
            return self._report_stamps(db, session, versions)

    def reports_since(self, session: str, version: int, after_mark: int) -> ReportsSince:
        """A version's reports written after mark `after_mark` (-1: all), and the stamp of
        them all (one snapshot): a reader that kept the earlier ones tops them up."""
        with self._read() as db:
            stamp = self._report_stamps(db, session, [version]).get(version, WrittenStamp(0, 0))
            rows = db.execute(
                f"SELECT {REPORT_COLUMNS} FROM reports WHERE session=? AND version=? AND written>?",
                (session, version, after_mark),
            ).fetchall()
        return ReportsSince(stamp, [report_record(r) for r in rows])

    @staticmethod
    def _report_stamps(db: sqlite3.Connection, session: str, versions: list[int]) -> dict[int, WrittenStamp]:
        marks = ",".join("?" * len(versions))
        return {
            r[0]: WrittenStamp(r[1], r[2])
            for r in db.execute(
                f"SELECT version, COUNT(*), MAX(written) FROM reports WHERE session=? AND version IN ({marks}) "
                "GROUP BY version",
                (session, *versions),
            )
        }

    def events_since(self, session: str, seq: int, limit: int = 256) -> list[Event]:
        """Version events after seq, oldest first (for WatchVersions replay)."""
        with self._read() as db:
            self._session(db, session)
            return events.since(db, session, seq, limit, lambda v: self._version(db, session, v))

    def latest_seq(self, session: str) -> int:
        """The newest event sequence number of a session (0 when none)."""
        with self._read() as db:
            return events.latest_seq(db, session)

    def event_states_since(self, session: str, seq: int) -> list[tuple[int, int, str]]:
        """(seq, version, state at that event) after seq: the raw event log."""
        with self._read() as db:
            return events.states_since(db, session, seq)


def _same(a: str, b: str) -> bool:
    """`a == b` in time that does not tell how much of a secret was guessed."""
    return hmac.compare_digest(a.encode(), b.encode())
