"""The Transport ABC (the puller's side) and the ChunkSource protocol (the serving side)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from weightsync.manifest import Endpoint

MAX_INDICES_PER_READ = 4096


@dataclass(frozen=True)
class FetchRequest:
    """Chunks of one rank's part of one version."""

    session: str
    version: int
    rank: int
    indices: Sequence[int]
    timeout_s: float
    spans: Sequence[tuple[int, int]] = ()  # (offset, length) per index: for transports that read in place
    token: str = ""  # the version's access token (tcp and relay servers check it)
    # the part's chunk count: indices from here on are its delta chunks, whose spans lie in
    # the delta's bytes (a server knows this itself; the fs store keeps them in a file apart)
    chunk_count: int = 0


@dataclass(frozen=True)
class ChunkPayload:
    """One received chunk; `data` may be a view into a receive buffer."""

    index: int
    offset: int
    data: memoryview


class ChunkSource(Protocol):
    """What a chunk server serves from: the trainer's slot table, a relay's buffers.

    Both servers take one: gRPC `ReadChunks` (`serve_chunks`) checks the token and the
    read, then sends `chunk_view`s; the tcp server (`TcpChunkServer`) checks the same,
    sends `chunk_lengths` in its reply header and the bytes with `send_chunks`.
    """

    def check_token(self, session: str, version: int, token: str) -> None:
        """PermissionDenied unless `token` is this version's access token."""
        ...

    def check_read(self, session: str, version: int, rank: int, indices: Sequence[int]) -> None:
        """Validates a read before the first byte is sent (names the bad field)."""
        ...

    def chunk_view(self, session: str, version: int, rank: int, index: int) -> tuple[int, memoryview]:
        """(offset, bytes view) of one chunk; raises NotFound / InvalidArgument."""
        ...

    def chunk_lengths(self, session: str, version: int, rank: int, indices: Sequence[int]) -> int:
        """Total bytes of the chunks."""
        ...

    def send_chunks(self, sock_fd: int, session: str, version: int, rank: int, indices: Sequence[int]) -> int:
        """Writes the chunks' bytes back to back to the socket; returns bytes sent."""
        ...


@runtime_checkable
class SharedSource(ChunkSource, Protocol):
    """A ChunkSource whose buffers readers on its host may map (a relay on a unix socket)."""

    def map_chunks(self, session: str, version: int, rank: int, indices: Sequence[int]) -> tuple[int, int, int]:
        """Waits until the first chunk is ready; returns a new read-only descriptor of the
        buffer it lies in (chunks at their offsets), how many of `indices` from the first
        are ready there, and their bytes. The caller closes the descriptor."""
        ...


class Transport(ABC):
    """Fetches chunk bytes from one endpoint. A context manager.

    Capabilities are class attributes with the methods they promise declared here (with
    defaults), so the puller asks the flag, never the class; instances are made by
    `weightsync.transports.create_transport(name)`.
    """

    name: ClassVar[str]
    cross_host: ClassVar[bool] = True  # False: reads only a source on this host (shm)
    # True: `fetch_into` receives and verifies straight into the receive buffer (no
    # payload objects, no copy); the puller then never calls `fetch`.
    receives_in_place: ClassVar[bool] = False

    @abstractmethod
    def open(self, endpoint: Endpoint) -> None:
        """Connects (lazily is fine) to a rank's endpoint."""

    @abstractmethod
    def fetch(self, request: FetchRequest) -> Iterator[ChunkPayload]:
        """Yields the requested chunks in request order; raises weightsync errors."""

    def fetch_into(
        self, request: FetchRequest, buf: np.ndarray, base: int, digests: Sequence[int] | None
    ) -> np.ndarray:
        """Receives the requested chunks into `buf` (chunk at `offset` lands at
        `buf[offset - base]`, spans in `request.spans`) and checks each against `digests`
        (None: received unchecked, all True); returns one bool per chunk. Only where
        `receives_in_place`."""
        raise NotImplementedError(f"transport {self.name!r} does not receive in place; use fetch()")

    @abstractmethod
    def close(self) -> None:
        """Releases connections; idempotent."""

    def interrupt(self) -> None:
        """Ends a read in progress on another thread now (it raises TransportUnavailable);
        the owner closes the transport after. Safe from any thread. By default nothing:
        reads that wait on no peer (a mapped arena, a file) end by themselves."""
        return None

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
