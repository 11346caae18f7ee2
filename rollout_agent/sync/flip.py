"""Atomic flips on the rollout's side (docs/design.md "Atomic flips"): what this rollout
knows of each ATOMIC version's flip, and the wait between its PREPARED report and the
coordinator's decision."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import WeightsyncError

log = logging.getLogger(__name__)
KEPT_VERSIONS = 16  # versions whose last known record is kept (a rollout waits on one)
_FLIPPED = frozenset({tpb.COMMITTED, tpb.PARTIAL})  # past a decision (a version commits only once decided)
_GONE = frozenset({tpb.FAILED, tpb.RELEASED})


def undecided_atomic(info: tpb.VersionInfo) -> bool:
    """A version this rollout must prepare and report PREPARED, not apply: ATOMIC, still
    READY, and its flip not decided."""
    return info.flip_policy == tpb.ATOMIC and info.state == tpb.READY and not info.HasField("flip_decided_at")


@dataclass(frozen=True)
class FlipVerdict:
    """How a wait for a version's flip ended: `flip` (apply what was prepared) or not,
    with why (the version's reason: aborted, released; or this rollout stopping)."""

    flip: bool
    why: str = ""


class FlipBoard:
    """The newest record of each version this rollout heard of (`note`: the watch's events,
    the answers to its reports), and `wait` for one's decision. A record missed while the
    watch was down (a coordinator restarting) is read from the coordinator's status: when a
    newer version is heard of while one is still undecided, and every `poll_s` while one is
    waited on. Thread-safe."""

    def __init__(self, client: CoordinatorClient, session: str, *, poll_s: float = 10.0) -> None:
        self._client = client
        self._session = session
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._records: dict[int, tpb.VersionInfo] = {}
        self._newest = 0  # the newest version heard of
        self._closed = False

    def note(self, info: tpb.VersionInfo) -> None:
        """A version's record as the coordinator sent it (any state). A record is never
        replaced by an older view of it: a decision, once heard of, stays."""
        with self._cond:
            kept = self._records.get(info.version)
            if kept is not None and _progress(kept) > _progress(info):
                return
            self._records[info.version] = info
            for old in sorted(self._records)[:-KEPT_VERSIONS]:
                del self._records[old]
            self._newest = max(self._newest, info.version)
            self._cond.notify_all()

    def forget(self) -> None:
        """The session was made again: its version numbers start over."""
        with self._cond:
            self._records.clear()
            self._newest = 0

    def close(self) -> None:
        """Ends every wait (the rollout is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def decided(self, version: int) -> bool:
        """Whether `version`'s flip is known decided (or the version past it: committed)."""
        with self._cond:
            info = self._records.get(version)
            return info is not None and (info.HasField("flip_decided_at") or info.state in _FLIPPED)

    def undecided(self, version: int) -> bool:
        """Whether this board knows `version` as an ATOMIC one still READY and undecided."""
        with self._cond:
            info = self._records.get(version)
            return info is not None and undecided_atomic(info)

    def wait(self, version: int, timeout_s: float | None = None) -> FlipVerdict:
        """Blocks until `version`'s flip is decided (True), or it FAILED or was RELEASED
        undecided, or this board closes, or `timeout_s` passed (False, why). The
        coordinator decides or aborts every ATOMIC version by its prepare deadline, so
        this ends while it runs."""
        asked = time.monotonic()
        until = None if timeout_s is None else asked + timeout_s
        asked_newest = 0
        while True:
            with self._cond:
                info = self._records.get(version)
                if info is not None and (info.HasField("flip_decided_at") or info.state in _FLIPPED):
                    return FlipVerdict(True)
                if info is not None and info.state in _GONE:
                    state = tpb.VersionState.Name(info.state)
                    return FlipVerdict(False, info.reason or f"version {version} is {state}")
                if self._closed:
                    return FlipVerdict(False, "the rollout is stopping")
                if until is not None and time.monotonic() >= until:
                    state = tpb.VersionState.Name(info.state) if info is not None else "not heard of"
                    prepared = f", {info.prepared} rollout(s) prepared it" if info is not None else ""
                    return FlipVerdict(False, f"its flip is not decided after {timeout_s:g} s ({state}{prepared})")
                newer = self._newest > version and self._newest != asked_newest
                due = time.monotonic() - asked >= self._poll_s
                if not (newer or due):
                    self._cond.wait(min(1.0, self._poll_s, max(0.01, until - time.monotonic()) if until else 1.0))
                    continue
                asked_newest = self._newest
            asked = time.monotonic()
            self._ask(version)

    def _ask(self, version: int) -> None:
        """Reads the session's newest versions from the coordinator (a record the watch
        missed); a version no longer among them was pruned, long after it ended."""
        try:
            st = self._client.status(self._session, 20)
        except WeightsyncError as e:
            log.info("asking for version %d's flip: %s; asking again", version, e.message)
            return
        for info in st.versions:
            self.note(info)
        if st.versions and version < st.versions[-1].version and not any(v.version == version for v in st.versions):
            self.note(tpb.VersionInfo(version=version, state=tpb.RELEASED, reason="no longer listed"))


def _progress(info: tpb.VersionInfo) -> int:
    """How far a record is along the flip: ended, decided, or neither."""
    if info.state in _GONE or info.state in _FLIPPED:
        return 2
    return 1 if info.HasField("flip_decided_at") else 0
