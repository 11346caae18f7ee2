"""A publish worker's host buffers under glibc: what unmapping a thread arena's heaps costs.

The device path lands each block's D2H in a host buffer from malloc. Allocated in a thread
other than the main one (`publish_async`'s worker), it comes from that thread's arena, made
of heaps of 64 MiB, and by glibc's default a free that empties such a heap unmaps it,
whatever the trim threshold: the next version's blocks fault in fresh pages
(`trainer_agent/device/host_heap.py`). This replays that pattern without a device: per version,
`--version-mib` in blocks of `--block-mib`, at most `--window-mib` in flight, each
allocated and written (as a D2H lands) on one worker thread and freed first in, first out
as if staged, the rest at the version's end. Modes, interleaved (ABAB):

  kept      the device path's `hold_freed_memory()`: a heap-sized top pad, heaps stay
  unmapped  the same thresholds with glibc's own top pad: emptied heaps are unmapped
  bound     the same writes into buffers allocated once (no malloc): the copy's rate

Each mode runs `--versions` versions a round in a process of its own (mallopt's settings,
and the heaps they leave, stay with a process), the first not counted (its heaps, or the
bound's buffers, are made then). Prints, per mode, the median GB/s and its ratio to the
bound's, and the worker's page faults (None, "unknown", where the kernel counts none:
gVisor) and system CPU seconds per version (RUSAGE_THREAD), as one JSON object (also to
`--out`).

    python bench/heap_reuse.py                        # a 0.6b-sized version, 1 GiB window
    python bench/heap_reuse.py --version-mib 8192     # a 4b-sized one
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import HEAP_PADS, emit_json, on_thread  # noqa: E402

from trainer_agent.device.host_heap import hold_freed_memory  # noqa: E402
from weightsync.host_memory import minor_faults  # noqa: E402

THREAD = resource.RUSAGE_THREAD

MODES = ("kept", "unmapped", "bound")


def one_version(n_blocks: int, in_flight: int, block: np.ndarray, new_buffer: Callable[[int], np.ndarray]) -> None:
    """`n_blocks` buffers from `new_buffer(i)`, each written from `block`, at most
    `in_flight` held: the oldest dropped first, the rest at the end."""
    held: deque[np.ndarray] = deque()
    for i in range(n_blocks):
        buf = new_buffer(i)
        np.copyto(buf, block)
        held.append(buf)
        if len(held) > in_flight:
            held.popleft()
    held.clear()


def blocks(args: argparse.Namespace) -> tuple[int, int, int]:
    """(bytes of a block, blocks of a version, blocks in flight at most)."""
    block_bytes = args.block_mib << 20
    return block_bytes, max(1, (args.version_mib << 20) // block_bytes), max(1, (args.window_mib << 20) // block_bytes)


def measure_mode(args: argparse.Namespace, mode: str) -> list[dict[str, float | None]]:
    """`args.versions` versions in `mode` on one worker thread of this process, the first
    not counted (its heaps, or the bound's buffers, are made then): seconds, page faults and
    system CPU seconds of each."""
    block_bytes, n_blocks, in_flight = blocks(args)
    block = np.full(block_bytes, 7, np.uint8)
    if mode != "bound" and not hold_freed_memory(top_pad_bytes=HEAP_PADS[mode]):
        raise SystemExit("this C library has no mallopt: nothing to compare")
    ring: list[np.ndarray] = []

    def buffer(i: int) -> np.ndarray:
        if mode != "bound":
            return np.empty(block_bytes, np.uint8)
        if len(ring) <= in_flight:
            ring.append(np.empty(block_bytes, np.uint8))
        return ring[i % len(ring)]

    rows: list[dict[str, float | None]] = []

    def worker() -> None:
        for _ in range(args.versions):
            f0, r0, t0 = minor_faults(THREAD), resource.getrusage(THREAD), time.perf_counter()
            one_version(n_blocks, in_flight, block, buffer)
            seconds, f1, r1 = time.perf_counter() - t0, minor_faults(THREAD), resource.getrusage(THREAD)
            faults = None if f0 is None or f1 is None else f1 - f0
            rows.append({"s": seconds, "faults": faults, "sys_s": r1.ru_stime - r0.ru_stime})

    on_thread(True, worker)
    return rows[1:]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Each mode in a process of its own (mallopt's settings, and the heaps they leave, stay
    with a process), the modes interleaved `args.rounds` times."""
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            child = [sys.executable, __file__, "--child", mode, *_sizes(args)]
            rows[mode] += json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
    block_bytes, n_blocks, in_flight = blocks(args)
    nbytes = n_blocks * block_bytes
    out: dict[str, Any] = {
        "version_bytes": nbytes,
        "block_bytes": block_bytes,
        "in_flight_blocks": in_flight,
        "versions_counted": len(rows["bound"]),
    }
    for mode in MODES:
        out[mode] = {
            "gbps": round(nbytes / statistics.median(r["s"] for r in rows[mode]) / 1e9, 3),
            "faults_per_version": _median_or_none([r["faults"] for r in rows[mode]]),
            "sys_s_per_version": round(statistics.median(r["sys_s"] for r in rows[mode]), 4),
        }
    for mode in ("kept", "unmapped"):
        out[mode]["ratio_to_bound"] = round(out[mode]["gbps"] / out["bound"]["gbps"], 3)
    return out


def _median_or_none(values: list[float | None]) -> int | None:
    """The rounded median; None (unknown) where any value is."""
    return None if None in values else round(statistics.median(values))  # type: ignore[type-var]


def _sizes(args: argparse.Namespace) -> list[str]:
    return [
        f"--version-mib={args.version_mib}",
        f"--block-mib={args.block_mib}",
        f"--window-mib={args.window_mib}",
        f"--versions={args.versions}",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version-mib", type=int, default=1152, help="bytes of one version (0.6b in bf16: ~1.2 GB)")
    p.add_argument("--block-mib", type=int, default=18, help="the device path's block (its default)")
    p.add_argument("--window-mib", type=int, default=1024, help="the device path's window (its default)")
    p.add_argument("--versions", type=int, default=4, help="versions per mode and round, the first not counted")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three modes (ABAB)")
    p.add_argument("--out", default="")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.versions < 2 or min(args.version_mib, args.block_mib, args.window_mib, args.rounds) < 1:
        p.error("--versions >= 2 and sizes and --rounds >= 1")
    if args.child:
        print(json.dumps(measure_mode(args, args.child)))
        return
    out = measure(args)
    for mode in MODES:
        r = out[mode]
        ratio = f", {r['ratio_to_bound']}x the bound" if "ratio_to_bound" in r else ""
        faults = "unknown" if r["faults_per_version"] is None else f"{r['faults_per_version']:,}"
        print(
            f"{mode}: {r['gbps']} GB/s{ratio}; {faults} page faults and "
            f"{r['sys_s_per_version']} s system CPU a version",
            file=sys.stderr,
        )
    emit_json(out, args.out)


if __name__ == "__main__":
    main()
