"""Staging: host shards -> their places in an arena slot as a `Layout` planned them (whole,
or arriving in blocks), with per-chunk xxh3-64, per-shard piecewise xxh3-64
(`digests.piecewise_xxh3`, pieces of the part's chunk size) and float64 sums.

Two engines with identical results: `native` (the C++ shim's fused, multithreaded copy +
digest pass) and `python` (numpy copy, then xxhash over the slot), the fallback when the
shim is not built. The JAX FFI path lives in `trainer_agent.stage.ffi_staging`, a stream of
unknown length (no layout planned) in `trainer_agent.stage.stream_staging`.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from weightsync import native
from weightsync.digests import combine_pieces, float64_sum, piecewise_xxh3, xxh3
from weightsync.dtypes import dtype_name_of, native_code
from weightsync.errors import InternalError, InvalidArgument
from weightsync.layout import place_shards, plan_chunks
from weightsync.manifest import ChunkSpec, ShardSpec, TensorSpec
from weightsync.validation import check_tensor_name


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

    def chunk_plan(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """The chunks of this layout: large shards' pieces each a chunk of their own."""
        return plan_chunks(self.total_bytes, chunk_bytes, list(zip(self.offsets, self.nbytes)))


def tensor_spec(name: Any, dtype: Any, shape: Sequence[int]) -> TensorSpec:
    """A tensor's spec, or InvalidArgument naming it: a name or dtype the coordinator would
    refuse is refused before its bytes are staged (after, a name that is not a string
    fails as INTERNAL once the part is staged, "Exception iterating requests!", and a
    dtype error does not say which of a model's tensors it is)."""
    if not isinstance(name, str):
        raise InvalidArgument(f"tensor names are strings, got {type(name).__name__} {name!r:.60}", field="params")
    field = f"params[{name!r:.200}]"
    check_tensor_name(name, field)
    return TensorSpec(name, dtype_name_of(dtype, field), tuple(shape))


def plan_layout(shards: Sequence[HostShard]) -> Layout:
    """Tensor specs (first shard of each name) and aligned shard offsets."""
    tensors: dict[str, TensorSpec] = {}
    for s in shards:
        if s.name not in tensors:
            tensors[s.name] = tensor_spec(s.name, s.data.dtype, s.global_shape)
    offsets, total = place_shards([s.nbytes for s in shards])
    return Layout(
        tensors=tuple(tensors.values()),
        boxes=tuple((s.name, s.start, s.stop) for s in shards),
        nbytes=tuple(s.nbytes for s in shards),
        offsets=tuple(offsets),
        total_bytes=total,
    )


def specs_from_digests(
    layout: Layout,
    digests: Sequence[int],
    sums: Sequence[float],
    chunk_digests: Sequence[int],
    chunks: Sequence[tuple[int, int]],
) -> tuple[list[ShardSpec], list[ChunkSpec]]:
    """Shard and chunk specs from a native pass's outputs (shards in layout order, chunks
    as planned by `Layout.chunk_plan`)."""
    specs = [
        ShardSpec(name, start, stop, off, n, int(d), float(total))
        for (name, start, stop), off, n, d, total in zip(layout.boxes, layout.offsets, layout.nbytes, digests, sums)
    ]
    return specs, [ChunkSpec(i, off, length, int(chunk_digests[i])) for i, (off, length) in enumerate(chunks)]


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
    return _stage_fused(slot, shards, layout, layout.chunk_plan(chunk_bytes), chunk_bytes, engine, threads)[:2]


def native_sources(shards: Sequence[HostShard], layout: Layout) -> list[tuple[np.ndarray, int, int]]:
    """(C-contiguous array, slot offset, dtype code) per shard: `native.stage`'s sources."""
    sources = []
    for s, off in zip(shards, layout.offsets):
        arr = np.ascontiguousarray(s.data)
        sources.append((arr, off, native_code(arr.dtype)))
    return sources


@dataclass(frozen=True)
class DeltaTarget:
    """Encode each staged chunk against `base` (the previous version, same layout, in
    another slot): encodings pass through `scratch` (at least `cap` x the bytes staged
    at once; keep it between publishes, fresh pages cost more than the encoding), and a
    chunk whose encoding would pass `cap` x its length goes raw."""

    base: np.ndarray
    scratch: np.ndarray
    cap: float


