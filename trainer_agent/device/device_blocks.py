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

A block is whole chunks of the part (`chunk_bytes` pieces counted from the shard's first
byte), so its chunks' digests are the shard's piece digests and the manifest is the one the
whole shard would give. It is cut by one jitted slice (of the few leading rows that hold
it, flattened), cast there when `weight_dtype` differs, compiled once per shard shape and
block size. Shards no larger than a block are packed: a run of consecutive ones on one
device, of one staged dtype, laid end to end by one program into a pack of at most a
block, copied once (`cut_array.PackSlice`; through a program, so the caller's array keeps
no host copy). A small model's version is then about its bytes over the block size in
copies, not one per tensor. On CPU devices the device memory is host memory: shards are
read in place, never cut.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer_agent.device import host_heap
from trainer_agent.stage import params
from trainer_agent.stage.cut_array import CutArray, PackSlice
from trainer_agent.stage.params import ArrayMeta, check_param, host_array, host_shards, shard_metas, shard_start
from trainer_agent.stage.staging import Block, HostShard
from weightsync.dtypes import dtype_info

# Measured on a TPU v5e host (bench/stage.py --devices 1 --model-size 4b --repeats 2, 1 GiB
# window, 2026-12-06, docs/performance.md): 18 MiB blocks staged at 13.89 and 14.32 GB/s in two
# runs (1.006x the best exact copy-only method of the second run), 24 MiB at 14.09; 12 MiB at
# 8.0-11.1, 9 MiB at 7.1-7.9, 6 MiB at 6.1, whole shards at 1.45-1.78. Below glibc's largest
# mmap threshold (32 MiB), so the host buffers the copies land in are reused heap memory.
DEFAULT_BLOCK_BYTES = 18 << 20

log = logging.getLogger(__name__)


def buffer_address(array: np.ndarray) -> int:
    """The address of `array`'s first byte."""
    return int(array.__array_interface__["data"][0])


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
    and glibc keeps once they are freed, stays within `limit_bytes`. With `heaps`, where
    each block's buffer landed is counted there (`host_heap.BlockHeaps`), and once the
    heaps they lie in hold more than `limit_bytes` (glibc did not place later blocks where
    earlier ones were freed), the excess is taken off what may be in flight: fewer blocks
    live in the same heaps leave more room for the next in them (on a v5e host the heaps
    then grew by a heap or none in a phase of 40 steps, not two: docs/performance.md)."""

    def __init__(
        self,
        limit_bytes: int,
        *,
        until_staged: bool = True,
        room: Callable[[int], int] | None = None,
        heaps: host_heap.BlockHeaps | None = None,
    ) -> None:
        self.limit_bytes = limit_bytes
        self._until_staged = until_staged
        self._room = room or (lambda nbytes: nbytes)
        self._heaps = heaps
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

    @property
    def room_bytes(self) -> int:
        """What may be in flight: `limit_bytes`, less what the blocks' heaps hold past it."""
        if self._heaps is None or not self._heaps.steer:
            return self.limit_bytes
        return self.limit_bytes - max(0, self._heaps.nbytes - self.limit_bytes)

    def admits(self, nbytes: int, *, inflight: bool) -> bool:
        """Whether a copy of `nbytes` may be issued now: it fits, or nothing is in flight
        and nothing being staged will free room (the blocks held are the consumer's)."""
        nbytes = self._room(nbytes)
        with self._changed:
            return self._used + nbytes <= self.room_bytes or (not inflight and not self._pending)

    def wait_for_room(self, nbytes: int) -> None:
        """Waits until `nbytes` fit, no staging is pending, or the window is closed."""
        nbytes = self._room(nbytes)
        with self._changed:
            self._changed.wait_for(lambda: self._used + nbytes <= self.room_bytes or not self._pending or self._closed)

    def issued(self, nbytes: int) -> None:
        with self._changed:
            self._used += self._room(nbytes)

    def landed(self, nbytes: int, buffer: np.ndarray | None = None) -> None:
        """A copy of `nbytes` landed, in `buffer` (its heap counted where the window counts heaps)."""
        if self._heaps is not None and buffer is not None and self._heaps.note(buffer_address(buffer), buffer.nbytes):
            if self._heaps.steer and self._heaps.nbytes > self.limit_bytes:
                log.info(
                    "the device path's host buffers lie in %d heaps (%d MiB), past its %d MiB window: %d MiB may be "
                    "in flight",
                    self._heaps.count,
                    self._heaps.nbytes >> 20,
                    self.limit_bytes >> 20,
                    max(0, self.room_bytes) >> 20,
                )
        if not self._until_staged:
            with self._changed:
                self._used -= self._room(nbytes)

    def submitted(self, nbytes: int) -> None:
        with self._changed:
            self._pending += nbytes

    def staged(self, nbytes: int) -> None:
        with self._changed:
            self._pending -= nbytes
            if self._until_staged:
                self._used -= self._room(nbytes)
            self._changed.notify_all()


