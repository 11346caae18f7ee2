"""Copy-only device-to-host methods: each brings the bytes of every given device buffer into
host memory and stages nothing. `bench/stage.py --devices` times them beside the device
path, on freshly made arrays each (JAX keeps an array's host copy once it is read).

On CPU devices the device memory is host memory: these copies move no bytes there.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

MiB = 1 << 20


class Unsupported(Exception):
    """The platform does not offer this method (the message says why)."""


@dataclass(frozen=True)
class Method:
    """A copy-only method: `prepare` runs untimed first (compiles), `run` is timed."""

    name: str
    run: Callable[[list[Any], list[Any]], None]  # (replica-0 shard buffers, whole arrays)
    prepare: Callable[[list[Any], list[Any]], None] = lambda datas, values: None


def copy_window(datas: Iterable[Any], window_bytes: int) -> None:
    """`copy_to_host_async` issued up to `window_bytes` ahead, each buffer read in its turn
    (the device path's pattern, without the staging)."""
    pending = iter(datas)
    inflight: deque[Any] = deque()
    held = 0
    while True:
        while not inflight or held < window_bytes:
            d = next(pending, None)
            if d is None:
                break
            d.copy_to_host_async()
            inflight.append(d)
            held += d.nbytes
        if not inflight:
            return
        d = inflight.popleft()
        held -= d.nbytes
        np.asarray(d)


def all_at_once(datas: Sequence[Any]) -> None:
    """Every copy issued, then each buffer read."""
    for d in datas:
        d.copy_to_host_async()
    for d in datas:
        np.asarray(d)


def into_warm_memory(datas: Sequence[Any], dst: np.ndarray) -> None:
    """Every copy issued, then each buffer's bytes copied into `dst` (warm host memory)."""
    for d in datas:
        d.copy_to_host_async()
    off = 0
    for d in datas:
        n = int(d.nbytes)
        np.copyto(dst[off : off + n], np.asarray(d).reshape(-1).view(np.uint8))
        off += n


def _device_get(datas: Sequence[Any]) -> None:
    jax.device_get(list(datas))


def pinned_host(values: Sequence[Any]) -> None:
    """`device_put` of each array to the `pinned_host` memory kind of its own devices."""
    kinds = {m.kind for m in values[0].addressable_shards[0].device.addressable_memories()} if values else set()
    if "pinned_host" not in kinds:
        raise Unsupported(f"no pinned_host memory kind on this platform (it has {', '.join(sorted(kinds))})")
    try:
        moved = [jax.device_put(v, v.sharding.with_memory_kind("pinned_host")) for v in values]
        jax.block_until_ready(moved)
    except Exception as e:  # noqa: BLE001 - reported as the method's result
        raise Unsupported(f"device_put to pinned_host failed: {str(e)[:200]}") from e


def _rows(d: Any, piece_bytes: int) -> int:
    row = int(d.nbytes) // d.shape[0] if d.ndim and d.shape[0] else int(d.nbytes)
    return max(1, piece_bytes // max(1, row))


_slice_rows = jax.jit(lambda x, start, rows: jax.lax.dynamic_slice_in_dim(x, start, rows), static_argnums=2)


def pieces(d: Any, piece_bytes: int) -> list[tuple[int, int]]:
    """(first row, rows) of each piece of at most ~`piece_bytes` of a buffer (whole when small)."""
    if not d.ndim or d.nbytes <= piece_bytes or d.shape[0] <= 1:
        return [(0, d.shape[0] if d.ndim else 0)]
    r = _rows(d, piece_bytes)
    return [(i, min(r, d.shape[0] - i)) for i in range(0, d.shape[0], r)]


def chunked(datas: Sequence[Any], piece_bytes: int, window_bytes: int) -> None:
    """Each buffer cut on its device into row blocks of ~`piece_bytes` (one dispatch each),
    the blocks copied through a window of `window_bytes`."""

    def blocks() -> Iterator[Any]:
        for d in datas:
            cuts = pieces(d, piece_bytes)
            if len(cuts) == 1:
                yield d
                continue
            for start, rows in cuts:
                yield _slice_rows(d, start, rows)

    copy_window(blocks(), window_bytes)  # cut as the window moves: a window's worth of blocks on the device


def warm_chunked(datas: Sequence[Any], piece_bytes: int) -> None:
    """Compiles every block shape `chunked` will cut (untimed): a compile per shape."""
    seen = set()
    for d in datas:
        cuts = pieces(d, piece_bytes)
        for start, rows in cuts if len(cuts) > 1 else ():
            key = (d.shape, str(d.dtype), rows)
            if key not in seen:
                seen.add(key)
                _slice_rows(d, start, rows).block_until_ready()


def threaded(datas: Sequence[Any], threads: int, window_bytes: int) -> None:
    """`threads` Python threads, each a window of `window_bytes / threads` over its share of
    the buffers (shares of about equal bytes, in order)."""
    shares: list[list[Any]] = [[] for _ in range(threads)]
    sizes = [0] * threads
    for d in datas:
        i = sizes.index(min(sizes))
        shares[i].append(d)
        sizes[i] += int(d.nbytes)
    errors: list[BaseException] = []

    def work(share: list[Any]) -> None:
        try:
            copy_window(share, max(1, window_bytes // threads))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    workers = [threading.Thread(target=work, args=(s,)) for s in shares if s]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def methods(windows: Sequence[int], piece_bytes: int, threads: int, dst: np.ndarray) -> list[Method]:
    """The copy-only methods, `windows` in bytes; `dst` is warm host memory for the whole model."""
    biggest = max(windows)
    out = [Method("into_warm_memory", lambda d, v: into_warm_memory(d, dst))]
    out += [Method(f"window_{w // MiB}MiB", lambda d, v, w=w: copy_window(d, w)) for w in windows]
    out += [
        Method("all_at_once", lambda d, v: all_at_once(d)),
        Method("device_get", lambda d, v: _device_get(d)),
        Method("pinned_host", lambda d, v: pinned_host(v)),
        Method(
            f"chunked_{piece_bytes // MiB}MiB_window_{biggest // MiB}MiB",
            lambda d, v: chunked(d, piece_bytes, biggest),
            lambda d, v: warm_chunked(d, piece_bytes),
        ),
        Method(f"threads_{threads}_window_{biggest // MiB}MiB", lambda d, v: threaded(d, threads, biggest)),
    ]
    return out
