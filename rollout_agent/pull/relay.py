"""Relay: a rollout re-serves the version it is pulling, chunk by chunk, over tcp.

The puller announces each version (`begin`) and each chunk it has verified (`mark`);
the tcp server answers downstream rollouts from the same receive buffers, waiting for
chunks not yet here, so a chain of rollouts pipelines one version and the trainer sends
each chunk about once. A version rebuilt from its delta is re-served both ways: its delta
chunks (fetch indices after the part's chunks, from the puller's delta buffers) as they
land, and every chunk of the rebuilt version once its tensors checked. Nothing here is
trusted downstream: every chunk is verified by its reader against the manifest, and a
reader whose relay fails or lags falls back to the trainer (one that ended a reply after
its wait but still answers is asked again: it waits on its own pull, e.g. on a frozen
relay before it that it is about to leave; `lanes.LaneReader._relay_still_pulling`).

On a unix socket (`--relay-host unix:DIR`) it serves the rollouts of its host, which map
its receive buffers (shared memory) instead of reading the bytes (`transports.hostshm`):
the host pulls each version once, with no inet socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from weightsync import native, populated
from weightsync.addresses import is_unix
from weightsync.errors import InvalidArgument, NotFound, TransportUnavailable, VersionNotFound
from weightsync.failpoints import Failpoints
from weightsync.manifest import ChunkSpec, Manifest
from weightsync.transports.hostshm import readonly_fd, shared_array
from weightsync.transports.tcp import TcpChunkServer, check_token

log = logging.getLogger(__name__)
STALL = "relay.stall_after_chunks"
DEFAULT_RELAY_WAIT_S = 10.0
# A reader's allowance beyond a relay's wait for a chunk (scheduling, a busy host).
RELAY_STALL_MARGIN_S = 5.0
# How long a reader whose relay ended a reply gives it to answer a probe (`tcp.answers`).
RELAY_PROBE_S = 2.0


def relay_stall_s(wait_s: float) -> float:
    """How long a reader waits for a relay's next byte. A working relay sends one within
    its `wait_s` (a chunk arrives, or it gives up and the connection ends); one silent for
    longer is frozen (SIGSTOP, a swap storm) or cut off, and its readers go to the trainer."""
    return wait_s + RELAY_STALL_MARGIN_S


@dataclass
class _Held:
    """One version being pulled (or pulled) into the puller's receive buffers."""

    version: int
    token: str
    chunks: dict[int, tuple[ChunkSpec, ...]]  # per rank: the part's chunks, then any delta chunks
    buffers: dict[int, np.ndarray]
    ready: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> bool per chunk
    failed: bool = False
    whole: dict[int, int] = field(default_factory=dict)  # rank -> the part's chunk count
    delta_buffers: dict[int, np.ndarray] = field(default_factory=dict)

    def view(self, rank: int, index: int) -> np.ndarray:
        c = self.chunks[rank][index]
        src = self.buffers if index < self.whole[rank] else self.delta_buffers
        return src[rank][c.offset : c.offset + c.length]


