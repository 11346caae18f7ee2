"""Prefetch: pull and verify each new servable version in the background, into the
puller's receive buffer, while the engine keeps serving; the apply step then loads only
verified bytes (`round.apply_prefetched`), so the engine pauses for the apply alone.

Memory stays one receive buffer: a prefetched version waits there until it is applied or
a newer one replaces it (leasing the newer version drops the older lease at the
coordinator, so the trainer's slot is freed). Nothing here touches the live weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

from rollout_agent.engines.applier import Applier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.flip import FlipBoard, undecided_atomic
from rollout_agent.sync.follow import FollowStop, NewestAnnounced, follow_servable
from rollout_agent.sync.outbox import ReportOutbox
from rollout_agent.sync.round import Prefetched, SyncResult, prefetch, report_prepared
from weightsync.errors import WeightsyncError
from weightsync.failpoints import Failpoints
from weightsync.logs import version_context

log = logging.getLogger(__name__)


class Prefetcher:
    """A thread that prefetches the newest requested version, and a watch that requests
    each new servable one (`follow=True`). The apply step runs inside `hold`, which stops
    prefetching for its duration: the receive buffer is the caller's there. With `stage`,
    the applier also builds each verified version aside (`Applier.stage`, where it can: a
    JAX engine that swaps), and the apply only commits it; `_pull` serializes every use of
    the applier's update round.

    Lock order: `_pull` before `_cond`; `_cond` is never held across a pull.
    """

    def __init__(
        self,
        puller: WeightPuller,
        *,
        applier: Applier | None = None,
        failpoints: Failpoints | None = None,
        follow: bool = True,
        nice: int = 0,
        stage: bool = False,
        flips: FlipBoard | None = None,
        outbox: ReportOutbox | None = None,
    ) -> None:
        """`flips`: an ATOMIC version still undecided that verified is reported PREPARED
        (`round.report_prepared`), its watch's records noted there; one the coordinator
        refuses is dropped. `outbox` keeps a PREPARED report not delivered yet."""
        self._puller = puller
        self._flips = flips
        self._outbox = outbox
        self._applier = applier  # refuses another model's versions before they are pulled
        self._stage = stage  # the applier builds each verified version aside (`Applier.stage`)
        self._nice = nice
        self._failpoints = failpoints
        self._pull = threading.Lock()  # whoever holds it owns the receive buffer
        self._cond = threading.Condition()
        self._wanted = 0  # newest version asked for
        self._done = 0  # newest version applied (or tried) through `hold`
        self._ready: Prefetched | None = None  # pulled and checked, waiting for its apply
        self._dropped: list[Prefetched] = []  # staged versions let go of, discarded under `_pull`
        self._held = False
        self._update_waits = 0  # the version an update (`hold`) waits for: an older pull is stale
        self._announced = NewestAnnounced()
        self._rules = [self._announced.stale, self._stale_for_update]
        puller.stale_rules += self._rules
        self._stop = FollowStop()
        self._threads = [threading.Thread(target=self._run, name="prefetch", daemon=True)]
        if follow:
            self._threads.append(
                threading.Thread(
                    target=follow_servable,
                    args=(puller.client, puller.session, self.request, self._stop, flips.note if flips else None),
                    name="prefetch-watch",
                    daemon=True,
                )
            )
        for t in self._threads:
            t.start()

    def request(self, version: int, generation: int = 0) -> None:
        """Prefetch `version` (ignored unless newer than every version asked for so far);
        `generation`, the trainer generation that published it (as the watch says), makes
        a pull in progress of an older generation's version stale (`NewestAnnounced`)."""
        self._announced.note(version, generation)
        with self._cond:
            if version > max(self._wanted, self._done):
                self._wanted = version
                self._cond.notify_all()
        self._puller.recheck()

    def _stale_for_update(self, version: int, generation: int) -> str:
        waits = self._update_waits
        return f"an update waits for version {waits}" if version < waits else ""

    @contextlib.contextmanager
    def hold(self, version: int) -> Iterator[Prefetched | None]:
        """The receive buffer for the block, and the prefetched `version` if there is one
        (a pull of it in progress is waited for). None: pull it directly, inside the block."""
        with self._cond:
            self._held = True
            self._update_waits = version
        self._puller.recheck()  # a prefetch of an older version is abandoned, not waited out
        try:
            with self._pull:  # waits for a pull in progress, most likely of this version
                self._discard_dropped()
                with self._cond:  # the caller's now: a waiting other version would be overwritten
                    ready, self._ready = self._ready, None
                if ready is not None and ready.version != version:
                    ready.discard(self._applier)
                    ready = None  # the caller pulls `version` itself; a newer one is fetched again after
                try:
                    yield ready
                finally:
                    if ready is not None:
                        ready.discard(self._applier)  # staged and not committed by the caller: its round aborted
                    with self._cond:
                        self._done = max(self._done, version)
        finally:
            with self._cond:
                self._held = False
                self._update_waits = 0
                self._cond.notify_all()

    def wait_ready(self, version: int, timeout_s: float) -> bool:
        """Asks for `version` and waits until it (or a newer one) waits verified, its pull
        gave up, or `timeout_s` passed; True when it is ready to apply."""
        self.request(version)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._ready is not None and self._ready.version >= version:
                    return True
                if self._wanted < version or self._done >= version:  # gave up, or applied meanwhile
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(min(remaining, 1.0))

    def forget_versions(self) -> None:
        """The session was made again (`RolloutWiring.on_new_session`): its version numbers
        start over, so none asked for or done counts, and a version waiting verified is of
        the old session (it would apply as the new one's version of the same number)."""
        self._announced.forget()
        with self._cond:
            self._wanted = self._done = 0
            if self._ready is not None:
                self._dropped.append(self._ready)  # (its open round is the applier's: aborted under `_pull`)
            self._ready = None
            self._cond.notify_all()

    def status(self) -> dict[str, int]:
        """The newest version asked for, the one waiting verified and, where it was built
        aside, staged (0: none)."""
        with self._cond:
            ready = self._ready
            return {
                "wanted": self._wanted,
                "ready": ready.version if ready else 0,
                "staged": ready.version if ready is not None and ready.staged else 0,
            }

    def close(self) -> None:
        """Stops prefetching (a pull in progress finishes first); the watch thread's stream
        is cancelled, so it ends at once."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._threads[0].join(timeout=30)
        for rule in self._rules:
            self._puller.stale_rules.remove(rule)
        with self._pull:
            with self._cond:
                if self._ready is not None:
                    self._dropped.append(self._ready)
                self._ready = None
            self._discard_dropped()

    def _discard_dropped(self) -> None:
        """Aborts the open rounds of staged versions let go of (the caller holds `_pull`:
        no other round of the applier is open)."""
        with self._cond:
            dropped, self._dropped = self._dropped, []
        for p in dropped:
            p.discard(self._applier)

    def _next(self) -> int:
        """The version to prefetch now; 0 when stopped (blocks while there is none)."""
        with self._cond:
            while not self._stop.is_set():
                target = self._wanted
                waiting = self._ready.version if self._ready is not None else 0
                if not self._held and target > max(self._done, waiting):
                    return target
                self._cond.wait(1.0)
        return 0

    def _run(self) -> None:
        if self._nice:  # Linux: per thread, and inherited by the pull's lane threads
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError as e:
                log.warning("prefetch: cannot set nice %d: %s", self._nice, e)
        while (version := self._next()) > 0:
            with self._pull:
                self._discard_dropped()
                with self._cond:
                    if self._held or version <= self._done:
                        continue  # an apply took the buffer first
                    dropped, self._ready = self._ready, None  # a newer version replaces a waiting older one
                if dropped is not None:
                    dropped.discard(self._applier)
                try:
                    with version_context(version):
                        got: Prefetched | None = prefetch(
                            self._puller, version, self._failpoints, self._applier, stage=self._stage
                        )
                except WeightsyncError as e:  # no manifest (released, not yet servable): nothing leased
                    log.warning("prefetch of version %d: %s", version, e.message)
                    got = None
                except Exception:  # noqa: BLE001 - a dead prefetch thread would make every update wait it out
                    log.exception("prefetch of version %d failed unexpectedly; the update pulls it", version)
                    got = None
                if got is not None and not self._prepare(got):
                    got = None
                with self._cond:
                    if got is not None:
                        self._ready = got
                        log.info("prefetched version %d (%s)", version, "verified" if got.error is None else "failed")
                    elif self._wanted == version:
                        self._wanted = 0  # a later announcement asks again
                    self._cond.notify_all()

    def _prepare(self, p: Prefetched) -> bool:
        """An undecided ATOMIC version that verified is reported PREPARED (False, and
        dropped, when the coordinator refuses it: the version is then aborted)."""
        if self._flips is None or p.error is not None or not undecided_atomic(p.header.version):
            return True
        result = SyncResult(p.version, ok=False, bytes_pulled=p.bytes_pulled, chunk_retries=p.chunk_retries)
        refused = report_prepared(
            p, self._puller, result, self._flips, outbox=self._outbox, failpoints=self._failpoints
        )
        if refused is None:
            log.info("version %d prepared; an update applies it once its flip is decided", p.version)
            return True
        log.warning("version %d not prepared: %s", p.version, refused[1])
        p.discard(self._applier)
        return False
