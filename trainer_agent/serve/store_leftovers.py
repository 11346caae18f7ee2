"""Parts in the fs store that no publisher will remove: those of a replaced trainer.

A publisher removes a version's part when it reuses the version's arena slot. A trainer
replaced by a new incarnation (preempted, crashed, frozen) never does, and its
successor starts with empty slots: left alone, every restart would leave up to `slots`
whole copies of the model in the store for good (and one more where it died between
writing a part and publishing it). The coordinator releases such versions once the new
generation committed a newer one and no rollout holds them; the successor removes their
parts (every rank's: a restart may have fewer ranks) when it next claims a slot, and those
of versions the coordinator never held.
"""

from __future__ import annotations

import logging

from weightsync import version_states
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import WeightsyncError
from weightsync.transports.fs import FsStore

log = logging.getLogger(__name__)

GONE = frozenset(tpb.VersionState.Value(name) for name in version_states.RETIRED)


def remove_released_parts(
    store: FsStore, client: CoordinatorClient, session: str, *, keep: set[int], below: int
) -> list[int]:
    """Removes the store's versions of `session` older than `below` and not in `keep`
    (what this publisher holds) that the coordinator says are RELEASED or FAILED, or does
    not hold at all; returns them. Never raises: a part left behind costs space, not a publish."""
    try:
        others = [v for v in store.versions(session) if v < below and v not in keep]
        if not others:
            return []
        limit = min(1000, below - min(others) + 1)  # GetStatus lists the newest `limit` versions
        listed = client.status(session, limit).versions
    except (OSError, WeightsyncError) as e:
        log.info("looking for parts a replaced trainer left in the fs store: %s", e)
        return []
    states = {v.version: v.state for v in listed}
    # Where the listing reaches, a version the coordinator does not hold is named by no
    # manifest: pruned from its history (released), or never taken (refused, or written by
    # a trainer that died before it published).
    reach = 0 if len(listed) < limit else min(states)
    removed = []
    for version in others:
        state = states.get(version)
        if state is None and version <= reach:
            continue  # past the listing: it may be anything
        if state is not None and state not in GONE:
            continue  # still servable: a rollout may read it
        try:
            store.remove_version(session, version)
        except FileNotFoundError:  # another rank took it first
            pass
        except OSError as e:
            log.warning("version %d: its parts were not removed from the fs store (%s)", version, e)
            continue
        removed.append(version)
    if removed:
        log.info("removed the fs store parts of released versions %s (left by a replaced trainer)", removed)
    return removed