def _stage_fused(
    slot: np.ndarray,
    shards: Sequence[HostShard],
    layout: Layout,
    chunks: Sequence[tuple[int, int]],
    chunk_bytes: int,
    engine: str,
    threads: int,
    delta: DeltaTarget | None = None,
) -> tuple[list[ShardSpec], list[ChunkSpec], list[bytes | None]]:
    """Shard and chunk specs, and with `delta` each chunk's encoding (None: raw)."""
    if delta is not None or engine == "native" or (engine == "auto" and native.available()):
        lengths = [n for _, n in chunks]
        sources = native_sources(shards, layout)
        how: dict = {"threads": threads}
        if delta is not None:
            how.update(base=delta.base, delta_cap=delta.cap, delta_out=delta.scratch)
        result = native.stage(slot, layout.total_bytes, lengths, chunk_bytes, sources, **how)
        specs, cspecs = specs_from_digests(layout, result.span_digests, result.span_sums, result.chunk_digests, chunks)
        return specs, cspecs, list(result.chunk_deltas or [])
    return (*_stage_python(slot, shards, layout, chunks, chunk_bytes), [])


def stage_shards_delta(
    slot: np.ndarray,
    shards: Sequence[HostShard],
    layout: Layout,
    chunk_bytes: int,
    delta: DeltaTarget,
    *,
    threads: int = 0,
) -> tuple[list[ShardSpec], list[ChunkSpec], list[bytes | None]]:
    """`stage_shards` (native) that also encodes each chunk against `delta.base` in the
    same pass: (shard specs, chunk specs, per chunk its encoding or None)."""
    return _stage_fused(slot, shards, layout, layout.chunk_plan(chunk_bytes), chunk_bytes, "native", threads, delta)


def stage_batched(
    slot: np.ndarray,
    layout: Layout,
    shards: Iterable[HostShard],
    chunk_bytes: int,
    *,
    batch_bytes: int,
    engine: str = "auto",
    threads: int = 0,
) -> tuple[list[ShardSpec], list[ChunkSpec]]:
    """`stage_shards` for shards that arrive one by one (the device path): they are staged
    in batches of about `batch_bytes`, each one fused pass over a run of whole chunks, and
    released before the next batch arrives. Same bytes and specs as `stage_shards`.

    Shards must come in layout order (InternalError otherwise).
    """
    specs, chunk_specs_, _ = stage_batched_delta(
        slot, layout, shards, chunk_bytes, None, batch_bytes=batch_bytes, engine=engine, threads=threads
    )
    return specs, chunk_specs_


def stage_batched_delta(
    slot: np.ndarray,
    layout: Layout,
    shards: Iterable[HostShard],
    chunk_bytes: int,
    delta: DeltaTarget | None,
    *,
    batch_bytes: int,
    engine: str = "auto",
    threads: int = 0,
) -> tuple[list[ShardSpec], list[ChunkSpec], list[bytes | None]]:
    """`stage_batched`, each batch's chunks also encoded against the same bytes of
    `delta.base` (when given)."""
    blocks = (Block(s, 0, s.data) for s in shards)
    return stage_blocks(
        slot, layout, blocks, chunk_bytes, delta, batch_bytes=batch_bytes, engine=engine, threads=threads
    )


@dataclass(frozen=True)
class Block:
    """Bytes [offset, offset + data.nbytes) of one shard, in host memory: `shard` describes
    the shard (its data may be an ArrayMeta), `data` holds them in the shard's dtype (C
    order). A shard staged whole is one block at offset 0."""

    shard: HostShard
    offset: int
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class StagingWindow(Protocol):
    """Told of the bytes of each run of blocks handed to a staging thread, and again once
    they are staged (and may be freed): what bounds the blocks landed ahead of staging."""

    def submitted(self, nbytes: int) -> None: ...

    def staged(self, nbytes: int) -> None: ...


@dataclass(frozen=True)
class _Unit:
    """A run of whole chunks [lo, hi) of the slot and the blocks that land in it: (their
    shard's index in the layout, the block, its bytes)."""

    lo: int
    hi: int
    blocks: list[tuple[int, Block, int]]
    nbytes: int


