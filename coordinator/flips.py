"""Atomic flips (docs/design.md "Atomic flips"): PREPARED reports, the flip decision or
abort of an ATOMIC version, and the flip skew a committed version records.

A mixin of `VersionLifecycle` (`coordinator.versions`), which supplies the connections,
the records, the state changes and the clock named below. Every method that writes runs
inside the caller's transaction, so a decision is durable with the report, the sweep or
the publish that made it.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager

from coordinator.handshake import AppliedReport, compare_report
from coordinator.records import ReportOutcome, SessionRecord, VersionRecord
from coordinator.states import VersionState
from weightsync.errors import FailedPrecondition, InvalidArgument, WrongState
from weightsync.manifest import Manifest
from weightsync.validation import check_agent_id, check_session_name, check_version
from weightsync.version_states import FLIP_POLICIES, PREPARED_LOSSES

S = VersionState
DEFAULT_PREPARE_TIMEOUT_S = 300.0
MAX_PREPARE_TIMEOUT_S = 7 * 86400.0
# "{agent} is a live rollout of session ?1 at time ?3": a primary-key lookup per row, so
# per-report checks stay cheap for a fleet of thousands (coordinator.versions' too).
LIVE_ROLLOUT = (
    "EXISTS (SELECT 1 FROM agents a WHERE a.session=?1 AND a.agent_id={agent} AND a.role='ROLLOUT' "
    "AND a.lease_expires_at>=?3)"
)
_PREPARED_OK = "EXISTS (SELECT 1 FROM prepares p WHERE p.session=?1 AND p.version=?2 AND p.agent_id={agent} AND p.ok=1)"
_REQUIRED = "json_each((SELECT required FROM versions WHERE session=?1 AND version=?2))"


def check_flip_settings(flip_policy: str, prepare_timeout_s: float, prepared_loss: str) -> None:
    """OpenSession's flip settings ("" and 0 keep the stored ones); InvalidArgument naming
    the request field."""
    if flip_policy and flip_policy not in FLIP_POLICIES:
        raise InvalidArgument(f"{flip_policy!r} is not one of {', '.join(FLIP_POLICIES)}", field="flip_policy")
    if prepared_loss and prepared_loss not in PREPARED_LOSSES:
        raise InvalidArgument(f"{prepared_loss!r} is not one of {', '.join(PREPARED_LOSSES)}", field="prepared_loss")
    if not (math.isfinite(prepare_timeout_s) and 0 <= prepare_timeout_s <= MAX_PREPARE_TIMEOUT_S):
        raise InvalidArgument(
            f"{prepare_timeout_s} is not a number of seconds in [0, {MAX_PREPARE_TIMEOUT_S:g}] (0 keeps the session's)",
            field="prepare_timeout_seconds",
        )


class FlipDecisions:
    """PREPARED reports and the decision of ATOMIC versions (see the module docstring)."""

    # Supplied by VersionLifecycle / SessionStore:
    _clock: Callable[[], float]
    _tx: Callable[[], AbstractContextManager[sqlite3.Connection]]
    _notify: Callable[[str], None]
    _session: Callable[[sqlite3.Connection, str], SessionRecord]
    _version: Callable[[sqlite3.Connection, str, int], VersionRecord]
    _manifest: Callable[[sqlite3.Connection, VersionRecord], Manifest]
    _renew: Callable[[sqlite3.Connection, str, str], None]
    _set_state: Callable[[sqlite3.Connection, str, int, VersionState, str], None]
    _flip_event: Callable[[sqlite3.Connection, str, int], None]

    def report_prepared(self, session: str, version: int, agent_id: str, report: AppliedReport) -> ReportOutcome:
        """Records that a rollout holds an ATOMIC version verified and ready (or could not:
        `local_error`), compared with the source; decides or aborts the flip as the
        reports then stand (`_evaluate_flip`). A report for a version whose flip was
        decided meanwhile (one sent again) is answered and changes nothing.

        Raises:
            FailedPrecondition: the version is not ATOMIC (naming `prepared`).
            WrongState: the version is not READY (aborted, released).
        """
        check_session_name(session)
        check_version(version)
        check_agent_id(agent_id)
        with self._tx() as db:
            self._session(db, session)
            rec = self._version(db, session, version)
            if rec.flip_policy != "ATOMIC":
                raise FailedPrecondition(
                    f"version {version} is flipped {rec.flip_policy}: each rollout applies it and reports what it "
                    "applied",
                    field="prepared",
                )
            if rec.state is not S.READY and not rec.flip_decided_at:
                raise WrongState(f"version {version} is {rec.state.value}; PREPARED reports are taken while READY")
            mismatch = compare_report(self._manifest(db, rec), rec.manifest_digest, report)
            if not rec.flip_decided_at:
                db.execute(
                    "INSERT OR REPLACE INTO prepares (session, version, agent_id, ok, mismatch, reported_at) "
                    "VALUES (?,?,?,?,?,?)",
                    (session, version, agent_id, int(mismatch is None), mismatch or "", self._clock()),
                )
                self._renew(db, session, agent_id)
                self._evaluate_flip(db, session, version)
            outcome = ReportOutcome(self._version(db, session, version), mismatch)
        self._notify(session)
        return outcome

    def _evaluate_flip(self, db: sqlite3.Connection, session: str, version: int) -> None:
        """An undecided ATOMIC READY version: FAILED at the first failed PREPARED report,
        the first required rollout lost before it prepared (or after, under ABORT_FLIP), or
        the deadline passed with a live required rollout still owing; decided once every
        live required rollout prepared OK and at least min_rollouts did.

        Counted in SQL, stopping at the first required rollout still owed (as
        `VersionLifecycle._owed`): this runs on every PREPARED report of a fleet. Lost
        rollouts are looked for only once none is owed, or by the sweep."""
        now = self._clock()
        row = db.execute(
            "SELECT prepare_by, prepared_loss FROM versions WHERE session=? AND version=?", (session, version)
        ).fetchone()
        failed = db.execute(
            "SELECT agent_id, mismatch FROM prepares WHERE session=? AND version=? AND ok=0 "
            "ORDER BY reported_at LIMIT 1",
            (session, version),
        ).fetchone()
        if failed is not None:
            self._abort_flip(db, session, version, f"rollout {failed[0]!r} did not prepare it: {failed[1]}")
            return
        owed = db.execute(
            f"SELECT r.value FROM {_REQUIRED} r WHERE {LIVE_ROLLOUT.format(agent='r.value')} "
            f"AND NOT {_PREPARED_OK.format(agent='r.value')} LIMIT 1",
            (session, version, now),
        ).fetchone()
        if owed is None:
            # Unprepared ones first: one of them aborts whatever prepared_loss says.
            lost = db.execute(
                f"SELECT r.value, {_PREPARED_OK.format(agent='r.value')} AS prepared FROM {_REQUIRED} r "
                "JOIN agents a ON a.session=?1 AND a.agent_id=r.value AND a.role='ROLLOUT' AND a.lease_expires_at<?3 "
                "ORDER BY prepared LIMIT 1",
                (session, version, now),
            ).fetchone()
            if lost is not None and not lost[1]:
                why = f"rollout {lost[0]!r} was lost (its lease lapsed) before it prepared"
                self._abort_flip(db, session, version, why)
                return
            if lost is not None and row["prepared_loss"] == "ABORT_FLIP":
                self._abort_flip(
                    db, session, version, f"rollout {lost[0]!r} was lost after it prepared (prepared_loss ABORT_FLIP)"
                )
                return
            rec = self._version(db, session, version)
            min_rollouts = self._session(db, session).min_rollouts
            if rec.prepared >= min_rollouts:
                db.execute(
                    "UPDATE versions SET flip_decided_at=? WHERE session=? AND version=?", (now, session, version)
                )
                self._flip_event(db, session, version)
                return
            if now > row["prepare_by"]:
                self._abort_flip(
                    db, session, version,
                    f"{rec.prepared} rollout(s) prepared it in time, fewer than min_rollouts {min_rollouts}",
                )  # fmt: skip
            return
        if now > row["prepare_by"]:
            self._abort_flip(db, session, version, f"rollout {owed[0]!r} did not prepare it in time")

    def _supersede_undecided(self, db: sqlite3.Connection, session: str, version: int) -> None:
        """`version` becomes READY: an older ATOMIC version whose flip is undecided is
        aborted first (its event before the new READY), so no rollout flips a version the
        fleet moved past while others drop it."""
        for (older,) in db.execute(
            "SELECT version FROM versions WHERE session=? AND version<? AND state=? AND flip_policy='ATOMIC' "
            "AND flip_decided_at=0",
            (session, version, S.READY.value),
        ).fetchall():
            self._abort_flip(db, session, older, f"version {version} became READY before this one's flip was decided")

    def _abort_flip(self, db: sqlite3.Connection, session: str, version: int, why: str) -> None:
        """READY -> FAILED with the reason; nobody may read it any more, so its leases go
        (a trainer reuses its slot at once)."""
        db.execute("DELETE FROM leases WHERE session=? AND version=?", (session, version))
        self._set_state(db, session, version, S.FAILED, f"flip aborted: {why}"[:500])

    @staticmethod
    def _record_flip_skew(db: sqlite3.Connection, session: str, version: int) -> None:
        """At COMMITTED: first to last flip time of the rollouts that flipped with the fleet
        (required at READY, or PREPARED OK), where two or more said theirs."""
        row = db.execute(
            "SELECT COUNT(*), MAX(flipped_at) - MIN(flipped_at) FROM reports q WHERE q.session=?1 AND q.version=?2 "
            f"AND q.ok=1 AND q.flipped_at>0 AND (q.agent_id IN (SELECT value FROM {_REQUIRED}) "
            f"OR {_PREPARED_OK.format(agent='q.agent_id')})",
            (session, version),
        ).fetchone()
        if row[0] >= 2:
            db.execute(
                "UPDATE versions SET flip_skew_s=? WHERE session=? AND version=?", (max(0.0, row[1]), session, version)
            )
