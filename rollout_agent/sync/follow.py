"""Following a session: learn of each servable version as the coordinator announces it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from weightsync import version_states
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import VersionNotFound, WeightsyncError

if TYPE_CHECKING:
    from rollout_agent.pull.puller import WeightPuller

log = logging.getLogger(__name__)
SERVABLE_STATES = frozenset(tpb.VersionState.Value(name) for name in version_states.SERVABLE)
LATEST_STATES = frozenset(tpb.VersionState.Value(name) for name in version_states.LATEST)


def newest_servable(client: CoordinatorClient, session: str) -> int:
    """The session's newest READY / COMMITTED / PARTIAL version (VersionNotFound if none):
    what a following rollout syncs, a PARTIAL one included (its retry may commit it)."""
    return _newest(client, session, SERVABLE_STATES, "READY, COMMITTED or PARTIAL")


def latest_version(client: CoordinatorClient, session: str) -> int:
    """What a caller's "latest" (version 0) names: the newest READY or COMMITTED version,
    as the coordinator's GetManifest answers it (VersionNotFound if none)."""
    return _newest(client, session, LATEST_STATES, "READY or COMMITTED")


def _newest(client: CoordinatorClient, session: str, states: frozenset[int], named: str) -> int:
    for v in client.status(session, 20).versions:
        if v.state in states:
            return v.version
    raise VersionNotFound(f"session {session!r} has no {named} version among its newest 20")


class NewestAnnounced:
    """The newest servable version a watch announced and the trainer generation that
    published it. As a puller's stale rule (`WeightPuller.stale_rules`): a pull of an
    older version published by an older generation is abandoned. Its trainer was
    replaced, frozen or cut off as likely as not (a pull from one waits `timeout_s` per
    read, three reads: six minutes at the defaults), and the newer version is what the
    rollout syncs next either way. A pull of the same generation finishes: a fleet that
    pulls slower than its trainer publishes would otherwise never apply a version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        self.generation = 0

    def note(self, version: int, generation: int) -> None:
        """Records an announcement; generation 0: not known (a caller that asked for the
        newest version by number). The watch's later event for that version brings its
        generation, which is taken then (ignored as "not newer", it would let a pull the
        version made stale go on)."""
        with self._lock:
            if (version, generation) > (self.version, self.generation):
                self.version, self.generation = version, generation

    def forget(self) -> None:
        """The session was made again: its versions and generations start over."""
        with self._lock:
            self.version = self.generation = 0

    def stale(self, version: int, generation: int) -> str:
        with self._lock:
            newest, newer_generation = self.version, self.generation
        if version < newest and generation < newer_generation:
            return (
                f"version {newest} is servable from trainer generation {newer_generation} "
                f"(version {version}'s, {generation}, was replaced)"
            )
        return ""


class FollowStop:
    """Stops a `follow_servable` loop from another thread at once: its watch stream is
    cancelled where it waits (stopping by the event alone would wait for the next event,
    or for the joiner's timeout: a second more for a rollout's SIGTERM)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._cancel: Callable[[], None] | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)

    def watching(self, cancel: Callable[[], None] | None) -> None:
        """The stream the loop reads now (None: none), cancelled at once if stopped."""
        with self._lock:
            self._cancel = cancel
            stopped = self._event.is_set()
        if stopped and cancel is not None:
            cancel()

    def set(self) -> None:
        with self._lock:
            self._event.set()
            cancel = self._cancel
        if cancel is not None:
            cancel()


