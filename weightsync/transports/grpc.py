"""gRPC chunk transport, both halves: ChunkData codec, serving loop and GrpcTransport.

The hot path never builds a ChunkData message around the bytes: the server encodes
(header fields + tag + length + payload) in one join, sent with a pass-through
serializer; the client takes raw bytes and slices the payload out without a copy.
gRPC Python sends only exact `bytes`, never memoryviews (the call would hang).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from weightsync import rpc
from weightsync._proto import trainer_agent_pb2 as _pb
from weightsync.errors import DataLoss, InvalidArgument, TransportUnavailable
from weightsync.failpoints import Failpoints
from weightsync.manifest import Endpoint
from weightsync.security import PLAINTEXT, Security
from weightsync.transports.base import MAX_INDICES_PER_READ, ChunkPayload, ChunkSource, FetchRequest, Transport

READ_CHUNKS_METHOD = "/weightsync.v1.TrainerAgent/ReadChunks"
_DATA_TAG = b"\x1a"  # field 3 (data), wire type 2 (length-delimited)
# Each parallel stream gets its own TCP connection (no shared subchannel).
_TRANSPORT_CHANNEL_OPTIONS = [*rpc.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DataLoss("truncated or malformed varint in ChunkData")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_chunk(index: int, offset: int, data: memoryview | bytes) -> bytes:
    """Wire bytes of ChunkData{index, offset, data} (valid protobuf; one copy of data)."""
    head = _pb.ChunkData(index=index, offset=offset).SerializeToString()
    return b"".join((head, _DATA_TAG, _varint(len(data)), data))


def decode_chunk(raw: bytes) -> ChunkPayload:
    """Parses ChunkData wire bytes; `data` is a view into raw (no copy)."""
    buf = memoryview(raw)
    pos = index = offset = 0
    data = buf[0:0]
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
            # Wider than the field's type: protobuf would truncate it (index 2^32 read as
            # chunk 0); a malformed reply is refused instead.
            if field == 1:
                if value >= 1 << 32:
                    raise DataLoss(f"ChunkData.index {value} does not fit uint32")
                index = value
            elif field == 2:
                if value >= 1 << 64:
                    raise DataLoss(f"ChunkData.offset {value} does not fit uint64")
                offset = value
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise DataLoss("ChunkData payload is truncated")
            if field == 3:
                data = buf[pos : pos + length]
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise DataLoss(f"unexpected wire type {wire_type} in ChunkData")
    return ChunkPayload(index, offset, data)


def serialize_response(message: Any) -> bytes:
    """Response serializer that passes pre-encoded bytes through."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def serve_chunks(
    source: ChunkSource, request: _pb.ReadChunksRequest, failpoints: Failpoints | None = None
) -> Iterator[bytes]:
    """The ReadChunks serving loop over any ChunkSource; validates before the first byte."""
    if len(request.indices) > MAX_INDICES_PER_READ:
        raise InvalidArgument(f"{len(request.indices)} exceed {MAX_INDICES_PER_READ} per call", field="indices")
    if not request.indices:
        raise InvalidArgument("must name at least one chunk", field="indices")
    source.check_token(request.session, request.version, request.access_token)
    source.check_read(request.session, request.version, request.rank, request.indices)
    for index in request.indices:
        offset, view = source.chunk_view(request.session, request.version, request.rank, index)
        payload = encode_chunk(index, offset, view)
        if failpoints is not None and failpoints.fire("chunk_server.corrupt_chunk"):
            flipped = bytearray(payload)
            flipped[-1] ^= 0xFF
            payload = bytes(flipped)
        yield payload


class GrpcTransport(Transport):
    """Pulls chunks with TrainerAgent.ReadChunks; one channel (TCP connection) per instance."""

    name = "grpc"
    cross_host = True

    def __init__(self, security: Security | None = None) -> None:
        self._security = security
        self._channel: grpc.Channel | None = None
        self._read: Any = None
        self._interrupted = False

    def open(self, endpoint: Endpoint) -> None:
        self.close()
        self._channel = (self._security or PLAINTEXT).channel(endpoint.address, _TRANSPORT_CHANNEL_OPTIONS)
        self._read = self._channel.unary_stream(
            READ_CHUNKS_METHOD,
            request_serializer=_pb.ReadChunksRequest.SerializeToString,
            response_deserializer=None,  # raw bytes: decode_chunk slices without a copy
        )

    def fetch(self, request: FetchRequest) -> Iterator[ChunkPayload]:
        if self._interrupted:
            raise TransportUnavailable("interrupted")
        if self._read is None:
            raise TransportUnavailable("not open; call open() first")
        req = _pb.ReadChunksRequest(
            session=request.session,
            version=request.version,
            rank=request.rank,
            indices=list(request.indices),
            access_token=request.token,
        )
        try:
            for raw in rpc.stream(self._read, req, timeout_s=request.timeout_s):
                yield decode_chunk(raw)
        except ValueError:  # "Cannot invoke RPC on closed channel!": interrupted meanwhile
            if not self._interrupted:
                raise
            raise TransportUnavailable("interrupted") from None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._read = None

    def interrupt(self) -> None:
        self._interrupted = True
        channel = self._channel
        if channel is not None:
            channel.close()  # cancels the stream in progress (grpc's close is thread-safe)
