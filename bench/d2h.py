"""Copy-only device-to-host methods: each brings the bytes of every given device buffer into
host memory and stages nothing. `bench/stage.py --devices` times them beside the device
path, on freshly made arrays each (JAX keeps an array's host copy once read).

Every method's bytes are checked: before it runs (untimed), each buffer's 16-bit words are
summed modulo 2^32 on its device; as the method brings a buffer or a block of one over,
a pool of threads sums the host bytes the same way, and the run's time ends once every sum
is in. A method whose sums all agree is `exact`; one that is not is no bound.

On CPU devices the device memory is host memory: these copies move no bytes there.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer_agent.device.device_blocks import cut_blocks

MiB = 1 << 20
CHECK_THREADS = 4


class Unsupported(Exception):
    """The platform does not offer this method (the message says why)."""


def _word(itemsize: int) -> Any:
    return np.uint16 if itemsize % 2 == 0 else np.uint8


@jax.jit
def _device_sum(x: jax.Array) -> jax.Array:
    words = jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize % 2 == 0 else x.view(jnp.uint8)
    return jnp.sum(words.astype(jnp.uint32), dtype=jnp.uint32)


def device_sums(datas: Sequence[Any]) -> list[int]:
    """Each buffer's words summed modulo 2^32 on its device."""
    return [int(s) for s in jax.device_get([_device_sum(d) for d in datas])]


