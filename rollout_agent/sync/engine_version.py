"""Which version a rollout's engine holds, and which of it the coordinator confirmed: the
one rule for the sidecar (`RolloutAgent`) and the vLLM worker (`VllmRollout`)."""

from __future__ import annotations

import threading

from rollout_agent.sync.round import SyncResult
from weightsync.provenance import Provenance

KEPT_DIGESTS = 64  # versions whose manifest digest a rollout keeps: a response finished late still finds its own


class EngineVersion:
    """`applied`: the version the engine holds (its handshake's verdict may be pending).
    `current`: the version this rollout says it serves (status, heartbeats, metrics), set
    by an OK verdict only while the engine holds that version: a verdict that arrives late,
    after another version was applied, changes nothing (taking the newer of the two, a
    rollout could say it serves a version the engine has replaced). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.applied = 0
        self._damaged = False  # an audit found the engine not holding `applied` exactly
        self._digests: dict[int, str] = {}  # version -> manifest digest, of the last KEPT_DIGESTS applied

    def after_round(self, result: SyncResult) -> None:
        """The engine holds a round's version once it applied (OK, or its verdict pending)."""
        if result.ok or result.handshake_pending:
            with self._lock:
                self.applied = result.version
                self._keep_digest(result.version, result.manifest_digest)

    def knows(self, version: int, manifest_digest: str) -> None:
        """`version`'s manifest digest, known before the engine holds it (its manifest
        came): a response sampled once it is applied, before its round ended, names it."""
        with self._lock:
            if version != self.applied:  # held: its round recorded the digest it applied
                self._keep_digest(version, manifest_digest)

    def _keep_digest(self, version: int, manifest_digest: str) -> None:  # (the lock held)
        self._digests.pop(version, None)  # (newest last)
        self._digests[version] = manifest_digest
        for old in list(self._digests)[:-KEPT_DIGESTS]:
            del self._digests[old]

    def provenance(self, version: int | None = None) -> Provenance:
        """`version`'s weights as this engine applied them, its manifest digest among
        them ("" for a version it has not applied, or forgot; version 0, the weights it
        started with, has none); None: the version it holds now."""
        with self._lock:
            v = self.applied if version is None else version
            return Provenance(v, self._digests.get(v, ""))

    def applied_whole(self, version: int) -> None:
        """An apply committed (called under the applier's lock, `audited.Audited.on_commit`,
        so in order with audits): what an audit found before is gone."""
        with self._lock:
            self._damaged = False

    def unserve(self, version: int) -> bool:
        """An audit found the engine not holding `version` (the one it was last given
        whole) exactly: it serves no version (`current` 0) until a version is applied whole
        again (`applied_whole`), and an OK verdict before that makes none current. True
        when it said it served one."""
        with self._lock:
            self._damaged = True
            said, self.current = self.current, 0
            return said != 0

    def confirmable(self, version: int) -> bool:
        """Whether an OK verdict for `version` would make it current (the engine holds it
        and it is not current already)."""
        with self._lock:
            return self._confirmable(version)

    def confirm(self, version: int) -> bool:
        """An OK verdict for `version`; True when it became current."""
        with self._lock:
            if not self._confirmable(version):
                return False
            self.current = version
            return True

    def _confirmable(self, version: int) -> bool:  # (the lock held)
        return version == self.applied and version != self.current and not self._damaged

    @property
    def newest(self) -> int:
        """The newer of the two: a following rollout never goes back past it."""
        with self._lock:
            return max(self.current, self.applied)

    def forget(self) -> None:
        """The session was made again: the engine holds no version of it."""
        with self._lock:
            self.current = self.applied = 0
            self._digests.clear()
