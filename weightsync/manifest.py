"""The manifest model: tensors made of shards, per-rank parts, chunks, canonical digest."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from weightsync.digests import (
    DIGEST_ALGORITHM,
    canonical_json,
    canonical_json_sliced,
    combine_shard_digests,
    hex64,
    sha256_hex,
)
from weightsync.dtypes import dtype_info

T = TypeVar("T")


def _kept(obj: object, key: str, build: Callable[[], T]) -> T:
    """A value derived from a frozen record, built on first use and kept in its __dict__:
    parts and manifests never change, and a publish or a fleet's handshakes (1,000 per
    version) ask for the same derived values again and again."""
    value = obj.__dict__.get(key)
    if value is None:
        value = build()
        object.__setattr__(obj, key, value)
    return value


def exact_sum(values: Iterable[float]) -> float:
    """math.fsum, except that sums holding +inf and -inf are NaN (fsum raises on them):
    weights may hold any float, and their sums must still compare."""
    values = list(values)
    if all(math.isfinite(v) for v in values):
        return math.fsum(values)
    return sum(values, 0.0)


@dataclass(frozen=True)
class TensorSpec:
    """Global description of one tensor (HF name, dtype, global shape)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def element_count(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.element_count * dtype_info(self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(d["name"], d["dtype"], tuple(d["shape"]))


@dataclass(frozen=True)
class ShardSpec:
    """A box [start, stop) of a tensor, stored contiguously at `offset` in a rank's part."""

    tensor_name: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    offset: int
    nbytes: int
    xxh3: int
    sum: float

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def element_count(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor_name": self.tensor_name,
            "start": list(self.start),
            "stop": list(self.stop),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "xxh3": hex64(self.xxh3),
            # NaN and +-inf are legitimate sums of real weights; JSON (and SQLite's JSON
            # functions) have no literal for them, so they travel as "nan" / "inf" / "-inf".
            "sum": self.sum if math.isfinite(self.sum) else repr(self.sum),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardSpec:
        return cls(
            d["tensor_name"],
            tuple(d["start"]),
            tuple(d["stop"]),
            d["offset"],
            d["nbytes"],
            int(d["xxh3"], 16),
            float(d["sum"]),
        )


@dataclass(frozen=True)
class ChunkSpec:
    """One fetchable byte range of a rank's part."""

    index: int
    offset: int
    length: int
    xxh3: int

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "offset": self.offset, "length": self.length, "xxh3": hex64(self.xxh3)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChunkSpec:
        return cls(d["index"], d["offset"], d["length"], int(d["xxh3"], 16))


DELTA_ENCODINGS = ("delta16",)  # native/delta.cc: 16-bit words, LEB128 gap + step byte


@dataclass(frozen=True)
class DeltaChunkSpec:
    """The encoded changes to full chunk `target` against the base version; fetched like a
    chunk by `index` (the part's chunk count + its place among the delta chunks), from
    `offset` in the part's delta bytes."""

    index: int
    target: int
    offset: int
    length: int
    xxh3: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "target": self.target,
            "offset": self.offset,
            "length": self.length,
            "xxh3": hex64(self.xxh3),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeltaChunkSpec:
        return cls(d["index"], d["target"], d["offset"], d["length"], int(d["xxh3"], 16))

    def as_chunk(self) -> ChunkSpec:
        """The chunk a transport fetches: `offset` is in the delta bytes, not the part."""
        return ChunkSpec(self.index, self.offset, self.length, self.xxh3)


@dataclass(frozen=True)
class PartDelta:
    """A part as a delta against `base_version` (same layout): changed chunks encoded
    (`chunks`) or fetched whole (`raw`, full chunk indices); every other chunk equals the
    base's. The part's full descriptors stay the truth a rebuild is checked against."""

    base_version: int
    base_manifest_digest: str
    total_bytes: int  # encoded bytes of every delta chunk, back to back
    chunks: tuple[DeltaChunkSpec, ...]
    raw: tuple[int, ...]
    encoding: str = "delta16"

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_version": self.base_version,
            "base_manifest_digest": self.base_manifest_digest,
            "encoding": self.encoding,
            "total_bytes": self.total_bytes,
            "chunks": [c.to_dict() for c in self.chunks],
            "raw": list(self.raw),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartDelta:
        return cls(
            d["base_version"],
            d["base_manifest_digest"],
            d["total_bytes"],
            tuple(DeltaChunkSpec.from_dict(c) for c in d["chunks"]),
            tuple(d["raw"]),
            d["encoding"],
        )


@dataclass(frozen=True)
class Endpoint:
    """Where a rank's bytes are served."""

    address: str = ""
    transports: tuple[str, ...] = ("grpc",)
    host_id: str = ""
    shm_path: str = ""  # "shm": the arena file of this part's slot
    shm_offset: int = 0  # "shm": byte offset of the part in that file
    fs_uri: str = ""  # "fs": fsspec URI of the directory holding part.bin and _SUCCESS
    tcp_address: str = ""  # "tcp": host:port of the native bulk server

    def to_dict(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "transports": list(self.transports),
            "host_id": self.host_id,
            "shm_path": self.shm_path,
            "shm_offset": self.shm_offset,
            "fs_uri": self.fs_uri,
            "tcp_address": self.tcp_address,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Endpoint:
        return cls(
            d.get("address", ""),
            tuple(d.get("transports", ())),
            d.get("host_id", ""),
            d.get("shm_path", ""),
            d.get("shm_offset", 0),
            d.get("fs_uri", ""),
            d.get("tcp_address", ""),
        )


@dataclass(frozen=True)
class Part:
    """One trainer rank's share of a version."""

    rank: int
    total_bytes: int
    chunk_bytes: int
    tensors: tuple[TensorSpec, ...]
    shards: tuple[ShardSpec, ...]
    chunks: tuple[ChunkSpec, ...]
    endpoint: Endpoint = field(default_factory=Endpoint)
    stage_seconds: float = 0.0
    delta: PartDelta | None = None

    @property
    def fetch_chunks(self) -> tuple[ChunkSpec, ...]:
        """What a transport fetches by index: the chunks, then the delta's chunks (indices
        from the chunk count on; their offsets lie in the delta's bytes)."""
        if self.delta is None:
            return self.chunks
        return self.chunks + tuple(c.as_chunk() for c in self.delta.chunks)

    def content_dict(self) -> dict[str, Any]:
        """The digest-relevant content (where it is served and how long it took are not).

        Built once per Part (it is frozen): a publish of 10^5 tensors needs it for the seal,
        the stored body and the manifest digest, ~1 s each. Callers must not modify it."""

        def build() -> dict[str, Any]:
            content = {
                "rank": self.rank,
                "digest_algorithm": DIGEST_ALGORITHM,
                "total_bytes": self.total_bytes,
                "chunk_bytes": self.chunk_bytes,
                "tensors": [t.to_dict() for t in self.tensors],
                "shards": [s.to_dict() for s in self.shards],
                "chunks": [c.to_dict() for c in self.chunks],
            }
            if self.delta is not None:  # absent otherwise: digests of full-only parts are unchanged
                content["delta"] = self.delta.to_dict()
            return content

        return _kept(self, "_content", build)

    def canonical(self) -> bytes:
        """The canonical encoding of `content_dict()` (built once): the part's digest, the
        manifest digest and the stored body are all made from it."""
        return _kept(self, "_canonical", lambda: canonical_json_sliced(self.content_dict()))

    def digest(self) -> str:
        """sha256 hex of the canonical encoding of this part's content (computed once)."""
        return _kept(self, "_digest", lambda: sha256_hex(self.canonical()))

    def to_json(self) -> str:
        """`to_dict()` as JSON text, made around the canonical content rather than encoding
        10^5 descriptors a second time (`from_dict(json.loads(...))` reads it back)."""
        content = self.canonical().decode()
        return (
            f'{content[:-1]},"endpoint":{json.dumps(self.endpoint.to_dict())},'
            f'"stage_seconds":{json.dumps(self.stage_seconds)}}}'
        )

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.content_dict())
        d["endpoint"] = self.endpoint.to_dict()
        d["stage_seconds"] = self.stage_seconds
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Part:
        return cls(
            rank=d["rank"],
            total_bytes=d["total_bytes"],
            chunk_bytes=d["chunk_bytes"],
            tensors=tuple(TensorSpec.from_dict(t) for t in d["tensors"]),
            shards=tuple(ShardSpec.from_dict(s) for s in d["shards"]),
            chunks=tuple(ChunkSpec.from_dict(c) for c in d["chunks"]),
            endpoint=Endpoint.from_dict(d.get("endpoint", {})),
            stage_seconds=d.get("stage_seconds", 0.0),
            delta=PartDelta.from_dict(d["delta"]) if d.get("delta") else None,
        )


@dataclass(frozen=True)
class Aggregates:
    """Source checksums over a whole version."""

    grand_total: float
    tensor_count: int
    element_count: int


@dataclass(frozen=True)
class Manifest:
    """The full description of a version: every rank's part, merged."""

    session: str
    version: int
    generation: int
    chunk_bytes: int
    parts: tuple[Part, ...]  # sorted by rank

    @property
    def tensors(self) -> Mapping[str, TensorSpec]:
        """Global tensor specs by name, in first-seen order (read-only)."""

        def build() -> Mapping[str, TensorSpec]:
            out: dict[str, TensorSpec] = {}
            for part in self.parts:
                for t in part.tensors:
                    out.setdefault(t.name, t)
            return MappingProxyType(out)

        return _kept(self, "_tensors", build)

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for p in self.parts)

    @property
    def delta_base(self) -> tuple[int, str] | None:
        """(base version, base manifest digest) when every part carries a delta against
        the same base, else None (the version is pulled whole)."""
        bases = {(p.delta.base_version, p.delta.base_manifest_digest) if p.delta else None for p in self.parts}
        return next(iter(bases)) if len(bases) == 1 and None not in bases else None

    def shards_of(self) -> dict[str, list[tuple[int, ShardSpec]]]:
        """(rank, shard) lists per tensor name, in canonical order (by box start)."""
        out: dict[str, list[tuple[int, ShardSpec]]] = {name: [] for name in self.tensors}
        for part in self.parts:
            for s in part.shards:
                out[s.tensor_name].append((part.rank, s))
        for shards in out.values():
            shards.sort(key=lambda rs: rs[1].start)
        return out

    def shards_of_name(self, name: str) -> list[tuple[int, ShardSpec]]:
        """(rank, shard) of one tensor in canonical order (cached index over all tensors)."""
        return _kept(self, "_shard_index", self.shards_of)[name]

    def tensor_digests(self) -> Mapping[str, int]:
        """Per-tensor digests by the rule in `digests.combine_shard_digests` (read-only)."""
        return _kept(
            self,
            "_tensor_digests",
            lambda: MappingProxyType(
                {name: combine_shard_digests(s.xxh3 for _, s in shards) for name, shards in self.shards_of().items()}
            ),
        )

    def tensor_sums(self) -> Mapping[str, float]:
        """Per-tensor float64 sums (sums of shard sums; read-only)."""
        return _kept(
            self,
            "_tensor_sums",
            lambda: MappingProxyType(
                {name: exact_sum(s.sum for _, s in shards) for name, shards in self.shards_of().items()}
            ),
        )

    def tensor_checks(self) -> Mapping[str, tuple[int, float, int]]:
        """Per tensor in manifest order: (digest, sum, element count), what a handshake is
        compared with (read-only; a fleet compares against it a thousand times)."""

        def build() -> Mapping[str, tuple[int, float, int]]:
            digests, sums = self.tensor_digests(), self.tensor_sums()
            return MappingProxyType({n: (digests[n], sums[n], t.element_count) for n, t in self.tensors.items()})

        return _kept(self, "_tensor_checks", build)

    def aggregates(self) -> Aggregates:
        """grand_total, tensor_count and element_count over the source tensors."""

        def build() -> Aggregates:
            tensors = self.tensors
            return Aggregates(
                grand_total=exact_sum(self.tensor_sums().values()),
                tensor_count=len(tensors),
                element_count=sum(t.element_count for t in tensors.values()),
            )

        return _kept(self, "_aggregates", build)

    def digest(self) -> str:
        """sha256 hex of the canonical encoding of the whole manifest's content:
        {"chunk_bytes", "digest_algorithm", "parts": [each part's content], "session",
        "version"}, made with the parts' own canonical encodings in place."""
        outer = canonical_json(
            {
                "session": self.session,
                "version": self.version,
                "chunk_bytes": self.chunk_bytes,
                "digest_algorithm": DIGEST_ALGORITHM,
                "parts": [],
            }
        )
        head, empty, tail = outer.partition(b'"parts":[]')
        assert empty, outer  # keys are fixed and session names hold no quotes
        return sha256_hex(head + b'"parts":[' + b",".join(p.canonical() for p in self.parts) + b"]" + tail)
