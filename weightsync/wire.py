"""Protos become dataclasses here, and only here (the edge)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

from google.protobuf.timestamp_pb2 import Timestamp

from weightsync._proto import coordinator_pb2 as _cpb
from weightsync._proto import types_pb2 as _tpb
from weightsync.dtypes import dtype_from_proto, dtype_info
from weightsync.errors import DigestMismatch, InvalidArgument
from weightsync.manifest import ChunkSpec, DeltaChunkSpec, Endpoint, Manifest, Part, PartDelta, ShardSpec, TensorSpec
from weightsync.validation import check_name_chars

BATCH_ITEMS = 2048  # descriptors per DescriptorBatch: ~100 KB messages
MAX_NAME_CHARS = 512  # as validation.TENSOR_NAME_RE allows; longer names are refused on arrival


def timestamp(unix_s: float) -> Timestamp | None:
    """A google.protobuf.Timestamp (grpcurl and MessageToJson print RFC 3339); None for 0,
    the store's "not yet", so the field stays unset."""
    if not unix_s:
        return None
    ts = Timestamp()
    ts.FromNanoseconds(round(unix_s * 1e9))
    return ts


def unix_seconds(ts: Timestamp) -> float:
    """Seconds since the epoch of a Timestamp field; 0.0 when unset."""
    return ts.ToNanoseconds() / 1e9


def endpoint_to_proto(e: Endpoint) -> _tpb.Endpoint:
    return _tpb.Endpoint(
        address=e.address,
        transports=list(e.transports),
        host_id=e.host_id,
        shm_path=e.shm_path,
        shm_offset=e.shm_offset,
        fs_uri=e.fs_uri,
        tcp_address=e.tcp_address,
    )


def endpoint_from_proto(p: _tpb.Endpoint) -> Endpoint:
    return Endpoint(p.address, tuple(p.transports), p.host_id, p.shm_path, p.shm_offset, p.fs_uri, p.tcp_address)


def tensor_from_proto(p: _tpb.TensorDescriptor, field: str) -> TensorSpec:
    return TensorSpec(p.name, dtype_from_proto(p.dtype, f"{field}.dtype").name, tuple(p.shape))


def tensor_to_proto(t: TensorSpec) -> _tpb.TensorDescriptor:
    return _tpb.TensorDescriptor(name=t.name, dtype=dtype_info(t.dtype).proto, shape=list(t.shape))


def shard_from_proto(p: _tpb.ShardDescriptor) -> ShardSpec:
    return ShardSpec(p.tensor_name, tuple(p.start), tuple(p.stop), p.offset, p.nbytes, p.xxh3, p.sum)


def chunk_from_proto(p: _tpb.ChunkDescriptor) -> ChunkSpec:
    return ChunkSpec(p.index, p.offset, p.length, p.xxh3)


def delta_to_proto(d: PartDelta | None) -> _tpb.PartDelta | None:
    """The delta's header (its descriptors travel in DescriptorBatches); None without one."""
    if d is None:
        return None
    return _tpb.PartDelta(
        base_version=d.base_version,
        base_manifest_digest=d.base_manifest_digest,
        encoding=d.encoding,
        total_bytes=d.total_bytes,
        chunk_count=len(d.chunks),
        raw_count=len(d.raw),
    )


def part_to_batches(part: Part, batch_items: int = BATCH_ITEMS) -> Iterator[_tpb.DescriptorBatch]:
    """Splits a part's descriptors into batches of at most batch_items each kind.

    Each batch is one message with its descriptors added in place: its tensors and the
    shards' placement are copied from a batch kept per layout (`_placement`), the shards'
    digests set, the chunks added. Protobuf's Python module (upb) calls glibc's
    `malloc_trim(0)` on every 10,000th block it frees, and a descriptor made as a message
    of its own, or one whose repeated field (a shape, a shard's start) is filled, frees
    about one each: a 0.6b part's ~1,650 a publish brought a trim every fifth or sixth
    publish, which walks every free chunk in the process (a trainer's heap after XLA's
    compile holds ~300,000) with the interpreter lock held (docs/performance.md)."""
    delta_chunks = part.delta.chunks if part.delta else ()
    raw = part.delta.raw if part.delta else ()
    n = max(len(part.tensors), len(part.shards), len(part.chunks), len(delta_chunks), len(raw))
    for i in range(0, max(n, 1), batch_items):
        shards = part.shards[i : i + batch_items]
        batch = _tpb.DescriptorBatch()
        batch.CopyFrom(_placement(part.rank, part.tensors[i : i + batch_items], tuple(map(_shard_place, shards))))
        for proto, s in zip(batch.shards, shards, strict=True):
            proto.xxh3, proto.sum = s.xxh3, s.sum
        for c in part.chunks[i : i + batch_items]:
            batch.chunks.add(index=c.index, offset=c.offset, length=c.length, xxh3=c.xxh3)
        for d in delta_chunks[i : i + batch_items]:
            batch.delta_chunks.add(index=d.index, target=d.target, offset=d.offset, length=d.length, xxh3=d.xxh3)
        batch.raw_chunks.extend(raw[i : i + batch_items])
        yield batch


