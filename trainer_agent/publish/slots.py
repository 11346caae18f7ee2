"""Plan the slot: which arena slot a version is staged into, freed of the version it held
(released at the coordinator: rollouts' leases waited out, or the newest COMMITTED version
given up), and the arena's slots fitted to the layout."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trainer_agent.publish.session_link import SessionLink
from trainer_agent.serve.arena import Arena
from trainer_agent.serve.chunk_server import SlotTable
from trainer_agent.serve.store_leftovers import remove_released_parts
from trainer_agent.settings import PublisherSettings
from weightsync.errors import (
    FailedPrecondition,
    NewestCommitted,
    SlotBusy,
    StaleGeneration,
    WeightsyncError,
    WrongState,
)
from weightsync.transports.fs import FsStore

log = logging.getLogger("trainer_agent.publish.publisher")  # the publish path logs under one name


class SlotPlanner:
    """Claims the slots of one rank's arena for the versions it publishes; `closed()` ends
    a wait for leases."""

    def __init__(
        self,
        arena: Arena,
        table: SlotTable,
        link: SessionLink,
        settings: PublisherSettings,
        fs_store: FsStore | None,
        closed: Callable[[], bool],
    ) -> None:
        self.arena = arena
        self.table = table
        self.link = link
        self.settings = settings
        self.fs_store = fs_store
        self.closed = closed

    def claim(self, version: int) -> int:
        """A slot to stage into: an empty one, else the oldest whose version can be released.

        A slot holding `version` itself is never chosen, so a retried or conflicting
        publish cannot overwrite bytes rollouts may be reading. The old version is
        released at the coordinator first, which is refused while a rollout holds a lease
        on it (we wait, bounded, rather than tear its bytes) and for the session's newest
        COMMITTED version until a newer one commits: another slot free to take is taken,
        so a version that fails its handshakes does not cost the session its last
        committed one; where the others are leased, that version is given up rather than
        waited on (a lease may be a prefetch that only a newer version ends).
        """
        entries = self.table.entries()
        if self.fs_store is not None:
            remove_released_parts(
                self.fs_store,
                self.link.client,
                self.link.session,
                keep={e.version for e in entries.values()},
                below=version,
            )
        for slot in range(self.arena.slots):
            if slot not in entries:
                return slot
        candidates = sorted(((s, e) for s, e in entries.items() if e.version != version), key=lambda kv: kv[1].version)
        if not candidates:
            raise FailedPrecondition(f"every slot holds version {version}; use slots >= 2")
        # One slot: staging overwrites its version's bytes, whatever that version is.
        unpin = self.arena.slots == 1
        pinned = None
        for slot, entry in candidates:  # the oldest slot free to take now
            released = self._release_for_reuse(slot, entry.version, unpin=unpin, wait=False)
            if released:
                break
            if released is False and pinned is None:  # the session's newest COMMITTED version
                pinned = slot, entry
        else:
            # Every other slot is leased or holds the newest COMMITTED version. A lease may be a
            # prefetch waiting on its engine, which only a newer version ends: that version is
            # given up rather than waited on; else the oldest slot's leases are waited out.
            slot, entry = pinned or candidates[0]
            self._release_for_reuse(slot, entry.version, unpin=True if pinned else unpin, wait=True)
        self.table.set(slot, None)
        if self.fs_store is not None:
            try:
                self.fs_store.remove_part(self.link.session, entry.version, self.settings.rank)
            except OSError as e:  # the store's trouble: an old part left behind costs space, not this publish
                log.warning("version %d: its part was not removed from the fs store (%s)", entry.version, e)
        return slot

    def _release_for_reuse(self, slot: int, version: int, *, unpin: bool, wait: bool) -> bool | None:
        """Releases (or, still STAGING, aborts) the version in `slot` so it can be reused:
        True. False where it is the session's newest COMMITTED version (and not `unpin`);
        None where rollouts lease it and not `wait`, else their leases are waited out for
        up to slot_wait_s (SlotBusy after)."""
        deadline = time.monotonic() + (self.settings.slot_wait_s if wait else 0.0)
        with self.link.fencing():
            while True:
                try:
                    self.link.release(version, unpin=unpin)
                    return True
                except NewestCommitted:  # (these two before FailedPrecondition, their base)
                    return False
                except StaleGeneration:
                    raise
                except WrongState:
                    # Still STAGING (another rank never sealed) or otherwise unreleasable: abort it.
                    try:
                        self.link.abort(version, "slot reused")
                    except StaleGeneration:
                        raise
                    except WeightsyncError:
                        pass
                    return True
                except FailedPrecondition as e:
                    if not wait:
                        return None
                    if time.monotonic() > deadline or self.closed():
                        raise SlotBusy(f"cannot reuse slot {slot}: {e.message}; raise slots or slot_wait_s") from None
                    time.sleep(0.05)
                except WeightsyncError as e:  # NOT_FOUND etc.: nothing to protect
                    log.info("releasing version %d: %s", version, e)
                    return True

    def fit(self, slot_bytes: int) -> None:
        """Makes every arena slot hold `slot_bytes`. A reallocation leaves no slot's bytes,
        so their versions are forgotten first: a reader then finds the version gone
        (NOT_FOUND) or holds a view of the old mapping, which outlives it; never a slot of an
        arena being made or of the new one. Raises ResourceExhausted
        (`arena`) when there is no room."""
        if self.arena.fits(slot_bytes):
            return
        for slot in range(self.arena.slots):
            self.table.set(slot, None)
        self.arena.ensure_slot_bytes(slot_bytes)
