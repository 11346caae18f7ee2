"""Auditor: when a rollout audits the weights its engine serves, and what it does with a
mismatch.

Audits run when asked (`audit()`: the RolloutAgent's `Audit` RPC, vLLM's worker
extension), when the coordinator asks (a request on a heartbeat answer: `wsctl audit
--fresh`), every `interval_s` (0: never), and once right after an apply that follows a
mismatch (to show the heal took). A periodic audit waits at least 100 times the last
audit's duration (`MAX_SHARE`), so the audits take at most 1% of the engine's time
whatever the model's size. Every audit holds the apply's lock (`audited.Audited`): it never
sees a version half applied, and an apply waits for it.

A mismatch marks the version not served (`unserved`) and calls the `on_mismatch` hooks,
which make the engine say so and re-apply it; the next exact audit clears it. After
`HEAL_LIMIT` re-applies in a row that did not come out exact, the hooks are no longer
called (the weights are damaged again as fast as they are applied: a person must look).
The last audit rides every heartbeat to the coordinator.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from rollout_agent.audit.audited import Audited
from rollout_agent.engines.audit_reading import AuditReading
from weightsync._proto import types_pb2 as tpb
from weightsync.errors import WeightsyncError
from weightsync.metrics import Metrics

log = logging.getLogger(__name__)

MAX_SHARE = 0.01  # of the engine's time periodic audits may take
HEAL_LIMIT = 3  # re-applies in a row that did not come out exact before the auditor stops re-applying
MAX_NAMED = 16  # mismatched tensors named in an AuditResult (the rest are counted)
MAX_DETAIL_CHARS = 256


class Auditor:
    """Runs the audits of one engine (`audited`) and keeps the last result."""

    def __init__(
        self, audited: Audited, *, session: str, interval_s: float = 0.0, metrics: Metrics | None = None
    ) -> None:
        self.audited = audited
        self.session = session
        self.interval_s = interval_s
        self._metrics: Metrics | None = None
        self.metrics = metrics
        self.on_mismatch: list[Callable[[int], None]] = []  # version -> make it unserved and re-apply it
        self.beat_soon: Callable[[], None] | None = None  # sends the new result on a heartbeat now
        # held around every audit where the engine must run nothing meanwhile (a vLLM
        # sidecar's engine lock): the applier may then read what must not be read beside it
        self.exclusive: Callable[[], AbstractContextManager[Any]] | None = None
        self.unserved = 0  # a version an audit found not served exactly, until an exact audit
        self.heals = 0
        self.audits = 0
        self._state = threading.Lock()
        self._running = threading.Lock()  # one audit at a time
        self._last: tpb.AuditResult | None = None
        self._finished = 0.0  # time.monotonic() of the last audit's end
        self._requested = self._answered = 0  # the coordinator's newest audit request, and the one answered
        self._confirm = False  # audit after the apply in progress (a mismatch is healing)
        self._failed_heals = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="audit", daemon=True)
        audited.on_commit.append(self._committed)

    @property
    def metrics(self) -> Metrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        """Where audits are counted. Both results' series exist from here, at 0: the first
        mismatch is then an increase an alert sees (a series born at 1 is not)."""
        self._metrics = metrics
        if metrics is not None:
            for result in ("exact", "mismatch"):
                metrics.audits.labels(role=metrics.role, session=self.session, result=result)

    def start(self) -> Auditor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def audit(self, request_seq: int = 0, *, on_engine_thread: bool = False) -> tpb.AuditResult:
        """Audits now (after an apply in progress); a mismatch calls the hooks.
        `on_engine_thread`: called on the engine's own thread (it runs nothing meanwhile)."""
        with self._running:
            exclusive = self.exclusive() if self.exclusive is not None else contextlib.nullcontext()
            with exclusive:
                t0 = time.perf_counter()
                reading = self.audited.audit(engine_held=on_engine_thread or self.exclusive is not None)
                seconds = time.perf_counter() - t0
            heal = 0
            with self._state:
                self.audits += 1
                if reading.version and not reading.exact:
                    self.unserved = reading.version
                    if self._failed_heals < HEAL_LIMIT:
                        self._failed_heals += 1
                        self.heals += 1
                        heal = reading.version
                elif reading.version:
                    self.unserved, self._failed_heals = 0, 0
                result = self._result(reading, seconds, request_seq)
                self._last, self._finished = result, time.monotonic()
            self._observe(reading, seconds)
            if reading.version and not reading.exact:
                self._report_mismatch(reading, heal)
        if self.beat_soon is not None:
            self.beat_soon()
        return _copy(result)

    def requested(self, seq: int) -> None:
        """The coordinator's newest audit request (every heartbeat answer carries it)."""
        with self._state:
            if not seq or seq in (self._requested, self._answered):
                return
            self._requested = seq
        self._wake.set()

    def summary(self) -> tpb.AuditResult | None:
        """The last audit, aged now (None before the first), for heartbeats and status."""
        with self._state:
            if self._last is None:
                return None
            out = _copy(self._last)
            out.age_seconds = time.monotonic() - self._finished
            out.heals, out.audits, out.unserved_version = self.heals, self.audits, self.unserved
            return out

    def _result(self, reading: AuditReading, seconds: float, request_seq: int) -> tpb.AuditResult:
        named = sorted(reading.mismatched)[:MAX_NAMED]
        return tpb.AuditResult(
            version=reading.version,
            exact=reading.exact,
            tensors=reading.compared,
            mismatch_count=len(reading.mismatched),
            mismatches=[tpb.AuditMismatch(tensor=n, detail=reading.mismatched[n][:MAX_DETAIL_CHARS]) for n in named],
            unaudited=len(reading.unaudited),
            seconds=seconds,
            request_seq=request_seq,
            method=reading.method,
            heals=self.heals,
            unserved_version=self.unserved,
            audits=self.audits,
        )

    def _report_mismatch(self, reading: AuditReading, heal: int) -> None:
        first = sorted(reading.mismatched)[0]
        log.error(
            "audit: the engine does not hold version %d exactly: %d tensor(s) differ, first %r (%s)%s",
            reading.version,
            len(reading.mismatched),
            first,
            reading.mismatched[first],
            "; re-applying it" if heal else f"; not re-applying it again ({HEAL_LIMIT} re-applies did not hold)",
        )
        if heal:
            for hook in self.on_mismatch:
                try:
                    hook(heal)
                except Exception:  # noqa: BLE001 - one hook's failure must not keep the others from running
                    log.exception("audit: reacting to the mismatch of version %d failed", heal)

    def _observe(self, reading: AuditReading, seconds: float) -> None:
        m = self.metrics
        if m is None or not reading.version:
            return
        m.audits.labels(role=m.role, session=self.session, result="exact" if reading.exact else "mismatch").inc()
        for name in reading.mismatched:
            m.audit_mismatches.labels(role=m.role, session=self.session, tensor=name).inc()
        m.observe_phase("audit", seconds)
        m.audit_age.labels(role=m.role, session=self.session).set_function(self._age)

    def _age(self) -> float:
        return time.monotonic() - self._finished

    def _committed(self, version: int) -> None:
        """After every apply (on the applying thread): a mismatch that is healing is
        audited again at once, on this auditor's thread."""
        with self._state:
            if not self.unserved:
                return
            self._confirm = True
        self._wake.set()

    def _due_in(self) -> float:
        """Seconds until the next periodic audit (inf: none)."""
        if not self.interval_s or not self.audited.applied:
            return math.inf
        with self._state:
            last = self._last.seconds if self._last is not None else 0.0
            since = self._finished if self._last is not None else self._started
        return since + max(self.interval_s, last / MAX_SHARE) - time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            due = self._due_in()
            if due > 0:
                self._wake.wait(min(due, 3600.0))
                self._wake.clear()
            if self._stop.is_set():
                return
            with self._state:
                request = self._requested if self._requested != self._answered else 0
                confirm, self._confirm = self._confirm, False
            if not (request or confirm or self._due_in() <= 0):
                continue
            try:
                self.audit(request)
            except WeightsyncError as e:
                log.warning("audit: %s", e.message)
            except Exception:  # noqa: BLE001 - this thread audits for the life of the rollout
                log.exception("audit failed unexpectedly")
            if request:
                with self._state:
                    self._answered = request


def _copy(result: tpb.AuditResult) -> tpb.AuditResult:
    out = tpb.AuditResult()
    out.CopyFrom(result)
    return out
