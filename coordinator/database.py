"""The coordinator's SQLite database: schema and migrations, one writer connection behind a
lock, a pool of read-only connections (WAL: reads see the last commit without waiting for
the writer), and the transactions the store runs on them."""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from weightsync.errors import FailedPrecondition, ResourceExhausted, TransportUnavailable, WeightsyncError

log = logging.getLogger(__name__)

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
-- ATOMIC versions: a rollout's PREPARED report (the version verified and held ready).
CREATE TABLE IF NOT EXISTS prepares (
  session TEXT NOT NULL, version INTEGER NOT NULL, agent_id TEXT NOT NULL, ok INTEGER NOT NULL,
  mismatch TEXT NOT NULL, reported_at REAL NOT NULL,
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
    # A store-wide mark, larger for every report written (replaced ones too): readers that
    # keep a version's reports ask for the newer ones (coordinator.status_view).
    ("reports", "written", "INTEGER NOT NULL DEFAULT 0"),
    # The same for agents: every write of a row (register, heartbeat, renewal) takes a new
    # mark, so a fleet's status reads only the rows changed since its last reply.
    ("agents", "written", "INTEGER NOT NULL DEFAULT 0"),
    # A part's size and staging time beside its body: every version record sums them, and
    # reading them out of the body parsed all of its JSON (5 ms at 3,000 tensors; -1: not
    # yet filled in from the body, `BACKFILLS`).
    ("parts", "total_bytes", "INTEGER NOT NULL DEFAULT -1"),
    ("parts", "stage_seconds", "REAL NOT NULL DEFAULT -1"),
    # The process(es) a rollout's row belongs to (RegisterAgentRequest.instance, or one drawn
    # for it; '' for trainers): the agent's key derives from it (coordinator.agent_keys).
    ("agents", "instance", "TEXT NOT NULL DEFAULT ''"),
    # A session's identity, drawn at its creation (RegisterAgentResponse.session_uid): a
    # session deleted and made again under its name, or after a lost database, has another.
    ("sessions", "uid", "TEXT NOT NULL DEFAULT ''"),
    # How rollouts take a session's versions (docs/design.md "Atomic flips"); a version
    # keeps the session's settings as they were at its READY.
    ("sessions", "flip_policy", "TEXT NOT NULL DEFAULT 'INDEPENDENT'"),
    ("sessions", "prepare_timeout_s", "REAL NOT NULL DEFAULT 300"),
    ("sessions", "prepared_loss", "TEXT NOT NULL DEFAULT 'FLIP_WITHOUT'"),
    ("versions", "flip_policy", "TEXT NOT NULL DEFAULT 'INDEPENDENT'"),
    ("versions", "prepared_loss", "TEXT NOT NULL DEFAULT 'FLIP_WITHOUT'"),
    ("versions", "prepare_by", "REAL NOT NULL DEFAULT 0"),  # READY + prepare_timeout_s
    ("versions", "flip_decided_at", "REAL NOT NULL DEFAULT 0"),  # 0: undecided
    ("versions", "flip_skew_s", "REAL"),  # NULL: fewer than two flip times
    ("reports", "flipped_at", "REAL NOT NULL DEFAULT 0"),  # the rollout's clock at the swap (0: not said)
    # Which rollout ids may join (register): a JSON list ('': any id) and a count of live
    # rollouts a new id may join (0: any number). The trainer sets them (OpenSession).
    ("sessions", "rollout_ids", "TEXT NOT NULL DEFAULT ''"),
    ("sessions", "max_rollouts", "INTEGER NOT NULL DEFAULT 0"),
)
# Columns added above whose values older rows hold elsewhere: filled in once, on open.
BACKFILLS = (
    "UPDATE parts SET total_bytes=json_extract(body, '$.total_bytes'), "
    "stage_seconds=COALESCE(json_extract(body, '$.stage_seconds'), 0.0) WHERE total_bytes<0",
    "UPDATE sessions SET uid=lower(hex(randomblob(8))) WHERE uid=''",
)
# Read connections (reads run beside the writer in WAL mode). Status, manifest and watch
# threads hold some while the event loop runs short reads on others: with 4, a fleet's
# burst found none free on the loop half the time.
READERS = 8


