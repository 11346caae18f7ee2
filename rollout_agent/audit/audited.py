"""Auditing the weights an engine serves: each tensor's exact fingerprint over its live
bits, compared with the one taken from the verified bytes of the version it was given.

An applier that can audit keeps, per engine entry (a NumPy array, a JAX leaf, a vLLM
parameter's region), the fingerprint of what that entry must hold, computed from the
verified host bytes while it applies them (`audit_reading.Expected`); its `audit()`
fingerprints the entries as they are now, where they live, and names every checkpoint
tensor whose entry differs (`audit_reading.compare`).

`Audited` wraps an applier so that its update rounds and its audits never overlap (one
lock: an audit waits for an apply in progress, an apply for an audit; a version staged
aside, the live weights untouched, holds it only for its commit) and an audit knows which
version the engine was last given whole.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rollout_agent.engines.applier import Applier
from rollout_agent.engines.apply_report import ApplyReport
from rollout_agent.engines.audit_reading import AuditReading, VerifiedDigests
from weightsync.errors import FailedPrecondition
from weightsync.failpoints import Failpoints
from weightsync.manifest import TensorSpec

log = logging.getLogger(__name__)

# Test-only faults written into the engine's own weights right after an apply commits
# (weightsync.failpoints), each naming the tensor it damaged.
FAULTS = {"audit.flip_live_bit": "flip", "audit.overwrite_tensor": "overwrite"}


class Audited(Applier):
    """`inner` with its update rounds and audits kept apart by one lock (`audit` waits for
    an apply in progress; an apply waits for an audit), the version it last took whole
    (`applied`), and `on_commit` hooks called after each apply, still under the lock (they
    must be quick and must not audit).

    `inner` audits with `audit() -> AuditReading | None` (None: it cannot) and, for the
    fault tests, damages its live weights with `inject(kind) -> str` (the tensor named);
    the failpoints in `FAULTS` call it right after an apply commits. Any other attribute
    is the inner applier's.
    """

    def __init__(self, inner: Applier, failpoints: Failpoints | None = None) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.applied = 0
        self.on_commit: list[Callable[[int], None]] = []
        self._failpoints = failpoints
        self._open = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def check(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        self.inner.check(version, tensors)

    def taken(self, version: int, tensors: Mapping[str, TensorSpec]) -> Mapping[str, int] | None:
        return self.inner.taken(version, tensors)

    def prepare(self, version: int, tensors: Mapping[str, np.ndarray], check: VerifiedDigests | None = None) -> None:
        self.inner.prepare(version, tensors, check)

    def host_bytes(self, tensors: Mapping[str, TensorSpec], *, aside: bool = False) -> int:
        return self.inner.host_bytes(tensors, aside=aside)

    def stage(
        self, version: int, tensors: Mapping[str, TensorSpec], groups: Sequence[Sequence[tuple[str, np.ndarray]]]
    ) -> bool:
        # Built aside, the live weights untouched: audits go on meanwhile. The commit
        # that swaps them in takes the lock.
        return self.inner.stage(version, tensors, groups)

    def begin_update(self, version: int, tensors: Mapping[str, TensorSpec]) -> None:
        self.lock.acquire()
        self._open = True
        try:
            self.inner.begin_update(version, tensors)
        except BaseException:
            self._release()
            raise

    def apply(self, group: Sequence[tuple[str, np.ndarray]]) -> None:
        self.inner.apply(group)

    def commit_update(self, version: int) -> list[str]:
        if not self._open:  # a round `stage` opened
            self.lock.acquire()
            self._open = True
        try:
            consumed = self.inner.commit_update(version)
            self.applied = version
            for hook in self.on_commit:  # under the lock: in order with every audit
                hook(version)
            self._inject_faults()
        finally:
            self._release()
        return consumed

    def abort_update(self) -> None:
        try:
            self.inner.abort_update()
        finally:
            self._release()

    def last_report(self) -> ApplyReport | None:
        return self.inner.last_report()

    def audit(self, *, engine_held: bool = False) -> AuditReading:
        """The inner applier's audit, between update rounds. `engine_held`: the engine runs
        nothing meanwhile (its lock is held, or this is its own thread), so reads that must
        not run beside it may (vLLM-CPU's GEMM probes). FailedPrecondition where the
        applier cannot audit."""
        reader = getattr(self.inner, "audit", None)
        if reader is None:
            raise FailedPrecondition(f"{type(self.inner).__name__} cannot audit the weights it serves")
        with self.lock:
            reading = reader(engine_held=engine_held)
        if reading is None:
            raise FailedPrecondition(f"{type(self.inner).__name__} cannot audit the weights it serves")
        return reading  # type: ignore[no-any-return]

    def _release(self) -> None:
        if self._open:
            self._open = False
            self.lock.release()

    def _inject_faults(self) -> None:
        if self._failpoints is None:
            return
        for name, kind in FAULTS.items():
            if self._failpoints.fire(name):
                damaged = self.inner.inject(kind)  # type: ignore[attr-defined]
                log.warning("failpoint %s: damaged the live copy of %r", name, damaged)
