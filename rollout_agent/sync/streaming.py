"""Streaming pulls: one layer group's chunks at a time, into scratch buffers.

Host memory stays near one group (plus a chunk of slack at each end of each run); a chunk
shared by two groups is fetched once per group. A group whose tensors lie apart in a
rank's part (the embedding at the front, the final norm at the back) is pulled as
separate runs, never as the span between them.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Iterator
from typing import Any

import numpy as np

from rollout_agent.engines.applier import layer_groups
from rollout_agent.pull.assembly import assemble_tensor
from rollout_agent.pull.lanes import PullPlan
from rollout_agent.pull.puller import WeightPuller
from weightsync.manifest import Manifest


def stream_verified_groups(
    puller: WeightPuller, plan: PullPlan, manifest: Manifest, result: Any, timings: dict[str, float]
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Yields each layer group's (name, tensor) pairs once all its chunks verified (read
    as `plan` says: `puller.plan(header)`).

    The tensors may be views into scratch buffers that are dropped after the next
    iteration: appliers copy what they keep. `result.bytes_pulled` / `chunk_retries` and
    `timings["pull_seconds"]` accumulate.
    """
    parts = {p.rank: p for p in manifest.parts}
    starts = {p.rank: [c.offset for c in p.chunks] for p in manifest.parts}
    tensors = manifest.tensors
    for group in layer_groups(tensors):
        # Each tensor's chunk interval per rank; overlapping or adjacent intervals form runs.
        spans: dict[str, dict[int, tuple[int, int]]] = {}
        for name in group:
            for rank, s in manifest.shards_of_name(name):
                if s.nbytes == 0:
                    continue
                first = bisect_right(starts[rank], s.offset) - 1
                last = bisect_right(starts[rank], s.offset + s.nbytes - 1) - 1
                lo, hi = spans.setdefault(name, {}).get(rank, (first, last))
                spans[name][rank] = (min(lo, first), max(hi, last))
        runs = _runs(spans)
        t0 = time.perf_counter()
        pulled_runs: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
        for rank, lo, hi in runs:
            chunks = parts[rank].chunks
            base = chunks[lo].offset
            buf = np.empty(chunks[hi].offset + chunks[hi].length - base, np.uint8)
            pulled, retries = puller.pull_chunks(plan, manifest, parts[rank], list(range(lo, hi + 1)), buf, base)
            result.bytes_pulled += pulled
            result.chunk_retries += retries
            pulled_runs[(rank, lo)] = (buf, base)
        timings["pull_seconds"] += time.perf_counter() - t0
        out = []
        for name in group:
            where = {rank: pulled_runs[_run_of(runs, rank, lo)] for rank, (lo, _) in spans.get(name, {}).items()}
            buffers = {rank: b for rank, (b, _) in where.items()}
            bases = {rank: base for rank, (_, base) in where.items()}
            out.append((name, assemble_tensor(tensors[name], manifest.shards_of_name(name), buffers, bases)))
        yield out


def _runs(spans: dict[str, dict[int, tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """(rank, first chunk, last chunk) runs covering every tensor's interval."""
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for per_rank in spans.values():
        for rank, interval in per_rank.items():
            by_rank.setdefault(rank, []).append(interval)
    runs = []
    for rank, intervals in sorted(by_rank.items()):
        intervals.sort()
        lo, hi = intervals[0]
        for a, b in intervals[1:]:
            if a <= hi + 1:
                hi = max(hi, b)
            else:
                runs.append((rank, lo, hi))
                lo, hi = a, b
        runs.append((rank, lo, hi))
    return runs


def _run_of(runs: list[tuple[int, int, int]], rank: int, first: int) -> tuple[int, int]:
    """The key (rank, run start) of the run holding chunk `first` of `rank`."""
    return next((r, lo) for r, lo, hi in runs if r == rank and lo <= first <= hi)
