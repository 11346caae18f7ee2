"""Memory with its pages in place when it is made: the arena (the trainer writes it), the
readers' mappings of it, a relay's shared buffers and a rollout's receive buffers.

A fresh mapping's first touch of each page is a fault. On Linux that costs little (a copy
into a fresh tmpfs mapping ran at 1.6-3 GB/s here, and reads fault 16 pages at a time). Under
gVisor, where a TPU VM's workloads run, each fault traps into its kernel in user space: the
v5e host's first pull of each arena slot ran at 0.05 GB/s (21 s for 1.2 GB, a warm pull
0.1 s), and the arena's first stage took 15.8 s. `MAP_POPULATE` maps every page at `mmap`
on Linux, and in gVisor where it commits the mapping (a 256 MiB shm file's first write
measured 0.70 s plain, 0.04 s after a populating `mmap` of 0.20 s, on the v5e host), while
`madvise(MADV_POPULATE_READ/WRITE)` is refused by gVisor (EINVAL) and is missing before
Linux 5.14. Memory made here costs its populate once, when it is made; every copy after
that finds its pages mapped. Not everywhere under gVisor: in a rollout's process on the
v5e host a receive buffer's populate took no time and its first pull still ran at an
eighth of the warm rate (docs/performance.md "First touches, first pulls").
"""

from __future__ import annotations

import errno
import mmap

import numpy as np


def map_shared(fd: int, nbytes: int, *, writable: bool = False) -> mmap.mmap:
    """`nbytes` of the file at `fd` (0: the whole file), mapped shared and populated.

    The file's pages must exist already (`posix_fallocate`, or a writer that filled them):
    `MAP_POPULATE` ignores what it cannot map, where a failing page would otherwise show as
    SIGBUS at the first touch."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)


def empty(nbytes: int) -> np.ndarray:
    """`nbytes` of private memory as a writable uint8 array, its pages mapped (zeroed): what
    `np.empty` gives, without a fault a page at the first write. Freed with the array and
    every view of it. MemoryError where the memory cannot be had, as `np.empty` raises."""
    try:
        pages = mmap.mmap(-1, max(nbytes, 1), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        raise MemoryError(f"cannot map {nbytes} bytes: {e.strerror}") from None
    return np.frombuffer(pages, np.uint8, count=nbytes)
