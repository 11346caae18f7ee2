"""Another process's RSS, sampled from outside it, highest value per named phase.

Where the kernel's high-water mark cannot be reset (gVisor, which TPU hosts run under, has
no VmHWM and getrusage's ru_maxrss keeps the peak since the start, compiling included),
a phase's own peak is only seen by sampling. A thread in the measured process would take
its GIL beside the work it measures; this samples from a child process instead, reading
the parent's /proc/PID/status every `--interval-ms`.

    with RssSampler() as rss:      # in the measured process
        rss.phase("async")
        ...
        rss.phase("idle")
    rss.peaks                      # {"async": bytes, "idle": bytes}

The sampler has read the RSS once before the block starts (its child imports for about a
second on a TPU host), so every phase that lasts an interval is sampled; a phase with no
sample has the peak None, unknown, not 0.

A copy of a few hundred MiB takes tens of milliseconds at the host's copy rates, so a
1 ms interval sees a peak that lasts a copy; a spike shorter than that can be missed
(the peak is a lower bound, within one interval's worth of allocation).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
from pathlib import Path

from common import rss_bytes


class RssSampler:
    """Samples this process's RSS from a child process; `phase(name)` starts a phase,
    `peaks` (after the block) holds each phase's highest sample in bytes (None: the phase
    ended before a sample, or the RSS could not be read). An interval of
    0 samples nothing (no child; `peaks` stays empty): a run can tell whether the sampling
    itself costs what it measures beside."""

    def __init__(self, interval_ms: float = 1.0) -> None:
        self.interval_ms = interval_ms
        self.peaks: dict[str, int | None] = {}
        self._child: subprocess.Popen[str] | None = None

    @property
    def sampling(self) -> bool:
        return self.interval_ms > 0

    def __enter__(self) -> RssSampler:
        if not self.sampling:
            return self
        self._child = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(os.getpid()), "--interval-ms", str(self.interval_ms)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._child.stdout is not None
        if self._child.stdout.readline().strip() != "ready":  # its first sample taken
            self._child.kill()
            self._child.wait()
            raise RuntimeError("the RSS sampler failed to start (its stderr says why)")
        return self

    def phase(self, name: str) -> None:
        """Samples from now on count toward `name` (a phase seen twice keeps its highest)."""
        if not self.sampling:
            return
        assert self._child is not None and self._child.stdin is not None
        self._child.stdin.write(name + "\n")
        self._child.stdin.flush()

    def __exit__(self, *exc: object) -> None:
        if not self.sampling:
            return
        assert self._child is not None
        out, _ = self._child.communicate(timeout=30)
        self.peaks = json.loads(out) if out.strip() else {}


def sample(pid: int, interval_s: float) -> dict[str, int | None]:
    """Samples `pid`'s VmRSS until stdin ends; phase names arrive on stdin, a line each;
    "ready" on stdout once the first sample is taken. A phase no sample fell in, or whose
    samples read no VmRSS, has None."""
    phase = "start"
    peaks: dict[str, int | None] = {phase: _rss_or_none(pid)}
    print("ready", flush=True)
    fd = sys.stdin.fileno()
    pending = b""
    while True:
        readable, _, _ = select.select([fd], [], [], interval_s)
        if readable:
            data = os.read(fd, 4096)
            if not data:
                break
            pending += data
            *names, pending = pending.split(b"\n")
            for name in names:
                phase = name.decode()
                peaks.setdefault(phase, None)
        try:
            rss = _rss_or_none(pid)
        except OSError:  # the process ended
            break
        if rss is not None:
            peaks[phase] = max(peaks.get(phase) or 0, rss)
    return peaks


def _rss_or_none(pid: int) -> int | None:
    """`pid`'s VmRSS in bytes; None where its status has none.

    Raises:
        OSError: the process ended.
    """
    return rss_bytes(pid) or None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pid", type=int)
    p.add_argument("--interval-ms", type=float, default=1.0)
    args = p.parse_args()
    print(json.dumps(sample(args.pid, args.interval_ms / 1e3)))


if __name__ == "__main__":
    main()
