"""Staging: host shards -> arena slot, with per-shard and per-chunk xxh3-64 and float64 sums.

Two engines with identical results: `native` (the C++ shim's fused, multithreaded copy +
digest pass) and `python` (numpy copy, then xxhash over the slot), the fallback when the
shim is not built. The JAX FFI path lives in `trainer_agent.ffi_staging`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightsync import native
from weightsync.digests import xxh3
from weightsync.dtypes import dtype_info, dtype_name_of
from weightsync.layout import place_shards, plan_chunks
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


def _sum64(a: np.ndarray) -> float:
    if a.dtype == np.bool_:
        return float(np.count_nonzero(a))
    return float(np.sum(a, dtype=np.float64))


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
            sources.append((arr, off, dtype_info(dtype_name_of(arr.dtype)).proto))
        result = native.stage(slot, layout.total_bytes, chunk_bytes, sources, threads=threads)
        return specs_from_digests(layout, result.span_digests, result.span_sums, result.chunk_digests, chunk_bytes)
    return _stage_python(slot, shards, layout, chunk_bytes)


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
        specs.append(ShardSpec(s.name, s.start, s.stop, off, s.nbytes, xxh3(dst), _sum64(src)))
        cursor = off + s.nbytes
    chunks = [
        ChunkSpec(i, off, length, xxh3(slot[off : off + length]))
        for i, (off, length) in enumerate(plan_chunks(layout.total_bytes, chunk_bytes))
    ]
    return specs, chunks
