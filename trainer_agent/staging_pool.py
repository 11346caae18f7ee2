"""The device path's staging threads, kept for the process and shared by its publishes.

A pool per publish started and ended its threads every version: each start maps a stack
and takes a malloc arena, each end gives them back, and on the TPU host (gVisor) those
mapping calls queue behind the ones the runtime's copies make. One pool per thread count,
made on first use, serves every publish after it; a forked child makes its own.
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