def publish_requests(part: Part, batches: Iterable[_tpb.DescriptorBatch]) -> Iterator[_cpb.PublishRequest]:
    """PublishVersion's stream after its header: `batches` (the part's, `part_to_batches`),
    then the seal with the part's digest."""
    for batch in batches:
        yield _cpb.PublishRequest(batch=batch)
    yield _cpb.PublishRequest(seal=_cpb.PublishSeal(part_digest=part.digest()))


ShardPlace = tuple[str, tuple[int, ...], tuple[int, ...], int, int]  # name, start, stop, offset, nbytes


def _shard_place(s: ShardSpec) -> ShardPlace:
    """Where a shard sits (what stays from version to version; its digests do not)."""
    return s.tensor_name, s.start, s.stop, s.offset, s.nbytes


@functools.lru_cache(maxsize=32)  # a batch each: 2,048 tensors and shards at most, under 1 MB
def _placement(rank: int, tensors: tuple[TensorSpec, ...], shards: tuple[ShardPlace, ...]) -> _tpb.DescriptorBatch:
    """A batch of `tensors` and the shards' placement (digests unset), built once per layout
    and only copied from (never handed out: a caller could change it)."""
    batch = _tpb.DescriptorBatch(rank=rank)
    batch.tensors.extend(tensor_to_proto(t) for t in tensors)
    for name, start, stop, offset, nbytes in shards:
        batch.shards.add(tensor_name=name, start=start, stop=stop, offset=offset, nbytes=nbytes)
    return batch


class PartBuilder:
    """Accumulates DescriptorBatches for one rank into a Part (used by both directions).

    `max_counts` (tensors, shards, chunks, delta chunks, raw chunks), when given, are
    enforced as each batch arrives, as are the length of every name and `max_name_chars`
    (the part's tensor names together): a stream that would exceed what its header
    announced, or a limit, is refused at the batch that does, before the rest is read or kept.
    """

    KINDS = ("tensors", "shards", "chunks", "delta.chunks", "delta.raw")

    def __init__(
        self,
        rank: int,
        *,
        max_items: int,
        max_counts: tuple[int, ...] | None = None,
        max_name_chars: int | None = None,
    ) -> None:
        self.rank = rank
        self.max_items = max_items
        self.max_counts = max_counts
        self.max_name_chars = max_name_chars
        self.name_chars = 0  # of the tensors received so far
        self.tensors: list[TensorSpec] = []
        self.shards: list[ShardSpec] = []
        self.chunks: list[ChunkSpec] = []
        self.delta_chunks: list[DeltaChunkSpec] = []
        self.raw: list[int] = []

    def counts(self) -> tuple[int, ...]:
        """Descriptors received so far, per kind (`KINDS`)."""
        return len(self.tensors), len(self.shards), len(self.chunks), len(self.delta_chunks), len(self.raw)

    def add(self, batch: _tpb.DescriptorBatch) -> None:
        if batch.rank != self.rank:
            raise InvalidArgument(f"{batch.rank} does not match the header's rank {self.rank}", field="batch.rank")
        have = self.counts()
        adding = (
            len(batch.tensors),
            len(batch.shards),
            len(batch.chunks),
            len(batch.delta_chunks),
            len(batch.raw_chunks),
        )
        if sum(have) + sum(adding) > self.max_items:
            raise InvalidArgument(
                f"more than {self.max_items} descriptors; the header's counts were exceeded", field="batch"
            )
        if self.max_counts is not None:
            for what, n, k, cap in zip(self.KINDS, have, adding, self.max_counts):
                if n + k > cap:
                    raise InvalidArgument(f"more than the {cap} the header announced", field=f"part.{what}")
        base = len(self.tensors)
        for i, name in enumerate([t.name for t in batch.tensors] + [s.tensor_name for s in batch.shards]):
            if len(name) > MAX_NAME_CHARS:
                kind, j = (
                    ("tensors", base + i)
                    if i < len(batch.tensors)
                    else ("shards", len(self.shards) + i - len(batch.tensors))
                )
                raise InvalidArgument(f"{len(name)} characters exceed {MAX_NAME_CHARS}", field=f"part.{kind}[{j}].name")
        self.name_chars += sum(len(t.name) for t in batch.tensors)
        if self.max_name_chars is not None:
            check_name_chars(self.name_chars, self.max_name_chars, "part.tensors")
        self.tensors.extend(tensor_from_proto(t, f"part.tensors[{base + i}]") for i, t in enumerate(batch.tensors))
        self.shards.extend(shard_from_proto(s) for s in batch.shards)
        self.chunks.extend(chunk_from_proto(c) for c in batch.chunks)
        self.delta_chunks.extend(
            DeltaChunkSpec(c.index, c.target, c.offset, c.length, c.xxh3) for c in batch.delta_chunks
        )
        self.raw.extend(batch.raw_chunks)

    def build(
        self,
        *,
        total_bytes: int,
        chunk_bytes: int,
        endpoint: Endpoint,
        stage_seconds: float,
        delta: _tpb.PartDelta | None = None,
    ) -> Part:
        """The Part; `delta` is the header's PartDelta (None: delta descriptors are refused)."""
        part_delta = None
        if delta is not None:
            part_delta = PartDelta(
                delta.base_version,
                delta.base_manifest_digest,
                delta.total_bytes,
                tuple(self.delta_chunks),
                tuple(self.raw),
                delta.encoding,
            )
        elif self.delta_chunks or self.raw:
            raise InvalidArgument("delta descriptors arrived but the header names no delta", field="header.delta")
        return Part(
            rank=self.rank,
            total_bytes=total_bytes,
            chunk_bytes=chunk_bytes,
            tensors=tuple(self.tensors),
            shards=tuple(self.shards),
            chunks=tuple(self.chunks),
            endpoint=endpoint,
            stage_seconds=stage_seconds,
            delta=part_delta,
        )


