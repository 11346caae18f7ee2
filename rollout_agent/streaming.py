"""Streaming pulls: one layer group's chunks at a time, into a scratch buffer per rank.

Host memory stays near one group (plus a chunk of slack at each end); a chunk shared by
two groups is fetched once per group.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Iterator
from typing import Any

import numpy as np

from rollout_agent.appliers import layer_groups
from rollout_agent.assembly import assemble_tensor
from rollout_agent.puller import WeightPuller
from weightsync.manifest import Manifest


def stream_verified_groups(
    puller: WeightPuller, manifest: Manifest, result: Any, timings: dict[str, float]
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Yields each layer group's (name, tensor) pairs once all its chunks verified.

    The tensors may be views into scratch buffers that are dropped after the next
    iteration: appliers copy what they keep. `result.bytes_pulled` / `chunk_retries` and
    `timings["pull_seconds"]` accumulate.
    """
    parts = {p.rank: p for p in manifest.parts}
    starts = {p.rank: [c.offset for c in p.chunks] for p in manifest.parts}
    tensors = manifest.tensors
    for group in layer_groups(tensors):
        spans: dict[int, tuple[int, int]] = {}
        for name in group:
            for rank, s in manifest.shards_of_name(name):
                if s.nbytes == 0:
                    continue
                first = bisect_right(starts[rank], s.offset) - 1
                last = bisect_right(starts[rank], s.offset + s.nbytes - 1) - 1
                lo, hi = spans.get(rank, (first, last))
                spans[rank] = (min(lo, first), max(hi, last))
        t0 = time.perf_counter()
        buffers: dict[int, np.ndarray] = {}
        bases: dict[int, int] = {}
        for rank, (lo, hi) in spans.items():
            chunks = parts[rank].chunks
            bases[rank] = chunks[lo].offset
            buffers[rank] = np.empty(chunks[hi].offset + chunks[hi].length - bases[rank], np.uint8)
            pulled, retries = puller.pull_chunks(manifest, parts[rank], list(range(lo, hi + 1)), buffers[rank], bases[rank])
            result.bytes_pulled += pulled
            result.chunk_retries += retries
        timings["pull_seconds"] += time.perf_counter() - t0
        yield [(name, assemble_tensor(tensors[name], manifest.shards_of_name(name), buffers, bases)) for name in group]
