"""Staging a stream of unknown length: tensors copied into a slot one at a time, in arrival
order, each released before the next; chunk digests of what the shards' own pieces did not
cover come from a second read pass. What `publish_stream` without specs stages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from trainer_agent.stage.staging import HostShard, tensor_spec
from weightsync import native
from weightsync.digests import float64_sum, piecewise_xxh3, xxh3
from weightsync.dtypes import native_code
from weightsync.errors import ResourceExhausted
from weightsync.layout import SHARD_ALIGN_BYTES, align_up, plan_chunks
from weightsync.manifest import ChunkSpec, ShardSpec, TensorSpec


def stage_one(
    slot: np.ndarray, offset: int, arr: np.ndarray, piece_bytes: int, *, engine: str = "auto"
) -> tuple[int, float, dict[int, tuple[int, int]]]:
    """Copies one contiguous array to slot[offset:]; returns (piecewise xxh3, float64 sum,
    {slot offset: (length, xxh3)} of the pieces hashed on the way, for `chunk_specs`)."""
    n = arr.nbytes
    if engine == "native" or (engine == "auto" and native.available()):
        pieces = plan_chunks(n, piece_bytes)
        r = native.stage(
            slot[offset : offset + n],
            n,
            [length for _, length in pieces],
            piece_bytes,
            [(arr, 0, native_code(arr.dtype))],
        )
        known = {offset + o: (length, int(d)) for (o, length), d in zip(pieces, r.chunk_digests)}
        return int(r.span_digests[0]), float(r.span_sums[0]), known
    dst = slot[offset : offset + n]
    np.copyto(dst, arr.reshape(-1).view(np.uint8))
    return piecewise_xxh3(dst, piece_bytes), float64_sum(arr), {}


@dataclass
class StreamStaged:
    """What `stage_stream` wrote: specs of every tensor and shard, and the bytes used."""

    tensors: dict[str, TensorSpec]
    shards: list[ShardSpec]
    total_bytes: int
    known: dict[int, tuple[int, int]] = field(default_factory=dict)  # piece digests: offset -> (length, xxh3)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of each shard, for `chunk_specs`."""
        return [(s.offset, s.nbytes) for s in self.shards]


def stage_stream(
    slot: np.ndarray, shards: Iterable[HostShard], piece_bytes: int, *, engine: str = "auto"
) -> StreamStaged:
    """Stages shards one at a time, in arrival order; each is released before the next.

    Shard digests are piecewise with `piece_bytes` (the part's chunk size).

    Raises:
        ResourceExhausted: the stream outgrows the slot.
    """
    out = StreamStaged({}, [], 0)
    cursor = 0
    for hs in shards:
        if hs.name not in out.tensors:
            out.tensors[hs.name] = tensor_spec(hs.name, hs.data.dtype, hs.global_shape)
        arr = np.ascontiguousarray(hs.data)
        offset = align_up(cursor, SHARD_ALIGN_BYTES)
        if offset + arr.nbytes > slot.nbytes:
            raise ResourceExhausted(
                f"capacity_bytes: the slot holds {slot.nbytes} bytes; {hs.name!r} needs up to {offset + arr.nbytes}",
                field="capacity_bytes",
            )
        slot[cursor:offset] = 0
        digest, total, known = stage_one(slot, offset, arr, piece_bytes, engine=engine)
        out.known.update(known)
        out.shards.append(ShardSpec(hs.name, hs.start, hs.stop, offset, arr.nbytes, digest, total))
        cursor = offset + arr.nbytes
        del arr, hs
    out.total_bytes = cursor
    return out


def stage_streamed(
    slot: np.ndarray, shards: Iterable[HostShard], chunk_bytes: int
) -> tuple[StreamStaged, list[ChunkSpec]]:
    """`stage_stream`, then the chunks the shards' own pieces did not cover, hashed in one
    read pass: what a publish of a stream of unknown length stages."""
    staged = stage_stream(slot, shards, chunk_bytes)
    return staged, chunk_specs(slot, staged.total_bytes, chunk_bytes, staged.spans, staged.known)


def chunk_specs(
    slot: np.ndarray,
    total: int,
    chunk_bytes: int,
    spans: Sequence[tuple[int, int]] = (),
    known: Mapping[int, tuple[int, int]] | None = None,
    *,
    engine: str = "auto",
) -> list[ChunkSpec]:
    """Chunk descriptors over slot[0, total), planned around the shards' (offset, nbytes)
    spans. A chunk that is a piece `stage_one` already hashed (`known`) keeps that digest;
    the rest are hashed in a separate read pass (parallel when native)."""
    planned = plan_chunks(total, chunk_bytes, spans)
    known = known or {}
    todo = [i for i, (o, n) in enumerate(planned) if known.get(o, (-1, 0))[0] != n]
    if engine == "native" or (engine == "auto" and native.available()):
        fresh = native.digest_ranges(slot, [planned[i][0] for i in todo], [planned[i][1] for i in todo]) if todo else []
    else:
        fresh = [xxh3(slot[planned[i][0] : planned[i][0] + planned[i][1]]) for i in todo]
    digests = {o: d for o, (_, d) in known.items()} | {planned[i][0]: int(d) for i, d in zip(todo, fresh)}
    return [ChunkSpec(i, o, n, digests[o]) for i, (o, n) in enumerate(planned)]