def part_to_proto(part: Part) -> _tpb.RankPart:
    return _tpb.RankPart(
        rank=part.rank,
        total_bytes=part.total_bytes,
        chunk_count=len(part.chunks),
        endpoint=endpoint_to_proto(part.endpoint),
        stage_seconds=part.stage_seconds,
        delta=delta_to_proto(part.delta),
    )


def manifest_to_pieces(header: _cpb.ManifestHeader, manifest: Manifest) -> Iterator[_cpb.ManifestPiece]:
    """A manifest as a stream: the header, then each rank's descriptor batches."""
    yield _cpb.ManifestPiece(header=header)
    yield from manifest_batches(manifest)


def manifest_batches(manifest: Manifest) -> Iterator[_cpb.ManifestPiece]:
    """The pieces after the header: each rank's descriptor batches, in rank order."""
    for part in manifest.parts:
        for batch in part_to_batches(part):
            yield _cpb.ManifestPiece(batch=batch)


class ManifestUnchecked(DigestMismatch):
    """A manifest whose header came but whose body does not check (its digest, a batch
    that does not build); `header` says which version, so a rollout can report it failed."""

    def __init__(self, message: str, *, field: str | None = None, header: _cpb.ManifestHeader | None = None) -> None:
        super().__init__(message, field=field)
        self.header = header if header is not None else _cpb.ManifestHeader()


def manifest_from_pieces(pieces: Iterable[_cpb.ManifestPiece]) -> tuple[_cpb.ManifestHeader, Manifest]:
    """Rebuilds a Manifest from GetManifest's stream; ManifestUnchecked (DATA_LOSS) unless
    it builds and hashes to the digest its header claims (so every reader, `wsctl`
    included, gets a checked manifest)."""
    it = iter(pieces)
    first = next(it, None)
    if first is None or not first.HasField("header"):
        raise InvalidArgument("stream did not start with a header", field="manifest")
    header = first.header
    try:
        return header, _body(header, it)
    except (InvalidArgument, DigestMismatch) as e:
        raise ManifestUnchecked(
            f"manifest of version {header.version.version} does not check: {e.message}", header=header
        ) from e


def _body(header: _cpb.ManifestHeader, it: Iterator[_cpb.ManifestPiece]) -> Manifest:
    builders: dict[int, PartBuilder] = {p.rank: PartBuilder(p.rank, max_items=1 << 40) for p in header.parts}
    for piece in it:
        if piece.batch.rank not in builders:
            raise InvalidArgument(f"unknown rank {piece.batch.rank}", field="manifest.batch.rank")
        builders[piece.batch.rank].add(piece.batch)
    parts = tuple(
        builders[p.rank].build(
            total_bytes=p.total_bytes,
            chunk_bytes=header.chunk_bytes,
            endpoint=endpoint_from_proto(p.endpoint),
            stage_seconds=p.stage_seconds,
            delta=p.delta if p.HasField("delta") else None,
        )
        for p in sorted(header.parts, key=lambda p: p.rank)
    )
    v = header.version
    manifest = Manifest(v.session, v.version, v.generation, header.chunk_bytes, parts)
    if manifest.digest() != v.manifest_digest:
        raise DigestMismatch(f"it hashes to {manifest.digest()[:16]}…, its header says {v.manifest_digest[:16]}…")
    return manifest
