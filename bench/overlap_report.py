"""The overlap bench's report (bench/train_overlap.py): an async phase's figures against the
no-publish step (`summary`, the JSON's "async" and each variant's), and the lines printed on
stderr as each phase ends (`report`, `heap_line`)."""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any


def summary(phase: dict[str, Any], baseline: float, param_bytes: int) -> dict[str, Any]:
    """Ratios of an async phase against the mean no-publish step `baseline`."""
    its, over = phase["iterations"], phase["overlapped"]
    n_over = sum(over)
    ready = phase["ready_s"]
    return {
        "iteration_s": time_stats(its),
        "step_dispatch_s": time_stats(phase["dispatches"]),
        "publish_async_call_s": time_stats(phase["calls"]),
        "cpu_s_per_step": round(phase["cpu_s"] / len(its), 4),
        # the process's page faults (None: the kernel counts none)
        "faults_per_step": None if phase["faults"] is None else round(phase["faults"] / len(its)),
        "gc_pauses": phase["gc"],
        "heap_at_end": phase["heap"],  # glibc's arenas and own mappings when the phase ended
        # each iteration's times, to line up slow ones with pauses
        "each_ms": {
            "iteration": [round(x * 1e3, 1) for x in its],
            "dispatch": [round(x * 1e3, 1) for x in phase["dispatches"]],
            "call": [round(x * 1e3, 1) for x in phase["calls"]],
            "start": [round(x * 1e3, 1) for x in phase["starts"]],
            "published_ready_at": [round(x * 1e3, 1) for x in phase["ready_at"]],  # from the phase's start
        },
        # each publish's staging and sending (step, version, start and end ms from the phase's
        # start), and the slow iterations with the steps they overlapped
        "publish_steps_ms": phase["timeline"],
        "slow_iterations": phase["slow"],
        "not_offered": phase["not_offered"],
        "async_ratio": round(sum(its) / (len(its) * baseline), 3),
        "overlap_ratio": round(sum(t for t, o in zip(its, over) if o) / (n_over * baseline), 3) if n_over else None,
        "overlapped_steps": n_over,
        "published": phase["published"],
        "skipped": phase["skipped"],
        "published_per_step": round(phase["published"] / len(its), 3),
        "publish_to_ready_s": time_stats(ready) if ready else None,
        "publish_to_ready_steps": {k: round(v / baseline, 2) for k, v in time_stats(ready).items() if k != "total"}
        if ready
        else None,
        "d2h_stage_gbps": round(param_bytes / statistics.fmean(phase["stages"]) / 1e9, 3) if phase["stages"] else None,
        "held_bytes_max": phase["held_max"],
        "flush_s": round(phase["flush_s"], 3),
    }


def count(n: int | None) -> str:
    """`n` with thousands separators; "unknown" for None."""
    return "unknown" if n is None else f"{n:,}"


def report(label: str, s: dict[str, Any], baseline: float) -> None:
    """One line on stderr per async phase, as it ends."""
    print(
        f"{label}: ratio {s['async_ratio']} (alone {baseline * 1e3:.1f} ms, iterations "
        f"{s['iteration_s']['median'] * 1e3:.1f} median / {s['iteration_s']['mean'] * 1e3:.1f} mean); "
        f"dispatch {s['step_dispatch_s']['median'] * 1e3:.1f} ms, publish_async call "
        f"{s['publish_async_call_s']['median'] * 1e3:.1f} median / "
        f"{s['publish_async_call_s']['max'] * 1e3:.0f} max ms; "
        f"published {s['published']}; to READY {s['publish_to_ready_steps'] or {}}; "
        f"{s['d2h_stage_gbps']} GB/s; CPU {s['cpu_s_per_step'] * 1e3:.0f} ms/step; "
        f"{count(s['faults_per_step'])} page faults/step; GC {s['gc_pauses']}"
        + (f"; not offered {s['not_offered']}" if s["not_offered"] else ""),
        file=sys.stderr,
    )
    if heap := s["heap_at_end"]:
        print(f"  heap at its end: {heap_line(heap)}", file=sys.stderr)
    for line in s["slow_iterations"]:
        print(f"  slow {line}", file=sys.stderr)


def heap_line(heap: dict[str, Any]) -> str:
    """glibc's account in a line: '4.43 GB free of 5.01 GB in 9 arenas; 64 MiB or more:
    main 2.10/1.90 GB, 1.22/1.20 GB; the largest in 19 heaps, free in 25 chunks, the
    largest 64.0 MiB; blocks in 17 heaps' (each arena's bytes from the kernel / free; the
    largest arena's heaps and free chunks: with nothing live in it, one chunk a heap; the
    heaps the device path's blocks landed in)."""
    gb = lambda pair: f"{pair[0] / 1e9:.2f}/{pair[1] / 1e9:.2f} GB"  # noqa: E731
    large = [gb(p) for p in heap.get("large", [])]
    if heap.get("main") in heap.get("large", []):
        large[heap["large"].index(heap["main"])] = "main " + gb(heap["main"])
    top = heap.get("largest") or {}
    where = f"in {top.get('heaps')} heaps" if top.get("heaps") else "(the main one)"
    chunks = (
        f"; the largest {where}, free in {top.get('free_chunks', 0)} chunks, the largest "
        f"{top.get('largest_free', 0) / (1 << 20):.1f} MiB"
        if top
        else ""
    )
    return (
        f"{heap.get('free', 0) / 1e9:.2f} GB free of {heap.get('arena', 0) / 1e9:.2f} GB in {heap.get('arenas', 0)} "
        f"arenas; 64 MiB or more: {', '.join(large) or 'none'}{chunks}"
        + (f"; blocks in {heap['block_heaps']} heaps" if heap.get("block_heaps") else "")
    )


def time_stats(xs: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(xs), 5),
        "median": round(statistics.median(xs), 5),
        "max": round(max(xs), 5),
        "total": round(math.fsum(xs), 4),
    }
