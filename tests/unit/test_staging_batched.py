"""The device path's staging of shards that arrive one by one, or cut into blocks and staged
on a pool of threads, writes the same bytes and specs as one fused pass over whole shards."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_agent.device.staging_pool import staging_pool
from trainer_agent.stage.staging import Block, HostShard, plan_layout, stage_batched, stage_blocks, stage_shards
from weightsync import native
from weightsync.errors import InternalError
from weightsync.layout import pack_limit

ENGINES = ["python", *(["native"] if native.available() else [])]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=12),
    chunk_bytes=st.sampled_from([4096, 8192, 65536]),
    batch_bytes=st.integers(1, 100_000),
    engine=st.sampled_from(ENGINES),
)
def test_batched_staging_equals_one_fused_pass(
    sizes: list[int], chunk_bytes: int, batch_bytes: int, engine: str
) -> None:
    rng = np.random.default_rng(len(sizes) * 7919 + chunk_bytes)
    shards = [
        HostShard(f"t{i}", rng.standard_normal(n // 4 or 0).astype(np.float32), (n // 4,), (0,))
        for i, n in enumerate(sizes)
    ]
    layout = plan_layout(shards)
    want = np.full(layout.total_bytes + 64, 0xAB, np.uint8)
    got = np.full(layout.total_bytes + 64, 0xCD, np.uint8)  # other garbage: padding must be zeroed
    ref = stage_shards(want, shards, layout, chunk_bytes, engine=engine)
    out = stage_batched(got, layout, iter(shards), chunk_bytes, batch_bytes=batch_bytes, engine=engine)
    assert out == ref
    assert want[: layout.total_bytes].tobytes() == got[: layout.total_bytes].tobytes()


class CountingWindow:
    """A `StagingWindow` that checks what it is told: every run handed over is staged once."""

    def __init__(self) -> None:
        self.submitted_bytes = self.staged_bytes = 0

    def submitted(self, nbytes: int) -> None:
        self.submitted_bytes += nbytes

    def staged(self, nbytes: int) -> None:
        self.staged_bytes += nbytes


def cut(shards: list[HostShard], chunk_bytes: int, pieces: list[int]) -> list[Block]:
    """Each shard with chunks of its own cut into blocks of a few chunks (counts from
    `pieces`, in turn), the others whole: what the device path hands to staging."""
    blocks, turn = [], 0
    for s in shards:
        flat = s.data.reshape(-1)
        if s.nbytes <= pack_limit(chunk_bytes):
            blocks.append(Block(s, 0, flat))
            continue
        per = chunk_bytes // flat.itemsize
        at = 0
        while at < flat.size:
            n = pieces[turn % len(pieces)] * per
            turn += 1
            blocks.append(Block(s, at * flat.itemsize, flat[at : at + n]))
            at += n
    return blocks


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60_000), min_size=1, max_size=10),
    chunk_bytes=st.sampled_from([4096, 8192]),
    pieces=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    batch_bytes=st.integers(1, 40_000),
    engine=st.sampled_from(ENGINES),
    workers=st.sampled_from([0, 1, 3]),
)
def test_blocks_staged_on_a_pool_equal_one_fused_pass_over_whole_shards(
    sizes: list[int], chunk_bytes: int, pieces: list[int], batch_bytes: int, engine: str, workers: int
) -> None:
    rng = np.random.default_rng(len(sizes) * 31 + chunk_bytes + sum(pieces))
    # integers over 64: every float64 sum is exact, in any order and any cut
    shards = [
        HostShard(f"t{i}", (rng.integers(-128, 128, n // 4) / 64).astype(np.float32), (n // 4,), (0,))
        for i, n in enumerate(sizes)
    ]
    layout = plan_layout(shards)
    want = np.full(layout.total_bytes + 64, 0xAB, np.uint8)
    got = np.full(layout.total_bytes + 64, 0xCD, np.uint8)
    ref = stage_shards(want, shards, layout, chunk_bytes, engine=engine)
    window = CountingWindow()
    blocks = cut(shards, chunk_bytes, pieces)
    with ThreadPoolExecutor(workers) if workers else contextlib.nullcontext() as pool:
        specs, chunks, encodings = stage_blocks(
            got, layout, iter(blocks), chunk_bytes, batch_bytes=batch_bytes, engine=engine, pool=pool, window=window
        )
    assert (specs, chunks) == ref and encodings == []
    assert want[: layout.total_bytes].tobytes() == got[: layout.total_bytes].tobytes()
    assert window.submitted_bytes == window.staged_bytes == sum(b.nbytes for b in blocks)


def test_a_stream_that_differs_from_the_layout_is_refused() -> None:
    shards = [HostShard(f"t{i}", np.ones(1000, np.float32), (1000,), (0,)) for i in range(3)]
    layout = plan_layout(shards)
    slot = np.zeros(layout.total_bytes, np.uint8)
    with pytest.raises(InternalError, match="not the one the layout planned"):
        stage_batched(slot, layout, iter(shards[::-1]), 4096, batch_bytes=1)
    with pytest.raises(InternalError, match="ended after"):
        stage_batched(slot, layout, iter(shards[:2]), 4096, batch_bytes=1 << 30)


def test_blocks_out_of_order_or_cut_across_shared_chunks_are_refused() -> None:
    big = HostShard("big", np.arange(4096, dtype=np.float32), (4096,), (0,))  # 16 KiB: chunks of its own
    small = HostShard("small", np.ones(64, np.float32), (64,), (0,))  # 256 B: shares a chunk with "last"
    last = HostShard("last", np.ones(8, np.float32), (8,), (0,))
    layout = plan_layout([big, small, last])
    slot = np.zeros(layout.total_bytes, np.uint8)
    flat = big.data
    skipped = [Block(big, 0, flat[:1024]), Block(big, 8192, flat[2048:])]
    with pytest.raises(InternalError, match="does not continue shard 0"):
        stage_blocks(slot, layout, iter(skipped), 4096, batch_bytes=1)
    halves = [Block(big, 0, flat), Block(small, 0, small.data[:32]), Block(small, 128, small.data[32:])]
    halves.append(Block(last, 0, last.data))
    with pytest.raises(InternalError, match="'small' was cut into blocks but its chunks are not its own"):
        stage_blocks(slot, layout, iter(halves), 4096, batch_bytes=1)
    with pytest.raises(InternalError, match="ended after 1 of 3"):
        whole_big = [Block(big, 0, flat[:1024]), Block(big, 4096, flat[1024:])]
        stage_blocks(slot, layout, iter(whole_big), 4096, batch_bytes=1)


def test_a_stream_that_fails_midway_returns_only_once_no_run_still_writes_into_the_slot() -> None:
    """The pool's threads outlive the call (`staging_pool`): when the blocks' stream fails,
    every run already handed over is staged before the error reaches the caller."""
    shards = [HostShard(f"t{i}", np.ones(4096, np.float32), (4096,), (0,)) for i in range(8)]
    layout = plan_layout(shards)
    slot = np.zeros(layout.total_bytes, np.uint8)
    window = CountingWindow()
    gate = threading.Event()

    def blocks() -> Iterator[Block]:
        for s in shards[:5]:
            yield Block(s, 0, s.data)
        gate.set()
        raise RuntimeError("the copies failed")

    def slow(fn: Any, *args: Any) -> Any:  # each run waits until the stream has failed
        gate.wait(10)
        time.sleep(0.05)
        return fn(*args)

    with ThreadPoolExecutor(2) as real:

        class SlowPool:
            def submit(self, fn: Any, *args: Any) -> Any:
                return real.submit(slow, fn, *args)

        with pytest.raises(RuntimeError, match="the copies failed"):
            stage_blocks(slot, layout, blocks(), 4096, batch_bytes=1, pool=SlowPool(), window=window)  # type: ignore[arg-type]
        assert window.submitted_bytes == window.staged_bytes == 5 * 4096 * 4  # all five staged by then


_FORK_CHECK = """
import os
from trainer_agent.device.staging_pool import staging_pool
pool = staging_pool(3)
pid = os.fork()
if pid == 0:  # the child: a pool of its own, whose threads run
    ok = staging_pool(3) is not pool and staging_pool(3).submit(lambda: 7).result(timeout=10) == 7
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def test_the_staging_pool_is_one_per_thread_count_for_the_process_and_a_childs_own() -> None:
    pool = staging_pool(3)
    assert staging_pool(3) is pool and staging_pool(2) is not pool
    idents = {pool.submit(threading.get_ident).result() for _ in range(20)}
    assert staging_pool(3).submit(threading.get_ident).result() in idents  # the same threads serve on
    # a fork in a process of its own (JAX, imported here, warns at any fork)
    root = Path(__file__).resolve().parents[2]
    child = subprocess.run([sys.executable, "-c", _FORK_CHECK], cwd=root, timeout=60, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