class RelaySource:
    """The ChunkSource of a relaying rollout: the current version's verified chunks.

    `wait_s` bounds how long a request waits for this rollout to start the version or
    to receive a chunk; past it the reader is refused (before the reply) or cut off
    (mid-reply) and goes to the trainer instead.
    """

    def __init__(
        self,
        session: str,
        *,
        wait_s: float = DEFAULT_RELAY_WAIT_S,
        failpoints: Failpoints | None = None,
        shares_memory: bool = False,
    ) -> None:
        self.session = session
        self.wait_s = wait_s
        self.shares_memory = shares_memory  # buffers of shared memory, mapped by readers on this host
        self._failpoints = failpoints or Failpoints()
        self.closed = threading.Event()
        self._cond = threading.Condition()
        self._held: _Held | None = None
        self.bytes_served = 0

    # -- the puller's side ----------------------------------------------------------
    def allocate(self, nbytes: int) -> np.ndarray:
        """A receive buffer for the puller: shared memory where readers map it."""
        return shared_array(nbytes) if self.shares_memory else populated.empty(nbytes)

    def begin(
        self,
        manifest: Manifest,
        token: str,
        buffers: dict[int, np.ndarray],
        delta_buffers: dict[int, np.ndarray] | None = None,
    ) -> None:
        """A new version starts arriving in `buffers` (the old one stops being served);
        with `delta_buffers`, it is rebuilt from its delta, whose chunks land there."""
        chunks = {p.rank: p.fetch_chunks if delta_buffers else p.chunks for p in manifest.parts}
        held = _Held(manifest.version, token, chunks, buffers, delta_buffers=delta_buffers or {})
        held.whole = {p.rank: len(p.chunks) for p in manifest.parts}
        held.ready = {rank: np.zeros(len(c), bool) for rank, c in chunks.items()}
        with self._cond:
            self._held = held
            self._cond.notify_all()

    def mark(self, version: int, rank: int, indices: Sequence[int]) -> None:
        """These chunks are verified and in place."""
        with self._cond:
            if self._held is not None and self._held.version == version:
                self._held.ready[rank][list(indices)] = True
                self._cond.notify_all()

    def mark_whole(self, version: int) -> None:
        """Every chunk of the version is in place and checked (its tensors were)."""
        with self._cond:
            if self._held is not None and self._held.version == version:
                for rank, n in self._held.whole.items():
                    self._held.ready[rank][:n] = True
                self._cond.notify_all()

    def fail(self, version: int) -> None:
        """The pull failed: waiting readers go elsewhere now."""
        with self._cond:
            if self._held is not None and self._held.version == version:
                self._held.failed = True
                self._cond.notify_all()

    # -- the server's side (ChunkSource) -------------------------------------------
    def _version(self, session: str, version: int) -> _Held:
        if session != self.session:
            raise NotFound(f"session {session!r} is not relayed here (this rollout relays {self.session!r})")
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while self._held is None or self._held.version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    have = self._held.version if self._held else "nothing"
                    raise VersionNotFound(f"version {version} has not reached this relay (it holds {have})")
                self._cond.wait(left)
            if self._held.version != version:
                raise VersionNotFound(f"this relay holds version {self._held.version}, not {version}")
            if self._held.failed:
                raise VersionNotFound(f"this relay's pull of version {version} failed")
            return self._held

    def check_token(self, session: str, version: int, token: str) -> None:
        check_token(self._version(session, version).token, token, version)

    def check_read(self, session: str, version: int, rank: int, indices: Sequence[int]) -> None:
        held = self._version(session, version)
        if rank not in held.chunks:
            raise InvalidArgument(f"version {version} has no rank {rank}", field="rank")
        n = len(held.chunks[rank])
        for i, index in enumerate(indices):
            if index >= n:
                raise InvalidArgument(f"{index} >= the {n} chunks of rank {rank} held here", field=f"indices[{i}]")

    def chunk_lengths(self, session: str, version: int, rank: int, indices: Sequence[int]) -> int:
        chunks = self._version(session, version).chunks[rank]
        return sum(chunks[i].length for i in indices)

    def send_chunks(self, sock_fd: int, session: str, version: int, rank: int, indices: Sequence[int]) -> int:
        """Sends each chunk as soon as it is verified here (pipelined), in request order."""
        held = self._version(session, version)
        ready = held.ready[rank]
        sent, pos = 0, 0
        while pos < len(indices):
            with self._cond:
                self._wait_ready(held, rank, indices[pos])
                end = pos
                while end < len(indices) and ready[indices[end]]:
                    end += 1
            if self._failpoints.armed(STALL):
                end = pos + 1
                if not self._failpoints.fire(STALL):
                    log.warning("failpoint %s: stalling this reply", STALL)
                    self.closed.wait()
            views = [held.view(rank, i) for i in indices[pos:end]]
            sent += native.send_views(sock_fd, views)
            pos = end
        return sent

    def map_chunks(self, session: str, version: int, rank: int, indices: Sequence[int]) -> tuple[int, int, int]:
        """Where a reader on this host finds chunks (`hostshm`): once the first is verified
        here, a read-only descriptor of the buffer it lies in, how many from the first are
        ready in that buffer, and their bytes."""
        held = self._version(session, version)
        stalling = self._failpoints.armed(STALL)  # one chunk per reply, as send_chunks does
        if stalling and not self._failpoints.fire(STALL):
            log.warning("failpoint %s: stalling this reply", STALL)
            self.closed.wait()
        whole = held.whole[rank]
        with self._cond:
            self._wait_ready(held, rank, indices[0])
            first_whole, ready = indices[0] < whole, 1
            while (
                not stalling
                and ready < len(indices)
                and (indices[ready] < whole) == first_whole
                and held.ready[rank][indices[ready]]
            ):
                ready += 1
        buffer = (held.buffers if first_whole else held.delta_buffers)[rank]
        nbytes = sum(held.chunks[rank][i].length for i in indices[:ready])
        return readonly_fd(buffer), ready, nbytes

    def chunk_view(self, session: str, version: int, rank: int, index: int) -> tuple[int, memoryview]:
        """One chunk once it is verified here (what a gRPC ReadChunks would send)."""
        held = self._version(session, version)
        self.check_read(session, version, rank, [index])
        with self._cond:
            self._wait_ready(held, rank, index)
        return held.chunks[rank][index].offset, memoryview(held.view(rank, index))

    def _wait_ready(self, held: _Held, rank: int, index: int) -> None:
        """Waits (holding `_cond`) until chunk `index` is verified here, at most wait_s."""
        deadline = time.monotonic() + self.wait_s
        while not held.ready[rank][index]:
            if self._held is not held or held.failed or time.monotonic() > deadline:
                # Mid-reply: the reader sees the connection drop and re-fetches elsewhere.
                raise TransportUnavailable(f"relay gave up on version {held.version} chunk {index}")
            self._cond.wait(0.5)

    def count_served(self, nbytes: int) -> None:
        with self._cond:
            self.bytes_served += nbytes


class Relay:
    """A RelaySource behind a TcpChunkServer on host:port (what a relaying rollout runs), or
    on a `unix:/path` host, whose readers on this host map its buffers (`hostshm`)."""

    def __init__(
        self,
        session: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        wait_s: float = DEFAULT_RELAY_WAIT_S,
        failpoints: Failpoints | None = None,
    ) -> None:
        self.source = RelaySource(session, wait_s=wait_s, failpoints=failpoints, shares_memory=is_unix(host))
        self.server = TcpChunkServer(
            self.source,
            host=host,
            port=port,
            on_sent=self.source.count_served,
            port_field="relay_port",
            host_field="relay_host",
        )
        self.address = self.server.address

    def close(self) -> None:
        self.source.closed.set()
        self.server.close()
