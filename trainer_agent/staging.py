"""Staging: host shards -> arena slot, with per-shard and per-chunk xxh3-64 and float64 sums.

Two engines with identical results: `native` (the C++ shim's fused, multithreaded copy +
digest pass) and `python` (numpy copy, then xxhash over the slot), the fallback when the
shim is not built. The JAX FFI path lives in `trainer_agent.ffi_staging`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from weightsync import native
from weightsync.digests import float64_sum, xxh3
from weightsync.dtypes import dtype_name_of, native_code
from weightsync.errors import ResourceExhausted
from weightsync.layout import SHARD_ALIGN_BYTES, align_up, place_shards, plan_chunks
from weightsync.manifest import ChunkSpec, ShardSpec, TensorSpec


@dataclass(frozen=True)
class HostShard:
    """A host-addressable box of a tensor: `data` covers [start, stop) of `global_shape`."""

    name: str
    data: np.ndarray
    global_shape: tuple[int, ...]
    start: tuple[int, ...]

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(a + n for a, n in zip(self.start, self.data.shape))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class Layout:
    """Where each shard goes in a slot; equal layouts let a slot be reused as is."""

    tensors: tuple[TensorSpec, ...]
    boxes: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    nbytes: tuple[int, ...]
    offsets: tuple[int, ...]
    total_bytes: int


def plan_layout(shards: Sequence[HostShard]) -> Layout:
    """Tensor specs (first shard of each name) and aligned shard offsets."""
    tensors: dict[str, TensorSpec] = {}
    for s in shards:
        tensors.setdefault(s.name, TensorSpec(s.name, dtype_name_of(s.data.dtype), tuple(s.global_shape)))
    offsets, total = place_shards([s.nbytes for s in shards])
    return Layout(
        tensors=tuple(tensors.values()),
        boxes=tuple((s.name, s.start, s.stop) for s in shards),
        nbytes=tuple(s.nbytes for s in shards),
        offsets=tuple(offsets),
        total_bytes=total,
    )


def specs_from_digests(
    layout: Layout, digests: Sequence[int], sums: Sequence[float], chunk_digests: Sequence[int], chunk_bytes: int
) -> tuple[list[ShardSpec], list[ChunkSpec]]:
    """Shard and chunk specs from a native pass's outputs (shards in layout order)."""
    specs = [
        ShardSpec(name, start, stop, off, n, int(d), float(total))
        for (name, start, stop), off, n, d, total in zip(layout.boxes, layout.offsets, layout.nbytes, digests, sums)
    ]
    chunks = [
        ChunkSpec(i, off, length, int(chunk_digests[i]))
        for i, (off, length) in enumerate(plan_chunks(layout.total_bytes, chunk_bytes))
    ]
    return specs, chunks


def stage_shards(
    slot: np.ndarray,
    shards: Sequence[HostShard],
    layout: Layout,
    chunk_bytes: int,
    *,
    engine: str = "auto",
    threads: int = 0,
) -> tuple[list[ShardSpec], list[ChunkSpec]]:
    """Copies shards into `slot` at the layout's offsets; returns shard and chunk specs.

    Alignment gaps are zeroed so chunk digests depend only on the data. `engine` is
    "native", "python" or "auto" (native when built).
    """
    if engine == "native" or (engine == "auto" and native.available()):
        sources = []
        for s, off in zip(shards, layout.offsets):
            arr = np.ascontiguousarray(s.data)
            sources.append((arr, off, native_code(arr.dtype)))
        result = native.stage(slot, layout.total_bytes, chunk_bytes, sources, threads=threads)
        return specs_from_digests(layout, result.span_digests, result.span_sums, result.chunk_digests, chunk_bytes)
    return _stage_python(slot, shards, layout, chunk_bytes)


def stage_one(slot: np.ndarray, offset: int, arr: np.ndarray, *, engine: str = "auto") -> tuple[int, float]:
    """Copies one contiguous array to slot[offset:]; returns (xxh3, float64 sum)."""
    n = arr.nbytes
    if engine == "native" or (engine == "auto" and native.available()):
        r = native.stage(slot[offset : offset + n], n, max(n, 1), [(arr, 0, native_code(arr.dtype))], threads=1)
        return int(r.span_digests[0]), float(r.span_sums[0])
    dst = slot[offset : offset + n]
    np.copyto(dst, arr.reshape(-1).view(np.uint8))
    return xxh3(dst), float64_sum(arr)


@dataclass
class StreamStaged:
    """What `stage_stream` wrote: specs of every tensor and shard, and the bytes used."""

    tensors: dict[str, TensorSpec]
    shards: list[ShardSpec]
    total_bytes: int


def stage_stream(slot: np.ndarray, shards: Iterable[HostShard], *, engine: str = "auto") -> StreamStaged:
    """Stages shards one at a time, in arrival order; each is released before the next.

    Raises:
        ResourceExhausted: the stream outgrows the slot.
    """
    out = StreamStaged({}, [], 0)
    cursor = 0
    for hs in shards:
        arr = np.ascontiguousarray(hs.data)
        offset = align_up(cursor, SHARD_ALIGN_BYTES)
        if offset + arr.nbytes > slot.nbytes:
            raise ResourceExhausted(
                f"capacity_bytes: the slot holds {slot.nbytes} bytes; {hs.name!r} needs up to {offset + arr.nbytes}",
                field="capacity_bytes",
            )
        slot[cursor:offset] = 0
        digest, total = stage_one(slot, offset, arr, engine=engine)
        out.tensors.setdefault(hs.name, TensorSpec(hs.name, dtype_name_of(arr.dtype), tuple(hs.global_shape)))
        out.shards.append(ShardSpec(hs.name, hs.start, hs.stop, offset, arr.nbytes, digest, total))
        cursor = offset + arr.nbytes
        del arr, hs
    out.total_bytes = cursor
    return out


def chunk_specs(slot: np.ndarray, total: int, chunk_bytes: int, *, engine: str = "auto") -> list[ChunkSpec]:
    """Chunk descriptors over slot[0, total) (a separate read pass, parallel when native)."""
    spans = plan_chunks(total, chunk_bytes)
    if engine == "native" or (engine == "auto" and native.available()):
        digests = native.digest_ranges(slot, [o for o, _ in spans], [n for _, n in spans]) if spans else []
    else:
        digests = [xxh3(slot[o : o + n]) for o, n in spans]
    return [ChunkSpec(i, o, n, int(d)) for i, ((o, n), d) in enumerate(zip(spans, digests))]


def _stage_python(
    slot: np.ndarray, shards: Sequence[HostShard], layout: Layout, chunk_bytes: int
) -> tuple[list[ShardSpec], list[ChunkSpec]]:
    specs = []
    cursor = 0
    for s, off in zip(shards, layout.offsets):
        if off > cursor:
            slot[cursor:off] = 0
        src = np.ascontiguousarray(s.data)
        dst = slot[off : off + s.nbytes]
        np.copyto(dst, src.reshape(-1).view(np.uint8))
        specs.append(ShardSpec(s.name, s.start, s.stop, off, s.nbytes, xxh3(dst), float64_sum(src)))
        cursor = off + s.nbytes
    chunks = [
        ChunkSpec(i, off, length, xxh3(slot[off : off + length]))
        for i, (off, length) in enumerate(plan_chunks(layout.total_bytes, chunk_bytes))
    ]
    return specs, chunks