def heap_window(limit_bytes: int, *, hold_freed_heap: bool, until_staged: bool = True) -> Window:
    """The device path's window of `limit_bytes`, glibc's freed heap held first where
    `hold_freed_heap` says so. The blocks' host buffers come from one thread's arena (the
    D2H thread's, or the publishing thread's): each counts as the heap room it takes
    there, and with the heaps kept, the heaps they landed in (`host_heap.block_heaps`,
    the process's) hold what may be in flight to the window."""
    if hold_freed_heap:
        host_heap.hold_for_device_path()
    heaps = host_heap.block_heaps if host_heap.heaps_kept() else None
    return Window(limit_bytes, until_staged=until_staged, room=host_heap.heap_room, heaps=heaps)


@dataclass(frozen=True)
class _Job:
    """A block to bring over: bytes [offset, offset + nbytes) of `shard`; `make` returns a
    device array (its copy not yet issued) or host bytes."""

    shard: HostShard
    offset: int
    nbytes: int
    make: Callable[[], Any]


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
            window.issued(job.nbytes)
            inflight.append((job, data))
            del data
            job = next(jobs, None)
        if inflight:
            done, data = inflight.popleft()
            host = host_array(done.shard.name, data).reshape(-1)  # waits for this block's copy
            del data
            window.landed(done.nbytes, host)
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
    runs = PackRuns(block_bytes)
    for name, value in items:
        check_param(name, value)
        if isinstance(value, CutArray):  # cut by the snapshot's program: only the copies to issue
            yield from _pack_jobs(runs.close())
            (shard,) = shard_metas(name, value)
            if not value.nbytes:
                yield _Job(shard, 0, 0, lambda dtype=value.dtype: np.empty(0, dtype))
            for offset, nbytes, block in value.take(name):
                yield _Job(shard, offset, nbytes, lambda block=block: block)
            continue
        if not hasattr(value, "addressable_shards"):
            yield from _pack_jobs(runs.close())
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
                if platform not in params.HOST_MEMORY_PLATFORMS and runs.takes(shard.nbytes):
                    yield from _pack_jobs(runs.add((s.device, dtype), shard.nbytes, (shard, s.data)))
                    continue
                yield from _pack_jobs(runs.close())
                yield from _cut(shard, s.data, platform, block_bytes)
    yield from _pack_jobs(runs.close())


class PackRuns:
    """The rule both the snapshot and a publish of live arrays pack by: consecutive entries
    no larger than a block, of one key (their device and staged dtype), run together into
    packs of at most `block_bytes`; anything else between them ends the run."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._run: list[Any] = []
        self._key: Any = None
        self._bytes = 0

    def takes(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` goes into a pack: blocks are cut, and it holds
        bytes, no more than a block."""
        return bool(self.block_bytes) and 0 < nbytes <= self.block_bytes

    def add(self, key: Any, nbytes: int, entry: Any) -> list[Any]:
        """Adds `entry` to the open run; returns the run it closed (empty if none)."""
        full = self._bytes + nbytes > self.block_bytes
        closed = self.close() if self._run and (key != self._key or full) else []
        self._run.append(entry)
        self._key = key
        self._bytes += nbytes
        return closed

    def close(self) -> list[Any]:
        """Ends the open run; returns it (empty if none)."""
        run, self._run, self._bytes = self._run, [], 0
        return run


