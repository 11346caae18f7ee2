"""glibc's malloc, seen and steered from Python (ctypes).

A TPU runtime's device-to-host copies land in host buffers from malloc. By default glibc
returns a free heap top above a threshold to the kernel (trim), and serves a request above
another threshold from a mapping of its own, unmapped at free; both thresholds grow with
what the process frees (up to 64 and 32 MiB). A thread other than the main one allocates
from an arena of its own, made of heaps of 64 MiB each: glibc unmaps such a heap as soon as
a free leaves it empty, whatever the trim threshold, unless its top pad is a heap's size.
A process that frees and allocates blocks of tens of MiB over and over (a publish worker's
device-to-host copies) may then fault in fresh pages for many of them, which a host under
gVisor pays dearly. `hold_freed_memory` fixes the thresholds and the pad for a process
already running (as MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_ and MALLOC_TOP_PAD_ do
from its start); the device path calls `hold_for_device_path` before its first copies on an
accelerator (the setting `d2h_hold_freed_heap`). `heap_stats` says how much memory glibc
holds.

glibc-specific code stays here: only `trainer_agent.device`'s modules import this one, and
no other module of trainer_agent imports ctypes (import contracts in pyproject.toml).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_M_MXFAST = 1  # mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
#: glibc's own largest fastbin request on 64-bit hosts (DEFAULT_MXFAST: 64 * sizeof(size_t) / 4)
MXFAST_DEFAULT = 128
#: the largest mmap threshold glibc takes on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_THRESHOLD_MAX = 32 << 20
#: the size of each heap a thread's arena is made of on 64-bit hosts (HEAP_MAX_SIZE, twice the
#: above): a top pad this large keeps glibc from unmapping a heap a free left empty
HEAP_BYTES = 2 * MMAP_THRESHOLD_MAX
#: glibc's own top pad (mallopt(3): 128 KiB)
TOP_PAD_DEFAULT = 128 << 10
_INT_MAX = (1 << 31) - 1
_NEVER = -1  # mallopt(3): a trim threshold of -1 disables trimming


@functools.cache
def libc_function(name: str, restype: type, *argtypes: type) -> Callable[..., Any] | None:
    """The C library's function `name` (None where it has none), looked up once: each
    lookup through a fresh `CDLL` makes a class of its own, memory from malloc that can land
    above a freed heap top and keep glibc from trimming it."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def _mallopt(*settings: tuple[int, int]) -> bool:
    """Each (parameter, value) given to glibc's mallopt; whether it took them all (False
    off glibc: nothing changed)."""
    mallopt = libc_function("mallopt", ctypes.c_int, ctypes.c_int, ctypes.c_int)
    if mallopt is None:
        return False
    return all([bool(mallopt(param, value)) for param, value in settings])  # every one set, even after a refusal


def hold_freed_memory(
    trim_bytes: int | None = _INT_MAX, mmap_bytes: int = MMAP_THRESHOLD_MAX, top_pad_bytes: int = HEAP_BYTES
) -> bool:
    """From now on, heap tops up to `trim_bytes` stay with the process (None: every heap
    top, glibc never trims) and requests up to `mmap_bytes` come from the heap (each capped
    at what mallopt takes); the thresholds no longer grow. Each heap grows by `top_pad_bytes`
    beyond a request, and keeps as much free at its top: with `HEAP_BYTES` (the default),
    no free unmaps a thread arena's heap (`TOP_PAD_DEFAULT`: glibc's own). Returns whether
    glibc took all three (False off glibc: nothing changed)."""
    trim = _NEVER if trim_bytes is None else min(trim_bytes, _INT_MAX)
    return _mallopt(
        (_M_TRIM_THRESHOLD, trim),
        (_M_MMAP_THRESHOLD, min(mmap_bytes, MMAP_THRESHOLD_MAX)),
        (_M_TOP_PAD, min(top_pad_bytes, _INT_MAX)),
    )


def set_max_fast(nbytes: int) -> bool:
    """Frees of chunks up to `nbytes` go to glibc's fastbins, kept apart unmerged until a
    later request merges them all at once; 0: no fastbins, every free merges at once
    (`MXFAST_DEFAULT` is glibc's own). Returns whether glibc took it (False off glibc)."""
    return _mallopt((_M_MXFAST, nbytes))


