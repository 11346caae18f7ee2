"""The Transport ABC (the puller's side) and the ChunkSource protocol (the serving side)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar, Protocol

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


@dataclass(frozen=True)
class ChunkPayload:
    """One received chunk; `data` may be a view into a receive buffer."""

    index: int
    offset: int
    data: memoryview


class ChunkSource(Protocol):
    """What a chunk server serves from (the trainer's arena, a relay's buffers)."""

    def chunk_view(self, session: str, version: int, rank: int, index: int) -> tuple[int, memoryview]:
        """(offset, bytes view) of one chunk; raises NotFound / InvalidArgument."""
        ...

    def check_read(self, session: str, version: int, rank: int, indices: Sequence[int]) -> None:
        """Validates a read before the first byte is sent (names the bad field)."""
        ...


class Transport(ABC):
    """Fetches chunk bytes from one endpoint. A context manager.

    Capability flags are class attributes; instances are made by
    `weightsync.transports.create_transport(name)`.
    """

    name: ClassVar[str]
    cross_host: ClassVar[bool] = True
    # True: the transport offers fetch_into(request, buf, base, digests) -> ok flags,
    # receiving and verifying straight into the receive buffer (no payload objects).
    receives_in_place: ClassVar[bool] = False

    @abstractmethod
    def open(self, endpoint: Endpoint) -> None:
        """Connects (lazily is fine) to a rank's endpoint."""

    @abstractmethod
    def fetch(self, request: FetchRequest) -> Iterator[ChunkPayload]:
        """Yields the requested chunks in request order; raises weightsync errors."""

    @abstractmethod
    def close(self) -> None:
        """Releases connections; idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
