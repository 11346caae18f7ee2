"""Reading a pull's chunks, lane by lane: each rank's chunks are split into lanes (one per
stream), each lane is routed to a source (the trainer rank over the transport the mode and
this host allow, or an upstream relay) and read over a transport kept open across
versions, a window of chunks per call, each chunk checked as it lands and fetched again on
failure. `LaneReader` is `WeightPuller`'s half that does this; the puller plans each
version, holds its buffers and decides when a pull is abandoned.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_agent.pull.relay import RELAY_PROBE_S, RelaySource
from weightsync import native
from weightsync.addresses import inet_refused, is_unix
from weightsync.digests import xxh3
from weightsync.errors import (
    TRANSIENT_ERRORS,
    DigestMismatch,
    PullAbandoned,
    TransportStalled,
    TransportUnavailable,
    WeightsyncError,
)
from weightsync.manifest import ChunkSpec, Endpoint, Manifest, Part
from weightsync.metrics import Metrics
from weightsync.security import Security
from weightsync.transports import FetchRequest, Transport, create_transport
from weightsync.transports.tcp import answers

log = logging.getLogger(__name__)


def _tcp_usable() -> bool:
    """The native tcp reader can run here: the shim is built and inet sockets open."""
    return native.available() and not inet_refused()


class Lane:
    """One stream's share of one rank's chunks (indices into `chunks`: the part's, or its
    `fetch_chunks` for delta chunks), the source it reads them from (the trainer rank's
    endpoint, or an upstream relay's), bytes and retries."""

    def __init__(self, part: Part, stream: int, indices: list[int], chunks: tuple[ChunkSpec, ...] = ()) -> None:
        self.part = part
        self.chunks = chunks or part.chunks
        self.stream = stream
        self.indices = indices
        self.bytes = 0
        self.retries = 0
        self.mode = ""  # transport name; set by LaneReader._route
        self.endpoint = part.endpoint
        self.relayed = False
        self.check = True  # hash each chunk as it lands (else the caller checks the tensors)
        self.digest_failures = 0  # chunks whose bytes arrived but did not verify
        # Reading from a relay: when it last brought a chunk, and how the last read from it
        # ended ("lost": it ended the reply; "stalled": silent; "refused": an error reply).
        self.relay_heard = 0.0
        self.relay_lost = ""

    @property
    def checks_on_arrival(self) -> bool:
        """Hash each chunk as it lands: asked for, or read from a relay (which may be wrong)."""
        return self.check or self.relayed


@dataclass(frozen=True)
class PullPlan:
    """Where one version's chunks come from (`WeightPuller.plan(header)`)."""

    mode: str  # in force for this version: the puller's, else the session's, else grpc
    token: str = ""  # the version's access token (tcp and relay servers check it)
    upstream: Endpoint | None = None  # relay mode: the relay before this rollout in the chain
    downstream: bool = False  # relay mode: a rollout after this one in the chain reads from it


class LaneReader:
    """Reads lanes of chunks into receive buffers: `WeightPuller`'s lane half, whose
    `__init__` sets the attributes below (the puller's settings and its open transports)."""

    session: str
    mode: str
    host_id: str
    fs_root: str
    fs_options: dict[str, Any]
    security: Security | None
    streams: int
    window_chunks: int
    max_attempts: int
    timeout_s: float
    relay_stall_s: float
    metrics: Metrics | None
    relay: RelaySource | None
    relay_fallbacks: int
    _transports: dict[tuple[str, str, int], Transport]
    _transports_lock: threading.Lock
    _fallbacks_logged: set[tuple[int, str]]
    _abandoned: str  # why the pull in progress was abandoned ("" while it goes on)

    def transport_for(self, part: Part, mode: str = "") -> str:
        """The transport for one rank's part under `mode` (default: this puller's, else
        grpc): shm only where asked for and possible."""
        mode = mode or self.mode or "grpc"
        ep = part.endpoint
        if mode == "fs":
            if "fs" in ep.transports and ep.fs_uri and self.fs_root:
                return "fs"
            return self._fallback(part, "offers no fs copy (or no fs_root here)")
        if mode in ("tcp", "relay"):  # relay: the trainer is read over tcp too
            if "tcp" in ep.transports and ep.tcp_address and _tcp_usable():
                return "tcp"
            return self._fallback(
                part,
                "offers no tcp address (or the native shim is not built here, or this host has no usable inet sockets)",
            )
        if mode == "shm":
            if "shm" in ep.transports and ep.shm_path and ep.host_id and ep.host_id == self.host_id:
                return "shm"
            return self._off_shm(part, f"is on host {ep.host_id!r}, we are on {self.host_id!r} (or offers no shm)")
        return mode

    def _off_shm(self, part: Part, why: str) -> str:
        """Where a rank's shm cannot be used: tcp when offered and built here, else grpc."""
        ep = part.endpoint
        offers_tcp = "tcp" in ep.transports and ep.tcp_address and _tcp_usable()
        return self._fallback(part, why, "tcp" if offers_tcp else "grpc")

    def _fallback(self, part: Part, why: str, mode: str = "grpc") -> str:
        """`mode` for a rank that cannot be read as asked; logged once per (rank, reason)."""
        if (part.rank, why) not in self._fallbacks_logged:
            self._fallbacks_logged.add((part.rank, why))
            log.info("rank %d %s: pulling over %s", part.rank, why, mode)
        return mode

    def _route(self, lanes: list[Lane], plan: PullPlan) -> list[Lane]:
        """Chooses each lane's source: the upstream relay in relay mode, else the rank."""
        for lane in lanes:
            if plan.upstream is not None:  # a relay on a unix socket is on this host: its buffers are mapped
                mode = "hostshm" if is_unix(plan.upstream.tcp_address) else "tcp"
                lane.mode, lane.endpoint, lane.relayed = mode, plan.upstream, True
            else:
                lane.mode, lane.endpoint, lane.relayed = (
                    self.transport_for(lane.part, plan.mode),
                    lane.part.endpoint,
                    False,
                )
        return lanes

    def _open_lane(self, lane: Lane) -> Transport:
        """The lane's open transport. A local shm mapping that cannot be opened (no shared
        /dev/shm although host ids are equal) is not a fault of the source: the lane moves
        to the next mode the rank offers, costing no attempt."""
        try:
            return self._transport(lane)
        except TransportUnavailable as e:
            if lane.mode != "shm":
                raise
            lane.mode = self._off_shm(lane.part, f"arena not mappable here ({e.message})")
            return self._transport(lane)

    def _from_trainer(self, lane: Lane, why: str, plan: PullPlan) -> None:
        """A relay failed or lagged: this lane reads the rest from the trainer rank."""
        log.warning("relay for rank %d failed (%s): pulling the rest from the trainer", lane.part.rank, why)
        self.relay_fallbacks += 1
        lane.mode, lane.endpoint, lane.relayed = self.transport_for(lane.part, plan.mode), lane.part.endpoint, False

    def _key(self, lane: Lane) -> tuple[str, str, int]:
        address = lane.endpoint.tcp_address if lane.mode in ("tcp", "hostshm") else lane.endpoint.address
        return (lane.mode, address, lane.stream)

    def _transport(self, lane: Lane) -> Transport:
        key = self._key(lane)
        with self._transports_lock:
            if self._abandoned:  # (a lane between its check and here)
                raise TransportUnavailable("the pull was abandoned")
            transport = self._transports.get(key)
            if transport is None:
                options = {
                    "fs": {"root": self.fs_root, "options": self.fs_options},
                    "grpc": {"security": self.security},
                }.get(key[0], {})
                transport = create_transport(key[0], **options)
                transport.open(lane.endpoint)
                self._transports[key] = transport
            elif key[0] in ("shm", "fs"):
                transport.open(lane.endpoint)  # this version's slot offset / directory
            return transport

    def _drop_transport(self, lane: Lane) -> None:
        with self._transports_lock:
            transport = self._transports.pop(self._key(lane), None)
        if transport is not None:
            transport.close()

    def _close_unused(self, manifest: Manifest, plan: PullPlan) -> None:
        """Closes the open transports to sources `manifest` is not read from: a trainer
        restarted at a new address, a relay that left the place before this rollout in the chain.
        Each held a socket, a channel or, for shm, a mapping of an arena its trainer
        unlinked, whose pages stay in memory for as long as a mapping does."""
        sources = {a for p in manifest.parts for a in (p.endpoint.address, p.endpoint.tcp_address) if a}
        if plan.upstream is not None:
            sources.add(plan.upstream.tcp_address)
        with self._transports_lock:
            gone = [key for key in self._transports if key[1] not in sources]
            unused = [self._transports.pop(key) for key in gone]
        for transport in unused:
            transport.close()

    def _split(self, plan: PullPlan, part: Part, indices: list[int], chunks: tuple[ChunkSpec, ...] = ()) -> list[Lane]:
        per = max(1, -(-len(indices) // self.streams))
        return self._route(
            [Lane(part, k, indices[i : i + per], chunks) for k, i in enumerate(range(0, len(indices), per))], plan
        )

    def _run_lanes(
        self, plan: PullPlan, manifest: Manifest, lanes: list[Lane], buf: np.ndarray, base: int, **how: object
    ) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(lanes)), thread_name_prefix="pull") as pool:
            for future in [pool.submit(self._run_lane, plan, manifest, lane, buf, base, **how) for lane in lanes]:
                future.result()

    def _check_abandoned(self, version: int) -> None:
        if why := self._abandoned:
            raise PullAbandoned(f"pull of version {version} abandoned: {why}", field="version")

    def _run_lane(
        self,
        plan: PullPlan,
        manifest: Manifest,
        lane: Lane,
        buf: np.ndarray,
        base: int = 0,
        first_attempt: int = 1,
        why: str = "",
    ) -> None:
        pending = lane.indices
        last_error = why and f"digest mismatch {why}"
        unreachable = False  # the last attempt failed to reach the source (not a bad byte)
        for attempt in range(first_attempt, self.max_attempts + 1):
            if not pending:
                return
            self._check_abandoned(manifest.version)
            if attempt > 1:
                lane.retries += len(pending)
                log.warning(
                    "version %d rank %d: re-fetching %d chunk(s) (attempt %d/%d): %s",
                    manifest.version,
                    lane.part.rank,
                    len(pending),
                    attempt,
                    self.max_attempts,
                    last_error,
                )
                if unreachable:  # give a restarting source time; jitter spreads the lanes
                    time.sleep(min(2.0, 0.1 * 2**attempt) * (0.5 + random.random()))
            failures_before = lane.digest_failures
            try:
                pending, last_error = self._fetch(plan, manifest, lane, pending, buf, base)
                while pending and lane.relayed:  # a relay's failure costs no attempt
                    self._check_abandoned(manifest.version)
                    if not self._relay_still_pulling(lane, last_error):
                        self._from_trainer(lane, last_error, plan)
                    lane.retries += len(pending)
                    pending, last_error = self._fetch(plan, manifest, lane, pending, buf, base)
                unreachable = bool(pending) and lane.digest_failures == failures_before
            except TRANSIENT_ERRORS as e:
                last_error, unreachable = e.message, True
            except WeightsyncError:
                self._check_abandoned(manifest.version)  # an interrupted read may fail in any way
                raise
        if pending:
            self._check_abandoned(manifest.version)
            what = (
                f"version {manifest.version} rank {lane.part.rank}: chunk {pending[0]} (and {len(pending) - 1} more) "
                f"failed after {self.max_attempts} attempts: {last_error}"
            )
            raise TransportUnavailable(what) if unreachable else DigestMismatch(what)

    def _relay_still_pulling(self, lane: Lane, why: str) -> bool:
        """Whether to ask the relay again rather than leave it for the trainer: it ended its
        reply (it waits `--relay-wait-s` for a chunk its own pull has not brought, e.g.
        from a frozen relay before it, which it leaves for the trainer within
        `relay_stall_s`), it still answers, and it brought a chunk within twice that. Left
        at once, every rollout after a frozen relay would go to the trainer, each before the
        relay between them has left the frozen one. A relay silent past `relay_stall_s`,
        one that refused (it does not hold the version, or its pull failed) and one that
        does not answer are left."""
        if lane.relay_lost != "lost" or time.monotonic() - lane.relay_heard > 2 * self.relay_stall_s:
            return False
        if not answers(lane.endpoint.tcp_address, RELAY_PROBE_S):
            return False
        log.info("relay for rank %d ended a reply (%s) and still answers: asking it again", lane.part.rank, why)
        return True

    def _count_digest_failure(self, lane: Lane) -> None:
        lane.digest_failures += 1
        if self.metrics is not None:
            self.metrics.digest_failures.labels(role=self.metrics.role, session=self.session).inc()

    def _fetch(
        self, plan: PullPlan, manifest: Manifest, lane: Lane, indices: Sequence[int], buf: np.ndarray, base: int = 0
    ) -> tuple[list[int], str]:
        """One pass over `indices`; returns (indices still to fetch, last problem)."""
        chunks = lane.chunks
        chunk_count = len(lane.part.chunks)  # (delta chunks follow)
        received: set[int] = set()
        problem = ""
        transport = self._open_lane(lane)
        if lane.relayed:
            lane.relay_heard, lane.relay_lost = lane.relay_heard or time.monotonic(), ""
        for w in range(0, len(indices), self.window_chunks):
            if self._abandoned:
                break
            window = list(indices[w : w + self.window_chunks])
            spans = [(chunks[i].offset, chunks[i].length) for i in window]
            timeout_s = self.relay_stall_s if lane.relayed else self.timeout_s
            request = FetchRequest(
                self.session, manifest.version, lane.part.rank, window, timeout_s, spans, plan.token, chunk_count
            )
            try:
                if transport.receives_in_place:
                    digests = [chunks[i].xxh3 for i in window] if lane.checks_on_arrival else None
                    ok = transport.fetch_into(request, buf, base, digests)
                    for i, good in zip(window, ok):
                        if good:
                            received.add(i)
                            lane.bytes += chunks[i].length
                        else:
                            problem = f"chunk {i} digest mismatch"
                            self._count_digest_failure(lane)
                    if self.relay is not None:
                        self.relay.mark(manifest.version, lane.part.rank, [i for i, good in zip(window, ok) if good])
                    if lane.relayed and any(ok):
                        lane.relay_heard = time.monotonic()
                    continue
                for payload in transport.fetch(request):
                    c = chunks[payload.index] if payload.index < len(chunks) else None
                    if (
                        c is None
                        or payload.index not in window
                        or payload.offset != c.offset
                        or len(payload.data) != c.length
                    ):
                        problem = (
                            f"unexpected chunk {payload.index} (offset {payload.offset}, {len(payload.data)} bytes)"
                        )
                        self._count_digest_failure(lane)  # wrong bytes from the source, not an absent source
                        continue
                    dst = buf[c.offset - base : c.offset - base + c.length]
                    if not lane.checks_on_arrival:  # the caller checks the tensors
                        dst[:] = np.frombuffer(payload.data, np.uint8)
                        good = True
                    elif native.available():  # copy and hash in one pass, GIL released
                        good = native.copy_digest(dst, np.frombuffer(payload.data, np.uint8)) == c.xxh3
                    elif good := xxh3(payload.data) == c.xxh3:
                        dst[:] = np.frombuffer(payload.data, np.uint8)
                    if not good:  # whatever landed in dst is overwritten by the re-fetch
                        problem = f"chunk {payload.index} digest mismatch"
                        self._count_digest_failure(lane)
                        continue
                    received.add(payload.index)
                    if self.relay is not None:
                        self.relay.mark(manifest.version, lane.part.rank, [payload.index])
                    lane.bytes += c.length
                    if lane.relayed:
                        lane.relay_heard = time.monotonic()
            except TransportUnavailable as e:
                problem = e.message
                lane.relay_lost = "stalled" if isinstance(e, TransportStalled) else "lost"
                self._drop_transport(lane)
                break
            except WeightsyncError as e:  # a relay that does not hold the version (yet)
                if not lane.relayed:
                    raise
                problem, lane.relay_lost = e.message, "refused"
                break
        missing = [i for i in indices if i not in received]
        return missing, problem
