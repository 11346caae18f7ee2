"""trainer_agent/device/host_heap.py with the real C library: the device path holds glibc's freed
heap once per process, and a block freed there serves the next one."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.unit.helpers import python_path

ROOT = Path(__file__).resolve().parents[2]

# in a process of its own: the thresholds stay set for the life of a process
_STAGE_TWICE = """
import json, logging, sys, threading, numpy as np
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from trainer_agent.device import host_heap
from trainer_agent.stage import params
from trainer_agent.settings import PublisherSettings
from trainer_agent.publish.stage_plan import stage_device
from trainer_agent.stage.staging import plan_layout
from trainer_agent.stage.params import shard_metas
import jax.numpy as jnp
params.HOST_MEMORY_PLATFORMS = frozenset()  # CPU devices take the accelerator's branch
hold = sys.argv[1] == "hold"
s = PublisherSettings(coordinator="127.0.0.1:1", chunk_bytes=4096, d2h_block_bytes=8192, d2h_hold_freed_heap=hold)
values = {"w": jnp.arange(6000, dtype=jnp.float32), "b": jnp.ones(10, jnp.float32)}
layout = plan_layout([m for n, v in values.items() for m in shard_metas(n, v)])
for _ in range(2):
    stage_device(np.zeros(layout.total_bytes, np.uint8), layout, values, s)
out = {"held": host_heap._held, "block_heaps": host_heap.block_heaps.count}
if hold:
    block = np.ones(20 << 20, np.uint8)  # under the 32 MiB mmap threshold: from the heap
    out["with_block"] = host_heap.heap_stats()
    del block
    out["after"] = host_heap.heap_stats()
    def in_a_thread():  # a publish worker's arena: heaps of its own, kept when a free empties one
        blocks = [np.ones(20 << 20, np.uint8) for _ in range(3)]
        out["thread_with_blocks"] = host_heap.heap_stats()["arena"]
        blocks.clear()
        out["thread_after"] = host_heap.heap_stats()["arena"]
    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
