"""Chunk planning around shards and the piecewise shard digest."""

from __future__ import annotations

import struct

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.digests import piecewise_xxh3
from weightsync.layout import pack_limit, place_shards, plan_chunks


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 50_000), max_size=30), chunk=st.integers(4096, 20_000))
def test_chunks_tile_the_part_and_large_shards_own_their_pieces(sizes: list[int], chunk: int) -> None:
    offsets, total = place_shards(sizes)
    chunks = plan_chunks(total, chunk, list(zip(offsets, sizes)))
    cursor = 0
    for off, length in chunks:
        assert off == cursor and 0 < length <= chunk
        cursor += length
    assert cursor == total
    starts = dict(chunks)
    for off, n in zip(offsets, sizes):
        if n > pack_limit(chunk):
            for p in range(off, off + n, chunk):
                assert starts.get(p) == min(chunk, off + n - p), (off, n, p)


def test_small_shards_share_chunks() -> None:
    sizes = [100, 2000, 64, 50_000, 8, 8]
    offsets, total = place_shards(sizes)
    chunks = plan_chunks(total, 32_768, list(zip(offsets, sizes)))
    # the three small shards (and their gaps) in one chunk, the large one in two, the tail in one
    assert [length for _, length in chunks] == [offsets[3], 32_768, 50_000 - 32_768, total - offsets[3] - 50_000]


def test_grid_plan_without_shards() -> None:
    assert plan_chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert plan_chunks(0, 4) == []


@given(data=st.binary(max_size=5000), piece=st.integers(1, 6000))
def test_piecewise_xxh3_definition(data: bytes, piece: int) -> None:
    got = piecewise_xxh3(data, piece)
    if len(data) <= piece:
        assert got == xxhash.xxh3_64_intdigest(data)
    else:
        parts = [xxhash.xxh3_64_intdigest(data[i : i + piece]) for i in range(0, len(data), piece)]
        assert got == xxhash.xxh3_64_intdigest(struct.pack(f"<{len(parts)}Q", *parts))
