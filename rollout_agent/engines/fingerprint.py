"""Exact fingerprints of an array's bits, every engine's audit and the JAX device check alike.

An array's fingerprint is, over its bits b (each element viewed as an unsigned integer of
its width; 8-byte elements as two uint32 on a trailing axis), all modulo 2^32:
T = sum(b), and per axis k, F_k = sum(b · index_k): a wrapping integer sum, no float
tolerance. T catches any changed bit; the F_k catch elements that moved (a shard on the
wrong device, a wrong permutation). Both are linear in position, so the fingerprints of
disjoint blocks add up to the whole's (`add`, each block's F_k `shifted` by its start).
NumPy only (the native shim's one-pass sums where it is built).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    from weightsync import native
except ImportError:  # a bare JAX host without the package's dependencies (xxhash): NumPy's sums
    native = None  # type: ignore[assignment]

MASK = 0xFFFFFFFF
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}

Fingerprint = tuple[int, ...]  # (T, F_0, ..., F_{n-1}), each in [0, 2^32)


def bits(a: np.ndarray) -> np.ndarray:
    """The elements' bits as unsigned integers (8-byte elements: two uint32 on a new last
    axis). A view where `a` is contiguous."""
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize == 8:
        return a.view(np.uint32).reshape(*a.shape, 2)
    return a.view(_UINT[a.dtype.itemsize])


def array_fingerprint(b: np.ndarray) -> Fingerprint:
    """(T, F_0, ..., F_{n-1}) of unsigned integers `b` in their own layout, in two passes
    over the bytes: `b` seen as a matrix of leading by trailing axes (rows of at least
    ~4096 elements where the shape allows), its row sums give the leading axes' per-index
    sums and its column sums the trailing axes'; then small weighted sums."""
    return _fingerprint(b, matrix_sums)


def canonical_fingerprint(b: np.ndarray, exponent_mask: int) -> tuple[Fingerprint, int]:
    """`array_fingerprint` of floats' bits `b` (uint16 or uint32: bf16, fp16, fp32) with every
    element whose `exponent_mask` bits are all 0 (-0, +0, subnormals) taken as +0, and the
    count of elements whose exponent bits are all 1 (NaN, infinity): one pass over the bytes
    in the native shim, NumPy's canonical copy otherwise."""
    b = np.ascontiguousarray(b)  # as `bits` makes it (a scalar becomes 1-d)
    if native is not None and native.available() and b.ndim >= 2 and b.flags.c_contiguous:
        found = [0]

        def sums(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            rows, cols, found[0] = native.float_matrix_sums(matrix, exponent_mask)
            return rows, cols

        return _fingerprint(b, sums), found[0]
    mask = b.dtype.type(exponent_mask)
    exponent = b & mask
    return array_fingerprint(np.where(exponent == 0, b.dtype.type(0), b)), int(np.count_nonzero(exponent == mask))


def _fingerprint(b: np.ndarray, sums: Any) -> Fingerprint:
    if b.ndim == 0:
        return (int(b) & MASK,)
    if b.size == 0:
        return (0,) * (b.ndim + 1)
    if b.ndim == 1:
        return (_total(b), _weighted(b))
    split, width = b.ndim - 1, b.shape[-1]
    while split > 1 and width < 4096:
        split -= 1
        width *= b.shape[split]
    rows, cols = sums(b.reshape(-1, width))
    rows, cols = rows.reshape(b.shape[:split]), cols.reshape(b.shape[split:])
    out = [_total(cols)]
    for k in range(b.ndim):
        part, axis = (rows, k) if k < split else (cols, k - split)
        others = tuple(a for a in range(part.ndim) if a != axis)
        out.append(_weighted(np.add.reduce(part, axis=others, dtype=np.uint32) if others else part))
    return tuple(out)


def matrix_sums(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row sums, column sums) of a 2-D array of unsigned integers, each uint32 modulo
    2^32: one pass in the native shim where it is built, two NumPy reductions otherwise."""
    if native is not None and native.available() and matrix.dtype.itemsize in (1, 2, 4) and matrix.flags.c_contiguous:
        return native.matrix_sums(matrix)
    return np.add.reduce(matrix, axis=1, dtype=np.uint32), np.add.reduce(matrix, axis=0, dtype=np.uint32)


def _total(m: np.ndarray) -> int:
    return int(np.add.reduce(m.reshape(-1), dtype=np.uint64)) & MASK


def _weighted(m: np.ndarray) -> int:
    """sum(j · m[j]) mod 2^32 (uint64 wraps modulo 2^64, a multiple of 2^32)."""
    return int((m.astype(np.uint64) * np.arange(m.size, dtype=np.uint64)).sum()) & MASK


def add(fps: Any) -> Fingerprint:
    """The sum of fingerprints of disjoint regions of one leaf."""
    total: list[int] | None = None
    for fp in fps:
        total = list(fp) if total is None else [a + b for a, b in zip(total, fp)]
    return tuple(x & MASK for x in (total or ()))


def shifted(local: Sequence[int], start: Sequence[int]) -> Fingerprint:
    """A block's fingerprint in leaf coordinates, from its own (local) one and its start."""
    t = local[0]
    return tuple(x & MASK for x in [t, *(f + s * t for f, s in zip(local[1:], start)), *local[1 + len(start) :]])
