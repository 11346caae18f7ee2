"""The only door to the native staging shim (ctypes over libweightsync_native.so).

`available()` says whether the shim was built; callers fall back to the pure-Python
digests (`weightsync.digests`) when it was not. Status codes from C++ become
`weightsync.errors` classes here.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from weightsync.digests import xxh3
from weightsync.errors import DataLoss, InternalError, InvalidArgument

_NATIVE_DIR = Path(__file__).resolve().parent / "_native"
_LIB_PATH = next(iter(sorted(_NATIVE_DIR.glob("libweightsync_native.*"))), _NATIVE_DIR / "libweightsync_native.so")
_ABI_VERSION = 14
BUILD_HINT = "build it with `make native` (or `pip install --no-build-isolation -e .` in a venv with jax)"


# ws_span (weightsync_native.h): built as a NumPy table and passed by address, as every
# array is here. ctypes' `data_as` casts and per-length array types leave reference cycles
# (a few objects a call, the collector's to find: each chunk a rollout receives made some).
_SPAN = np.dtype(
    [("src", np.uint64), ("nbytes", np.uint64), ("dst_offset", np.uint64), ("dtype", np.int32), ("pad", np.int32)]
)
_ADDR = ctypes.c_void_p  # an array's address: int(array.ctypes.data), or None


def _span_table(rows: Sequence[tuple[int, int, int, int]]) -> np.ndarray:
    """ws_span rows (source address or 0, nbytes, destination offset, dtype code)."""
    table = np.zeros(max(1, len(rows)), _SPAN)
    if rows:
        table[: len(rows)] = [(*row, 0) for row in rows]
    return table


def _load() -> tuple[ctypes.CDLL | None, str]:
    if not _LIB_PATH.exists():
        return None, f"{_LIB_PATH.name} was not built ({_LIB_PATH} missing); {BUILD_HINT}"
    try:
        lib = ctypes.CDLL(str(_LIB_PATH))
    except OSError as e:
        return None, f"cannot load {_LIB_PATH}: {e}; {BUILD_HINT}"
    if lib.ws_abi_version() != _ABI_VERSION:
        return None, f"{_LIB_PATH.name} has ABI {lib.ws_abi_version()}, expected {_ABI_VERSION}; {BUILD_HINT}"
    lib.ws_cpu_limit.argtypes = [ctypes.c_char_p]
    lib.ws_stage.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint64,
        _ADDR,
        ctypes.c_uint64,
        ctypes.c_uint64,
        _ADDR,
        ctypes.c_uint64,
        _ADDR,
        _ADDR,
        _ADDR,
        ctypes.c_int,
    ]
    lib.ws_stage_delta.argtypes = [
        *lib.ws_stage.argtypes[:-1],
        ctypes.c_void_p,
        ctypes.c_void_p,
        _ADDR,
        _ADDR,
        ctypes.c_int,
    ]
    lib.ws_rebuild_digest.argtypes = [
        *lib.ws_stage.argtypes[:-1],
        ctypes.c_void_p,
        ctypes.c_uint64,
        _ADDR,
        _ADDR,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.ws_digest_spans.argtypes = [
        _ADDR,
        ctypes.c_uint64,
        ctypes.c_uint64,
        _ADDR,
        _ADDR,
        ctypes.c_int,
    ]
    lib.ws_digest_ranges.argtypes = [ctypes.c_void_p, _ADDR, _ADDR, ctypes.c_uint64, _ADDR, ctypes.c_int]
    lib.ws_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    lib.ws_copy_many.argtypes = [_ADDR, _ADDR, _ADDR, ctypes.c_uint64, ctypes.c_int]
    lib.ws_copy_digest.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, _ADDR]
    lib.ws_send_mem_ranges.argtypes = [ctypes.c_int, _ADDR, _ADDR, ctypes.c_uint64]
    lib.ws_send_mem_ranges.restype = ctypes.c_int64
    lib.ws_recv_verify.argtypes = [ctypes.c_int, ctypes.c_void_p, _ADDR, _ADDR, _ADDR, ctypes.c_uint64, ctypes.c_void_p]
    lib.ws_recv_verify.restype = ctypes.c_int64
    lib.ws_delta16_encode.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_void_p,
        ctypes.c_uint64,
        _ADDR,
    ]
    lib.ws_delta16_encode.restype = ctypes.c_int64
    lib.ws_delta16_decode.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64]
    lib.ws_matrix_sums.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    lib.ws_float_matrix_sums.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                                         ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, _ADDR]  # fmt: skip
    return lib, ""


_LIB, _MISSING = _load()
THREADS_VARIABLE = "WEIGHTSYNC_NATIVE_THREADS"
if (_threads := os.environ.get(THREADS_VARIABLE)) and _LIB is not None and not _LIB.ws_threads_setting():
    logging.getLogger(__name__).warning(  # by the shim's own reading of it
        "%s=%r is not an integer in [1, 4096]: ignored, native passes use %d threads",
        THREADS_VARIABLE,
        _threads,
        int(_LIB.ws_default_threads()),
    )
_CUDA_LIB_PATH = _NATIVE_DIR / "libweightsync_native_cuda.so"


def _load_cuda() -> ctypes.CDLL | None:
    if not _CUDA_LIB_PATH.exists():
        return None
    try:
        lib = ctypes.CDLL(str(_CUDA_LIB_PATH))
    except OSError:
        return None
    lib.ws_cuda_selftest.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
    return lib


_CUDA = _load_cuda()


def cuda_built() -> bool:
    """True when the CUDA staging variant was built (a CUDA toolkit was present)."""
    return _CUDA is not None


def cuda_device_count() -> int:
    """GPUs the CUDA variant can see (0 without the variant, a driver or a GPU)."""
    return int(_CUDA.ws_cuda_device_count()) if _CUDA is not None else 0


def cuda_selftest(nbytes: int) -> tuple[int, int]:
    """(digest of a host pattern, digest after device -> pinned arena staging)."""
    if _CUDA is None:
        raise RuntimeError(f"{_CUDA_LIB_PATH.name} was not built (no CUDA toolkit at build time)")
    a, b = ctypes.c_uint64(), ctypes.c_uint64()
    _check(_CUDA.ws_cuda_selftest(nbytes, ctypes.byref(a), ctypes.byref(b)), "ws_cuda_selftest")
    return a.value, b.value


def available() -> bool:
    """True when the shim is built and loadable."""
    return _LIB is not None


def missing_reason() -> str:
    """Why the shim is unavailable (empty when it is)."""
    return _MISSING


def ffi_available() -> bool:
    """True when the shim was built with the JAX FFI handler."""
    return _LIB is not None and hasattr(_LIB, "WsStageFfi")


def ffi_missing_reason() -> str:
    if _LIB is None:
        return _MISSING
    if not hasattr(_LIB, "WsStageFfi"):
        return (
            f"{_LIB_PATH.name} was built without the JAX FFI handler (jax headers absent at build time); {BUILD_HINT}"
        )
    return ""


def ffi_handler() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The XLA FFI handler symbol (for jax.ffi.pycapsule)."""
    if not ffi_available():
        raise RuntimeError(ffi_missing_reason())
    return _LIB.WsStageFfi  # type: ignore[union-attr]