def _pack_jobs(members: list[tuple[HostShard, Any]]) -> Iterator[_Job]:
    """The jobs of one pack of (shard, device array), one per shard, in order; the pack's
    program runs when the first one's copy is issued."""
    if not members:
        return
    pack = _LazyPack(tuple(x for _, x in members), members[0][0].data.dtype)
    start = 0
    for shard, _ in members:
        count = shard.nbytes // shard.data.dtype.itemsize
        yield _Job(shard, 0, shard.nbytes, functools.partial(pack.slice, start, count))
        start += count


class _LazyPack:
    """A pack's device program, dispatched when its first shard's copy is issued."""

    def __init__(self, arrays: tuple[Any, ...], dtype: np.dtype) -> None:
        self._arrays: tuple[Any, ...] | None = arrays
        self._dtype = dtype
        self._pack: Any = None

    def slice(self, start: int, count: int) -> PackSlice:
        if self._pack is None:
            assert self._arrays is not None
            self._pack, self._arrays = slicers()[2](self._arrays, self._dtype), None
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
    """(byte offset, bytes, cut) of each block of device array `x` flattened and cast to
    `dtype`: `block_bytes` each but the last (one block when `x` is no larger, or
    `block_bytes` is not whole elements); `cut()` dispatches the block's slice on the
    device. Each block is read from the few leading rows of `x` that hold it, so the
    device relays out about a block's bytes, never the whole shard."""
    item = dtype.itemsize
    size = math.prod(x.shape)
    tail = slicers()[1]
    per = block_elements(size, item, block_bytes)
    if per >= size:
        return [(0, size * item, lambda: tail(x, 0, dtype))]
    count, rest = divmod(size, per)
    row = size // x.shape[0]
    rows = min(x.shape[0], -(-per // row) + 1)  # the rows any one block lies in
    out = []
    for j in range(count):
        first = min(j * per // row, x.shape[0] - rows)
        out.append(
            (j * block_bytes, block_bytes, functools.partial(_block, x, first, j * per - first * row, rows, per, dtype))
        )
    if rest:
        out.append((count * block_bytes, rest * item, functools.partial(tail, x, count * per, dtype)))
    return out


def _block(x: Any, first: int, offset: int, rows: int, per: int, dtype: np.dtype) -> Any:
    return slicers()[0](x, first, offset, rows, per, dtype)


@functools.cache
def slicers() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """Jitted, compiled once per shard shape and block size: (block(x, first, offset, rows,
    per, dtype): elements [offset, offset + per) of x's leading rows [first, first + rows)
    flattened, cast; tail(x, start, dtype): x flattened from element `start`, cast, read
    from the rows that hold it; pack(xs, dtype): the arrays `xs` flattened, cast and laid
    end to end)."""
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
        jax.jit(pack_flat, static_argnums=1),
    )


def pack_flat(xs: Sequence[Any], dtype: Any) -> Any:
    """The arrays `xs` flattened, cast to `dtype` and laid end to end: a pack, traced inside
    a device program (the live arrays' own, `slicers`, or the snapshot's). In a buffer of
    its own (`jnp.copy`): a pack of one array already flat and of its dtype would otherwise
    be that array, so its host copy would stay with the caller's array, and a snapshot's
    pack would be the buffer the caller's next donating step deletes."""
    import jax.numpy as jnp

    return jnp.copy(jnp.concatenate([x.reshape(-1).astype(dtype) for x in xs]))