_CORRUPT_CODES = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


class _Corrupt(sqlite3.DatabaseError):
    """`PRAGMA quick_check` found the file damaged."""

    sqlite_errorcode = sqlite3.SQLITE_CORRUPT


def _primary_code(error: BaseException | None) -> int | None:
    """SQLite's primary result code of an error: Python reports the extended one
    (SQLITE_IOERR_WRITE, SQLITE_CORRUPT_INDEX, SQLITE_BUSY_SNAPSHOT...), whose low byte
    is the primary code."""
    code = getattr(error, "sqlite_errorcode", None) if isinstance(error, sqlite3.Error) else None
    return None if code is None else code & 0xFF


def is_corrupt(error: BaseException | None) -> bool:
    """Whether SQLite found the database file damaged (a torn write, a bad disk, a file
    that is no database)."""
    return _primary_code(error) in _CORRUPT_CODES


def quarantine(db_path: Path) -> Path:
    """Moves a damaged database (and its WAL and shared-memory files) aside, beside it, as
    `<name>.corrupt-<UTC time>`; returns the new path of the database file."""
    kept = db_path.with_name(f"{db_path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    for suffix in ("", "-wal", "-shm"):
        source = Path(f"{db_path}{suffix}")
        if source.exists():
            source.rename(f"{kept}{suffix}")
    return kept


def _storage_error(error: BaseException | None) -> WeightsyncError | None:
    """What a statement SQLite refused for a reason of the machine, not of the request, is
    answered with (None for any other error): a full disk (or page limit) is
    RESOURCE_EXHAUSTED, a database another process holds locked past the busy timeout
    (an operator's sqlite3 shell, a backup), a damaged file or a disk that fails its reads
    or writes (an I/O error, a file system remounted read-only, a file-size limit)
    UNAVAILABLE; all name `database`. Raised as they are, they would come back INTERNAL
    and end the coordinator's housekeeping."""
    code = _primary_code(error)
    if code in _CORRUPT_CODES:
        return TransportUnavailable(
            f"the coordinator's database is damaged ({error}): it restarts on a new one; retry", field="database"
        )
    if code == sqlite3.SQLITE_FULL:
        return ResourceExhausted(
            f"the coordinator's disk is full ({error}); nothing was written: free space, then retry", field="database"
        )
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return TransportUnavailable(
            f"another process holds the coordinator's database locked ({error}); nothing was written: retry",
            field="database",
        )
    if code in (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN):
        return TransportUnavailable(
            f"the coordinator's disk failed the database ({error}, {getattr(error, 'sqlite_errorname', '')}); "
            "nothing was written: retry",
            field="database",
        )
    return None


class StoreBusy(Exception):
    """Within `SessionStore.nonblocking()`: the call would have waited for a connection
    (the writer's lock or a free reader) and did nothing; run it on a thread instead."""


class NotOnLoop(StoreBusy):
    """Within `nonblocking()`: the call would hold its thread long (a manifest not built yet,
    a very large report) and did nothing irreversible; run it on a thread at once."""


class Database:
    """Connections and transactions; thread-safe. Lock order: the writer's lock only."""

    def __init__(self, db_path: str | Path) -> None:
        self.lock = threading.Lock()  # the writer's
        self._nowait = threading.local()  # set on a thread inside nonblocking()
        # Called (on the releasing thread) each time the writer's lock or a reader is let
        # go: how an event loop waiting to run a short store call on itself (StoreBusy)
        # learns it may try again.
        self.on_free: Callable[[], None] | None = None
        # Called (once, on the thread that met it) when a statement finds the file damaged:
        # the coordinator then stops, and its next start moves the file aside.
        self.on_corrupt: Callable[[BaseException], None] | None = None
        self.corrupt: BaseException | None = None
        self.closed = False
        self._lock_fd = -1
        try:
            if str(db_path) != ":memory:":
                Path(db_path).parent.mkdir(parents=True, exist_ok=True)
                self._lock_fd = _lock_database(Path(db_path))
            try:
                self._open(db_path)
            except sqlite3.DatabaseError as e:
                if not is_corrupt(e) or str(db_path) == ":memory:":
                    raise
                # Lost state heals (agents register again, the trainer opens its session
                # again: docs/design.md "Invariants under faults"); a coordinator that would not
                # start would wait for a person. The damaged file is kept for one.
                kept = quarantine(Path(db_path))
                log.error("the database %s is damaged (%s): moved to %s; starting with a new one", db_path, e, kept)
                self._open(db_path)
        except (OSError, sqlite3.Error) as e:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
            raise FailedPrecondition(
                f"cannot open the database {db_path}: {e} (its directory must exist or be creatable and be "
                f"writable by uid {os.getuid()}; on Kubernetes, the pod's fsGroup)",
                field="db_path",
            ) from e

    def _open(self, db_path: str | Path) -> None:
        self.writer_db = db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        try:
            self._prepare(db, db_path)
        except BaseException:
            db.close()
            while self.readers is not None and not self.readers.empty():
                self.readers.get().close()
            raise

    def _prepare(self, db: sqlite3.Connection, db_path: str | Path) -> None:
        self.readers: queue.SimpleQueue[sqlite3.Connection] | None = None
        db.row_factory = sqlite3.Row
        # A damaged page surfaces here rather than as a failed request later. Retention
        # bounds what this reads: 227 MB of parts took 0.06 s warm, 0.48 s from disk here.
        problem = db.execute("PRAGMA quick_check(1)").fetchone()[0]
        if problem != "ok":
            raise _Corrupt(f"quick_check: {problem}")
        # WAL + synchronous=NORMAL: a committed transaction survives a killed process
        # (the WAL is in the OS page cache); only a host crash may lose the last commits.
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # takes effect on a new file only
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        for table, column, decl in MIGRATIONS:  # databases from before the column existed
            if column not in {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
        for statement in BACKFILLS:
            db.execute(statement)
        # Reads (GetStatus, watches, manifests) use connections of their own: in WAL mode
        # they see the last commit without waiting for the writer's lock, so a fleet's
        # heartbeats and a big publish do not queue every status call behind them.
        if str(db_path) != ":memory:":
            self.readers = queue.SimpleQueue()
            for _ in range(READERS):
                reader = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None, timeout=30)
                reader.row_factory = sqlite3.Row
                reader.execute("PRAGMA query_only=ON")
                self.readers.put(reader)

    def meta(self, key: str, default: str) -> str:
        """A persistent setting, stored as `default` the first time it is asked for."""
        with self.writer() as db:
            db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (key, default))
            return str(db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()[0])

    def close(self) -> None:
        """Closes every connection. A call still running (a handler the server's stop left
        behind) then gets UNAVAILABLE, not a closed connection's ProgrammingError (INTERNAL)
        or a wait for a reader that never comes back."""
        self.closed = True
        with self.lock:
            while self.readers is not None and not self.readers.empty():
                self.readers.get().close()
            self.writer_db.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # another coordinator may open the database now
                self._lock_fd = -1

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

    def is_nonblocking(self) -> bool:
        """Whether this thread is inside `nonblocking()`."""
        return bool(getattr(self._nowait, "on", False))

    def acquire_writer(self) -> None:
        if not self.lock.acquire(blocking=not getattr(self._nowait, "on", False)):
            raise StoreBusy
        if self.closed:
            self.lock.release()
            raise _stopping()

    def release_writer(self) -> None:
        self.lock.release()
        if (free := self.on_free) is not None:
            free()

    @contextmanager
    def writer(self) -> Iterator[sqlite3.Connection]:
        """The writer connection for one autocommit statement (no BEGIN/COMMIT round trips)."""
        self.acquire_writer()
        try:
            yield self.writer_db
        except sqlite3.Error as e:
            if (known := self.storage_error(e)) is not None:
                raise known from e
            raise
        finally:
            self.release_writer()

    def raise_failure(self, body_error: BaseException | None, commit_error: sqlite3.Error | None) -> None:
        """Raises what ending a transaction says (at most one of the two is set: a body
        that failed is not committed): a machine's refusal as `storage_error` maps it, a
        failed COMMIT as it is. A body's other errors propagate from `__exit__` as they were."""
        failed = body_error or commit_error
        if (known := self.storage_error(failed)) is not None:
            raise known from failed
        if commit_error is not None:
            raise commit_error

    def storage_error(self, error: BaseException | None) -> WeightsyncError | None:
        """`_storage_error`, noting a damaged file (`corrupt`, `on_corrupt`) the first time."""
        if is_corrupt(error) and self.corrupt is None:
            assert error is not None
            self.corrupt = error
            log.error("the database is damaged: %s", error)
            if (react := self.on_corrupt) is not None:
                react(error)
        return _storage_error(error)

    def tx(self) -> _Tx:
        """A write transaction (BEGIN IMMEDIATE under the writer's lock)."""
        return _Tx(self)

    def read(self) -> _Read | _Tx:
        """A read-only snapshot (a reader connection; the writer's for ":memory:")."""
        return _Tx(self) if self.readers is None else _Read(self, getattr(self._nowait, "on", False))