def default_threads() -> int:
    """Threads a native pass runs on unless told: `WEIGHTSYNC_NATIVE_THREADS`, else the
    cores this process may run on (its CPU affinity, capped by its cgroup's CPU quota)."""
    return int(_LIB.ws_default_threads()) if _LIB is not None else 1


def cpu_limit(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Whole cores of the CPU quota of the cgroup mounted at `cgroup_root`, rounded up;
    0 where it sets none."""
    return int(_require().ws_cpu_limit(str(cgroup_root).encode()))


def _require() -> ctypes.CDLL:
    if _LIB is None:
        raise RuntimeError(_MISSING)
    return _LIB


_WS_DATA_LOSS = 3  # ws_status: a delta encoding that does not decode


def _check(rc: int, what: str) -> None:
    if rc == 1:
        raise InvalidArgument(f"{what}: spans overlap, leave the destination, or a pointer is null", field="spans")
    if rc != 0:
        raise InternalError(f"{what} failed with native status {rc}")


@dataclass(frozen=True)
class StageResult:
    """Digests and sums from one fused staging pass."""

    span_digests: np.ndarray  # uint64[n]
    span_sums: np.ndarray  # float64[n]
    chunk_digests: np.ndarray  # uint64[n_chunks]
    # with a base: each chunk's delta encoding against it (None: the chunk goes raw)
    chunk_deltas: list[bytes | None] | None = None


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def stage(
    dst: np.ndarray,
    total: int,
    chunk_lengths: Sequence[int],
    piece_bytes: int,
    sources: Sequence[tuple[np.ndarray, int, int]],
    *,
    base: np.ndarray | None = None,
    delta_cap: float = 0.5,
    delta_out: np.ndarray | None = None,
    threads: int = 0,
) -> StageResult:
    """Copies each (C-contiguous array, dst offset, dtype code) into dst and digests it.

    One pass: xxh3-64 of each chunk (the chunks tile dst[0, total) with these lengths),
    float64 sum and piecewise digest (`digests.piecewise_xxh3` with `piece_bytes`) per
    span, gaps zeroed. Spans must be sorted by offset and must not overlap.

    With `base` (the previous version staged with the same layout: the other arena slot),
    the same pass also encodes each chunk's 16-bit words against it (`delta16_encode`'s
    format) while the new bytes are in cache; a chunk whose encoding would pass
    `delta_cap` x its length goes raw (None in `chunk_deltas`). The encodings are written
    to `delta_out` (uint8, at least `delta_cap` x total bytes), which a caller staging
    every step keeps: a fresh buffer's pages are zeroed as each chunk's region is first
    written (2 MiB huge pages: measured 6x the staging time on 1.19 GB, against 2.4x).
    """
    lib = _require()
    if dst.dtype != np.uint8 or dst.nbytes < total or not dst.flags.c_contiguous:
        raise InvalidArgument(f"needs a contiguous uint8 buffer of at least {total} bytes", field="dst")
    for i, (arr, _, _) in enumerate(sources):
        if not arr.flags.c_contiguous:
            raise InvalidArgument("array is not C-contiguous", field=f"sources[{i}]")
    spans = _span_table([(_ptr(arr) if arr.nbytes else 0, arr.nbytes, offset, dtype) for arr, offset, dtype in sources])
    lengths = _chunk_plan(chunk_lengths, total)
    args, digests, sums, chunks = _pass_args(_ptr(dst), total, lengths, piece_bytes, spans, len(sources))
    if base is None:
        _check(lib.ws_stage(*args, threads), "ws_stage")
        return StageResult(digests[: len(sources)], sums[: len(sources)], chunks[: len(lengths)])
    if base.dtype != np.uint8 or base.nbytes < total or not base.flags.c_contiguous:
        raise InvalidArgument(f"needs a contiguous uint8 buffer of at least {total} bytes", field="base")
    if _ptr(base) < _ptr(dst) + total and _ptr(dst) < _ptr(base) + total:
        raise InvalidArgument("overlaps dst: the previous version must be in another slot", field="base")
    if (lengths % 2).any():
        raise InvalidArgument("a delta compares 16-bit words: every chunk length must be even", field="chunk_lengths")
    if not 0 <= delta_cap <= 1:
        raise InvalidArgument(f"must be in [0, 1], got {delta_cap}", field="delta_cap")
    caps = (lengths * delta_cap).astype(np.uint64)
    out = np.empty(max(int(caps.sum()), 1), np.uint8) if delta_out is None else delta_out
    if out.dtype != np.uint8 or out.nbytes < int(caps.sum()) or not out.flags.c_contiguous:
        raise InvalidArgument(f"needs a contiguous uint8 buffer of at least {int(caps.sum())} bytes", field="delta_out")
    sizes = np.zeros(max(len(lengths), 1), np.int64)
    rc = lib.ws_stage_delta(*args, _ptr(base), _ptr(out), _ptr(caps), _ptr(sizes), threads)
    _check(rc, "ws_stage_delta")
    starts = np.concatenate([[0], np.cumsum(caps)])
    deltas = [None if n < 0 else out[int(a) : int(a) + int(n)].tobytes() for a, n in zip(starts, sizes[: len(lengths)])]
    return StageResult(digests[: len(sources)], sums[: len(sources)], chunks[: len(lengths)], deltas)


@dataclass(frozen=True)
class RebuildResult(StageResult):
    """A staging pass's digests and sums of a buffer rebuilt from its chunks' deltas
    (`rebuild_digest`), and the chunks whose encoding did not decode."""

    broken: list[int] = field(default_factory=list)


def _pass_args(
    dst: int | None, total: int, lengths: np.ndarray, piece_bytes: int, spans: np.ndarray, n_spans: int
) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    """The arguments every staging pass takes (ws_stage's, less the threads), and the span
    digests, span sums and chunk digests they point at (addresses only: the caller keeps
    `lengths` and `spans` alive through the call)."""
    digests = np.zeros(max(n_spans, 1), np.uint64)
    sums = np.zeros(max(n_spans, 1), np.float64)
    chunks = np.zeros(max(len(lengths), 1), np.uint64)
    args = [
        dst,
        total,
        _ptr(lengths),
        len(lengths),
        piece_bytes,
        _ptr(spans),
        n_spans,
        _ptr(digests),
        _ptr(sums),
        _ptr(chunks),
    ]
    return args, digests, sums, chunks


def _chunk_plan(chunk_lengths: Sequence[int], total: int) -> np.ndarray:
    lengths = np.ascontiguousarray(chunk_lengths, np.uint64)
    if int(lengths.sum()) != total or (lengths == 0).any():
        raise InvalidArgument(
            f"must be positive and tile [0, {total}); they sum to {int(lengths.sum())}", field="chunk_lengths"
        )
    return lengths


def rebuild_digest(
    buf: np.ndarray,
    chunk_lengths: Sequence[int],
    piece_bytes: int,
    spans: Sequence[tuple[int, int, int]],
    encodings: np.ndarray,
    encoded: Sequence[tuple[int, int, int]],
    *,
    threads: int = 0,
) -> RebuildResult:
    """Rebuilds a part in `buf` (uint8, it holds the delta's base; the chunks tile it) and
    digests it in the same pass: for each (chunk index, offset, length) in `encoded`, the
    changes that encoding (`delta16_encode`'s format) at encodings[offset:offset + length]
    makes are applied block by block, each block then summed and hashed while in cache.
    `spans`: (offset, nbytes, dtype code) of each shard in the part, sorted, as `stage`
    digests them: piecewise xxh3-64 and float64 sum per span, xxh3-64 per chunk. A chunk
    whose encoding does not decode is listed in `broken` (its bytes hold part of it)."""
    lib = _require()
    total = buf.nbytes
    if buf.dtype != np.uint8 or not buf.flags.c_contiguous:
        raise InvalidArgument("needs a contiguous uint8 buffer", field="buf")
    lengths = _chunk_plan(chunk_lengths, total)
    if (lengths % 2).any():
        raise InvalidArgument("a delta changes 16-bit words: every chunk length must be even", field="chunk_lengths")
    enc = np.ascontiguousarray(encodings, np.uint8).reshape(-1)
    offsets = np.zeros(max(len(lengths), 1), np.uint64)
    sizes = np.full(max(len(lengths), 1), -1, np.int64)
    for index, offset, length in encoded:
        if not 0 <= index < len(lengths):
            raise InvalidArgument(f"chunk {index} is not one of the {len(lengths)} chunks", field="encoded")
        offsets[index], sizes[index] = offset, length
    c_spans = _span_table([(0, nbytes, offset, dtype) for offset, nbytes, dtype in spans])
    args, digests, sums, chunks = _pass_args(
        _ptr(buf) if total else None, total, lengths, piece_bytes, c_spans, len(spans)
    )
    broken = np.zeros(max(len(lengths), 1), np.uint8)
    rc = lib.ws_rebuild_digest(
        *args,
        _ptr(enc) if enc.size else None,
        enc.size,
        _ptr(offsets),
        _ptr(sizes),
        _ptr(broken),
        threads,
    )
    _check(rc, "ws_rebuild_digest")
    return RebuildResult(
        digests[: len(spans)],
        sums[: len(spans)],
        chunks[: len(lengths)],
        broken=[int(c) for c in np.flatnonzero(broken[: len(lengths)])],
    )


def digest_arrays(
    arrays: Sequence[tuple[np.ndarray, int]], piece_bytes: int, *, threads: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(piecewise xxh3-64 per array, float64 sum per array) of C-contiguous (array, dtype
    code) pairs, in place and in parallel."""
    lib = _require()
    for i, (arr, _) in enumerate(arrays):
        if not arr.flags.c_contiguous:
            raise InvalidArgument("array is not C-contiguous", field=f"arrays[{i}]")
    spans = _span_table([(_ptr(arr) if arr.nbytes else 0, arr.nbytes, 0, dtype) for arr, dtype in arrays])
    digests = np.zeros(max(len(arrays), 1), np.uint64)
    sums = np.zeros(max(len(arrays), 1), np.float64)
    rc = lib.ws_digest_spans(
        _ptr(spans),
        len(arrays),
        piece_bytes,
        _ptr(digests),
        _ptr(sums),
        threads,
    )
    _check(rc, "ws_digest_spans")
    return digests[: len(arrays)], sums[: len(arrays)]


def digest_ranges(base: np.ndarray, offsets: Sequence[int], lengths: Sequence[int], *, threads: int = 0) -> np.ndarray:
    """xxh3-64 of each range of a contiguous buffer, in parallel."""
    lib = _require()
    off = np.ascontiguousarray(offsets, np.uint64)
    ln = np.ascontiguousarray(lengths, np.uint64)
    if len(off) != len(ln):
        raise InvalidArgument("needs one length per offset", field="lengths")
    if len(off) and int((off + ln).max()) > base.nbytes:
        raise InvalidArgument("a range leaves the buffer", field="offsets")
    out = np.zeros(max(len(off), 1), np.uint64)
    rc = lib.ws_digest_ranges(_ptr(base), _ptr(off), _ptr(ln), len(off), _ptr(out), threads)
    _check(rc, "ws_digest_ranges")
    return out[: len(off)]


def copy(dst: np.ndarray, src: np.ndarray, *, threads: int = 0) -> None:
    """dst[:] = src with the shim's non-temporal stores (same-size contiguous buffers)."""
    lib = _require()
    if dst.nbytes != src.nbytes:
        raise InvalidArgument(f"{dst.nbytes} bytes != source {src.nbytes}", field="dst")
    _check(lib.ws_copy(_ptr(dst), _ptr(src), src.nbytes, threads), "ws_copy")


def copy_many(pairs: Sequence[tuple[np.ndarray, np.ndarray]], *, threads: int = 0) -> None:
    """dst[:] = src for every (dst, src) pair of same-size C-contiguous arrays, in one call
    whose threads split the bytes of all pairs (a layer's tensors into an engine's weights)."""
    lib = _require()
    for i, (dst, src) in enumerate(pairs):
        if dst.nbytes != src.nbytes:
            raise InvalidArgument(f"destination {dst.nbytes} bytes != source {src.nbytes}", field=f"pairs[{i}]")
        if not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.writeable):
            raise InvalidArgument("needs C-contiguous arrays and a writeable destination", field=f"pairs[{i}]")
    dsts = np.array([_ptr(d) for d, _ in pairs] or [0], np.uint64)
    srcs = np.array([_ptr(s) for _, s in pairs] or [0], np.uint64)
    lengths = np.array([s.nbytes for _, s in pairs] or [0], np.uint64)
    rc = lib.ws_copy_many(_ptr(dsts), _ptr(srcs), _ptr(lengths), len(pairs), threads)
    _check(rc, "ws_copy_many")


def copy_digest(dst: np.ndarray, src: np.ndarray) -> int:
    """dst[:] = src and the xxh3-64 of the bytes written to dst, in one pass on the calling
    thread with the GIL released (a received chunk into its receive buffer). The digest is
    of dst: a source another process writes to (a mapped arena) cannot pass a check with
    bytes other than the ones this process keeps."""
    n = src.nbytes
    if dst.nbytes != n:
        raise InvalidArgument(f"{dst.nbytes} bytes != source {n}", field="dst")
    if n == 0:
        return xxh3(b"")
    lib = _require()
    out = np.zeros(1, np.uint64)
    _check(lib.ws_copy_digest(_ptr(dst), _ptr(src), n, _ptr(out)), "ws_copy_digest")
    return int(out[0])


def _moved(rc: int, what: str) -> int:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


def send_views(sock_fd: int, views: Sequence[np.ndarray]) -> int:
    """Sends contiguous uint8 arrays back to back to a blocking socket; bytes sent, or OSError."""
    lib = _require()
    ptrs = np.ascontiguousarray([_ptr(v) for v in views], np.uint64)
    ln = np.ascontiguousarray([v.nbytes for v in views], np.uint64)
    rc = lib.ws_send_mem_ranges(sock_fd, _ptr(ptrs), _ptr(ln), len(views))
    return _moved(rc, "send")


def recv_verify(
    sock_fd: int, buf: np.ndarray, spans: Sequence[tuple[int, int]], digests: Sequence[int] | None
) -> np.ndarray:
    """Receives len(spans) payloads back to back into buf[offset:offset+length], hashing
    each as it lands; returns a bool array: payload i's xxh3-64 == digests[i] (all True
    where `digests` is None: received, not hashed). OSError on a socket error (timeouts:
    EAGAIN) or a short stream."""
    lib = _require()
    off = np.ascontiguousarray([s[0] for s in spans], np.uint64)
    ln = np.ascontiguousarray([s[1] for s in spans], np.uint64)
    if buf.dtype != np.uint8 or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise InvalidArgument("needs a writable contiguous uint8 buffer", field="buf")
    if len(off) and int((off + ln).max()) > buf.nbytes:
        raise InvalidArgument("a span leaves the receive buffer", field="spans")
    if digests is not None and len(digests) != len(off):
        raise InvalidArgument(f"{len(digests)} digests for {len(off)} spans", field="digests")
    want = None if digests is None else np.ascontiguousarray(digests, np.uint64)
    ok = np.zeros(max(len(off), 1), np.uint8)
    rc = lib.ws_recv_verify(
        sock_fd,
        _ptr(buf),
        _ptr(off),
        _ptr(ln),
        None if want is None else _ptr(want),
        len(off),
        _ptr(ok),
    )
    _moved(rc, "recv")
    return ok[: len(off)].astype(bool)


def delta16_encode(base: np.ndarray, now: np.ndarray, *, cap: int | None = None) -> tuple[bytes | None, int]:
    """(encoding, elements changed) of `now` against `base`: C-contiguous arrays of the
    same number of 16-bit elements (bf16, f16, uint16; bit patterns are compared, not
    floats). The encoding (native/delta.cc) is None when it would take more than `cap`
    bytes (default: `now.nbytes`, never more than the raw bytes); the count is then 0."""
    lib = _require()
    for name, a in (("base", base), ("now", now)):
        if a.dtype.itemsize != 2 or not a.flags.c_contiguous:
            raise InvalidArgument(f"needs C-contiguous 16-bit elements (bf16, f16), got {a.dtype}", field=name)
    if base.size != now.size:
        raise InvalidArgument(f"{now.size} elements != base's {base.size}", field="now")
    cap = now.nbytes if cap is None else cap
    if cap < 0:
        raise InvalidArgument(f"must be >= 0, got {cap}", field="cap")
    out = np.empty(max(cap, 1), np.uint8)
    changed = np.zeros(1, np.uint64)
    n = lib.ws_delta16_encode(_ptr(base), _ptr(now), now.size, _ptr(out), cap, _ptr(changed))
    if n == -1:
        return None, 0
    if n < 0:
        raise InvalidArgument("a null pointer", field="base")
    return out[:n].tobytes(), int(changed[0])


def delta16_decode(buf: np.ndarray, encoding: bytes | np.ndarray) -> None:
    """Applies a `delta16_encode` encoding to `buf` (the base version's 16-bit elements) in
    place. DataLoss for an encoding that is truncated, names an element past the end or a
    step of 0; `buf` may then hold part of the changes (rebuild from a clean base)."""
    lib = _require()
    if buf.dtype.itemsize != 2 or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise InvalidArgument(f"needs a writable C-contiguous array of 16-bit elements, got {buf.dtype}", field="buf")
    enc = np.frombuffer(encoding, np.uint8)
    rc = lib.ws_delta16_decode(_ptr(buf) if buf.size else None, buf.size, _ptr(enc) if enc.size else None, enc.size)
    if rc == _WS_DATA_LOSS:
        raise DataLoss(f"a delta encoding of {enc.size} bytes does not decode onto {buf.size} elements")
    _check(rc, "ws_delta16_decode")


def matrix_sums(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row sums, column sums) of a C-contiguous 2-D array of uint8, uint16 or uint32,
    each uint32 and modulo 2^32 (NumPy's `add.reduce(..., dtype=np.uint32)` along each
    axis), in one pass over the bytes (native/fingerprint.cc; the GIL is released)."""
    row_sums, col_sums, _ = float_matrix_sums(matrix, 0)
    return row_sums, col_sums


def float_matrix_sums(matrix: np.ndarray, exponent_mask: int) -> tuple[np.ndarray, np.ndarray, int]:
    """`matrix_sums` of floats' bits (uint16 for bf16/fp16, uint32 for fp32), with the
    elements whose `exponent_mask` bits are all 0 (zeros, subnormals) counted as 0, and
    how many have them all 1 (NaN, infinity), in the same one pass. exponent_mask 0:
    `matrix_sums` (0 non-finite)."""
    lib = _require()
    if matrix.ndim != 2 or matrix.dtype not in (np.uint8, np.uint16, np.uint32) or not matrix.flags.c_contiguous:
        raise InvalidArgument(
            f"needs a C-contiguous 2-D array of uint8, uint16 or uint32, got {matrix.dtype} {matrix.shape}",
            field="matrix",
        )
    if not 0 <= exponent_mask < 1 << (8 * matrix.dtype.itemsize):
        raise InvalidArgument(f"{exponent_mask:#x} does not fit {matrix.dtype}", field="exponent_mask")
    rows, cols = matrix.shape
    row_sums, col_sums, bad = np.empty(rows, np.uint32), np.empty(cols, np.uint32), np.zeros(1, np.uint64)
    rc = lib.ws_float_matrix_sums(_ptr(matrix) if matrix.size else None, rows, cols, matrix.dtype.itemsize,
                                  exponent_mask, _ptr(row_sums) if rows else None, _ptr(col_sums) if cols else None,
                                  _ptr(bad))  # fmt: skip
    _check(rc, "ws_float_matrix_sums")
    return row_sums, col_sums, int(bad[0])
