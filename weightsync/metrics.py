"""All weightsync Prometheus metrics, built on an injected CollectorRegistry.

Series that belong to a session carry a `session` label (a coordinator serves many; the
rules and dashboard in deploy/ group by it). The coordinator's fleet gauges (agents,
leases, newest versions) are read from its store at scrape time: `coordinator.fleet_metrics`.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from weightsync import __version__

# Phases run from ~1 ms (tiny models on loopback) to minutes (100 GB models over a
# network): exponential buckets x2.5 from 1 ms to ~10 min keep relative error bounded.
PHASE_BUCKETS_S = tuple(round(0.001 * 2.5**i, 6) for i in range(15))
# RPCs are control-plane calls: 0.5 ms .. ~30 s.
RPC_BUCKETS_S = tuple(round(0.0005 * 3**i, 6) for i in range(11))
# Flip skew, first to last rollout serving a version by their own clocks: 0.1 ms (one host,
# staged swaps) .. ~1 h (rollouts that each apply when their own pull verifies), x3.
SKEW_BUCKETS_S = tuple(round(0.0001 * 3**i, 7) for i in range(16))
# Garbage-collector pauses: 0.1 ms .. ~2 s.
GC_BUCKETS_S = tuple(round(0.0001 * 3**i, 7) for i in range(10))


@dataclass
class Metrics:
    """The metrics of one process; `role` is a low-cardinality label value."""

    registry: CollectorRegistry
    role: str
    rpc_total: Counter
    rpc_seconds: Histogram
    phase_seconds: Histogram
    transfer_bytes: Counter
    digest_failures: Counter
    current_version: Gauge
    versions_total: Counter
    fenced: Gauge
    publish_skipped: Counter
    publish_held_bytes: Gauge
    database_bytes: Gauge
    handshakes: Counter
    leases_dropped: Counter
    ready_to_commit_seconds: Histogram
    flip_skew_seconds: Histogram
    sync_failures: Counter
    chunk_retries: Counter
    pulls: Counter
    held_bytes: Gauge
    host_memory_bytes: Gauge
    host_memory_limit_bytes: Gauge
    pause_seconds: Histogram
    ready_to_serving_seconds: Histogram
    gc_pause_seconds: Histogram
    gc_frozen_objects: Gauge
    auth_open: Gauge
    applies: Counter
    apply_hbm_peak_bytes: Gauge
    apply_repaired_leaves: Counter
    audits: Counter
    audit_mismatches: Counter
    audit_age: Gauge

    def forget_session(self, session: str) -> None:
        """Drops every series labelled with `session` (deleted: a platform that makes a
        session per job and deletes it after would otherwise keep each one's series)."""
        for metric in vars(self).values():
            names = getattr(metric, "_labelnames", ())  # the order `remove` takes values in
            if "session" not in names:
                continue
            doomed = {
                tuple(sample.labels[n] for n in names)
                for family in metric.collect()
                for sample in family.samples
                if sample.labels.get("session") == session
            }
            for values in doomed:
                metric.remove(*values)

    def observe_rpc(self, method: str, code: str, seconds: float | None) -> None:
        """RpcObserver hook for `rpc.StatusInterceptor` (seconds None: a response stream,
        counted but not timed)."""
        service, _, name = method.lstrip("/").rpartition("/")
        self.rpc_total.labels(service=service, method=name, code=code).inc()
        if seconds is not None:
            self.rpc_seconds.labels(service=service, method=name).observe(seconds)

    def observe_phase(self, phase: str, seconds: float) -> None:
        self.phase_seconds.labels(role=self.role, phase=phase).observe(seconds)

    def observe_apply(self, session: str, mode: str, hbm_peak_bytes: int | None, repaired_leaves: int = 0) -> None:
        """One version an engine took: how (`mode`), its accelerator memory high-water mark
        where the backend reports one, and the leaves built twice to pass the device check."""
        self.applies.labels(role=self.role, session=session, mode=mode).inc()
        if repaired_leaves:
            self.apply_repaired_leaves.labels(role=self.role, session=session).inc(repaired_leaves)
        if hbm_peak_bytes is not None:
            self.apply_hbm_peak_bytes.labels(role=self.role, session=session).set(hbm_peak_bytes)

    def add_bytes(self, direction: str, n: int) -> None:
        self.transfer_bytes.labels(role=self.role, direction=direction).inc(n)


def build_metrics(role: str, registry: CollectorRegistry | None = None) -> Metrics:
    """Creates every weightsync metric on `registry` (a fresh one by default)."""
    registry = registry if registry is not None else CollectorRegistry()
    info = Info("weightsync_build", "Build information.", registry=registry)
    info.info({"version": __version__, "python": platform.python_version(), "role": role})
    return Metrics(
        registry=registry,
        role=role,
        rpc_total=Counter(
            "weightsync_rpc_requests_total",
            "Finished RPCs by status code.",
            ["service", "method", "code"],
            registry=registry,
        ),
        rpc_seconds=Histogram(
            "weightsync_rpc_seconds",
            "RPC handling time.",
            ["service", "method"],
            buckets=RPC_BUCKETS_S,
            registry=registry,
        ),
        phase_seconds=Histogram(
            "weightsync_phase_seconds",
            "Duration of sync phases (stage, publish, pull, verify, assemble, apply, handshake).",
            ["role", "phase"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        ),
        transfer_bytes=Counter(
            "weightsync_transfer_bytes_total",
            "Weight bytes moved, by direction (staged, served, pulled, applied).",
            ["role", "direction"],
            registry=registry,
        ),
        digest_failures=Counter(
            "weightsync_digest_failures_total",
            "Chunks (rollouts) or handshakes (coordinator) whose digests did not match.",
            ["role", "session"],
            registry=registry,
        ),
        current_version=Gauge(
            "weightsync_current_version",
            "Newest version this process serves (a rollout that never synced reads 0).",
            ["role", "session"],
            registry=registry,
        ),
        versions_total=Counter(
            "weightsync_version_transitions_total",
            "Versions entering each state (STAGING, READY, COMMITTED, PARTIAL, FAILED, RELEASED).",
            ["session", "state"],
            registry=registry,
        ),
        handshakes=Counter(
            "weightsync_handshakes_total",
            "Rollout handshakes by outcome: ok, mismatch (digests differ from the source: DATA_LOSS), "
            "local_error (the rollout failed on its side).",
            ["session", "outcome"],
            registry=registry,
        ),
        leases_dropped=Counter(
            "weightsync_leases_dropped_total",
            "Version leases dropped because the rollout holding them stopped heartbeating.",
            ["session"],
            registry=registry,
        ),
        ready_to_commit_seconds=Histogram(
            "weightsync_ready_to_commit_seconds",
            "From a version's first published part to its COMMITTED or PARTIAL verdict.",
            ["session"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        ),
        flip_skew_seconds=Histogram(
            "weightsync_flip_skew_seconds",
            "Per COMMITTED version: from the first to the last rollout serving it, by the flip times the rollouts "
            "reported (their own clocks), by the session's flip policy (independent, atomic).",
            ["session", "flip_policy"],
            buckets=SKEW_BUCKETS_S,
            registry=registry,
        ),
        sync_failures=Counter(
            "weightsync_sync_failures_total",
            "Sync rounds that did not apply a version, by reason: data_loss (bytes did not verify), "
            "transient (a source or the coordinator unreachable), local (this process failed to apply), "
            "mismatch (the coordinator's digests differ), refused (the handshake was refused), "
            "abandoned (a newer version made the pull stale), aborted (an atomic flip this rollout prepared was "
            "aborted: the version's own failure names why).",
            ["role", "session", "reason"],
            registry=registry,
        ),
        pause_seconds=Histogram(
            "weightsync_pause_seconds",
            "Per OK handshake: how long the rollout's engine could not serve because of the round.",
            ["session"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        ),
        ready_to_serving_seconds=Histogram(
            "weightsync_ready_to_serving_seconds",
            "Per OK handshake: from the version's READY to the new weights serving at the rollout.",
            ["session"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        ),
        chunk_retries=Counter(
            "weightsync_chunk_retries_total",
            "Chunks fetched again after a failed digest or an unreachable source.",
            ["role", "session"],
            registry=registry,
        ),
        pulls=Counter(
            "weightsync_pulls_total",
            "Versions pulled, by kind: whole, or delta (rebuilt from the version the receive buffer held).",
            ["role", "session", "kind"],
            registry=registry,
        ),
        held_bytes=Gauge(
            "weightsync_held_bytes",
            "Bytes a rollout keeps between versions, by kind: receive (its copy of each rank's part), delta "
            "(encoded delta chunks), assembly (tensors split across trainer ranks, joined).",
            ["role", "session", "kind"],
            registry=registry,
        ),
        host_memory_bytes=Gauge(
            "weightsync_host_memory_bytes",
            "This process's resident host memory (/proc/self/status), by kind: rss (VmRSS), anon (RssAnon: its "
            "own), shmem (RssShmem: shared memory it maps, a trainer's arena), file (RssFile), peak (VmHWM, or "
            "getrusage's maximum where the kernel has none). Where the kernel splits no kinds (gVisor), anon, "
            "shmem and file read 0.",
            ["role", "session", "kind"],
            registry=registry,
        ),
        host_memory_limit_bytes=Gauge(
            "weightsync_host_memory_limit_bytes",
            "A rollout's host_memory_limit_bytes (0: none): the most RssAnon a pull and apply may take it to.",
            ["role", "session"],
            registry=registry,
        ),
        database_bytes=Gauge(
            "weightsync_database_bytes",
            "Size of the coordinator's SQLite file (retention keeps it bounded).",
            registry=registry,
        ),
        gc_pause_seconds=Histogram(
            "weightsync_gc_pause_seconds",
            "Python garbage collections by generation: every thread of the process waits this long.",
            ["generation"],
            buckets=GC_BUCKETS_S,
            registry=registry,
        ),
        gc_frozen_objects=Gauge(
            "weightsync_gc_frozen_objects",
            "Objects frozen out of Python's garbage collection (weightsync.gc_freeze); reference cycles "
            "that died among them are reclaimed at the next --gc-refresh-s.",
            registry=registry,
        ),
        auth_open=Gauge(
            "weightsync_auth_open",
            "1 when a gRPC server of this process takes calls without a credential from every user who reaches it "
            "(TCP, loopback included, without bearer tokens or client certificates; a unix socket others may "
            "write), else 0.",
            registry=registry,
        ),
        applies=Counter(
            "weightsync_applies_total",
            "Versions an engine took, by mode: swap (built aside while it served, swapped in at once), inplace "
            "(leaf by leaf inside the pause, each old buffer reused: memory for one copy), or the applier's own.",
            ["role", "session", "mode"],
            registry=registry,
        ),
        apply_hbm_peak_bytes=Gauge(
            "weightsync_apply_hbm_peak_bytes",
            "After the last applied version: the accelerator memory high-water mark of the busiest device "
            "(memory_stats' peak_bytes_in_use, over the process' life); absent where the backend has none.",
            ["role", "session"],
            registry=registry,
        ),
        apply_repaired_leaves=Counter(
            "weightsync_apply_repaired_leaves_total",
            "Leaves an in-place apply built a second time because their device copy did not match the verified "
            "host bytes (damaged between host and device; the damage never served). Any rise is a host or device "
            "fault worth a look.",
            ["role", "session"],
            registry=registry,
        ),
        audits=Counter(
            "weightsync_audits_total",
            "Audits of the weights a rollout's engine serves against the version it was last given whole, by "
            "result: exact (every tensor bit for bit) or mismatch (the engine served something else; it re-applies "
            "the version).",
            ["role", "session", "result"],
            registry=registry,
        ),
        audit_mismatches=Counter(
            "weightsync_audit_mismatches_total",
            "Per tensor: audits that found the engine's live copy of it differing from the version it was given. "
            "Any rise: the engine served weights that are not the version it claims (docs/runbooks.md).",
            ["role", "session", "tensor"],
            registry=registry,
        ),
        audit_age=Gauge(
            "weightsync_audit_age_seconds",
            "Seconds since the rollout's last audit of its served weights finished (absent before the first).",
            ["role", "session"],
            registry=registry,
        ),
        fenced=Gauge(
            "weightsync_fenced",
            "1 when a newer trainer incarnation fenced this trainer (its writes are refused), else 0.",
            ["session"],
            registry=registry,
        ),
        publish_skipped=Counter(
            "weightsync_publish_skipped_total",
            "Async publishes a newer version replaced before they started (latest wins).",
            ["session"],
            registry=registry,
        ),
        publish_held_bytes=Gauge(
            "weightsync_publish_held_bytes",
            "Bytes of parameters async publishes hold while they run or wait (device memory for device arrays).",
            ["session"],
            registry=registry,
        ),
    )
