"""Byte layout of a rank's part: shard placement and chunking."""

from __future__ import annotations

from collections.abc import Sequence

SHARD_ALIGN_BYTES = 256  # cache-line and AVX-512 friendly; padding bytes are zero
# The largest round chunk size below gRPC's 4 MiB message limit; measured best for grpc and tcp.
DEFAULT_CHUNK_BYTES = 3 << 20


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


def plan_chunks(total_bytes: int, chunk_bytes: int, shards: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """(offset, length) of each chunk covering [0, total_bytes) exactly, in order.

    Without `shards` ((offset, nbytes), in order) the chunks are a fixed grid. With them,
    chunks follow the shards so that staging hashes each byte once: a shard larger than
    `pack_limit(chunk_bytes)` gets chunks of its own, one per `chunk_bytes` piece counted
    from its first byte (its piecewise digest is then made of chunk digests), while smaller
    shards and the alignment gaps are packed together into chunks of up to `chunk_bytes`.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunks: list[tuple[int, int]] = []

    def grid(start: int, end: int) -> None:  # [start, end) in chunk_bytes pieces from start
        chunks.extend((off, min(chunk_bytes, end - off)) for off in range(start, end, chunk_bytes))

    open_at = 0  # start of the packed chunk being filled; it ends at `cursor`
    cursor = 0
    limit = pack_limit(chunk_bytes)
    for offset, nbytes in shards:
        if nbytes > limit:
            grid(open_at, offset)  # what is packed so far, and the gap before this shard
            grid(offset, offset + nbytes)
            open_at = cursor = offset + nbytes
        else:
            if offset + nbytes - open_at > chunk_bytes:
                grid(open_at, cursor)
                open_at = cursor
            cursor = offset + nbytes
    grid(open_at, total_bytes)
    return chunks


def pack_limit(chunk_bytes: int) -> int:
    """Shards up to this size share chunks (and are hashed twice when staged: their own
    digest and their chunk's); larger ones get chunks of their own."""
    return chunk_bytes // 16