def follow_servable(
    client: CoordinatorClient,
    session: str,
    on_version: Callable[[int, int], None],
    stop: FollowStop,
    on_record: Callable[[tpb.VersionInfo], None] | None = None,
    on_connect: Callable[[cpb.GetStatusResponse], None] | None = None,
) -> None:
    """Calls `on_version(version, generation)` with the newest servable version on
    (re)connect, then with each new one, until `stop` is set; rides out coordinator
    outages by reconnecting. A PARTIAL version comes with generation 0
    (`_announced_generation`). `on_record`: every record heard, whatever its state (the
    newest on (re)connect, then each event's), before `on_version` is called with it.
    `on_connect`: the status read on each (re)connect (then of the newest 20 versions)."""
    seq = -1
    failing = False
    while not stop.is_set():
        try:
            if seq < 0:  # (re)connect: no replay of history, just the newest version
                st = client.status(session, 20 if on_connect is not None else 1)
                seq = st.event_seq
                if on_connect is not None:
                    on_connect(st)
                if failing:
                    log.info("watch reconnected")
                    failing = False
                if st.versions and on_record is not None:
                    on_record(st.versions[0])
                if st.versions and st.versions[0].state in SERVABLE_STATES:
                    on_version(st.versions[0].version, _announced_generation(st.versions[0]))
            events, cancel = client.open_watch(session, seq)
            stop.watching(cancel)
            try:
                for ev in events:
                    seq = ev.seq
                    if stop.is_set():
                        return
                    if on_record is not None:
                        on_record(ev.version)
                    if ev.version.state in SERVABLE_STATES:
                        on_version(ev.version.version, _announced_generation(ev.version))
            finally:
                stop.watching(None)
                cancel()
        except Exception as e:  # noqa: BLE001 - how the agent learns of versions: it outlives a bug as an outage
            if not stop.is_set():
                if not isinstance(e, WeightsyncError):
                    log.exception("watch failed unexpectedly; reconnecting")
                elif not failing:  # once per outage, not twice a second
                    log.warning("watch interrupted (%s); reconnecting", e)
                failing = True
                seq = -1
                stop.wait(0.5)


def _announced_generation(v: tpb.VersionInfo) -> int:
    """The trainer generation an announced version is noted with (`NewestAnnounced`): 0,
    "not known", for a PARTIAL one. A version some live rollout could not verify
    supersedes nothing: a pull of an older generation's version, `latest` among them,
    goes on (followers still want the PARTIAL version, and retry it)."""
    return 0 if v.state == tpb.PARTIAL else v.generation


class StaleWatch:
    """Follows a session only to abandon a pull its announcements make stale
    (`NewestAnnounced`), for a puller whose versions a caller chooses: a vLLM worker
    without prefetch, whose update would pull from a frozen trainer with the engine held for
    `timeout_s` per read, three reads, while its replacement's version is servable, and
    a sidecar started with `--follow false`. (A following rollout and a prefetcher watch
    the session for their own reasons and do this themselves.) Its owner calls
    `announced.forget()` when the session is made again."""

    def __init__(
        self,
        puller: WeightPuller,
        on_record: Callable[[tpb.VersionInfo], None] | None = None,
        on_connect: Callable[[cpb.GetStatusResponse], None] | None = None,
    ) -> None:
        """`on_record`, `on_connect`: as `follow_servable`'s (a rollout's `Readiness`)."""
        self.announced = NewestAnnounced()
        self._puller = puller
        puller.stale_rules.append(self._stale)
        self._stop = FollowStop()
        self._thread = threading.Thread(
            target=follow_servable,
            args=(puller.client, puller.session, self._announce, self._stop, on_record, on_connect),
            name="stale-watch",
            daemon=True,
        )
        self._thread.start()

    def _stale(self, version: int, generation: int) -> str:
        # A pull from a store (fs) never waits on a trainer process: a version its caller
        # chose from a replaced trainer reads while the coordinator keeps it (until the
        # new generation commits a newer one and nothing holds it).
        if self._puller.in_flight_mode == "fs":
            return ""
        return self.announced.stale(version, generation)

    def _announce(self, version: int, generation: int) -> None:
        self.announced.note(version, generation)
        self._puller.recheck()

    def close(self) -> None:
        """Stops following (its watch stream is cancelled: the thread ends at once)."""
        self._stop.set()
        self._puller.stale_rules.remove(self._stale)
