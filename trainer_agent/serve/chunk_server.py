"""Serves a rank's staged versions: the slot table (a ChunkSource), the TrainerAgent servicer,
and the servers started over them (gRPC, and the native tcp server where it can run)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from trainer_agent.serve.arena import Arena
from trainer_agent.settings import PublisherSettings
from weightsync import native
from weightsync._proto import trainer_agent_pb2 as pb
from weightsync.addresses import inet_unusable
from weightsync.config import advertised
from weightsync.errors import InvalidArgument, NotFound, VersionNotFound
from weightsync.failpoints import Failpoints
from weightsync.manifest import ChunkSpec, Endpoint
from weightsync.metrics import Metrics
from weightsync.security import Security
from weightsync.server import SMALL_REQUEST_BYTES, RunningServer, Service, start_server
from weightsync.transports.grpc import serialize_response, serve_chunks
from weightsync.transports.tcp import TcpChunkServer, check_token

log = logging.getLogger("trainer_agent.publish.publisher")  # the publish path logs under one name

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TrainerAgent"].full_name


@dataclass
class SlotEntry:
    """A served version: its chunks in the slot, then its delta chunks (fetch indices
    len(chunks) + j) in `delta_bytes`."""

    version: int
    chunks: tuple[ChunkSpec, ...]
    total_bytes: int
    token: str = ""  # the version's access token (tcp reads)
    delta_chunks: tuple[ChunkSpec, ...] = ()  # offsets in delta_bytes
    delta_bytes: np.ndarray | None = None

    @property
    def fetchable(self) -> int:
        return len(self.chunks) + len(self.delta_chunks)

    def spec(self, index: int) -> ChunkSpec:
        n = len(self.chunks)
        return self.chunks[index] if index < n else self.delta_chunks[index - n]

    def view(self, slot: np.ndarray, index: int) -> np.ndarray:
        """The bytes of fetch index `index`: a chunk in the slot, or a delta chunk."""
        c = self.spec(index)
        src = slot if index < len(self.chunks) else self.delta_bytes
        assert src is not None
        return src[c.offset : c.offset + c.length]


class SlotTable:
    """Which version each arena slot holds. A ChunkSource for `serve_chunks`.

    Lock order: `_lock` only; views are taken under it, copied outside it (a torn read
    during slot reuse is caught by the reader's chunk digests).
    """

    def __init__(self, arena: Arena, session: str, rank: int, failpoints: Failpoints | None = None) -> None:
        self.arena = arena
        self.session = session
        self.rank = rank
        self.failpoints = failpoints or Failpoints()
        self._lock = threading.Lock()
        self._slots: dict[int, SlotEntry] = {}

    def set(self, slot: int, entry: SlotEntry | None) -> None:
        with self._lock:
            if entry is None:
                self._slots.pop(slot, None)
            else:
                self._slots[slot] = entry

    def entries(self) -> dict[int, SlotEntry]:
        with self._lock:
            return dict(self._slots)

    def latest_version(self) -> int:
        """The newest version a slot holds (0: none)."""
        return max((e.version for e in self.entries().values()), default=0)

    def _find(self, session: str, version: int, rank: int) -> SlotEntry:
        with self._lock:
            return self._find_locked(session, version, rank)[1]

    def _find_bytes(self, session: str, version: int, rank: int) -> tuple[SlotEntry, np.ndarray]:
        """A version's entry and a view of its slot, taken together under the lock: the
        publisher forgets every entry before it reallocates the arena, so the view is of the
        mapping the entry was staged in (kept alive by the view)."""
        with self._lock:
            slot, entry = self._find_locked(session, version, rank)
            return entry, self.arena.slot(slot)

    def _find_locked(self, session: str, version: int, rank: int) -> tuple[int, SlotEntry]:
        if session != self.session:
            raise NotFound(f"session {session!r} is not served here (this agent serves {self.session!r})")
        if rank != self.rank:
            raise InvalidArgument(f"this agent serves rank {self.rank}, not {rank}", field="rank")
        for slot, entry in self._slots.items():
            if entry.version == version:
                return slot, entry
        held = sorted(e.version for e in self._slots.values())
        raise VersionNotFound(f"version {version} is not staged here (slots hold {held or 'nothing'})")

    def check_read(self, session: str, version: int, rank: int, indices: Sequence[int]) -> None:
        entry = self._find(session, version, rank)
        for i, index in enumerate(indices):
            if index >= entry.fetchable:
                raise InvalidArgument(
                    f"{index} >= {entry.fetchable} (chunk_count {len(entry.chunks)} + delta chunks)",
                    field=f"indices[{i}]",
                )

    def check_token(self, session: str, version: int, token: str) -> None:
        entry = self._find(session, version, self.rank)
        check_token(entry.token, token, version)

    def chunk_lengths(self, session: str, version: int, rank: int, indices: Sequence[int]) -> int:
        entry = self._find(session, version, rank)
        return sum(entry.spec(i).length for i in indices)

    def send_chunks(self, sock_fd: int, session: str, version: int, rank: int, indices: Sequence[int]) -> int:
        """Sends the chunks from the mapped arena.

        Not `sendfile`: from a tmpfs file it costs more CPU in all on loopback (measured:
        0.82-0.92 vs 0.66-0.71 CPU s for 1.19 GB, sender + receiver), since the receiver's
        copy then reads cold pages. The views keep the mapping alive while they are sent,
        even if the arena is reallocated meanwhile (`Arena._release`)."""
        entry, arena = self._find_bytes(session, version, rank)
        views = [entry.view(arena, i) for i in indices]
        if self.failpoints.fire("chunk_server.corrupt_chunk"):  # the first chunk leaves with one byte flipped
            views[0] = np.array(views[0])
            views[0][-1:] ^= 0xFF
        return native.send_views(sock_fd, views)

    def chunk_view(self, session: str, version: int, rank: int, index: int) -> tuple[int, memoryview]:
        entry, arena = self._find_bytes(session, version, rank)
        if index >= entry.fetchable:
            raise InvalidArgument(f"{index} >= {entry.fetchable} (chunks + delta chunks)", field="indices")
        return entry.spec(index).offset, memoryview(entry.view(arena, index))


class TrainerAgentServicer:
    """ReadChunks and GetStatus for one rank."""

    def __init__(
        self, table: SlotTable, metrics: Metrics, failpoints: Failpoints, generation: Callable[[], int]
    ) -> None:
        self._table = table
        self._metrics = metrics
        self._failpoints = failpoints
        self._generation = generation
        self.bytes_served = 0
        self._served_lock = threading.Lock()

    def count_served(self, nbytes: int) -> None:
        """Bytes served by any transport (gRPC here, tcp through its callback)."""
        self._metrics.add_bytes("served", nbytes)
        with self._served_lock:
            self.bytes_served += nbytes

    def ReadChunks(self, request: pb.ReadChunksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        for payload in serve_chunks(self._table, request, self._failpoints):
            self.count_served(len(payload))
            yield payload

    def GetStatus(self, request: pb.TrainerStatusRequest, context: grpc.ServicerContext) -> pb.TrainerStatus:
        entries = self._table.entries()
        return pb.TrainerStatus(
            session=self._table.session,
            rank=self._table.rank,
            generation=self._generation(),
            arena_bytes=self._table.arena.nbytes,
            slots=[
                pb.SlotInfo(slot=s, version=e.version, total_bytes=e.total_bytes, chunk_count=len(e.chunks))
                for s, e in sorted(entries.items())
            ],
            bytes_served=self.bytes_served,
            latest_version=max((e.version for e in entries.values()), default=0),
        )


def add_trainer_agent_service(servicer: TrainerAgentServicer, server: grpc.Server) -> None:
    """Like the generated add_TrainerAgentServicer_to_server, but ReadChunks yields pre-encoded bytes."""
    handlers = {
        "ReadChunks": grpc.unary_stream_rpc_method_handler(
            servicer.ReadChunks,
            request_deserializer=pb.ReadChunksRequest.FromString,
            response_serializer=serialize_response,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus,
            request_deserializer=pb.TrainerStatusRequest.FromString,
            response_serializer=pb.TrainerStatus.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


@dataclass
class ChunkServers:
    """A rank's running chunk servers and the endpoint that advertises them."""

    servicer: TrainerAgentServicer
    tcp_server: TcpChunkServer | None
    server: RunningServer
    endpoint: Endpoint


def start_chunk_servers(
    table: SlotTable,
    settings: PublisherSettings,
    metrics: Metrics,
    generation: Callable[[], int],
    security: Security,
    resources: contextlib.ExitStack,
    leave: Callable[[], None],
) -> ChunkServers:
    """Serves `table` over gRPC (and its health and `/metrics`), and over the native tcp
    path where this host has inet sockets and the shim is built; each server's stop goes
    on `resources` as it starts (the gRPC server's health first, then `leave()`, then its
    calls' grace)."""
    s, failpoints = settings, table.failpoints
    servicer = TrainerAgentServicer(table, metrics, failpoints, generation)
    transports = ("grpc", "shm")
    tcp_server: TcpChunkServer | None = None
    if why := inet_unusable(host=s.host):
        log.info("the tcp transport is not offered: %s", why)
    elif native.available():  # the native bulk path ("tcp"): sends from the mapped arena
        tcp_server = TcpChunkServer(
            table, host=s.host, port=s.tcp_port, on_sent=servicer.count_served, failpoints=failpoints
        )
        resources.callback(tcp_server.close)
        transports += ("tcp",)
    else:
        log.warning("native shim missing (%s): the tcp transport is not offered", native.missing_reason())
    server = start_server(
        [Service(add_trainer_agent_service, servicer, SERVICE_NAME)],
        host=s.host,
        port=s.port,
        metrics=metrics,
        metrics_port=s.metrics_port,
        metrics_host=s.metrics_host,
        security=security,
        max_request_bytes=SMALL_REQUEST_BYTES,
    )

    def stop() -> None:
        server.enter_graceful_shutdown()  # health first: nobody new is sent here
        leave()
        server.stop(grace_s=1.0)

    resources.callback(stop)
    endpoint = Endpoint(
        advertised(server.address, s.advertise_host),
        transports,
        s.host_id or socket.gethostname(),
        tcp_address=advertised(tcp_server.address, s.advertise_host) if tcp_server else "",
    )
    return ChunkServers(servicer, tcp_server, server, endpoint)
