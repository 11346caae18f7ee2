"""The version lifecycle of the session store: publish (STAGING -> READY), leases and
manifests, handshakes (-> COMMITTED / PARTIAL), abort, release, and the lease sweep.

A mixin of `SessionStore` (`coordinator.store`), which supplies the connections, the
session / agent queries and the clock named below.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sqlite3
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager

from coordinator import events
from coordinator.database import Database, NotOnLoop
from coordinator.flips import LIVE_ROLLOUT, FlipDecisions
from coordinator.handshake import AppliedReport, compare_report
from coordinator.recent import Recent
from coordinator.records import PublishOutcome, ReportOutcome, SessionRecord, VersionRecord
from coordinator.states import LATEST, SERVABLE, VersionState, check_transition
from weightsync.errors import (
    AgentNotFound,
    FailedPrecondition,
    InvalidArgument,
    NewestCommitted,
    SessionNotFound,
    StaleGeneration,
    VersionConflict,
    VersionNotFound,
    WrongState,
)
from weightsync.manifest import Manifest, Part
from weightsync.validation import (
    MAX_KEY_CHARS,
    Limits,
    check_agent_id,
    check_session_name,
    check_version,
    validate_against_parts,
    validate_part,
)

S = VersionState


class VersionLifecycle(FlipDecisions):
    """Publish, lease, handshake, abort, release, sweep (see the module docstring); the
    decisions of ATOMIC versions in `coordinator.flips`."""

    # Supplied by SessionStore:
    db: Database
    limits: Limits
    lease_ttl_s: float
    _clock: Callable[[], float]
    _manifests: Recent[tuple[str, int], Manifest]
    _tx: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _read: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _writer: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _notify: Callable[[str], None]
    _appended_event: Callable[[str], None]
    _decided: Callable[[VersionRecord], None]  # a flip decided in the open transaction
    on_transition: Callable[[VersionRecord], None] | None
    session: Callable[[str], SessionRecord]
    parts: Callable[[str, int], list[Part]]
    version: Callable[[str, int], VersionRecord]
    _session: Callable[[sqlite3.Connection, str], SessionRecord]
    _version: Callable[[sqlite3.Connection, str, int], VersionRecord]
    _parts: Callable[[sqlite3.Connection, str, int], list[Part]]
    _live_agents: Callable[[sqlite3.Connection, str, str], list[str]]
    _is_live_rollout: Callable[[sqlite3.Connection, str, str], bool]
    _renew: Callable[[sqlite3.Connection, str, str], None]
    _report_mark: int  # the newest reports.written

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
        if len(idempotency_key) > MAX_KEY_CHARS:
            raise InvalidArgument(f"longer than {MAX_KEY_CHARS} characters", field="header.idempotency_key")
        digest = part.digest()
        body = part.to_json()
        # Validation runs before the store's lock is taken: a part of 10^5 tensors takes a
        # while, and every session's calls wait on that lock. The transaction then checks
        # that what the validation relied on still holds (the generation, the sealed ranks).
        s = self.session(session)
        check_generation(generation, s)
        validate_part(part, trainer_ranks=s.trainer_ranks, limits=self.limits)
        if part.delta is not None:
            self._check_delta_base(session, version, part)
        checked = self._check_against_sealed(session, version, generation, part, s.trainer_ranks)
        with self._tx() as db:
            s = self._session(db, session)
            check_generation(generation, s)  # same generation: same trainer_ranks as validated
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
                    self._parts(db, session, version), session, version, generation, part, s.trainer_ranks, self.limits
                )
            if vrow is None:
                db.execute(
                    "INSERT INTO versions (session, version, state, generation, chunk_bytes, manifest_digest, "
                    "created_at, ready_at, committed_at, reason, required) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (session, version, S.STAGING.value, generation, part.chunk_bytes, "", now, 0.0, 0.0, "", "[]"),
                )
            db.execute(
                "INSERT INTO parts (session, version, rank, idempotency_key, part_digest, body, total_bytes, "
                "stage_seconds) VALUES (?,?,?,?,?,?,?,?)",
                (session, version, part.rank, idempotency_key, digest, body, part.total_bytes, part.stage_seconds),
            )
            if vrow is None:
                self._event(db, session, version, S.STAGING)
            if checked.manifest_digest:  # this part completes the version
                required = self._live_agents(db, session, "ROLLOUT")
                # Shuffled: `_owed` scans it for the first rollout still owed, which takes a
                # few steps per handshake whatever order the fleet reports in (sorted: n).
                random.shuffle(required)
                # The session's flip settings as they are now hold for this version.
                db.execute(
                    "UPDATE versions SET manifest_digest=?, ready_at=?, required=?, flip_policy=?, prepared_loss=?, "
                    "prepare_by=? WHERE session=? AND version=?",
                    (
                        checked.manifest_digest, now, json.dumps(required), s.flip_policy, s.prepared_loss,
                        now + s.prepare_timeout_s, session, version,
                    ),
                )  # fmt: skip
                self._supersede_undecided(db, session, version)
                self._set_state(db, session, version, S.READY, "")
            outcome = PublishOutcome(self._version(db, session, version), duplicate=False)
        if checked.manifest is not None:
            # The first reader would otherwise decode every rank's stored body: one
            # json.loads of a 10^5-tensor part holds the GIL for most of a second.
            self._manifests.put((session, version), checked.manifest)
        self._notify(session)
        return outcome

    def _check_delta_base(self, session: str, version: int, part: Part) -> None:
        """A delta names an older version of this session, by its manifest digest, whose
        part of this rank has the same chunk layout (what its encodings were made against)."""
        d = part.delta
        assert d is not None
        if d.base_version >= version:
            raise InvalidArgument(
                f"{d.base_version} is not older than version {version}", field="header.delta.base_version"
            )
        try:
            base = self.version(session, d.base_version)
        except VersionNotFound:
            raise FailedPrecondition(
                f"version {d.base_version} is not known here (never published, or pruned)",
                field="header.delta.base_version",
            ) from None
        if not base.manifest_digest or base.manifest_digest != d.base_manifest_digest:
            raise FailedPrecondition(
                f"{d.base_manifest_digest[:16]}… is not the manifest digest of version {d.base_version} "
                f"({base.manifest_digest[:16] or 'none yet'}…)",
                field="header.delta.base_manifest_digest",
            )
        layout = [(c.offset, c.length) for c in part.chunks]
        # (the base is most often the version before, whose manifest is kept decoded)
        kept = self._manifests.get((session, d.base_version))
        base_parts = kept.parts if kept is not None else self.parts(session, d.base_version)
        base_part = next((p for p in base_parts if p.rank == part.rank), None)
        if base_part is None or [(c.offset, c.length) for c in base_part.chunks] != layout:
            raise FailedPrecondition(
                f"version {d.base_version}'s part of rank {part.rank} has another chunk layout than this one",
                field="header.delta.base_version",
            )

    def _check_against_sealed(
        self, session: str, version: int, generation: int, part: Part, trainer_ranks: int
    ) -> _SealCheck | None:
        """Cross-rank checks against the parts sealed so far, outside the lock; None when
        this rank already sealed (the transaction answers duplicate or conflict)."""
        sealed = self.parts(session, version)
        if any(p.rank == part.rank for p in sealed):
            return None
        return _SealCheck.of(sealed, session, version, generation, part, trainer_ranks, self.limits)

    def manifest(self, session: str, version: int = 0, *, lease_for: str = "") -> tuple[VersionRecord, Manifest]:
        """A servable version's manifest (0 = the newest READY or COMMITTED one: `LATEST`);
        optionally takes a lease.

        Read on a reader connection; the lease is then one conditional statement under the
        writer's lock (a fleet takes a thousand at once on each new version, and a
        transaction of reads per lease queued every heartbeat behind them)."""
        check_session_name(session)
        if lease_for:
            check_agent_id(lease_for)
        with self._read() as db:
            self._session(db, session)
            if version == 0:
                version = self._latest(db, session)
            rec = self._version(db, session, version)
            _check_servable(rec)
            if lease_for and not self._is_live_rollout(db, session, lease_for):
                raise _no_live_lease(lease_for)
            if self.db.is_nonblocking() and (rec.session, rec.version) not in self._manifests:
                raise NotOnLoop  # decoding every rank's descriptors is long for a large model
            manifest = self._manifest(db, rec)
        if lease_for:
            rec = self._take_lease(rec, lease_for)
        return rec, manifest

    def _latest(self, db: sqlite3.Connection, session: str) -> int:
        """The newest READY or COMMITTED version (VersionNotFound when there is none)."""
        marks = ",".join("?" * len(LATEST))
        row = db.execute(
            f"SELECT MAX(version) AS v FROM versions WHERE session=? AND state IN ({marks})",
            (session, *[s.value for s in LATEST]),
        ).fetchone()
        if row["v"] is None:
            raise VersionNotFound(
                f"session {session!r} has no READY or COMMITTED version (a PARTIAL one is served by its number)"
            )
        return row["v"]

    def _take_lease(self, rec: VersionRecord, agent_id: str) -> VersionRecord:
        """Records `agent_id`'s lease on `rec`'s version if it is still servable and the
        agent still a live rollout (both re-checked in the statement: either may have
        changed since the caller read them); the record as of after the lease."""
        marks = ",".join("?" * len(SERVABLE))
        with self._writer() as db:
            db.execute(
                "INSERT OR IGNORE INTO leases SELECT ?1, ?2, ?4 WHERE "
                f"EXISTS (SELECT 1 FROM versions WHERE session=?1 AND version=?2 AND state IN ({marks})) "
                f"AND {LIVE_ROLLOUT.format(agent='?4')}",
                (rec.session, rec.version, self._clock(), agent_id, *[s.value for s in SERVABLE]),
            ).fetchall()
            # A rollout reads one version at a time: leasing a newer one ends its older leases
            # (a prefetch abandoned for a newer version frees the trainer's slot at once).
            db.execute(
                "DELETE FROM leases WHERE session=? AND agent_id=? AND version<? "
                "AND EXISTS (SELECT 1 FROM leases WHERE session=? AND agent_id=? AND version=?)",
                (rec.session, agent_id, rec.version, rec.session, agent_id, rec.version),
            )
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
            self._manifests.put(key, m)  # readers fill it too, outside the writer's lock
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
            if rec.flip_policy == "ATOMIC" and not rec.flip_decided_at:
                raise FailedPrecondition(
                    f"version {version} is flipped ATOMIC and its flip is not decided: report it PREPARED and apply "
                    "it once the flip is decided",
                    field="prepared",
                )
            mismatch = compare_report(self._manifest(db, rec), rec.manifest_digest, report)
            self._report_mark += 1  # under the writer's lock; a rolled-back mark is skipped, never reused
            db.execute(
                "INSERT OR REPLACE INTO reports (session, version, agent_id, ok, mismatch, body, reported_at, written, "
                "flipped_at) VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    session,
                    version,
                    agent_id,
                    int(mismatch is None),
                    mismatch or "",
                    json.dumps(report.stored()),
                    self._clock(),
                    self._report_mark,
                    report.flipped_at,
                ),
            )
            db.execute("DELETE FROM leases WHERE session=? AND version=? AND agent_id=?", (session, version, agent_id))
            self._renew(db, session, agent_id)
            self._evaluate(db, session, version)
            outcome = ReportOutcome(self._version(db, session, version), mismatch)
        self._notify(session)
        return outcome

    def _evaluate(self, db: sqlite3.Connection, session: str, version: int) -> None:
        """COMMITTED when every live required rollout reported OK and at least min_rollouts did;
        PARTIAL when every live required one reported and one of them failed. Only the
        rollouts the version requires (live when it became READY) can fail it: one that
        registered later counts toward min_rollouts with an OK, never against it.

        Runs on every handshake, so it is counted in SQL, stopping at the first required
        rollout still owed (a fleet of 1,000 would otherwise cost O(n) Python per report)."""
        rec = self._version(db, session, version)
        if rec.state not in (S.READY, S.PARTIAL):
            return
        if rec.flip_policy == "ATOMIC" and not rec.flip_decided_at:
            self._evaluate_flip(db, session, version)  # nothing commits before its flip is decided
            return
        s = self._session(db, session)
        counts = db.execute(
            "SELECT COUNT(*) AS n, COALESCE(SUM(ok), 0) AS ok FROM reports WHERE session=? AND version=?",
            (session, version),
        ).fetchone()
        if counts["ok"] >= s.min_rollouts and not self._owed(db, session, version, ok_only=True):
            self._record_flip_skew(db, session, version)
            self._set_state(db, session, version, S.COMMITTED, "")
            self._release_superseded(db, session)
        elif (  # PARTIAL needs a required rollout's failed report
            rec.state is S.READY
            and counts["n"] >= s.min_rollouts
            and not self._owed(db, session, version, ok_only=False)
            and (failed := self._required_failures(db, session, version))
        ):
            named = ", ".join(failed[:10]) + (" and more" if len(failed) > 10 else "")
            self._set_state(db, session, version, S.PARTIAL, f"handshake failed for {named}")

    def _required_failures(self, db: sqlite3.Connection, session: str, version: int) -> list[str]:
        """Up to 11 of the required rollouts whose handshake failed, by id."""
        return [
            r[0]
            for r in db.execute(
                "SELECT p.agent_id FROM reports p WHERE p.session=?1 AND p.version=?2 AND p.ok=0 AND p.agent_id IN "
                "(SELECT value FROM json_each((SELECT required FROM versions WHERE session=?1 AND version=?2))) "
                "ORDER BY p.agent_id LIMIT 11",
                (session, version),
            )
        ]

    def _owed(self, db: sqlite3.Connection, session: str, version: int, *, ok_only: bool) -> bool:
        """Whether a live required rollout has not reported (with ok_only: not reported OK)."""
        return (
            db.execute(
                "SELECT 1 FROM json_each((SELECT required FROM versions WHERE session=?1 AND version=?2)) r "
                f"WHERE {LIVE_ROLLOUT.format(agent='r.value')} AND NOT EXISTS ("
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
            check_generation(generation, self._session(db, session))
            rec = self._version(db, session, version)
            check_transition(version, rec.state, S.FAILED)
            if rec.flip_decided_at and rec.state is S.READY:
                raise WrongState(
                    f"version {version}'s flip was decided: its rollouts are applying it (every one, or none, flips)"
                )
            self._set_state(db, session, version, S.FAILED, reason[:500] or "aborted")
            rec = self._version(db, session, version)
        self._notify(session)
        return rec

    def release_version(
        self, session: str, version: int, *, generation: int, force: bool = False, unpin: bool = False
    ) -> VersionRecord:
        """-> RELEASED, by the session's current generation only (a fenced trainer releases
        nothing). Refused while a live rollout holds a lease, and for the session's newest
        COMMITTED version (`NewestCommitted`: the verified version a rollout can get while
        no newer one committed); `unpin` lifts the second (a trainer whose other slots are
        leased, or that has one slot), `force` both."""
        check_session_name(session)
        check_version(version)
        with self._tx() as db:
            check_generation(generation, self._session(db, session))
            rec = self._version(db, session, version)
            if rec.state is S.RELEASED:
                return rec
            check_transition(version, rec.state, S.RELEASED)
            if rec.state is S.COMMITTED and not (force or unpin) and self._pinned(db, session, version):
                raise NewestCommitted(
                    f"version {version} is the session's newest COMMITTED version: it stays servable until a newer "
                    "version commits (release another slot's version, or pass force)",
                    field="version",
                )
            holders = self._lease_holders(db, session, version, limit=11)
            if holders and not force:
                named = ", ".join(holders[:10]) + (" and more" if len(holders) > 10 else "")
                raise FailedPrecondition(
                    f"version {version} is leased by {named}; wait for their handshake or pass force"
                )
            db.execute("DELETE FROM leases WHERE session=? AND version=?", (session, version))
            self._set_state(db, session, version, S.RELEASED, "")
            rec = self._version(db, session, version)
        self._manifests.discard((session, version))
        self._notify(session)
        return rec

    @staticmethod
    def _pinned(db: sqlite3.Connection, session: str, version: int) -> bool:
        """Whether COMMITTED `version` is the session's newest COMMITTED version."""
        row = db.execute(
            "SELECT 1 FROM versions WHERE session=? AND version>? AND state=? LIMIT 1",
            (session, version, S.COMMITTED.value),
        ).fetchone()
        return row is None

    def _lease_holders(self, db: sqlite3.Connection, session: str, version: int, limit: int = -1) -> list[str]:
        """Live rollouts holding a lease on the version (sorted; at most `limit`)."""
        rows = db.execute(
            "SELECT agent_id FROM leases l WHERE session=?1 AND version=?2 "
            f"AND {LIVE_ROLLOUT.format(agent='l.agent_id')} ORDER BY agent_id LIMIT ?4",
            (session, version, self._clock(), limit),
        ).fetchall()
        return [r[0] for r in rows]

    def sweep(self) -> dict[str, int]:
        """Drops leases of expired agents, re-evaluates versions awaiting handshakes and
        releases what replaced trainers left (`_release_superseded`); returns how many
        leases of expired (or forgotten) agents each session lost."""
        touched = set()
        with self._tx() as db:
            now = self._clock()
            dropped = db.execute(
                "DELETE FROM leases WHERE EXISTS (SELECT 1 FROM agents a WHERE a.session=leases.session "
                "AND a.agent_id=leases.agent_id AND a.lease_expires_at<?) OR NOT EXISTS (SELECT 1 FROM agents a "
                "WHERE a.session=leases.session AND a.agent_id=leases.agent_id) RETURNING session",
                (now,),
            ).fetchall()
            rows = db.execute(
                "SELECT session, version, state FROM versions WHERE state IN (?,?)", (S.READY.value, S.PARTIAL.value)
            )
            for r in rows.fetchall():
                self._evaluate(db, r["session"], r["version"])
                touched.add(r["session"])  # told only where an event was appended (`_notify`)
            released = self._release_superseded(db)
        for session in touched | released:
            self._notify(session)
        return dict(Counter(r["session"] for r in dropped))

    def _release_superseded(self, db: sqlite3.Connection, session: str | None = None) -> set[str]:
        """Releases what replaced trainers left servable, once superseded and no live
        rollout holds it; returns the sessions touched. Only the trainer that publishes a
        version releases it (when its slot is reused), and a replaced one never comes back
        to: left alone, its versions would stay READY or COMMITTED for good, never
        summarized by the retention window (each keeping its descriptors and a handshake
        per rollout), and every sweep would evaluate its READY ones again.

        Superseded means: by a newer COMMITTED version, for any version; and for one that
        never committed, also by a newer generation's PARTIAL version (its trainer moved on
        and rollouts abandon it for the newer one). A newer version that failed its
        handshakes never releases a COMMITTED one: the session's newest COMMITTED version
        stays servable until a newer version commits (invariant 2, docs/design.md).

        Runs in the sweep (a lease that ended) and when a version commits (for `session`
        alone), so a successor that sees its version COMMITTED sees what it superseded
        RELEASED."""
        marks = ",".join("?" * len(SERVABLE))
        candidates = db.execute(
            "SELECT v.session, v.version, v.generation, v.state FROM versions v JOIN sessions s ON s.name=v.session "
            f"WHERE v.generation<s.generation AND v.state IN ({marks}) AND (? IS NULL OR v.session=?)",
            [*[st.value for st in SERVABLE], session, session],
        ).fetchall()
        touched = set()
        for r in candidates:
            name, version = r["session"], r["version"]
            # A PARTIAL version of a newer generation supersedes only what never committed.
            partial_counts = r["state"] != S.COMMITTED.value
            newer = db.execute(
                "SELECT version, generation FROM versions WHERE session=? AND version>? AND "
                "(state=? OR (? AND state=? AND generation>?)) ORDER BY version LIMIT 1",
                (name, version, S.COMMITTED.value, partial_counts, S.PARTIAL.value, r["generation"]),
            ).fetchone()
            if newer is None or self._lease_holders(db, name, version, limit=1):
                continue  # nothing replaced it yet, or a rollout still reads it (an fs store outlives its trainer)
            db.execute("DELETE FROM leases WHERE session=? AND version=?", (name, version))
            reason = f"superseded by version {newer['version']} of trainer generation {newer['generation']}"
            self._set_state(db, name, version, S.RELEASED, reason)
            self._manifests.discard((name, version))
            touched.add(name)
        return touched

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
        rec = self._version(db, session, version)
        events.append(db, rec, state, self._clock())
        self._appended_event(session)  # _notify, after the commit, wakes the watchers
        if self.on_transition is not None:  # metrics: counted where every transition passes
            self.on_transition(rec)

    def _flip_event(self, db: sqlite3.Connection, session: str, version: int) -> None:
        """An ATOMIC version's flip was decided: an event of its READY record with
        `flip_decided_at` set (no transition: it stays READY until its rollouts report)."""
        rec = self._version(db, session, version)
        events.append(db, rec, rec.state, self._clock())
        self._appended_event(session)
        self._decided(rec)


