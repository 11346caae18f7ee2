"""The device path's staging threads, kept for the process and shared by its publishes.

Starting a thread maps a stack and attaches a malloc arena, and ending it gives them back:
a pool per publish would do both at the end of every version, beside a training loop that
may be waiting for the interpreter. One pool per thread count, made on first use, serves
every publish after it; a forked child makes its own. (On a TPU v5e host keeping it did not
change the overlap bench's stalls: docs/performance.md.)
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def staging_pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of `threads` staging threads (made on first use)."""
    if threads < 1:
        raise ValueError(f"a staging pool needs a thread, got {threads}")
    with _lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix=f"ws-stage-{threads}")
        return pool


def _forget_in_child() -> None:  # a fork copies the pools but not their threads
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