def stage_blocks(
    slot: np.ndarray,
    layout: Layout,
    blocks: Iterable[Block],
    chunk_bytes: int,
    delta: DeltaTarget | None = None,
    *,
    batch_bytes: int,
    engine: str = "auto",
    threads: int = 0,
    pool: Executor | None = None,
    window: StagingWindow | None = None,
) -> tuple[list[ShardSpec], list[ChunkSpec], list[bytes | None]]:
    """Stages shards that arrive in blocks (the device path) into their places in `slot`:
    (shard specs, chunk specs, per chunk its encoding against `delta.base` when given).
    The bytes, specs and encodings are those of `stage_shards` / `stage_shards_delta` of
    the whole shards, float64 sums aside (a shard in several blocks sums block by block).

    Blocks are gathered into runs of whole chunks of about `batch_bytes`, each staged by
    one fused pass (`threads` threads) as soon as its last block arrives: in this thread,
    or with `pool` on one of its threads while the next blocks land (`window` is told of
    each run handed over and of each staged). A shard cut into several blocks must have
    chunks of its own (larger than `pack_limit(chunk_bytes)`): its digest is then made of
    its chunks' digests.

    Blocks must come in layout order, each shard's in byte order and covering it
    (InternalError otherwise).
    """
    chunks = layout.chunk_plan(chunk_bytes)
    starts = [off for off, _ in chunks] + [layout.total_bytes]
    scratch_at = None
    if delta is not None:  # each run's encodings go to its own region of the scratch buffer
        caps = (np.asarray([n for _, n in chunks], np.uint64) * delta.cap).astype(np.uint64)
        scratch_at = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
    staged: list[Future | tuple] = []

    def stage(unit: _Unit) -> tuple:
        try:
            return _stage_unit(slot, layout, unit, chunks, starts, chunk_bytes, engine, threads, delta, scratch_at)
        finally:
            if window is not None:
                window.staged(unit.nbytes)

    try:
        _submit_runs(blocks, layout, starts, batch_bytes, window, pool, stage, staged)
    finally:  # the pool's threads may outlive this call: none still writes into the slot after it
        futures.wait([r for r in staged if isinstance(r, Future)])
    return _specs(layout, chunks, chunk_bytes, [r.result() if isinstance(r, Future) else r for r in staged])


def _submit_runs(
    blocks: Iterable[Block],
    layout: Layout,
    starts: Sequence[int],
    batch_bytes: int,
    window: StagingWindow | None,
    pool: Executor | None,
    stage: Callable[[_Unit], tuple],
    staged: list[Future | tuple],
) -> None:
    """Gathers `blocks` into runs of whole chunks and stages each (`stage`, on `pool` when
    given), appending its result or future to `staged`; InternalError where the blocks do
    not follow the layout."""
    unit: list[tuple[int, Block, int]] = []
    lo, held, i, filled, last = 0, 0, -1, 0, len(layout.offsets) - 1
    for b in blocks:
        n = b.nbytes
        if i < 0 or filled == layout.nbytes[i]:  # the next shard begins
            i, filled = i + 1, 0
            box = (b.shard.name, tuple(b.shard.start), tuple(b.shard.stop), b.shard.nbytes)
            if i > last or b.offset != 0 or box != (*layout.boxes[i], layout.nbytes[i]):
                raise InternalError(
                    f"shard {i} ({b.shard.name!r} at {b.shard.start}) is not the one the layout planned there"
                )
        elif b.offset != filled or b.shard.name != layout.boxes[i][0] or filled + n > layout.nbytes[i]:
            raise InternalError(
                f"a block of {n} bytes at byte {b.offset} of {b.shard.name!r} does not continue shard {i} "
                f"({layout.boxes[i][0]!r}, {filled} of {layout.nbytes[i]} bytes staged)"
            )
        unit.append((i, b, n))
        held += n
        filled += n
        end = layout.offsets[i] + filled
        whole = filled == layout.nbytes[i]
        nxt = (layout.offsets[i + 1] if i < last else layout.total_bytes) if whole else end
        k = bisect.bisect_left(starts, end)
        if k < len(starts) and starts[k] <= nxt and (held >= batch_bytes or (whole and i == last)):
            run = _Unit(lo, starts[k], unit, held)
            if window is not None:
                window.submitted(run.nbytes)
            staged.append(pool.submit(stage, run) if pool is not None else stage(run))
            unit, held, lo = [], 0, starts[k]
            del run
        del b
    if unit or lo != layout.total_bytes or i != last:
        arrived = i + (i >= 0 and filled == layout.nbytes[i])
        raise InternalError(f"the stream ended after {arrived} of {len(layout.offsets)} planned shards")