print(json.dumps(out))
"""


def _script_json(script: str, arg: str, env_pad: int = 0, tunables: str = "") -> tuple[dict, str]:
    """What `script` prints last (JSON) and its log, run with `arg` in a process of its
    own (mallopt's settings stay for the life of a process; JAX on the CPU); `env_pad`
    bytes of environment shift where the interpreter's early mallocs land; `tunables`:
    glibc's, read at the interpreter's start (GLIBC_TUNABLES)."""
    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": python_path(ROOT), "PATH": "/usr/bin:/bin", "PAD": "x" * env_pad}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run(
        [sys.executable, "-c", script, arg], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_the_device_path_holds_freed_heap_once_and_a_freed_block_stays_for_the_next() -> None:
    r, log = _script_json(_STAGE_TWICE, "hold")
    assert r["held"]
    assert log.count("glibc's trim and mmap thresholds and top pad (64 MiB) held") == 1  # two publishes, set once
    assert r["after"]["arena"] == r["with_block"]["arena"]  # not trimmed back to the kernel
    assert r["after"]["free"] - r["with_block"]["free"] > 19 << 20  # free in it, for the next block
    assert r["thread_after"] == r["thread_with_blocks"]  # nor a thread arena's heaps unmapped
    assert r["block_heaps"] >= 1  # the heaps kept: where the blocks landed is counted


def test_with_the_setting_off_the_device_path_leaves_malloc_alone() -> None:
    r, log = _script_json(_STAGE_TWICE, "leave")
    assert not r["held"] and "thresholds" not in log
    assert r["block_heaps"] == 0  # heaps glibc may unmap: their addresses say nothing, not counted


# 220 MiB of heap (10 blocks of 22 MiB, under the mmap threshold) freed as one top, past a
# trim threshold of 64 MiB. np.empty touches no page, so little of it is resident. The
# account is read once before: its first reading mallocs (ctypes' lookup), and a chunk
# placed above the blocks would keep them from the top in some environments (CI's did).
_FREE_A_TOP = """
import json, sys, numpy as np
from trainer_agent.device import host_heap
assert host_heap.hold_freed_memory(trim_bytes=None if sys.argv[1] == "never" else 64 << 20)
host_heap.heap_stats()
blocks = [np.empty(22 << 20, np.uint8) for _ in range(10)]
with_blocks = host_heap.heap_stats()["arena"]
del blocks
print(json.dumps({"with_blocks": with_blocks, "after": host_heap.heap_stats()["arena"]}))
"""


# Environments of these sizes shift the interpreter's early mallocs; without the warm reading,
# a pad of 1,900 bytes left a chunk above the blocks on the dev machine (CI's clone failed so).
_ENV_PADS = range(0, 3200, 100)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
@pytest.mark.parametrize("trim", ["never", "64M"])
def test_a_heap_top_past_the_trim_threshold_goes_back_unless_trimming_is_off(trim: str) -> None:
    with ThreadPoolExecutor(4) as pool:
        runs = dict(zip(_ENV_PADS, pool.map(lambda pad: _script_json(_FREE_A_TOP, trim, pad)[0], _ENV_PADS)))
    assert all(r["with_blocks"] > 10 * (22 << 20) for r in runs.values())
    if trim == "never":  # the whole top stays with the process
        assert [pad for pad, r in runs.items() if r["after"] != r["with_blocks"]] == []
    else:  # glibc gave the top back
        assert [pad for pad, r in runs.items() if r["after"] >= r["with_blocks"] - (150 << 20)] == []


# A thread other than the main one allocates from an arena of its own, made of 64 MiB heaps:
# eight 18 MiB blocks (under the mmap threshold) span three, freed every round.
_FREE_IN_A_THREAD = """
import json, sys, threading, numpy as np
from trainer_agent.device import host_heap
pad = host_heap.HEAP_BYTES if sys.argv[1] == "kept" else host_heap.TOP_PAD_DEFAULT
assert host_heap.hold_freed_memory(top_pad_bytes=pad)
host_heap.heap_stats()
rounds = []
def publish_worker():
    for _ in range(4):
        blocks = [np.ones(18 << 20, np.uint8) for _ in range(8)]
        with_blocks = host_heap.heap_stats()["arena"]
        blocks.clear()
        rounds.append((with_blocks, host_heap.heap_stats()["arena"]))
worker = threading.Thread(target=publish_worker)
worker.start()
worker.join()
print(json.dumps(rounds))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
@pytest.mark.parametrize("heaps", ["kept", "glibc's pad"])
def test_a_thread_arenas_heaps_stay_mapped_only_with_a_heap_sized_top_pad(heaps: str) -> None:
    rounds, _ = _script_json(_FREE_IN_A_THREAD, "kept" if heaps == "kept" else "default")
    assert all(with_blocks > 8 * (18 << 20) for with_blocks, _ in rounds)
    if heaps == "kept":  # every heap stays, for the next round's blocks
        assert all(after == with_blocks for with_blocks, after in rounds)
    else:  # whatever the trim threshold, glibc unmaps a heap the frees left empty, every round
        assert all(after < with_blocks for with_blocks, after in rounds)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_heap_stats_counts_the_free_chunks_beside_the_bytes() -> None:
    from trainer_agent.device.host_heap import heap_stats

    stats = heap_stats()
    assert set(stats) == {"arena", "mapped", "free", "free_chunks", "fast_chunks"}
    assert stats["free_chunks"] >= 1 and stats["fast_chunks"] >= 0


# 1000 chunks of 64 bytes freed (past the 7 of each size glibc's per-thread cache keeps)
_FREE_SMALL = """
import ctypes, json, sys
from trainer_agent.device import host_heap
if sys.argv[1] == "off":
    assert host_heap.set_max_fast(0)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
mallinfo2 = libc.mallinfo2
mallinfo2.restype = host_heap._MallInfo2  # looked up first: a large request on the way would merge the fastbins
held = [libc.malloc(64) for _ in range(2000)]
odd = held[::2]
for p in odd:  # every other one: neighbours stay in use, so nothing merges with them
    libc.free(p)
m = mallinfo2()
print(json.dumps({"fast_chunks": m.smblks}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
@pytest.mark.parametrize("fastbins", ["on", "off"])
def test_with_fastbins_off_small_frees_are_not_kept_in_fastbins(fastbins: str) -> None:
    stats, _ = _script_json(_FREE_SMALL, fastbins)
    if fastbins == "on":
        assert stats["fast_chunks"] >= 900
    else:
        assert stats["fast_chunks"] == 0


_ARENAS = """
import json, sys, threading, numpy as np
from trainer_agent.device import host_heap
host_heap.hold_freed_memory()
out = {"before": host_heap.arena_stats()}
def blocks():  # a thread's 18 MiB blocks, freed: they stay in its arena (heaps held)
    xs = [np.ones(18 << 20, np.uint8) for _ in range(6)]
    del xs
for _ in range(int(sys.argv[1])):
    t = threading.Thread(target=blocks)
    t.start()
    t.join()
out["after"] = host_heap.arena_stats()
out["summary"] = host_heap.arenas_summary(out["after"])
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_info is glibc's")
def test_arena_stats_show_the_arena_a_threads_freed_blocks_stay_in() -> None:
    """The main arena first, then each thread's; a thread's freed blocks stay in its arena
    (heaps held), not the main one's."""
    r, _ = _script_json(_ARENAS, "1")
    blocks = 6 * (18 << 20)
    assert r["before"] and all(a["system"] >= a["free"] >= 0 for a in r["after"])
    grown = [a for a in r["after"][1:] if a["free"] >= blocks]
    assert len(grown) == 1 and r["after"][0]["free"] < blocks, r["after"]  # the thread's arena holds them
    summary = r["summary"]
    assert summary["arenas"] == len(r["after"])
    assert [grown[0]["system"], grown[0]["free"]] in summary["large"]
    assert summary["main"] is None or summary["main"] in summary["large"]


def test_heap_room_counts_the_heap_a_block_shares_with_others_of_its_size() -> None:
    from trainer_agent.device.host_heap import HEAP_BYTES, MMAP_THRESHOLD_MAX, heap_room

    assert heap_room(0) == 0
    assert heap_room(18 << 20) == -(-HEAP_BYTES // 3)  # three to a 64 MiB heap, 10 MiB of it empty
    assert heap_room(21 << 20) == heap_room(18 << 20)  # three fit all the same: the empty room is theirs
    assert heap_room(24 << 20) == HEAP_BYTES // 2
    assert 8192 < heap_room(8192) < 8192 + 128  # small: its bytes and a chunk's header
    assert heap_room(MMAP_THRESHOLD_MAX) == MMAP_THRESHOLD_MAX  # a mapping of its own, whole pages
    assert heap_room((40 << 20) + 1) == (40 << 20) + 4096


_SLIDING = """
import json, sys, threading, numpy as np
from trainer_agent.device import host_heap
host_heap.hold_freed_memory()
n, size = int(sys.argv[1]), 18 << 20
out = {}
def window():  # n blocks live, sliding first in, first out; every 7th a shard's shorter tail
    live = [np.empty(size, np.uint8) for _ in range(n)]
    for i in range(300):
        live.pop(0)
        live.append(np.empty(size if i % 7 else size // 3, np.uint8))
    live.clear()
    out["heaps"] = max(a["system"] for a in host_heap.arena_stats()[1:])
t = threading.Thread(target=window)
t.start()
t.join()
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heaps' geometry is glibc's")
@pytest.mark.parametrize("blocks", [48, 57])
def test_a_threads_arena_holds_a_sliding_window_of_blocks_in_their_heap_room(blocks: int) -> None:
    """What `heap_room` predicts is what glibc keeps: 57 blocks of 18 MiB (a 1 GiB window
    counted by their bytes) take 19 heaps, 1,216 MiB; 48 (the same window counted by
    their room) take 16, 1,024 MiB (dev machine: both exactly)."""
    from trainer_agent.device.host_heap import HEAP_BYTES, heap_room

    r, _ = _script_json(_SLIDING, str(blocks))
    assert blocks * (18 << 20) < r["heaps"] <= blocks * heap_room(18 << 20) + HEAP_BYTES


_PINNED = """
import ctypes, json, sys, threading
from trainer_agent.device import host_heap
malloc = host_heap.libc_function("malloc", ctypes.c_void_p, ctypes.c_size_t)
free = host_heap.libc_function("free", None, ctypes.c_void_p)
host_heap.hold_freed_memory()
out = {}
def blocks():  # 9 blocks of 18 MiB, with a small live allocation after each when pinned
    xs, pins, heaps = [], [], host_heap.BlockHeaps()  # and the heaps their addresses name
    for _ in range(9):
        xs.append(malloc(18 << 20))
        heaps.note(xs[-1], 18 << 20)
        if sys.argv[1] == "pinned":
            pins.append(malloc(5000))
    for x in xs:
        free(x)
    arenas = host_heap.arena_stats()
    out.update(arena=max(arenas[1:], key=lambda a: a["system"]), summary=host_heap.arenas_summary(arenas))
    out["block_heaps"] = heaps.count
t = threading.Thread(target=blocks)
t.start()
t.join()
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_info is glibc's")
@pytest.mark.parametrize("pins", ["none", "pinned"])
def test_arena_stats_count_a_threads_free_chunks_and_the_largest(pins: str) -> None:
    """With nothing live in a thread's arena each of its heaps is one free chunk; small
    live allocations between its blocks hold the freed blocks apart: more chunks."""
    from trainer_agent.device.host_heap import HEAP_BYTES

    r, _ = _script_json(_PINNED, pins)
    arena = r["arena"]
    assert arena["heaps"] == 3 and arena["system"] == 3 * HEAP_BYTES  # three 18 MiB blocks to a heap
    assert r["summary"]["largest"] == arena
    assert arena["largest_free"] > 54 << 20  # a heap no live allocation is in: one chunk
    # the pins lie between the first heap's blocks (and in its tail): its free memory in pieces
    assert arena["free_chunks"] == (3 if pins == "none" else 6)


_ARENA_LIMIT = """
import ctypes, json, os, threading
from trainer_agent.device import host_heap
hold, took = threading.Event(), threading.Semaphore(0)
def start(count):  # threads that each malloc once (taking an arena) and stay
    def worker():
        host_heap.libc_function("malloc", ctypes.c_void_p, ctypes.c_size_t)(1000)
        took.release()
        hold.wait()
    for _ in range(count):
        threading.Thread(target=worker, daemon=True).start()
    for _ in range(count):
        took.acquire()
    return len(host_heap.arena_stats())
limit = 8 * len(os.sched_getaffinity(0))  # glibc's: 8 arenas a core on 64-bit hosts
out = {"limit": limit, "first": start(limit + 4)}
out["raised"] = host_heap.libc_function("mallopt", ctypes.c_int, ctypes.c_int, ctypes.c_int)(-8, 1024)  # M_ARENA_MAX
out["then"] = start(8)
hold.set()
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the arenas are glibc's")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) > 16, reason="a thread for each of 8 arenas a core")
@pytest.mark.parametrize("tunables", ["", "glibc.malloc.arena_max=1024"])
def test_glibc_reads_its_arena_limit_once_so_only_its_tunable_at_start_raises_it(tunables: str) -> None:
    """Past 8 arenas a core, a new thread shares an arena (its frees' heaps hold others'
    allocations): `mallopt(M_ARENA_MAX)` then takes the value and changes nothing, the
    tunable in the interpreter's environment does (`tpu_checks.sh diagnose`'s
    `overlap-arenas`)."""
    r, _ = _script_json(_ARENA_LIMIT, "", tunables=tunables)
    assert r["raised"] == 1
    if tunables:
        assert r["first"] > r["limit"] and r["then"] >= r["first"] + 8
    else:
        assert r["first"] == r["then"] == r["limit"]


def test_block_heaps_count_the_64_mib_heaps_buffers_lie_in_and_leave_own_mappings_out() -> None:
    from trainer_agent.device.host_heap import HEAP_BYTES, MMAP_THRESHOLD_MAX, BlockHeaps

    heaps = BlockHeaps()
    assert heaps.note(5 * HEAP_BYTES + 4096, 18 << 20)  # in the sixth heap
    assert not heaps.note(5 * HEAP_BYTES + (20 << 20), 18 << 20)  # the same heap: nothing new
    assert heaps.note(6 * HEAP_BYTES - (1 << 20), 2 << 20)  # across the next one's start
    assert (heaps.count, heaps.nbytes) == (2, 2 * HEAP_BYTES)
    assert not heaps.note(9 * HEAP_BYTES, MMAP_THRESHOLD_MAX)  # a mapping of its own
    assert not heaps.note(9 * HEAP_BYTES, 0)
    assert heaps.count == 2


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heaps' geometry is glibc's")
def test_block_heaps_from_buffer_addresses_are_the_heaps_glibc_made_for_them() -> None:
    """A thread arena's heaps are aligned to their size, so the addresses of the blocks
    in them name them: three 18 MiB blocks to a heap, as `arena_stats` counts."""
    r, _ = _script_json(_PINNED, "none")
    assert r["block_heaps"] == r["arena"]["heaps"] == 3
