"""The device path's device-to-host copies at the host's rate: each large shard is cut on
its device into blocks, the blocks' copies are issued through a window, and each block is
handed on (to be staged into its place in the arena) as it lands.

Why blocks (measured on a TPU v5e host, docs/performance.md): the runtime allocates the
host buffer each copy lands in. glibc serves an allocation above its mmap threshold (which
rises to at most 32 MiB) with a fresh mapping, and on that host (gVisor, no transparent
hugepages) every fresh page costs a fault through the sandbox: filling a fresh 256 MiB
buffer runs at ~1 GB/s, so whole-shard copies of 256 MiB ran at 1.3 GB/s. A block of a
few MiB lands in heap memory that the blocks before it freed, already faulted in: the same
copies in 8 MiB blocks ran at 14 GB/s.

A version's shards on one device and of one staged dtype run end to end, in order, and are
cut into packs of exactly a block (`PackStream`): a large shard's middle is whole blocks,
its first and last pieces share packs with its neighbours, and small shards are laid end
to end between them; a pack that ends short is padded to its size class (a block, a half,
a quarter, ...). Where a device's shards run together (a trainer of one chip) every host
buffer the copies land in but a version's last is then one size, so a freed one serves a
later copy whole and the heap stays what the window counts (mixed sizes fragment it: on
the v5e host a 0.6b model's 18 MiB blocks and 12 MiB packs kept 19 heaps of 64 MiB for a 1
GiB window, docs/performance.md). Where the pieces end is nothing to the manifest: a shard
split between packs is larger than the layout's `pack_limit`, so its chunks are its own
`chunk_bytes` pieces and its digest is theirs, hashed from the slot. A block of one shard
is one jitted slice (of the few leading rows that hold it, flattened, cast there when
`weight_dtype` differs), compiled once per shard shape and block size; any other pack one
program (through a program, so the caller's array keeps no host copy) that depends on its
arrays' shapes, not on where the stream cut them. A version is then about its bytes over
the block size in copies, not one per tensor. On CPU devices the device memory is host
memory: shards are read in place, never cut.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer_agent import params
from trainer_agent.cut_array import CutArray, PackSlice
from trainer_agent.params import ArrayMeta, check_param, host_array, host_shards, shard_metas, shard_start
from trainer_agent.staging import Block, HostShard
from weightsync.dtypes import dtype_info

# Measured on a TPU v5e host (bench/stage.py --devices 1 --model-size 4b --repeats 2, 1 GiB
# window, 2026-12-06, docs/performance.md): 18 MiB blocks staged at 13.89 and 14.32 GB/s in two
# runs (1.006x the best exact copy-only method of the second run), 24 MiB at 14.09; 12 MiB at
# 8.0-11.1, 9 MiB at 7.1-7.9, 6 MiB at 6.1, whole shards at 1.45-1.78. Below glibc's largest
# mmap threshold (32 MiB), so the host buffers the copies land in are reused heap memory.
DEFAULT_BLOCK_BYTES = 18 << 20


def block_size(block_bytes: int, chunk_bytes: int) -> int:
    """The bytes of the blocks large shards are cut into: `block_bytes` rounded to the
    nearest multiple of `chunk_bytes` (at least one chunk); 0 when `block_bytes` is 0
    (whole shards)."""
    if block_bytes <= 0:
        return 0
    return max(1, round(block_bytes / chunk_bytes)) * chunk_bytes


def block_elements(size: int, itemsize: int, block_bytes: int) -> int:
    """Elements in each block of a tensor of `size` elements cut into `block_bytes` blocks
    (the last one holds what is left): all of them (at least one) when the tensor is no
    larger than a block or a block is not whole elements."""
    if not block_bytes or size * itemsize <= block_bytes or block_bytes % itemsize:
        return max(size, 1)
    return block_bytes // itemsize


def cuts(values: Iterable[Any]) -> bool:
    """Whether any of these values has a shard on a device whose memory is not host memory
    (its large shards are cut into blocks), or was cut already (a `CutArray`)."""
    values = list(values)
    return any(isinstance(v, CutArray) for v in values) or any(
        getattr(s.device, "platform", "cpu") not in params.HOST_MEMORY_PLATFORMS
        for v in values
        if hasattr(v, "addressable_shards")
        for s in v.addressable_shards
    )


class Window:
    """Bytes of blocks whose copies were issued and that are not yet staged (with
    `until_staged` False: not yet landed), against `limit_bytes`; the staging side reports
    through `submitted` and `staged` (`staging.StagingWindow`). With `room`, each block
    counts as `room(its bytes)`: the host memory its buffer takes (`host_heap.heap_room`,
    where the buffers come from a thread's arena), so that the memory the copies hold,
    and glibc keeps once they are freed, stays within `limit_bytes`."""

    def __init__(
        self, limit_bytes: int, *, until_staged: bool = True, room: Callable[[int], int] | None = None
    ) -> None:
        self.limit_bytes = limit_bytes
        self._until_staged = until_staged
        self._room = room or (lambda nbytes: nbytes)
        self._used = 0
        self._pending = 0  # handed to staging threads, not yet staged
        self._closed = False
        self._changed = threading.Condition()

    @property
    def closed(self) -> bool:
        """Whether the staging side stopped taking blocks (`close`)."""
        return self._closed

    def close(self) -> None:
        """The staging side takes no more blocks: a copier waiting for room stops waiting."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def admits(self, nbytes: int, *, inflight: bool) -> bool:
        """Whether a copy of `nbytes` may be issued now: it fits, or nothing is in flight
        and nothing being staged will free room (the blocks held are the consumer's)."""
        nbytes = self._room(nbytes)
        with self._changed:
            return self._used + nbytes <= self.limit_bytes or (not inflight and not self._pending)

    def wait_for_room(self, nbytes: int) -> None:
        """Waits until `nbytes` fit, no staging is pending, or the window is closed."""
        nbytes = self._room(nbytes)
        with self._changed:
            self._changed.wait_for(lambda: self._used + nbytes <= self.limit_bytes or not self._pending or self._closed)

    def issued(self, nbytes: int) -> None:
        with self._changed:
            self._used += self._room(nbytes)

    def landed(self, nbytes: int, pad: int = 0) -> None:
        """A block of `nbytes` landed, with `pad` bytes of its pack's padding (issued with
        it, never staged: counted out here)."""
        if not self._until_staged or pad:
            with self._changed:
                self._used -= self._room(pad if self._until_staged else nbytes + pad)
                self._changed.notify_all()

    def submitted(self, nbytes: int) -> None:
        with self._changed:
            self._pending += nbytes

    def staged(self, nbytes: int) -> None:
        with self._changed:
            self._pending -= nbytes
            if self._until_staged:
                self._used -= self._room(nbytes)
            self._changed.notify_all()


@dataclass(frozen=True)
class _Job:
    """A block to bring over: bytes [offset, offset + nbytes) of `shard`; `make` returns a
    device array (its copy not yet issued) or host bytes."""

    shard: HostShard
    offset: int
    nbytes: int
    make: Callable[[], Any]
    pad: int = 0  # bytes of padding its pack's buffer holds after it (the last piece of a padded pack)


def device_blocks(
    items: Iterable[tuple[str, Any]], weight_dtype: str, window: Window, block_bytes: int
) -> Iterator[Block]:
    """Blocks of the replica-0 shards of `items`, in order: large shards on accelerators cut
    into `block_bytes` blocks (a multiple of the chunk size: `block_size`), smaller ones and
    host values whole. Copies are issued while `window` admits them, each block is yielded
    once its bytes are in host memory, and items are pulled lazily (a tensor is cast and cut
    as the window reaches it)."""
    jobs = _jobs(items, weight_dtype, block_bytes)
    inflight: deque[tuple[_Job, Any]] = deque()
    job = next(jobs, None)
    while not window.closed:
        while job is not None and window.admits(job.nbytes, inflight=bool(inflight)):
            data = job.make()
            if not isinstance(data, np.ndarray):
                data.copy_to_host_async()
            window.issued(job.nbytes + job.pad)
            inflight.append((job, data))
            del data
            job = next(jobs, None)
        if inflight:
            done, data = inflight.popleft()
            host = host_array(done.shard.name, data).reshape(-1)  # waits for this block's copy
            del data
            window.landed(done.nbytes, done.pad)
            yield Block(done.shard, done.offset, host)
            del host, done
        elif job is None:
            return
        else:
            window.wait_for_room(job.nbytes)


def warm(items: Iterable[tuple[str, Any]], weight_dtype: str, block_bytes: int) -> None:
    """Runs once every device program a publish of `items` dispatches (its blocks' slices
    and its packs, each compiled at its first run), one at a time, copying nothing to host:
    what a trainer's first publish compiles, done ahead (a bench measures after it).
    Snapshots (`CutArray`) are left as they are: their program is the snapshot's."""
    live = ((name, value) for name, value in items if not isinstance(value, CutArray))
    for job in _jobs(live, weight_dtype, block_bytes):
        data = job.make()
        data = getattr(data, "pack", data)  # a PackSlice: its pack
        if hasattr(data, "block_until_ready"):
            data.block_until_ready()
        del data


def _jobs(items: Iterable[tuple[str, Any]], weight_dtype: str, block_bytes: int) -> Iterator[_Job]:
    stream = PackStream(block_bytes)

    def packed(packs: Iterable[list[Piece]]) -> Iterator[_Job]:
        for pieces in packs:
            yield from _pack_jobs(pieces, block_bytes)

    for name, value in items:
        check_param(name, value)
        if isinstance(value, CutArray):  # cut by the snapshot's program: only the copies to issue
            yield from packed([stream.close()])
            (shard,) = shard_metas(name, value)
            if not value.nbytes:
                yield _Job(shard, 0, 0, lambda dtype=value.dtype: np.empty(0, dtype))
            for offset, nbytes, block in value.take(name):
                yield _Job(shard, offset, nbytes, lambda block=block: block)
            continue
        if not hasattr(value, "addressable_shards"):
            yield from packed([stream.close()])
            for s in host_shards(name, value, weight_dtype):
                data = np.ascontiguousarray(s.data)
                yield _Job(s, 0, data.nbytes, lambda data=data: data)
            continue
        dtype = dtype_info(weight_dtype).numpy if weight_dtype else np.dtype(value.dtype)
        for s in value.addressable_shards:
            if s.replica_id == 0:
                meta = ArrayMeta(tuple(s.data.shape), dtype)
                shard = HostShard(name, meta, tuple(value.shape), shard_start(s.index, value.ndim))
                platform = getattr(s.device, "platform", "cpu")
                if platform not in params.HOST_MEMORY_PLATFORMS and block_bytes:
                    entry = (shard, s.data)
                    yield from packed(stream.add((s.device, dtype), entry, math.prod(meta.shape), dtype.itemsize))
                    continue
                yield from packed([stream.close()])
                yield from _cut(shard, s.data, platform, block_bytes)
    yield from packed([stream.close()])


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + count) of `entry` (flattened, cast to its staged dtype), in a pack."""

    entry: Any
    start: int
    count: int


class PackStream:
    """The rule both the snapshot and a publish of live arrays cut and pack by. The entries
    of one key (their device and staged dtype) run end to end, in order, and are cut into
    packs of `block_bytes`: an entry larger than a sixteenth of a block is split where a
    pack fills (the layout gives it chunks of its own, `layout.pack_limit`, so where its
    pieces end is nothing to its digests), a smaller one that does not fit ends the pack,
    and so do another key and anything not packed (`close`). A pack that ends short is
    padded on its device to its size class (`pack_elements`): every host buffer the copies
    land in is then one of a few sizes that tile a block's (one size where a model's
    tensors share a device), and glibc hands each one freed to a later copy whole. Mixed sizes
    fragment the heap the copies take past what the window counts (a v5e host, 0.6b
    shapes: 18 MiB blocks beside 12 MiB packs kept 19 heaps of 64 MiB for a 1 GiB window,
    docs/performance.md)."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._pieces: list[Piece] = []
        self._key: Any = None
        self._bytes = 0

    def add(self, key: Any, entry: Any, size: int, itemsize: int) -> list[list[Piece]]:
        """Adds the `size` elements of `entry`; returns the packs it filled or ended, in
        order. An empty entry joins the open pack (or makes a pack of no bytes alone)."""
        packs = []
        if self._pieces and key != self._key:
            packs.append(self.close())
        self._key = key
        if not size:
            self._pieces.append(Piece(entry, 0, 0))
            return packs if self._bytes else [*packs, self.close()]
        split = size * itemsize > self.block_bytes // 16
        start = 0
        while start < size:
            room = (self.block_bytes - self._bytes) // itemsize
            take = size - start
            if take > room:
                if self._bytes and (not split or not room):
                    packs.append(self.close())
                    continue
                take = max(room, 1)
            self._pieces.append(Piece(entry, start, take))
            self._bytes += take * itemsize
            start += take
            if self._bytes >= self.block_bytes:
                packs.append(self.close())
        return packs

    def close(self) -> list[Piece]:
        """Ends the open pack; returns its pieces (empty if none)."""
        pieces, self._pieces, self._bytes = self._pieces, [], 0
        return pieces