def _stage_unit(
    slot: np.ndarray,
    layout: Layout,
    unit: _Unit,
    chunks: Sequence[tuple[int, int]],
    starts: Sequence[int],
    chunk_bytes: int,
    engine: str,
    threads: int,
    delta: DeltaTarget | None,
    scratch_at: np.ndarray | None,
) -> tuple[list[tuple[int, int, int, float]], list[ChunkSpec], list[bytes | None]]:
    """One fused pass over a run of whole chunks: ((shard index, block offset, digest,
    sum) per block, the run's chunk specs, their encodings)."""
    lo, hi = unit.lo, unit.hi
    first, k = bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)
    offsets = tuple(layout.offsets[i] + b.offset - lo for i, b, _ in unit.blocks)
    sub = Layout(
        tensors=(),
        boxes=tuple(layout.boxes[i] for i, _, _ in unit.blocks),
        nbytes=tuple(n for _, _, n in unit.blocks),
        offsets=offsets,
        total_bytes=hi - lo,
    )
    view = slot[lo:hi]
    view[offsets[-1] + sub.nbytes[-1] :] = 0  # padding up to the chunk boundary (the next shard's alignment)
    sub_delta = None
    if delta is not None and scratch_at is not None:
        sub_delta = dataclasses.replace(delta, base=delta.base[lo:hi], scratch=delta.scratch[scratch_at[first] :])
    shards = [HostShard(b.shard.name, b.data, (), ()) for _, b, _ in unit.blocks]
    sub_chunks = [(off - lo, n) for off, n in chunks[first:k]]
    specs, cspecs, encs = _stage_fused(view, shards, sub, sub_chunks, chunk_bytes, engine, threads, sub_delta)
    spans = [(i, b.offset, s.xxh3, s.sum) for (i, b, _), s in zip(unit.blocks, specs)]
    return spans, [ChunkSpec(first + c.index, c.offset + lo, c.length, c.xxh3) for c in cspecs], encs


def _specs(
    layout: Layout, chunks: Sequence[tuple[int, int]], chunk_bytes: int, runs: Sequence[tuple]
) -> tuple[list[ShardSpec], list[ChunkSpec], list[bytes | None]]:
    """Shard specs (a shard in several blocks: its chunks' digests combined, its blocks'
    sums added), chunk specs and encodings of the staged runs, in order."""
    chunk_specs_ = [c for _, cs, _ in runs for c in cs]
    encodings = [e for _, _, es in runs for e in es]
    blocks: dict[int, list[tuple[int, int, float]]] = {}
    for spans, _, _ in runs:
        for i, offset, digest, total in spans:
            blocks.setdefault(i, []).append((offset, digest, total))
    starts = [off for off, _ in chunks]
    specs = []
    for i, ((name, start, stop), off, n) in enumerate(zip(layout.boxes, layout.offsets, layout.nbytes)):
        parts = blocks[i]
        digest, total = parts[0][1], parts[0][2]
        if len(parts) > 1:
            c0, c1 = bisect.bisect_left(starts, off), bisect.bisect_left(starts, off + n)
            if [chunks[c] for c in range(c0, c1)] != [
                (o, min(chunk_bytes, off + n - o)) for o in range(off, off + n, chunk_bytes)
            ]:
                raise InternalError(
                    f"{name!r} was cut into blocks but its chunks are not its own {chunk_bytes}-byte pieces"
                )
            digest = combine_pieces([c.xxh3 for c in chunk_specs_[c0:c1]])
            total = sum(t for _, _, t in parts)
        specs.append(ShardSpec(name, start, stop, off, n, int(digest), float(total)))
    return specs, chunk_specs_, encodings


def _stage_python(
    slot: np.ndarray, shards: Sequence[HostShard], layout: Layout, chunks: Sequence[tuple[int, int]], piece_bytes: int
) -> tuple[list[ShardSpec], list[ChunkSpec]]:
    specs = []
    cursor = 0
    for s, off in zip(shards, layout.offsets):
        if off > cursor:
            slot[cursor:off] = 0
        src = np.ascontiguousarray(s.data)
        dst = slot[off : off + s.nbytes]
        np.copyto(dst, src.reshape(-1).view(np.uint8))
        specs.append(
            ShardSpec(s.name, s.start, s.stop, off, s.nbytes, piecewise_xxh3(dst, piece_bytes), float64_sum(src))
        )
        cursor = off + s.nbytes
    return specs, [ChunkSpec(i, off, length, xxh3(slot[off : off + length])) for i, (off, length) in enumerate(chunks)]
