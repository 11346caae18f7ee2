"""Byte layout of a rank's part: shard placement and chunking."""

from __future__ import annotations

SHARD_ALIGN_BYTES = 256  # cache-line and AVX-512 friendly; padding bytes are zero


def align_up(value: int, align: int) -> int:
    """Rounds value up to a multiple of align."""
    return (value + align - 1) // align * align


def place_shards(nbytes: list[int], align: int = SHARD_ALIGN_BYTES) -> tuple[list[int], int]:
    """Offsets for consecutive shards, each aligned; returns (offsets, total_bytes).

    total_bytes is the end of the last shard (not padded), so chunks cover no trailing
    padding.
    """
    offsets = []
    cursor = 0
    for n in nbytes:
        cursor = align_up(cursor, align)
        offsets.append(cursor)
        cursor += n
    return offsets, cursor


def plan_chunks(total_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk covering [0, total_bytes) exactly, in order."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return [(off, min(chunk_bytes, total_bytes - off)) for off in range(0, total_bytes, chunk_bytes)]
