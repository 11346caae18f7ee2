"""Assembly: tensors from shard boxes in per-rank receive buffers, and their digests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from weightsync import native
from weightsync.digests import combine_shard_digests, float64_sum, piecewise_xxh3
from weightsync.dtypes import dtype_info, native_code
from weightsync.manifest import Manifest, ShardSpec, TensorSpec, exact_sum


def _as_bytes(arr: np.ndarray) -> np.ndarray:
    """A uint8 view (xxhash cannot take every dtype's buffer format, e.g. bfloat16)."""
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _box(s: ShardSpec) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(s.start, s.stop))


def _is_whole(spec: TensorSpec, s: ShardSpec) -> bool:
    return all(a == 0 for a in s.start) and tuple(s.stop) == tuple(spec.shape)


def assemble_tensor(
    spec: TensorSpec,
    shards: list[tuple[int, ShardSpec]],
    buffers: Mapping[int, np.ndarray],
    bases: Mapping[int, int] | None = None,
    reuse: dict[str, np.ndarray] | None = None,
) -> np.ndarray:
    """One tensor from its shards; buffers[rank][0] is byte bases[rank] of that rank's part.

    Held whole by one rank: a zero-copy view. Split across ranks: copied box by box into
    an array kept in `reuse` for the next version (persistent buffers avoid re-faulting
    fresh pages every step).
    """
    dt = dtype_info(spec.dtype).numpy

    def shard_bytes(rank: int, s: ShardSpec) -> np.ndarray:
        if s.nbytes == 0:
            return np.empty(0, np.uint8)
        start = s.offset - (bases[rank] if bases else 0)
        return buffers[rank][start : start + s.nbytes]

    if len(shards) == 1 and _is_whole(spec, shards[0][1]):
        rank, s = shards[0]
        return shard_bytes(rank, s).view(dt).reshape(spec.shape)
    arr = reuse.get(spec.name) if reuse is not None else None
    if arr is None or arr.shape != spec.shape or arr.dtype != dt:
        arr = np.empty(spec.shape, dt)
        if reuse is not None:
            reuse[spec.name] = arr
    for rank, s in shards:
        arr[_box(s)] = shard_bytes(rank, s).view(dt).reshape(s.shape)
    return arr


def assemble(
    manifest: Manifest, buffers: Mapping[int, np.ndarray], reuse: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Every tensor of the manifest as an array of its global shape (see assemble_tensor).
    Arrays in `reuse` of tensors this manifest does not split across ranks are dropped from it."""
    reuse = reuse if reuse is not None else {}
    tensors = manifest.tensors
    out = {
        name: assemble_tensor(tensors[name], shards, buffers, None, reuse)
        for name, shards in manifest.shards_of().items()
    }
    for name in [n for n, arr in reuse.items() if out.get(n) is not arr]:
        del reuse[name]  # a tensor renamed, or held whole by one rank now
    return out


def tensor_digest(arr: np.ndarray, shards: list[ShardSpec], piece_bytes: int) -> tuple[int, float]:
    """(xxh3 by the manifest's rule, float64 sum) of an assembled tensor: each shard box's
    piecewise xxh3 (pieces of the manifest's chunk_bytes), combined across shards.

    Computed over the assembled array itself, i.e. over what is handed to the engine.
    """
    if len(shards) == 1 and all(a == 0 for a in shards[0].start) and tuple(shards[0].stop) == arr.shape:
        digest = piecewise_xxh3(_as_bytes(arr), piece_bytes)
    else:
        digest = combine_shard_digests(piecewise_xxh3(_as_bytes(arr[_box(s)]), piece_bytes) for s in shards)
    return digest, float64_sum(arr)


def held_whole(manifest: Manifest) -> set[str]:
    """Names of the tensors one shard holds whole, with no other shard (an empty one in
    another rank included): each assembles to a view of that shard's bytes, and its digest
    is that shard's."""
    return {
        name
        for name, shards in manifest.shards_of().items()
        if len(shards) == 1 and _is_whole(manifest.tensors[name], shards[0][1])
    }


def digest_all(
    manifest: Manifest,
    tensors: Mapping[str, np.ndarray],
    known: Mapping[str, tuple[int, float]] | None = None,
    names: Iterable[str] | None = None,
    threads: int = 0,
) -> dict[str, tuple[int, float]]:
    """Per-tensor (xxh3, sum) over assembled tensors, in manifest order (`names`: only
    those of the manifest's tensors; `threads`: the native pass's, 0 for every core).

    Tensors held whole by one shard go through the native shim in one parallel pass
    (xxh3 and float64 sum per block while it is in cache); the rest through Python.
    `known`: digests already made from the very bytes these tensors view (a delta's
    rebuild pass digests what it rebuilt), taken as they are.
    """
    shards = manifest.shards_of()
    known = known or {}
    asked = None if names is None else set(names)
    wanted = [n for n in manifest.tensors if asked is None or n in asked]
    one_shard = held_whole(manifest) if native.available() else set()
    whole = [name for name in wanted if name not in known and name in one_shard and tensors[name].flags.c_contiguous]
    out: dict[str, tuple[int, float]] = {n: known[n] for n in wanted if n in known}
    if whole:
        arrays = [(tensors[n], native_code(tensors[n].dtype)) for n in whole]
        digests, sums = native.digest_arrays(arrays, manifest.chunk_bytes, threads=threads)
        out.update((n, (int(d), float(s))) for n, d, s in zip(whole, digests, sums))
    for name in wanted:
        if name not in out:
            out[name] = tensor_digest(tensors[name], [s for _, s in shards[name]], manifest.chunk_bytes)
    return {name: out[name] for name in wanted}


@dataclass(frozen=True)
class TensorCheck:
    """A verified version's tensor check: the xxh3 digests its bytes matched (the
    manifest's) and the rule that made them, so that an engine holding those bytes in the
    same layout can take them as its audit's reference instead of reading the bytes again
    (`engines.audit_reading.VerifiedDigests`)."""

    manifest: Manifest

    def expected(self) -> Mapping[str, int]:
        return self.manifest.tensor_digests()

    def digests(self, arrays: Mapping[str, np.ndarray]) -> dict[str, int]:
        """xxh3 of each of `arrays` (named as the manifest's tensors) by the manifest's rule,
        on one thread (an audit leaves the engine's other cores alone)."""
        return {n: d for n, (d, _) in digest_all(self.manifest, arrays, names=arrays, threads=1).items()}


def mismatched(manifest: Manifest, digests: Mapping[str, tuple[int, float]]) -> list[tuple[str, int, int]]:
    """(name, assembled xxh3, manifest xxh3) of each tensor whose digests differ, in order."""
    expected = manifest.tensor_digests()
    return [(name, got, expected[name]) for name, (got, _) in digests.items() if got != expected[name]]


def describe_difference(name: str, got: int, expected: int) -> str:
    return f"tensor {name!r}: assembled xxh3 {got:016x} != manifest {expected:016x}"


def first_difference(manifest: Manifest, digests: Mapping[str, tuple[int, float]]) -> str | None:
    """The first tensor whose assembled digest differs from the manifest's, if any."""
    bad = mismatched(manifest, digests)
    return describe_difference(*bad[0]) if bad else None


def grand_total(digests: Mapping[str, tuple[int, float]]) -> float:
    return exact_sum(s for _, s in digests.values())