_held = False
_held_pad = 0
_held_lock = threading.Lock()


def hold_for_device_path(top_pad_bytes: int = HEAP_BYTES) -> bool:
    """Once per process: glibc's thresholds held (`hold_freed_memory`'s defaults: heap tops
    up to 2 GiB kept, requests up to 32 MiB from the heap, thread arenas' heaps kept), so
    the host buffers of the device path's blocks, freed as each block is staged, serve the
    next blocks' copies instead of fresh pages, in whichever thread publishes. The first
    call's `top_pad_bytes` stays (a bench passes `TOP_PAD_DEFAULT` to measure glibc's own).
    Returns whether they are held (False off glibc)."""
    global _held, _held_pad
    with _held_lock:
        if not _held:
            _held = hold_freed_memory(top_pad_bytes=top_pad_bytes)
            _held_pad = top_pad_bytes if _held else 0
            log.info(
                "glibc's trim and mmap thresholds and top pad (%g MiB) %s for the device path's blocks",
                top_pad_bytes / (1 << 20),
                "held" if _held else "not set",
            )
        return _held


def _own_mapping(nbytes: int) -> bool:
    """Whether glibc serves `nbytes` from a mapping of its own, not a heap: with its size
    field, at the mmap threshold the device path holds."""
    return nbytes + 8 >= MMAP_THRESHOLD_MAX


def heaps_kept() -> bool:
    """Whether `hold_for_device_path` held the thresholds with a heap-sized top pad: then no
    heap a thread's arena is made of is unmapped, and the heaps host buffers landed in are
    still the process's (`BlockHeaps`)."""
    with _held_lock:
        return _held and _held_pad >= HEAP_BYTES


class BlockHeaps:
    """The heaps the device path's host buffers landed in, from their addresses: glibc lays
    a thread's arena in heaps of `HEAP_BYTES` aligned to their size, so a buffer's heap is
    its address over 64 MiB (the main arena grows by brk: its 64 MiB stretches). With the
    heaps kept (`heaps_kept`) none is given back, so `nbytes` is host memory the process
    holds for those buffers, however glibc placed them. Buffers at or past
    the mmap threshold are mappings of their own, not counted. With `steer` False a window
    only counts them (a bench's control). Thread-safe."""

    def __init__(self) -> None:
        self._heaps: set[int] = set()
        self._lock = threading.Lock()
        self.steer = True

    def note(self, address: int, nbytes: int) -> bool:
        """Counts the heaps a buffer of `nbytes` at `address` lies in; whether they were new."""
        if nbytes <= 0 or _own_mapping(nbytes):
            return False
        first, last = address // HEAP_BYTES, (address + nbytes - 1) // HEAP_BYTES
        with self._lock:
            before = len(self._heaps)
            self._heaps.update(range(first, last + 1))
            return len(self._heaps) > before

    @property
    def count(self) -> int:
        return len(self._heaps)

    @property
    def nbytes(self) -> int:
        """The bytes of the heaps counted."""
        return len(self._heaps) * HEAP_BYTES


#: the heaps this process's device path has copied blocks into (`device_blocks.heap_window`)
block_heaps = BlockHeaps()


#: what a heap holds besides its chunks, rounded up: its header and, in an arena's first
#: heap, the arena's own
_HEAP_HEADER = 4096
#: what a chunk takes besides its bytes, rounded up: its size field and an alignment of 64
_CHUNK_SLACK = 64