def host_sum(arr: np.ndarray, itemsize: int = 0) -> int:
    """`device_sums`' rule over host bytes (raw bytes: of elements of `itemsize` bytes)."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    return int(np.add.reduce(flat.view(np.uint8).view(_word(itemsize or flat.itemsize)), dtype=np.uint32))


class Checker:
    """Sums the host bytes a method brings over (buffer index, array), on a pool of
    threads that holds each array until it is summed."""

    def __init__(self, expected: Sequence[int]) -> None:
        self.expected = list(expected)
        self._pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="d2h-check")
        self._pending: list[tuple[int, Future]] = []

    def __call__(self, index: int, arr: np.ndarray, itemsize: int = 0) -> None:
        self._pending.append((index, self._pool.submit(host_sum, arr, itemsize)))

    def finish(self) -> bool:
        """Waits for every sum; whether each buffer's came out as its device's."""
        got = [0] * len(self.expected)
        for index, future in self._pending:
            got[index] = (got[index] + future.result()) & 0xFFFFFFFF
        self._pool.shutdown()
        self._pending.clear()
        return got == self.expected


Sink = Callable[[int, np.ndarray], None]


@dataclass(frozen=True)
class Method:
    """A copy-only method: `prepare` runs untimed first (compiles), `run` is timed; both get
    the replica-0 shard buffers and the whole arrays, `run` also the sink of host bytes."""

    name: str
    run: Callable[[list[Any], list[Any], Sink], None]
    prepare: Callable[[list[Any], list[Any]], None] = lambda datas, values: None
    slow: bool = False  # whole buffers: bound by faulting in fresh host memory, run fewer times


def copy_window(blocks: Iterable[tuple[int, Any]], window_bytes: int, sink: Sink) -> None:
    """`copy_to_host_async` issued up to `window_bytes` ahead, each (buffer index, device
    array) read in its turn and handed to `sink` (the device path's pattern, unstaged)."""
    pending = iter(blocks)
    inflight: deque[tuple[int, Any]] = deque()
    held = 0
    while True:
        while not inflight or held < window_bytes:
            nxt = next(pending, None)
            if nxt is None:
                break
            nxt[1].copy_to_host_async()
            inflight.append(nxt)
            held += nxt[1].nbytes
        if not inflight:
            return
        index, d = inflight.popleft()
        held -= d.nbytes
        sink(index, np.asarray(d))
        del d


def all_at_once(datas: Sequence[Any], sink: Sink) -> None:
    """Every copy issued, then each buffer read."""
    for d in datas:
        d.copy_to_host_async()
    for i, d in enumerate(datas):
        sink(i, np.asarray(d))


def _device_get(datas: Sequence[Any], sink: Sink) -> None:
    for i, arr in enumerate(jax.device_get(list(datas))):
        sink(i, arr)


def pinned_host(values: Sequence[Any], sink: Sink) -> None:
    """`device_put` of each array to the `pinned_host` memory kind of its own devices; the
    check reads the replica-0 shards of what landed there."""
    kinds = {m.kind for m in values[0].addressable_shards[0].device.addressable_memories()} if values else set()
    if "pinned_host" not in kinds:
        raise Unsupported(f"no pinned_host memory kind on this platform (it has {', '.join(sorted(kinds))})")
    try:
        moved = [jax.device_put(v, v.sharding.with_memory_kind("pinned_host")) for v in values]
        jax.block_until_ready(moved)
    except Exception as e:  # noqa: BLE001 - reported as the method's result
        raise Unsupported(f"device_put to pinned_host failed: {str(e)[:200]}") from e
    i = 0
    for m in moved:
        for s in m.addressable_shards:
            if s.replica_id == 0:
                sink(i, np.asarray(s.data))
                i += 1


_slice_rows = jax.jit(lambda x, start, rows: jax.lax.dynamic_slice_in_dim(x, start, rows), static_argnums=2)


def row_pieces(d: Any, piece_bytes: int) -> list[tuple[int, int]]:
    """(first row, rows) of each piece of at most ~`piece_bytes` of a buffer (whole when small)."""
    if not d.ndim or d.nbytes <= piece_bytes or d.shape[0] <= 1:
        return [(0, d.shape[0] if d.ndim else 0)]
    row = int(d.nbytes) // d.shape[0]
    r = max(1, piece_bytes // max(1, row))
    return [(i, min(r, d.shape[0] - i)) for i in range(0, d.shape[0], r)]


def row_blocks(datas: Sequence[Any], piece_bytes: int) -> Iterator[tuple[int, Any]]:
    """Each buffer cut on its device into row blocks of ~`piece_bytes` (one dispatch each),
    lazily: a window's worth of blocks on the device at a time."""
    for i, d in enumerate(datas):
        cuts = row_pieces(d, piece_bytes)
        if len(cuts) == 1:
            yield i, d
            continue
        for start, rows in cuts:
            yield i, _slice_rows(d, start, rows)


def flat_blocks(datas: Sequence[Any], block_bytes: int) -> Iterator[tuple[int, Any]]:
    """Each buffer flattened and cut on its device into `block_bytes` blocks by the device
    path's own slices (`trainer_agent.device.device_blocks.cut_blocks`), lazily."""
    for i, d in enumerate(datas):
        for _, _, cut in cut_blocks(d, d.dtype, block_bytes):
            yield i, cut()


def warm_rows(datas: Sequence[Any], piece_bytes: int) -> None:
    """Compiles every row-block shape `row_blocks` cuts (untimed): one dispatch per shape."""
    seen = set()
    for d in datas:
        for start, rows in row_pieces(d, piece_bytes):
            key = (d.shape, str(d.dtype), d.sharding, rows)
            if rows != d.shape[0] and key not in seen:
                seen.add(key)
                _slice_rows(d, start, rows).block_until_ready()


def warm_flat(datas: Sequence[Any], block_bytes: int) -> None:
    """Compiles the device path's slices for every shard shape `flat_blocks` cuts
    (untimed): its first and last block per shape."""
    seen = set()
    for d in datas:
        key = (d.shape, str(d.dtype), d.sharding)
        if key not in seen:
            seen.add(key)
            cuts = cut_blocks(d, d.dtype, block_bytes)
            for _, _, cut in cuts if len(cuts) < 3 else (cuts[0], cuts[-1]):
                cut().block_until_ready()


def threaded(blocks: Iterable[tuple[int, Any]], threads: int, window_bytes: int, sink: Sink) -> None:
    """`threads` Python threads, each with a window of `window_bytes / threads`, taking the
    next block from one shared stream of lazily cut blocks."""
    lock = threading.Lock()
    source = iter(blocks)
    errors: list[BaseException] = []

    def shared() -> Iterator[tuple[int, Any]]:
        while True:
            with lock:
                nxt = next(source, None)
            if nxt is None:
                return
            yield nxt

    def work() -> None:
        try:
            copy_window(shared(), max(1, window_bytes // threads), sink)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def methods(window: int, block_bytes: int, rows_mib: Sequence[int], threads: int) -> list[Method]:
    """The copy-only methods at a `window` of bytes in flight: whole buffers (through the
    window, all at once, device_get, pinned_host), row blocks of each of `rows_mib`, the
    device path's flat blocks of `block_bytes`, and those on `threads` threads."""
    w = window // MiB
    b = block_bytes / MiB
    out = [
        Method(f"whole_window_{w}MiB", lambda d, v, s: copy_window(enumerate(d), window, s), slow=True),
        Method("whole_all_at_once", lambda d, v, s: all_at_once(d, s), slow=True),
        Method("whole_device_get", lambda d, v, s: _device_get(d, s), slow=True),
        Method("whole_pinned_host", lambda d, v, s: pinned_host(v, s), slow=True),
    ]
    for r in rows_mib:
        out.append(
            Method(
                f"rows_{r}MiB_window_{w}MiB",
                lambda d, v, s, r=r: copy_window(row_blocks(d, r * MiB), window, s),
                lambda d, v, r=r: warm_rows(d, r * MiB),
            )
        )
    flat = functools.partial(flat_blocks, block_bytes=block_bytes)
    out += [
        Method(
            f"flat_{b:g}MiB_window_{w}MiB",
            lambda d, v, s: copy_window(flat(d), window, s),
            lambda d, v: warm_flat(d, block_bytes),
        ),
        Method(
            f"flat_{b:g}MiB_threads_{threads}_window_{w}MiB",
            lambda d, v, s: threaded(flat(d), threads, window, s),
            lambda d, v: warm_flat(d, block_bytes),
        ),
    ]
    return out
