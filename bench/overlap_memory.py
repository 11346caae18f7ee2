"""The overlap bench's RSS and heap accounting (bench/train_overlap.py): glibc's account
(`heap_account`), the process's page faults, each block's host buffer as the device path's
window saw it land and freed (`BlockTrace`), and each async phase's RSS peak against its
bound (`rss_bounds`)."""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_agent.device.device_blocks import Window, buffer_address  # noqa: E402
from trainer_agent.device.host_heap import (  # noqa: E402
    arena_stats,
    arenas_summary,
    block_heaps,
    heap_stats,
    malloc_info_text,
)
from weightsync.host_memory import minor_faults  # noqa: E402

__all__ = ["TRACE_COLUMNS", "BlockTrace", "heap_account", "heap_stats", "page_faults", "rss_bounds"]


def heap_account() -> dict[str, Any]:
    """glibc's account (`heap_stats`) with its arenas in short (`arenas_summary`) and the
    heaps the device path's blocks landed in (`block_heaps`, counted with the heaps kept)."""
    return heap_stats() | arenas_summary(arena_stats()) | {"block_heaps": block_heaps.count}


def page_faults() -> int | None:
    """The process's page faults so far (minor: a fresh page mapped in); None where the
    kernel does not count them (gVisor)."""
    return minor_faults()


def rss_bounds(
    phases: Sequence[Any],
    labels: Sequence[str],
    peaks: Mapping[str, int],
    baselines: Mapping[str, int],
    held_max: Mapping[str, int],
    param_bytes: int,
    held_counted: bool,
) -> dict[str, dict[str, Any]]:
    """Each async phase's RSS peak (sampled from another process: gVisor has no resettable
    high-water mark; the first phase's under "async", the others' under their labels)
    against the RSS before its publisher started + arena (two slots) + window + 256 MiB
    (+ the versions held, where they are in host memory: `held_counted`)."""
    bounds = {}
    for i, (v, label) in enumerate(zip(phases, labels, strict=True)):
        phase_peak = peaks.get("async" if i == 0 else label)  # None: unknown (no sample)
        bound = baselines[label] + 2 * param_bytes + v.window_bytes + (256 << 20) + held_max[label] * held_counted
        bounds[label] = {
            "baseline_bytes": baselines[label],
            "peak_bytes": phase_peak,
            "bound_bytes": bound,
            "within": phase_peak <= bound if phase_peak is not None else None,  # None: not sampled
        }
    return bounds


TRACE_COLUMNS = [
    "t_landed", "address", "owner_bytes", "block_bytes", "window_used", "window_room", "t_freed",
    "t_issued", "window_used_at_issue",
]  # fmt: skip


class BlockTrace:
    """Each block's host buffer as the device path's window saw it land: the time, the
    address and bytes of the array that owns the buffer (a pack's, for a packed entry), the
    block's bytes, the room the window had in flight and allowed then, when the owning
    array was freed (a finalizer), and when its copy was issued (its buffer allocated) with
    what the window had in flight just after; glibc's `malloc_info` at the end. Where glibc
    placed the blocks, version after version, and whether any outlived their staging."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.rows: list[list[Any]] = []
        self.owner_bases: collections.Counter[str] = collections.Counter()
        self._owners: dict[int, list[Any]] = {}
        self._issues: weakref.WeakKeyDictionary[Window, collections.deque] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        issued, landed = Window.issued, Window.landed

        def traced_issue(window: Window, nbytes: int) -> None:
            issued(window, nbytes)
            with self._lock:  # a window's copies land in the order they were issued
                self._issues.setdefault(window, collections.deque()).append((self._now(), window._used))

        def traced(window: Window, nbytes: int, buffer: np.ndarray | None = None) -> None:
            landed(window, nbytes, buffer)
            if buffer is not None:
                self.note(window, nbytes, buffer)

        Window.issued = traced_issue  # type: ignore[method-assign]
        Window.landed = traced  # type: ignore[method-assign]

    def _now(self) -> float:
        return round(time.perf_counter() - self.t0, 6)

    def note(self, window: Window, nbytes: int, buffer: np.ndarray) -> None:
        owner = buffer
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        with self._lock:
            self.owner_bases[type(owner.base).__name__] += 1
            issues = self._issues.get(window)
            t_issued, used_at_issue = issues.popleft() if issues else (None, None)
            row = [self._now(), buffer_address(owner), owner.nbytes, nbytes, window._used, window.room_bytes, None]
            row += [t_issued, used_at_issue]
            self.rows.append(row)
            if id(owner) in self._owners:  # a pack's later entry: freed with the pack
                return
            self._owners[id(owner)] = row
        weakref.finalize(owner, self._freed, id(owner))

    def _freed(self, key: int) -> None:
        with self._lock:
            row = self._owners.pop(key, None)
            if row is not None:
                row[6] = self._now()

    def write(self, path: str) -> None:
        with self._lock:
            doc = {
                "columns": TRACE_COLUMNS,
                "rows": self.rows,
                "owner_bases": dict(self.owner_bases),
                "block_heaps": block_heaps.count,
                "malloc_info": malloc_info_text(),
            }
        with open(path, "w") as f:
            json.dump(doc, f)
        print(f"block trace: {len(doc['rows'])} blocks, {path}", file=sys.stderr)
