"""Following a session: learn of each servable version as the coordinator announces it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from weightsync import version_states
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import VersionNotFound, WeightsyncError

log = logging.getLogger(__name__)
SERVABLE_STATES = frozenset(tpb.VersionState.Value(name) for name in version_states.SERVABLE)


def newest_servable(client: CoordinatorClient, session: str) -> int:
    """The session's newest READY / COMMITTED / PARTIAL version (VersionNotFound if none)."""
    for v in client.status(session, 20).versions:
        if v.state in SERVABLE_STATES:
            return v.version
    raise VersionNotFound(f"session {session!r} has no READY version yet")


def follow_servable(
    client: CoordinatorClient, session: str, on_version: Callable[[int], None], stop: threading.Event
) -> None:
    """Calls `on_version` with the newest servable version on (re)connect, then with each
    new one, until `stop` is set; rides out coordinator outages by reconnecting."""
    seq = -1
    failing = False
    while not stop.is_set():
        try:
            if seq < 0:  # (re)connect: no replay of history, just the newest version
                st = client.status(session, 1)
                seq = st.event_seq
                if failing:
                    log.info("watch reconnected")
                    failing = False
                if st.versions and st.versions[0].state in SERVABLE_STATES:
                    on_version(st.versions[0].version)
            for ev in client.watch(session, seq):
                seq = ev.seq
                if stop.is_set():
                    return
                if ev.version.state in SERVABLE_STATES:
                    on_version(ev.version.version)
        except Exception as e:  # noqa: BLE001 - how the agent learns of versions: it outlives a bug as an outage
            if not stop.is_set():
                if not isinstance(e, WeightsyncError):
                    log.exception("watch failed unexpectedly; reconnecting")
                elif not failing:  # once per outage, not twice a second
                    log.warning("watch interrupted (%s); reconnecting", e)
                failing = True
                seq = -1
                stop.wait(0.5)
