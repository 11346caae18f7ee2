"""A process's host memory as the kernel counts it (`/proc/PID/status`), split by kind.

`VmRSS` is every resident page the process maps; it adds up three kinds that mean
different things for a host's budget:

- `RssAnon`: the process's own anonymous pages (heap, NumPy arrays, receive buffers, a
  runtime's host allocations): memory nobody else holds, gone only when the process frees it;
- `RssShmem`: shared memory it maps (a trainer's arena read by `shm`): counted in every
  process that maps it, but there once on the host;
- `RssFile`: file pages (code, shared libraries): page cache, shared and reclaimable.

Mapped but never touched memory is in none of them (it is not resident). `VmHWM` is the
high-water mark of VmRSS since the process started (a host where /proc/self/clear_refs is
not writable cannot reset it). `MemAvailable` (`/proc/meminfo`) is what the host can still
give without swapping: where it falls by as much as a process's RSS rose, the pages are
real memory.

gVisor (the TPU host's sandbox) reports `VmRSS` alone: no kinds, no `VmHWM`. There
`by_kind` is False, `own` is all of VmRSS, and this process's peak comes from
`getrusage`'s `ru_maxrss`. gVisor counts no page faults either (`ru_minflt` stays 0):
`minor_faults` says None, unknown, there.

`$WEIGHTSYNC_PROC_LACKS` makes this process (and those it starts) read as if the host
lacked the facts it names (`lacks`): a test seam that emulates gVisor on Linux, read once at
the first call (`make test-host` sets it to `gvisor`).
"""

from __future__ import annotations

import functools
import mmap
import os
import resource
from collections.abc import Iterable
from dataclasses import asdict, dataclass

LACKS_VARIABLE = "WEIGHTSYNC_PROC_LACKS"
# what gVisor's /proc and getrusage lack of what Linux gives: the status fields past VmRSS,
# the fault counts, a writable /proc/PID/clear_refs (no way to reset VmHWM)
GVISOR_LACKS = frozenset({"VmHWM", "RssAnon", "RssFile", "RssShmem", "minflt", "clear_refs"})

_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "peak"}


@dataclass(frozen=True)
class HostMemory:
    """One process's resident memory, in bytes (0 for a field the kernel does not report)."""

    rss: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0
    peak: int = 0  # VmHWM: the largest rss since the start
    by_kind: bool = False  # the kernel splits rss into anon, file and shmem

    @property
    def own(self) -> int:
        """The process's own memory: its anonymous pages, or all of rss where the kernel
        does not split it (a budget then counts shared and file pages too, erring high)."""
        return self.anon if self.by_kind else self.rss

    def as_dict(self) -> dict[str, int]:
        """The byte counts by kind (`by_kind` is not one of them)."""
        return {k: v for k, v in asdict(self).items() if k != "by_kind"}


@functools.cache
def lacks() -> frozenset[str]:
    """The facts this process reads as absent: those `$WEIGHTSYNC_PROC_LACKS` names, comma
    separated (status fields such as `VmHWM`, `minflt` for the fault counts, `clear_refs`;
    `gvisor` for all that gVisor lacks). Empty unless set: the host's own answers."""
    names = {n.strip() for n in os.environ.get(LACKS_VARIABLE, "").split(",") if n.strip()}
    return frozenset(names - {"gvisor"}) | (GVISOR_LACKS if "gvisor" in names else frozenset())


def status_lines(pid: int | str = "self") -> list[str]:
    """The lines of `/proc/PID/status` this host gives (less those `lacks` names).

    Raises:
        OSError: no such process, or no /proc.
    """
    with open(f"/proc/{pid}/status") as f:
        lines = f.readlines()
    gone = lacks()
    return [line for line in lines if line.partition(":")[0] not in gone] if gone else lines


@functools.cache
def faults_counted() -> bool:
    """Whether the kernel counts this process's page faults: probed once by touching 16
    fresh pages (Linux counts a fault each; gVisor counts none)."""
    if "minflt" in lacks():
        return False
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with mmap.mmap(-1, 16 * mmap.PAGESIZE) as pages:
        for offset in range(0, len(pages), mmap.PAGESIZE):
            pages[offset] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt > before


def minor_faults(who: int = resource.RUSAGE_SELF) -> int | None:
    """The page faults so far (minor: a fresh page mapped in) of this process, or of the
    calling thread with `resource.RUSAGE_THREAD`; None (unknown) where the kernel counts
    none (gVisor), not 0."""
    return resource.getrusage(who).ru_minflt if faults_counted() else None


def host_memory(pid: int | str = "self") -> HostMemory:
    """The process's resident memory now (`/proc/PID/status`); zeros where there is none
    (not Linux, or the process is gone). Another process's `peak` is 0 where the kernel
    has no VmHWM (gVisor): `peak or None` for a figure that must say unknown."""
    try:
        m = parse_status(status_lines(pid))
    except (OSError, ValueError, IndexError):
        return HostMemory()
    if not m.peak and pid in ("self", os.getpid(), str(os.getpid())):
        peak = max(m.rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # ru_maxrss: kB
        m = HostMemory(m.rss, m.anon, m.file, m.shmem, peak, m.by_kind)
    return m


def parse_status(lines: Iterable[str]) -> HostMemory:
    """The memory fields of a `/proc/PID/status` text."""
    values: dict[str, int] = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            values[_FIELDS[key]] = int(rest.split()[0]) * 1024  # kB
    return HostMemory(**values, by_kind="anon" in values)


def mem_available() -> int:
    """The host's MemAvailable in bytes (`/proc/meminfo`); 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
