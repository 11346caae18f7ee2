"""Failpoints for fault tests (etcd gofail style): `name=count` pairs set by a flag.

Production code asks `failpoints.fire("name")`; with nothing configured it is a dict
lookup. Counts fire that many times, then the failpoint is spent.
"""

from __future__ import annotations

import threading

from weightsync.errors import InvalidArgument

KNOWN = {
    "applier.raise": "the rollout's applier (its engine) raises while applying a version, N times",
    "jax_applier.corrupt_after_check": (
        "a JAX applier flips one bit of the first leaf on its way to the device, after the host took its "
        "fingerprint, N applies (the device check must refuse the version)"
    ),
    "chunk_server.corrupt_chunk": "flip one byte in the next N chunks sent over grpc or tcp (trainer side)",
    "puller.corrupt_assembled": (
        "flip one byte of the first tensor before its check, N checks (rollout side; a flip the check finds is "
        "repaired by re-fetching its chunk and checked again, so N=2 makes a version fail)"
    ),
    "puller.unchecked_manifest": "a rollout takes the next N manifests it fetches as not checking (a corrupt manifest)",
    "relay.stall_after_chunks": "a relaying rollout sends N chunks, then stalls every reply (a hung relay)",
    "tcp_server.drop_mid_reply": (
        "the tcp chunk server promises a reply, then drops the connection, N times (trainer side)"
    ),
    "sync.pause_before_report": "a rollout pauses 3 s between applying a version and its handshake, N times",
    "flip.pause_before_prepared": (
        "a rollout holding an ATOMIC version verified pauses 5 s before it reports PREPARED, N times"
    ),
    "flip.wrong_prepared_digest": (
        "a rollout reports PREPARED with the first tensor's digest changed, N times (the coordinator must abort)"
    ),
    "coordinator.exit_after_flip_decision": (
        "the coordinator exits (status 17) right after it wrote a flip decision, before anyone is told, N times"
    ),
    "audit.flip_live_bit": (
        "right after each of the next N applies, a rollout flips one bit in its engine's live copy of the tensor "
        "first in name order (a memory fault after the version verified; the next audit must name it)"
    ),
    "audit.overwrite_tensor": (
        "right after each of the next N applies, a rollout overwrites its engine's whole live copy of the tensor "
        "last in name order (a second loader; the next audit must name it)"
    ),
}


class Failpoints:
    """Parsed from 'name=N,name2=M'; thread-safe countdowns."""

    def __init__(self, spec: str = "") -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, count = item.partition("=")
            if name not in KNOWN:
                raise InvalidArgument(
                    f"unknown failpoint {name!r}; known: {', '.join(sorted(KNOWN))}", field="failpoints"
                )
            if not count.isdigit():
                raise InvalidArgument(f"{item!r} must be name=COUNT", field="failpoints")
            self._counts[name] = int(count)

    def arm(self, name: str, count: int) -> None:
        """Arms `name` for `count` more fires (tests that fault one phase of a run)."""
        if name not in KNOWN:
            raise InvalidArgument(f"unknown failpoint {name!r}; known: {', '.join(sorted(KNOWN))}", field="failpoints")
        with self._lock:
            self._counts[name] = count

    def armed(self, name: str) -> bool:
        """True when the failpoint was configured (spent or not)."""
        return name in self._counts

    def fire(self, name: str) -> bool:
        """True (and one count spent) when the failpoint is armed."""
        if not self._counts:
            return False
        with self._lock:
            left = self._counts.get(name, 0)
            if left <= 0:
                return False
            self._counts[name] = left - 1
            return True