def _stopping() -> TransportUnavailable:
    return TransportUnavailable("the coordinator is stopping; retry", field="database")


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


class _Read:
    """`with database.read() as db`: a reader connection from the pool, in one snapshot."""

    def __init__(self, database: Database, nowait: bool) -> None:
        assert database.readers is not None
        self._database = database
        self._readers = database.readers
        self._nowait = nowait
        self._db: sqlite3.Connection | None = None

    def __enter__(self) -> sqlite3.Connection:
        while True:
            if self._database.closed:
                raise _stopping()
            try:  # waits in steps: a reader never comes back once the database is closed
                self._db = self._readers.get(block=not self._nowait, timeout=0.5)
                break
            except queue.Empty:
                if self._nowait:
                    raise StoreBusy from None
        self._db.execute("BEGIN")
        return self._db

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        db = self._db
        assert db is not None
        try:
            commit_error = _end_transaction(db, exc_type is None)
        finally:
            if self._database.closed:
                db.close()  # out while close() closed the others
            else:
                self._readers.put(db)
            if (free := self._database.on_free) is not None:
                free()
        self._database.raise_failure(exc, commit_error)


class _Tx:
    """`with database.tx() as db`: takes the lock, BEGIN IMMEDIATE, COMMIT or ROLLBACK."""

    def __init__(self, database: Database) -> None:
        self._database = database

    def __enter__(self) -> sqlite3.Connection:
        self._database.acquire_writer()
        try:
            self._database.writer_db.execute("BEGIN IMMEDIATE")  # waits out another process's lock, 5 s
        except BaseException as e:
            self._database.release_writer()
            if (known := self._database.storage_error(e)) is not None:
                raise known from e
            raise
        return self._database.writer_db

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            commit_error = _end_transaction(self._database.writer_db, exc_type is None)
        finally:
            self._database.release_writer()
        self._database.raise_failure(exc, commit_error)


def _end_transaction(db: sqlite3.Connection, ok: bool) -> sqlite3.Error | None:
    """Commits `db`'s transaction when its body succeeded, else rolls it back; returns the
    COMMIT's error. After some errors (a full disk) SQLite has rolled the transaction back
    itself, and a ROLLBACK would fail and hide the error; after others (a failed COMMIT) it
    is still open, and every later BEGIN on the connection would fail until it ends."""
    commit_error = None
    if ok:
        try:
            db.execute("COMMIT")
        except sqlite3.Error as e:
            commit_error = e
    if db.in_transaction:
        db.execute("ROLLBACK")
    return commit_error