def heap_room(nbytes: int) -> int:
    """The bytes an allocation of `nbytes` takes from a thread's arena while many of its
    size are live: glibc lays them in heaps of `HEAP_BYTES` (64 MiB), so as many as fit
    whole share a heap and the rest of it stays empty (three 18 MiB blocks take 64 MiB:
    21.3 MiB each). Past the mmap threshold, a mapping of its own (whole pages)."""
    if nbytes <= 0:
        return 0
    if _own_mapping(nbytes):
        return -(-nbytes // 4096) * 4096
    per_heap = (HEAP_BYTES - _HEAP_HEADER) // (nbytes + _CHUNK_SLACK)
    return -(-HEAP_BYTES // per_heap)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )
    ]  # fmt: skip


def heap_stats() -> dict[str, int]:
    """glibc's account (`mallinfo2`, every arena): bytes of its arenas (`arena`), of its
    own mappings for large requests (`mapped`), free within the arenas (`free`), the free
    chunks in its bins (`free_chunks`) and, beside them, those in its fastbins, not yet
    merged (`fast_chunks`); empty where there is no mallinfo2 (not glibc, or before 2.33).
    It walks every free chunk under each arena's lock, so its time grows with them, and
    mallocs in that arena wait for it (about 20 ms a call on a v5e trainer's heap,
    docs/performance.md)."""
    mallinfo2 = libc_function("mallinfo2", _MallInfo2)
    if mallinfo2 is None:
        return {}
    m = mallinfo2()
    return {
        "arena": m.arena,
        "mapped": m.hblkhd,
        "free": m.fordblks,
        "free_chunks": m.ordblks,
        "fast_chunks": m.smblks,
    }


def arena_stats() -> list[dict[str, int]]:
    """glibc's account arena by arena (`malloc_info`): for each, the bytes it holds from
    the kernel (`system`), of them free in its bins and fastbins (`free`), its heaps
    (`heaps`; glibc's `subheaps`, a thread's arena only: the main one grows by brk), its
    free chunks (`free_chunks`) and the largest of them in its bins (`largest_free`),
    the main arena first; empty off glibc. With nothing live in a thread's arena each
    heap is one free chunk (the last, its top): more chunks, and a largest one short of
    a heap, are live allocations holding its heaps apart. A thread mallocs from the
    arena it was given at its first malloc, so this tells which threads' frees a process
    keeps (one arena per thread that copied blocks keeps up to a window). Walks every
    free chunk under each arena's lock, as `heap_stats` does."""
    return _parse_malloc_info(malloc_info_text())


def malloc_info_text() -> str:
    """glibc's `malloc_info` XML (each arena's free chunks by size, its heaps and bytes);
    empty off glibc."""
    memstream = libc_function(
        "open_memstream", ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
    )
    malloc_info = libc_function("malloc_info", ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    fclose = libc_function("fclose", ctypes.c_int, ctypes.c_void_p)
    free = libc_function("free", None, ctypes.c_void_p)
    if memstream is None or malloc_info is None or fclose is None or free is None:
        return ""
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return ""
    try:
        malloc_info(0, stream)
    finally:
        fclose(stream)  # sets buf and size
    try:
        return ctypes.string_at(buf, size.value).decode() if buf.value else ""
    finally:
        free(buf)


def _parse_malloc_info(text: str) -> list[dict[str, int]]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return []

    def sizes(heap: ET.Element, tag: str) -> dict[str | None, int]:  # <tag type=".." size=".."/> by type
        return {t.get("type"): int(t.get("size", 0)) for t in heap.findall(tag)}

    out = []
    for heap in root.findall("heap"):
        totals, system, aspace = (sizes(heap, tag) for tag in ("total", "system", "aspace"))
        chunks = sum(int(t.get("count", 0)) for t in heap.findall("total"))
        binned = list(heap.iterfind("sizes/*"))  # <size>s of each bin, the <unsorted> bin's
        out.append(
            {
                "system": system.get("current", 0),
                "free": totals.get("fast", 0) + totals.get("rest", 0),
                "heaps": aspace.get("subheaps", 0),
                "free_chunks": chunks,
                "largest_free": max((int(b.get("to", 0)) for b in binned), default=0),
            }
        )
    return out


def arenas_summary(arenas: list[dict[str, int]], min_bytes: int = 64 << 20) -> dict[str, Any]:
    """`arena_stats` in short: how many arenas, and those holding `min_bytes` or more from
    the kernel, as [system, free] bytes each, largest first (the main arena marked by its
    index 0 in `main`), and the largest one's account whole (`largest`)."""
    large = sorted(
        ([a["system"], a["free"], i] for i, a in enumerate(arenas) if a["system"] >= min_bytes),
        reverse=True,
    )
    return {
        "arenas": len(arenas),
        "large": [[s, f] for s, f, _ in large],
        "main": next(([s, f] for s, f, i in large if i == 0), None),
        "largest": arenas[large[0][2]] if large else None,
    }