@dataclasses.dataclass(frozen=True)
class _SealCheck:
    """A part checked against the ranks sealed before it; `manifest_digest` is set when
    it completes the version."""

    ranks: frozenset[int]
    manifest_digest: str
    manifest: Manifest | None  # built to digest it: readers need not decode what was just sealed

    @classmethod
    def of(
        cls,
        others: list[Part],
        session: str,
        version: int,
        generation: int,
        part: Part,
        trainer_ranks: int,
        limits: Limits,
    ) -> _SealCheck:
        others = [p for p in others if p.rank != part.rank]
        final = len(others) + 1 == trainer_ranks
        validate_against_parts(part, others, final=final, limits=limits)
        manifest = None
        if final:
            parts = tuple(sorted([*others, part], key=lambda p: p.rank))
            manifest = Manifest(session, version, generation, part.chunk_bytes, parts)
        return cls(frozenset(p.rank for p in others), manifest.digest() if manifest else "", manifest)


def check_generation(generation: int, s: SessionRecord) -> None:
    """Writers must carry the session's current generation (fencing, docs/design.md "Concepts").

    An older one is a fenced writer (StaleGeneration). A newer one was never issued here:
    this coordinator lost the state it gave it (a database gone with its volume), so the
    writer's session is not known here, and the writer should open it again."""
    if generation > s.generation:
        raise SessionNotFound(
            f"session {s.name!r} at generation {generation} is not known here: this coordinator holds generation "
            f"{s.generation} (it lost its database?); open the session again"
        )
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
