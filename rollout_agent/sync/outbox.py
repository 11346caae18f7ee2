"""Handshakes the coordinator did not receive, sent again until it answers."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import TRANSIENT_ERRORS, AgentIdHeld, DataLoss, WeightsyncError

log = logging.getLogger(__name__)
Verdict = Callable[[int, bool, str], None]  # (version, ok, mismatch)
REPORT_RETRIES = 2  # a few quick retries in the call; the outbox rides out longer outages


@dataclass(frozen=True)
class HandshakeVerdict:
    """The coordinator's answer to one handshake. `failure` names why it is not ok: local
    (this rollout reported its own error), mismatch (DATA_LOSS: digests differ from the
    source) or refused (any other refusal, e.g. the version was released meanwhile)."""

    ok: bool
    mismatch: str = ""
    failure: str = ""
    version: tpb.VersionInfo | None = None  # the version's record in the answer (None: refused)


#: what leaves a handshake undelivered, to be sent again: the coordinator out of reach, or
#: this rollout's agent id held by another process until the heartbeat takes it back
UNDELIVERED = (*TRANSIENT_ERRORS, AgentIdHeld)


def send_report(client: CoordinatorClient, report: pb.ReportAppliedRequest) -> HandshakeVerdict:
    """Sends one handshake. A refusal other than DATA_LOSS is a failed round. Raises
    `UNDELIVERED` errors when the coordinator could not be reached or refused the agent id
    (the report may be sent again: the coordinator keeps one report per agent and version)."""
    try:
        answer = client.report_applied(report, retries=REPORT_RETRIES)
        if report.local_error:
            return HandshakeVerdict(False, report.local_error, "local", answer.version)
        return HandshakeVerdict(True, version=answer.version)
    except DataLoss as e:
        return HandshakeVerdict(False, e.message, "mismatch")
    except UNDELIVERED:
        raise
    except WeightsyncError as e:
        return HandshakeVerdict(False, f"handshake refused: {e.message}", "refused")


class ReportOutbox:
    """Holds the newest undelivered handshake and re-sends it with jittered backoff
    (0.5 s doubling to `max_backoff_s`) until the coordinator answers or a newer
    version's report replaces it; then calls `on_verdict`. A PREPARED report (an ATOMIC
    version held ready) is sent the same way; its answer is only logged: the round that
    sent it learns of the flip from the coordinator's events.

    Lock order: `_lock` only; `on_verdict` is called outside it.
    """

    def __init__(self, client: CoordinatorClient, on_verdict: Verdict, *, max_backoff_s: float = 8.0) -> None:
        self._client = client
        self._on_verdict = on_verdict
        self._max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._pending: pb.ReportAppliedRequest | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="handshake-outbox", daemon=True)
        self._thread.start()

    @property
    def pending_version(self) -> int:
        """The version whose handshake of an apply waits for delivery (0: none)."""
        with self._lock:
            return self._pending.version if self._pending is not None and not self._pending.prepared else 0

    def put(self, report: pb.ReportAppliedRequest) -> None:
        """Keeps `report` for delivery unless a newer version's report is already waiting."""
        with self._lock:
            if self._pending is not None and self._pending.version > report.version:
                return
            self._pending = report
        log.warning("handshake for version %d not delivered; retrying until the coordinator answers", report.version)
        self._wake.set()

    def discard_older_than(self, version: int) -> None:
        """A newer version was reported: older undelivered handshakes do not matter."""
        with self._lock:
            if self._pending is not None and self._pending.version < version:
                log.info("handshake for version %d superseded by version %d", self._pending.version, version)
                self._pending = None

    def discard_prepared(self, version: int) -> None:
        """`version` was applied: its undelivered PREPARED report says nothing new."""
        with self._lock:
            if self._pending is not None and self._pending.version == version and self._pending.prepared:
                self._pending = None

    def discard(self) -> None:
        """The session was made again: an undelivered handshake names a version of the old one."""
        with self._lock:
            if self._pending is not None:
                log.info("handshake for version %d dropped: its session is gone", self._pending.version)
                self._pending = None

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            with self._lock:
                report = self._pending
            if report is None:
                self._wake.wait()
                self._wake.clear()
                backoff = 0.5
                continue
            if self._wake.wait(backoff * (0.5 + random.random())):  # a newer report or close
                self._wake.clear()
                continue
            try:
                verdict = send_report(self._client, report)
            except UNDELIVERED as e:
                log.info("handshake for version %d still not delivered: %s", report.version, e.message)
                backoff = min(self._max_backoff_s, backoff * 2)
                continue
            except Exception:  # noqa: BLE001 - the handshake waits here alone: keep it through a bug
                log.exception("handshake for version %d: sending failed unexpectedly; trying again", report.version)
                backoff = min(self._max_backoff_s, backoff * 2)
                continue
            with self._lock:
                if self._pending is report:
                    self._pending = None
                else:
                    continue  # superseded while in flight: the newer one decides
            what = "PREPARED report" if report.prepared else "handshake"
            log.info("%s for version %d delivered: %s", what, report.version, "ok" if verdict.ok else verdict.mismatch)
            if not report.prepared:
                self._on_verdict(report.version, verdict.ok, verdict.mismatch)
            backoff = 0.5
