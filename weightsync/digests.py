"""Digest rules shared by publishers, rollouts and the coordinator (xxh3-64, sha256)."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

# Chunk digests are xxh3-64; shard digests follow the piecewise rule (`piecewise_xxh3`).
# Part and manifest digests cover this name, so a trainer, coordinator or rollout from
# before the piecewise rule is refused at seal or manifest time, not at the tensor check.
DIGEST_ALGORITHM = "xxh3-64-piecewise"


def xxh3(data: Any) -> int:
    """xxh3-64 of a bytes-like object (bytes, memoryview, contiguous ndarray)."""
    return xxhash.xxh3_64_intdigest(data)


def float64_sum(arr: np.ndarray) -> float:
    """The layout-invariant cross-check: float64 sum of the elements (bool: count of True).

    Trainers sum what they stage and rollouts what they assembled, with this one rule.
    """
    if arr.dtype == np.bool_:
        return float(np.count_nonzero(arr))
    return float(np.sum(arr, dtype=np.float64))


def piecewise_xxh3(data: Any, piece_bytes: int) -> int:
    """A shard's digest: xxh3-64 of its bytes when they fit in one piece, else xxh3-64 of
    the little-endian u64 xxh3-64s of its consecutive `piece_bytes` pieces.

    The piece size is the part's `chunk_bytes`, and the chunk plan gives every piece of a
    large shard a chunk of its own, so staging hashes each byte once: a shard's digest is
    derived from its chunks' digests (the native shim and this function agree bit for bit).
    """
    view = memoryview(data).cast("B")
    if len(view) <= piece_bytes:
        return xxh3(view)
    return combine_pieces([xxh3(view[i : i + piece_bytes]) for i in range(0, len(view), piece_bytes)])


def combine_pieces(piece_digests: Sequence[int]) -> int:
    """The piecewise rule's last step: one piece's digest as is, several as xxh3-64 of
    their little-endian u64 digests (a shard staged in blocks gets its digest from its
    chunks' this way)."""
    if len(piece_digests) == 1:
        return int(piece_digests[0])
    return xxh3(struct.pack(f"<{len(piece_digests)}Q", *piece_digests))


def combine_shard_digests(shard_digests: Iterable[int]) -> int:
    """A tensor's digest from its shards' digests, in canonical shard order.

    One shard: the shard digest itself (the xxh3 of the whole tensor). Several: xxh3-64
    of the little-endian u64 shard digests, concatenated. Every party (trainer ranks,
    coordinator, rollout) derives tensor digests with this one rule.
    """
    digests = list(shard_digests)
    if len(digests) == 1:
        return digests[0]
    return xxh3(struct.pack(f"<{len(digests)}Q", *digests))


def access_token(token_key: str, version: int) -> str:
    """The per-version token tcp and relay servers require of readers: HMAC-SHA256 of the
    version under the session's token key (the coordinator's; trainers receive it on
    attach, rollouts receive per-version tokens with their leases)."""
    return hmac.new(token_key.encode(), str(version).encode(), hashlib.sha256).hexdigest()[:32]


def canonical_json(obj: Any) -> bytes:
    """The canonical encoding: sorted keys, no whitespace, UTF-8."""
    return _canonical(obj).encode()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# Items per json.dumps call in canonical_json_sliced: ~0.5 ms of encoding each (a shard's
# descriptor is the longest), so another thread waits at most that long for the GIL. At
# 2,048 items (4 ms a slice) a status call, which takes the GIL back after each SQLite
# call, waited 50-150 ms behind a 100,000-tensor publish; encoding as a whole is as fast.
SLICE_ITEMS = 256


def canonical_json_sliced(obj: dict[str, Any]) -> bytes:
    """canonical_json of a dict whose lists may be long (a part's 10^5 descriptors), the
    lists encoded a slice at a time. The same bytes; but json's C encoder holds the GIL
    for the whole of one call (most of a second for such a part), stalling every other
    thread of the process (the coordinator's event loop, its status calls), and between
    slices other threads run."""
    fields = []
    for key in sorted(obj):
        value = obj[key]
        if isinstance(value, list) and len(value) > SLICE_ITEMS:
            slices = (_canonical(value[i : i + SLICE_ITEMS])[1:-1] for i in range(0, len(value), SLICE_ITEMS))
            encoded = "[" + ",".join(slices) + "]"
        else:
            encoded = _canonical(value)
        fields.append(f"{_canonical(key)}:{encoded}")
    return ("{" + ",".join(fields) + "}").encode()


def sha256_hex(data: bytes) -> str:
    """sha256 hex of bytes."""
    return hashlib.sha256(data).hexdigest()


def hex64(value: int) -> str:
    """A u64 digest as 16 hex digits."""
    return f"{value:016x}"
