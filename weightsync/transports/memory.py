"""InMemoryTransport: the test seam; serves chunks from an in-process ChunkSource."""

from __future__ import annotations

from collections.abc import Iterator

from weightsync.errors import TransportUnavailable
from weightsync.manifest import Endpoint
from weightsync.transports.base import ChunkPayload, ChunkSource, FetchRequest, Transport

# address -> source; tests register sources here instead of starting servers.
SOURCES: dict[str, ChunkSource] = {}


class InMemoryTransport(Transport):
    name = "memory"
    cross_host = False

    def __init__(self) -> None:
        self._source: ChunkSource | None = None

    def open(self, endpoint: Endpoint) -> None:
        source = SOURCES.get(endpoint.address)
        if source is None:
            raise TransportUnavailable(f"no in-memory source registered at {endpoint.address!r}")
        self._source = source

    def fetch(self, request: FetchRequest) -> Iterator[ChunkPayload]:
        if self._source is None:
            raise TransportUnavailable("not open; call open() first")
        self._source.check_read(request.session, request.version, request.rank, request.indices)
        for i in request.indices:
            offset, view = self._source.chunk_view(request.session, request.version, request.rank, i)
            yield ChunkPayload(i, offset, memoryview(bytes(view)))

    def close(self) -> None:
        self._source = None