def pack_elements(pieces: Sequence[Piece], itemsize: int, block_bytes: int) -> int:
    """The elements of the pack of `pieces`: theirs where they fill a block (or an element
    is larger than one), else padded to the block's size class: the block's elements halved
    as often as they still hold the pieces (a block, a half, a quarter, ...); none for empty
    entries alone (no copy). So a stream of one device and dtype lands in buffers of one
    size but its last, and shards of several devices in turn (each ends its pack) in a
    few sizes that tile a block's, at most twice their bytes."""
    filled = sum(p.count for p in pieces)
    elements = block_bytes // itemsize
    if not filled or filled >= elements:
        return filled
    while elements > 1 and -(-elements // 2) >= filled:
        elements = -(-elements // 2)
    return elements


def _pack_jobs(pieces: list[Piece], block_bytes: int) -> Iterator[_Job]:
    """The jobs of one pack of pieces of (shard, device array), one per piece, in order: a
    block of one array is its slice (`cut_blocks`' program), any other pack one program
    that lays its pieces end to end, run when the first one's copy is issued."""
    if not pieces:
        return
    dtype = pieces[0].entry[0].data.dtype
    item = dtype.itemsize
    elements = pack_elements(pieces, item, block_bytes)
    if not elements:
        for p in pieces:
            yield _Job(p.entry[0], 0, 0, lambda: np.empty(0, dtype))
        return
    if len(pieces) == 1 and pieces[0].count == elements and pieces[0].entry[1].ndim:
        (p,) = pieces
        shard, x = p.entry
        yield _Job(shard, p.start * item, p.count * item, functools.partial(_rows_block, x, p.start, p.count, dtype))
        return
    pack = _LazyPack(pieces, dtype, elements, block_bytes // item)
    at = 0
    for i, p in enumerate(pieces):
        pad = (elements - at - p.count) * item if i == len(pieces) - 1 else 0
        yield _Job(p.entry[0], p.start * item, p.count * item, functools.partial(pack.slice, at, p.count), pad)
        at += p.count


class _LazyPack:
    """A pack's device program, dispatched when its first piece's copy is issued.

    Each piece is read as a window of a fixed size (a block's elements, or the whole array
    where that is smaller) from its array's start (its first piece) or end (its last), and
    placed at a position passed in: where the piece belongs, the rest of the window outside
    the pack's other pieces (a stream's pack splits an array only as its last piece, and
    begins with the rest). The program then depends on the arrays' shapes, not on where the
    stream cut them, so the packs of a model's layers, alike but for that, share one
    compiled program instead of one each (a 4b model: 201 packs, one program each with the
    cuts compiled in). A pack cut otherwise gets its cuts compiled in (`pack_pieces`)."""

    def __init__(self, pieces: Sequence[Piece], dtype: np.dtype, elements: int, block_elements: int) -> None:
        self._dtype = dtype
        self._elements = elements
        arrays, reads, at = [], [], []
        pos, last = 0, max((i for i, p in enumerate(pieces) if p.count), default=0)
        for i, p in enumerate(pieces):
            x = p.entry[1]
            size = math.prod(x.shape)
            window = min(block_elements, size)
            if p.count and p.start == 0 and p.count <= window and (i == last or p.count == window):
                arrays.append(x)
                reads.append((0, window))
                at.append(pos)
            elif p.count and p.start + p.count == size and p.count <= window and not pos:
                arrays.append(x)
                reads.append((size - window, window))
                at.append(pos + p.count - window)
            elif p.count:
                arrays, reads, at = [x for x in (q.entry[1] for q in pieces)], None, None
                break
            pos += p.count
        self._arrays: tuple[Any, ...] | None = tuple(arrays)
        self._reads = tuple(reads) if reads is not None else None
        self._at = np.asarray(at, np.int32) if at is not None else None
        self._spans = tuple((p.start, p.count) for p in pieces)
        self._pack: Any = None

    def slice(self, start: int, count: int) -> PackSlice:
        if self._pack is None:
            assert self._arrays is not None
            if self._reads is not None:
                self._pack = slicers()[2](self._arrays, self._reads, self._dtype, self._elements, self._at)
            else:
                self._pack = slicers()[3](self._arrays, self._spans, self._dtype, self._elements)
            self._arrays = None
        return PackSlice(self._pack, start, count)


def _cut(shard: HostShard, x: Any, platform: str, block_bytes: int) -> Iterator[_Job]:
    """The jobs of one device shard `x`: read in place on a host-memory platform, else cut
    into blocks (whole when it is no larger than one)."""
    dtype, n = shard.data.dtype, shard.nbytes
    if n == 0:
        yield _Job(shard, 0, 0, lambda: np.empty(0, dtype))
    elif platform in params.HOST_MEMORY_PLATFORMS:
        yield _Job(shard, 0, n, lambda: x if x.dtype == dtype else x.astype(dtype))
    else:
        yield from (_Job(shard, offset, nbytes, make) for offset, nbytes, make in cut_blocks(x, dtype, block_bytes))


def cut_blocks(x: Any, dtype: np.dtype, block_bytes: int) -> list[tuple[int, int, Callable[[], Any]]]:
    """(byte offset, bytes, cut) of each block of device array `x` alone, flattened and
    cast to `dtype`: `block_bytes` each but the last (one block when `x` is no larger, or
    `block_bytes` is not whole elements); `cut()` dispatches the block's slice on the
    device (`_rows_block`). A publish cuts a version's arrays as one stream
    (`PackStream`); this is one array's blocks (whole shards when `block_bytes` is 0, a
    bench's own slices)."""
    item = dtype.itemsize
    size = math.prod(x.shape)
    per = block_elements(size, item, block_bytes)
    if per >= size:
        return [(0, size * item, lambda: slicers()[1](x, 0, dtype))]
    count, rest = divmod(size, per)
    out = [(j * block_bytes, block_bytes, functools.partial(_rows_block, x, j * per, per, dtype)) for j in range(count)]
    if rest:
        out.append((count * block_bytes, rest * item, functools.partial(slicers()[1], x, count * per, dtype)))
    return out


def _rows_block(x: Any, start: int, per: int, dtype: np.dtype) -> Any:
    """Elements [start, start + per) of device array `x` flattened, cast to `dtype`: a
    block program, compiled once per shape and block size, that reads only the few leading
    rows holding them, so the device relays out about a block's bytes, never the whole
    shard."""
    row = math.prod(x.shape) // x.shape[0]
    rows = min(x.shape[0], -(-per // row) + 1)  # the rows any `per` elements lie in
    first = min(start // row, x.shape[0] - rows)
    return slicers()[0](x, first, start - first * row, rows, per, dtype)


@functools.cache
def slicers() -> tuple[Callable[..., Any], ...]:
    """Jitted, compiled once per shard shape and block size: (block(x, first, offset, rows,
    per, dtype): elements [offset, offset + per) of x's leading rows [first, first + rows)
    flattened, cast; tail(x, start, dtype): x flattened from element `start`, cast, read
    from the rows that hold it; place(xs, reads, dtype, elements, at): `place_pieces`;
    pack(xs, spans, dtype, elements): `pack_pieces`)."""
    import jax
    from jax import lax

    def block(x: Any, first: Any, offset: Any, rows: int, per: int, dtype: Any) -> Any:
        held = lax.dynamic_slice_in_dim(x, first, rows).reshape(-1)
        return lax.dynamic_slice_in_dim(held, offset, per).astype(dtype)

    def tail(x: Any, start: int, dtype: Any) -> Any:
        if x.ndim == 0:
            return x.reshape(-1).astype(dtype)
        row = x.size // x.shape[0] if x.shape[0] else 1
        first = start // row
        return x[first:].reshape(-1)[start - first * row :].astype(dtype)

    return (
        jax.jit(block, static_argnums=(3, 4, 5)),
        jax.jit(tail, static_argnums=(1, 2)),
        jax.jit(place_pieces, static_argnums=(1, 2, 3)),
        jax.jit(pack_pieces, static_argnums=(1, 2, 3)),
    )


def place_pieces(xs: Sequence[Any], reads: Sequence[tuple[int, int]], dtype: Any, elements: int, at: Any) -> Any:
    """A pack of `elements`, each array of `xs` flattened, its window `reads` (first
    element, elements) read and cast to `dtype` and written from position `at[i]` (traced:
    the one program serves wherever the pieces begin), in order; what falls outside the
    pack is cut off (`_LazyPack` places the windows so that only its pieces stay)."""
    import jax.numpy as jnp
    from jax import lax

    margin = max(w for _, w in reads)
    out = jnp.zeros(elements + 2 * margin, dtype)
    for i, (x, (lo, window)) in enumerate(zip(xs, reads, strict=True)):
        out = lax.dynamic_update_slice(out, _piece(x, lo, window).astype(dtype), (at[i] + margin,))
    return out[margin : margin + elements]


def pack_pieces(xs: Sequence[Any], spans: Sequence[tuple[int, int]], dtype: Any, elements: int) -> Any:
    """Elements [start, start + count) of each array of `xs` (its span) flattened, cast to
    `dtype` and laid end to end, zeros after them up to `elements`: a pack, traced inside a
    device program (the live arrays' own, `slicers`, or the snapshot's). Each piece is read
    from the rows that hold it. In a buffer of its own (`jnp.copy`): a pack of one array
    already flat and of its dtype would otherwise be that array, so its host copy would stay
    with the caller's array, and a snapshot's pack would be the buffer the caller's next
    donating step deletes."""
    import jax.numpy as jnp

    parts = [_piece(x, start, count).astype(dtype) for x, (start, count) in zip(xs, spans, strict=True)]
    filled = sum(count for _, count in spans)
    if elements > filled:
        parts.append(jnp.zeros(elements - filled, dtype))
    return jnp.copy(jnp.concatenate(parts))


def _piece(x: Any, start: int, count: int) -> Any:
    """Elements [start, start + count) of `x` flattened (traced), from the rows holding them."""
    if x.ndim == 0 or not count:
        return x.reshape(-1)[start : start + count]
    row = x.size // x.shape[0]
    first, last = start // row, -(-(start + count) // row)
    return x[first:last].reshape(-1)[start - first * row : start - first * row + count]
