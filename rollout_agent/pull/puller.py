"""WeightPuller: fetches a version's chunks from every trainer rank and verifies each one.

The puller plans each version (its mode, its relay upstream), sizes and keeps the receive
buffers, rebuilds a version from its delta where the buffers hold the delta's base, and
abandons a pull gone stale; reading the chunks, lane by lane, is `lanes.LaneReader`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_agent.pull.assembly import held_whole
from rollout_agent.pull.lanes import Lane, LaneReader, PullPlan
from rollout_agent.pull.relay import DEFAULT_RELAY_WAIT_S, RelaySource, relay_stall_s
from rollout_agent.settings import check_pull_args
from weightsync import native, populated
from weightsync._proto import coordinator_pb2 as pb
from weightsync.addresses import inet_refused, is_unix
from weightsync.client import CoordinatorClient
from weightsync.config import check_positive
from weightsync.digests import xxh3
from weightsync.dtypes import dtype_info
from weightsync.errors import InvalidArgument
from weightsync.host_memory import host_memory
from weightsync.manifest import Endpoint, Manifest, Part
from weightsync.metrics import Metrics
from weightsync.modes import normalize_mode
from weightsync.security import Security
from weightsync.transports import Transport, available_transports
from weightsync.validation import INT64_MAX, check_agent_id, check_int_arg, check_session_name
from weightsync.wire import endpoint_from_proto

log = logging.getLogger(__name__)


def _nbytes(buf: np.ndarray | None) -> int:
    return 0 if buf is None else int(buf.nbytes)


# (version, trainer generation) of a pull in progress -> why it is stale ("": it is not)
StaleRule = Callable[[int, int], str]


@dataclass
class PulledVersion:
    """A version's chunks in per-rank receive buffers, each verified as it landed unless
    pulled with `check_chunks=False`."""

    header: pb.ManifestHeader
    manifest: Manifest
    buffers: dict[int, np.ndarray]
    bytes_pulled: int
    chunk_retries: int
    pull_seconds: float
    delta_base: int = 0  # rebuilt from this version's bytes by a delta (0: pulled whole)
    # (xxh3, sum) of the tensors a part holds whole, made from the rebuilt bytes in the
    # rebuild's own pass (a delta pull; the tensor check digests only the rest)
    digests: dict[str, tuple[int, float]] = field(default_factory=dict)


class WeightPuller(LaneReader):
    """Pulls versions with parallel streams and a bounded in-flight window.

    `mode` is a weight-sync mode ("" = the session's default, read from each
    manifest): "tcp" reads the native bulk server, "shm" maps a same-host trainer's arena
    (host ids equal), "fs" reads parts from the store under `fs_root` (fsspec storage options
    `fs_options`: endpoint, credentials), "relay" reads from
    a rollout before this one in the coordinator's chain (`upstream_of`: the first on its
    host relaying on a unix socket, whose buffers it maps, else the one before it; the
    trainer over tcp when none, or when that relay fails) and re-serves through `relay`;
    ranks that do not offer the mode are pulled over "grpc". Each rank's chunks are split
    into `streams` contiguous lanes; a lane requests at most `window_chunks` chunks per
    call, so at most streams x window_chunks x chunk_bytes are in flight per rank. Each
    chunk's xxh3 is checked on arrival, except in a `pull(check_chunks=False)`, whose
    caller checks the tensors the chunks make up (one hash pass, not two) and has `repair`
    locate and re-fetch the chunks under a tensor that failed; chunks read from a relay, or
    re-served to the rollout after this one in a relay chain, are always checked. A bad or missing
    chunk is fetched again (with backoff after a transport failure), up to `max_attempts`
    times in all, then DigestMismatch (DATA_LOSS) when a chunk's bytes did not verify, or
    TransportUnavailable when the source could not be read (retryable: nothing was wrong
    with any byte). Receive buffers persist across versions. Every byte is copied into
    them, shm included, and checked there: what is verified and applied is this process's
    own copy, which no other process can change after the check (a view of the trainer's
    arena could).
    """

    def __init__(
        self,
        client: CoordinatorClient,
        session: str,
        agent_id: str,
        *,
        mode: str = "",
        host_id: str = "",
        fs_root: str = "",
        fs_options: Mapping[str, Any] | None = None,
        streams: int = 2,
        window_chunks: int = 32,
        max_attempts: int = 3,
        timeout_s: float = 120.0,
        relay_stall_s: float = relay_stall_s(DEFAULT_RELAY_WAIT_S),
        metrics: Metrics | None = None,
        relay: RelaySource | None = None,
        security: Security | None = None,
        host_memory_limit_bytes: int = 0,
    ) -> None:
        self.client = client
        self.session = check_session_name(session, "session")
        self.agent_id = check_agent_id(agent_id, "agent_id")
        # A mode, or any registered transport (tests register an in-memory one).
        self.mode = mode if mode in available_transports() else normalize_mode(mode, "mode", allow_empty=True)
        self.relay = relay  # "relay" mode: re-serves what this puller receives
        self.relay_fallbacks = 0
        self.host_id = host_id or socket.gethostname()
        self.fs_root = fs_root
        self.fs_options = dict(fs_options or {})
        if relay is not None and self.mode not in ("relay", ""):
            raise InvalidArgument(
                f"a relay source needs mode 'relay' (or the session's), not {self.mode!r}", field="mode"
            )
        self.streams = streams
        self.window_chunks = window_chunks
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        # as the sidecar's settings check them: a library caller's arguments are checked alike
        check_pull_args(self, self.mode, fs_root)
        check_positive(self, ("timeout_s",))
        if fs_root and "://" not in fs_root and not os.path.isdir(fs_root):  # a local path: cheap to look at
            # not refused: the trainer may make it later (pods start in any order)
            log.warning(
                "fs_root %r does not exist here (yet): fs reads fail until the trainer's store is there", fs_root
            )
        # A read from a relay gives it this long to move a byte (it answers within its own
        # wait or gives up): a relay frozen or cut off is left for the trainer in seconds,
        # not after the data-plane deadline.
        self.relay_stall_s = min(timeout_s, relay_stall_s)
        self.metrics = metrics
        self.security = security  # for gRPC reads from trainer agents
        self.host_memory_limit_bytes = host_memory_limit_bytes  # (`host_budget`; 0: none)
        self._buffers: dict[int, np.ndarray] = {}
        self._delta_buffers: dict[int, np.ndarray] = {}  # encoded delta chunks, per rank
        # The version whose verified bytes fill the receive buffers (a delta's base), and its
        # manifest digest: set by the caller once every tensor checked, cleared by any pull.
        self._holding: tuple[Manifest, str] | None = None
        self.assembly_buffers: dict[str, np.ndarray] = {}  # tensors split across ranks
        self._lock = threading.Lock()
        # One open transport (connection) per (endpoint, stream), kept across versions.
        self._transports: dict[tuple[str, str, int], Transport] = {}
        self._fallbacks_logged: set[tuple[int, str]] = set()  # (rank, reason), logged once
        self._transports_lock = threading.Lock()
        self.last_retries = 0  # chunks re-fetched by the last pull, also when it failed
        # Abandoning a stale pull (`stale_rules`, `recheck`): the (version, generation) a
        # pull is fetching, and why it was abandoned ("" while it goes on).
        self.stale_rules: list[StaleRule] = []
        self._flight_lock = threading.Lock()
        self._in_flight: tuple[int, int] | None = None
        self.in_flight_mode = ""  # the mode of the pull in `_in_flight`, for rules that ask
        self._abandoned = ""
        self._interrupted: list[Transport] = []

    def _drop_other_ranks(self, manifest: Manifest) -> None:
        """Lets go of receive and delta buffers of ranks `manifest` does not have (a trainer
        restarted with fewer ranks): each held its part for as long as this rollout lived."""
        ranks = {p.rank for p in manifest.parts}
        for buffers in (self._buffers, self._delta_buffers):
            for rank in [r for r in buffers if r not in ranks]:
                del buffers[rank]

    def held(self) -> dict[str, int]:
        """Bytes of the buffers kept between versions, by kind (receive, delta, assembly)."""
        kinds = {"receive": self._buffers, "delta": self._delta_buffers, "assembly": self.assembly_buffers}
        return {kind: sum(b.nbytes for b in buffers.values()) for kind, buffers in kinds.items()}

    def growth(self, manifest: Manifest) -> int:
        """Bytes a pull of `manifest` would add to the buffers held: each rank's receive
        buffer grown to its part, a delta buffer where the version has a delta, and the
        tensors split across ranks joined."""
        grow = 0
        for part in manifest.parts:
            grow += max(0, part.total_bytes - _nbytes(self._buffers.get(part.rank)))
            if part.delta is not None:
                grow += max(0, part.delta.total_bytes - _nbytes(self._delta_buffers.get(part.rank)))
        whole = held_whole(manifest)
        for name, spec in manifest.tensors.items():
            if name not in whole:
                grow += max(0, spec.nbytes - _nbytes(self.assembly_buffers.get(name)))
        return grow

    def note_held(self) -> None:
        """Sets `weightsync_held_bytes` from the buffers kept between versions, and
        `weightsync_host_memory_bytes` from this process's resident memory."""
        if self.metrics is None:
            return
        m = self.metrics
        for kind, held in self.held().items():
            m.held_bytes.labels(role=m.role, session=self.session, kind=kind).set(held)
        for kind, n in host_memory().as_dict().items():
            m.host_memory_bytes.labels(role=m.role, session=self.session, kind=kind).set(n)
        m.host_memory_limit_bytes.labels(role=m.role, session=self.session).set(self.host_memory_limit_bytes)

    def recheck(self) -> None:
        """Abandons the pull in progress if a rule in `stale_rules` now calls its version
        stale: its reads stop at once (a read waiting on a frozen or cut-off source ends
        now, not after `timeout_s` per attempt) and the pull raises PullAbandoned. Call it
        after whatever a rule reads changed (a newer version wanted, an update waiting)."""
        with self._flight_lock:
            if self._in_flight is None or self._abandoned:
                return
            why = self._stale(*self._in_flight)
            if not why:
                return
            self._abandoned = why
            # Out of the table, so no lane takes one again (`_transport` refuses new ones
            # from here on); closed by the pull once its lanes are done with them. Under the
            # flight lock: a pull that ended meanwhile would leave them to the next pull,
            # whose new transports this took and interrupted.
            with self._transports_lock:
                interrupted, self._transports = list(self._transports.values()), {}
            self._interrupted += interrupted
        for transport in interrupted:
            transport.interrupt()

    def _stale(self, version: int, generation: int) -> str:
        return next((why for rule in self.stale_rules if (why := rule(version, generation))), "")

    @contextlib.contextmanager
    def pulling(self, header: pb.ManifestHeader) -> Iterator[None]:
        """Marks a pull of `header`'s version as in progress for `recheck` (`pull` does; a
        streamed round wraps its `pull_chunks` calls in it); raises PullAbandoned at once
        when the version is stale already (it became so before the pull began)."""
        v = header.version
        with self._flight_lock:
            self.in_flight_mode = self.mode_for(header)
            self._in_flight, self._abandoned = (v.version, v.generation), self._stale(v.version, v.generation)
        try:
            self._check_abandoned(v.version)
            yield
        finally:
            with self._flight_lock:
                self._in_flight, self._abandoned, self.in_flight_mode = None, "", ""
                interrupted, self._interrupted = self._interrupted, []
            for transport in interrupted:
                transport.close()

    def close(self) -> None:
        """Closes every open transport."""
        with self._transports_lock:
            transports, self._transports = list(self._transports.values()), {}
        for t in transports:
            t.close()

    def fetch_manifest(self, version: int = 0) -> tuple[pb.ManifestHeader, Manifest]:
        """The manifest of `version` (0 = newest servable); takes a lease on it."""
        version = check_int_arg(version, "version", 0, INT64_MAX)
        return self.client.get_manifest(self.session, version, agent_id=self.agent_id)

    def mode_for(self, header: pb.ManifestHeader) -> str:
        """The mode a version is pulled in: this puller's, else the session's, else grpc."""
        return self.mode or header.weight_sync_mode or "grpc"

    def plan(self, header: pb.ManifestHeader) -> PullPlan:
        """Where a version's chunks come from, from its manifest header: this puller's mode,
        else the session's; the version's access token; in relay mode, the relay to read
        from of those before this rollout in the coordinator's chain (`upstream_of`; none
        when it is first or not listed)."""
        mode = self.mode_for(header)
        upstream, downstream = None, False
        chain = [peer.agent_id for peer in header.relay_chain]
        if mode == "relay" and self.agent_id in chain:
            at = chain.index(self.agent_id)
            upstream = self.upstream_of([endpoint_from_proto(p.endpoint) for p in header.relay_chain[:at]])
            downstream = at < len(chain) - 1
        return PullPlan(mode, header.access_token, upstream, downstream)

    def upstream_of(self, before: Sequence[Endpoint]) -> Endpoint | None:
        """Of the relays before this rollout in the chain, the one it reads from: the first
        on its host that serves on a unix socket (the host's puller: one pull per host, every
        other rollout there maps its buffers), else the last one on an inet socket where
        this host has them, else none (the trainer)."""
        here = [e for e in before if is_unix(e.tcp_address) and e.host_id == self.host_id]
        if here:
            return here[0]
        inet = [e for e in before if not is_unix(e.tcp_address)]
        return inet[-1] if inet and not inet_refused() else None

    def _grow(self, buffers: dict[int, np.ndarray], rank: int, nbytes: int) -> np.ndarray:
        buf = buffers.get(rank)
        if buf is None or buf.nbytes < nbytes:
            t0 = time.perf_counter()
            buf = self.relay.allocate(max(nbytes, 1)) if self.relay else populated.empty(max(nbytes, 1))
            buffers[rank] = buf
            log.info("receive buffer for rank %d: %d bytes made in %.3f s", rank, nbytes, time.perf_counter() - t0)
        return buf[:nbytes]

    def _buffer(self, rank: int, nbytes: int) -> np.ndarray:
        return self._grow(self._buffers, rank, nbytes)

    def holds(self, manifest: Manifest, manifest_digest: str) -> None:
        """The receive buffers hold `manifest`'s bytes, every tensor checked: a later
        version published as a delta against it may be rebuilt there."""
        self._holding = (manifest, manifest_digest)
        if self.relay is not None:  # a rebuilt version's chunks are re-served from now on
            self.relay.mark_whole(manifest.version)

    def forget_versions(self) -> None:
        """The session was made again: the version the receive buffers hold is of the old
        one and is no delta's base."""
        self._holding = None  # (no lock: a pull holds it for its whole length)

    @property
    def holding(self) -> int:
        """The version a delta may be rebuilt from (0: none)."""
        return self._holding[0].version if self._holding else 0

    def _why_not_delta(self, manifest: Manifest, plan: PullPlan, held: tuple[Manifest, str] | None) -> str:
        """Why this pull cannot rebuild `manifest` from its delta ("" when it can)."""
        base = manifest.delta_base
        if base is None:
            return "it has no delta"
        if held is None or held[1] != base[1]:
            have = f"version {held[0].version}" if held else "no checked version"
            return f"its delta's base is version {base[0]}, the receive buffers hold {have}"
        layouts = {p.rank: [(c.offset, c.length) for c in p.chunks] for p in held[0].parts}
        for part in manifest.parts:
            if layouts.get(part.rank) != [(c.offset, c.length) for c in part.chunks]:
                return f"rank {part.rank}'s chunks differ from the base's"
            mode = self.transport_for(part, plan.mode)
            if mode not in ("tcp", "grpc", "fs"):
                return f"rank {part.rank} is read over {mode}, which serves whole parts"
        return ""

    def pull(self, header: pb.ManifestHeader, manifest: Manifest, *, check_chunks: bool = True) -> PulledVersion:
        """Fetches every chunk of every rank into the receive buffers, each verified as it
        lands unless `check_chunks` is False (then the caller verifies the tensors and
        calls `repair`); chunks this rollout re-serves as a relay, or reads from one, are
        verified all the same."""
        started = time.perf_counter()
        plan = self.plan(header)
        with self._lock, self.pulling(header):
            self._close_unused(manifest, plan)
            self._drop_other_ranks(manifest)
            held, self._holding = self._holding, None  # overwritten from here on
            why = self._why_not_delta(manifest, plan, held)
            if not why:
                return self._pull_delta(header, manifest, plan, started)
            if manifest.delta_base is not None:
                log.info("version %d: pulling it whole: %s", manifest.version, why)
            lanes = [lane for part in manifest.parts for lane in self._split(plan, part, list(range(len(part.chunks))))]
            # A relay checks what it will pass on as it lands; the chain's tail passes nothing
            # on (a rollout that joins after it later reads relayed chunks checked on its side).
            relaying = self.relay is not None and plan.downstream
            for lane in lanes:
                lane.check = check_chunks or relaying
            buffers = {p.rank: self._buffer(p.rank, p.total_bytes) for p in manifest.parts}
            if self.relay is not None:
                self.relay.begin(manifest, plan.token, buffers)
            with self._pulling(manifest, lanes):
                with ThreadPoolExecutor(max_workers=max(1, len(lanes)), thread_name_prefix="pull") as pool:
                    futures = [
                        pool.submit(self._run_lane, plan, manifest, lane, buffers[lane.part.rank]) for lane in lanes
                    ]
                    for future in futures:
                        future.result()
        return self._pulled(header, manifest, buffers, lanes, started)

    @contextlib.contextmanager
    def _pulling(self, manifest: Manifest, lanes: list[Lane]) -> Iterator[None]:
        """Around a pull: a failure tells the relay (its readers go elsewhere); the
        re-fetches of `lanes` (appended to meanwhile) count in `last_retries` either way."""
        try:
            yield
        except BaseException:
            if self.relay is not None:
                self.relay.fail(manifest.version)
            raise
        finally:
            self.last_retries = sum(lane.retries for lane in lanes)

    def _pulled(
        self,
        header: pb.ManifestHeader,
        manifest: Manifest,
        buffers: dict[int, np.ndarray],
        lanes: list[Lane],
        started: float,
        delta_base: int = 0,
    ) -> PulledVersion:
        seconds = time.perf_counter() - started
        pulled = sum(lane.bytes for lane in lanes)
        if self.metrics is not None:
            self.metrics.observe_phase("pull", seconds)
            self.metrics.add_bytes("pulled", pulled)
            kind = "delta" if delta_base else "whole"
            self.metrics.pulls.labels(role=self.metrics.role, session=self.session, kind=kind).inc()
        return PulledVersion(header, manifest, buffers, pulled, self.last_retries, seconds, delta_base)

    def _pull_delta(
        self, header: pb.ManifestHeader, manifest: Manifest, plan: PullPlan, started: float
    ) -> PulledVersion:
        """Rebuilds `manifest` in the receive buffers, which hold its delta's base: fetches
        each rank's raw chunks into place (unchecked: the tensor check covers them) and its
        delta chunks, each checked as it lands, into a delta buffer, then decodes each onto
        the base bytes of the chunk it rebuilds and digests the tensors in the same pass. A
        delta chunk that passes its check yet does not decode has its full chunk fetched
        instead. The caller checks every tensor (and `repair`s), as after a whole pull."""
        buffers = {p.rank: self._buffer(p.rank, p.total_bytes) for p in manifest.parts}
        scratch = {
            p.rank: self._grow(self._delta_buffers, p.rank, p.delta.total_bytes) for p in manifest.parts if p.delta
        }
        relaying = self.relay is not None and plan.downstream  # raw chunks passed on are checked as they land
        if self.relay is not None:
            self.relay.begin(manifest, plan.token, buffers, scratch)
        lanes: list[Lane] = []
        digests: dict[str, tuple[int, float]] = {}
        whole = held_whole(manifest)
        with self._pulling(manifest, lanes):
            for part in manifest.parts:
                d = part.delta
                assert d is not None
                raw = self._split(plan, part, list(d.raw))
                for lane in raw:
                    lane.check = relaying
                # The delta chunks are fetched like chunks: by index, into the delta buffer.
                encoded = self._split(plan, part, [c.index for c in d.chunks], part.fetch_chunks)
                lanes += raw + encoded
                buf = buffers[part.rank]
                self._run_lanes(plan, manifest, raw, buf, 0)
                self._run_lanes(plan, manifest, encoded, scratch[part.rank], 0)
                broken, rebuilt = self._rebuild(part, buf, scratch[part.rank], manifest.chunk_bytes, whole)
                if broken:  # (the tensor check digests this part's tensors again)
                    log.warning(
                        "version %d rank %d: %d delta chunk(s) did not decode; fetching their chunks whole",
                        manifest.version,
                        part.rank,
                        len(broken),
                    )
                    whole = self._split(plan, part, broken)
                    lanes += whole
                    self._run_lanes(plan, manifest, whole, buf, 0)
                else:
                    digests.update(rebuilt)
        base = manifest.delta_base
        assert base is not None
        pulled = self._pulled(header, manifest, buffers, lanes, started, delta_base=base[0])
        pulled.digests = digests
        return pulled

    @staticmethod
    def _rebuild(
        part: Part, buf: np.ndarray, scratch: np.ndarray, piece_bytes: int, whole: set[str]
    ) -> tuple[list[int], dict[str, tuple[int, float]]]:
        """Decodes each delta chunk of `part` onto its chunk in `buf`, digesting every block
        just after its changes land (`native.rebuild_digest`: one pass over the part, not a
        decode and then the tensor check's read). Returns the chunks whose encoding did not
        decode (they may hold part of their changes) and (xxh3, sum) of each tensor named in
        `whole` (`assembly.held_whole`) that this part holds, by the tensor check's rule
        (pieces of `piece_bytes`)."""
        d = part.delta
        assert d is not None
        specs = {t.name: t for t in part.tensors}
        shards = sorted(part.shards, key=lambda s: s.offset)
        result = native.rebuild_digest(
            buf,
            [c.length for c in part.chunks],
            piece_bytes,
            [(s.offset, s.nbytes, dtype_info(specs[s.tensor_name].dtype).proto) for s in shards],
            scratch,
            [(c.target, c.offset, c.length) for c in d.chunks],
        )
        digests = {
            s.tensor_name: (int(xxh), float(total))
            for s, xxh, total in zip(shards, result.span_digests, result.span_sums)
            if s.tensor_name in whole
        }
        return result.broken, digests

    def pull_chunks(
        self, plan: PullPlan, manifest: Manifest, part: Part, indices: list[int], buf: np.ndarray, base: int
    ) -> tuple[int, int]:
        """Fetches and verifies some chunks of one rank into buf (buf[0] is byte `base` of
        the part) as `plan` says; returns (bytes pulled, chunks re-fetched). For streaming
        apply."""
        self._holding = None  # a streamed pull reuses no receive buffer
        self._close_unused(manifest, plan)
        lanes = self._split(plan, part, indices)
        self._run_lanes(plan, manifest, lanes, buf, base)
        return sum(lane.bytes for lane in lanes), sum(lane.retries for lane in lanes)

    def repair(self, plan: PullPlan, manifest: Manifest, buffers: dict[int, np.ndarray], names: Sequence[str]) -> None:
        """After a pull without chunk checks: hashes the chunks under the named tensors'
        shards in the receive buffers and re-fetches, verified, each that differs from the
        manifest. The pull was each chunk's first attempt: at most `max_attempts` in all,
        then DigestMismatch as in a pull. Re-fetches count in `last_retries`."""
        shards = manifest.shards_of()
        for part in manifest.parts:
            spans = [(s.offset, s.offset + s.nbytes) for n in names for rank, s in shards[n] if rank == part.rank]
            under = [
                i
                for i, c in enumerate(part.chunks)
                if any(c.offset < stop and start < c.offset + c.length for start, stop in spans)
            ]
            if not under:
                continue
            buf = buffers[part.rank]
            got = (
                native.digest_ranges(
                    buf, [part.chunks[i].offset for i in under], [part.chunks[i].length for i in under]
                )
                if native.available()
                else [xxh3(buf[part.chunks[i].offset :][: part.chunks[i].length]) for i in under]
            )
            bad = [i for i, d in zip(under, got) if int(d) != part.chunks[i].xxh3]
            if not bad:
                continue
            log.warning(
                "version %d rank %d: %d chunk(s) under a tensor that failed its check differ; re-fetching",
                manifest.version,
                part.rank,
                len(bad),
            )
            if self.metrics is not None:
                self.metrics.digest_failures.labels(role=self.metrics.role, session=self.session).inc(len(bad))
            lanes = self._split(plan, part, bad)
            try:
                self._run_lanes(plan, manifest, lanes, buf, 0, first_attempt=2, why="found by the tensor check")
            finally:
                self.last_retries += sum(lane.retries for lane in lanes)
