"""Native stacks of a process whose loop stalls, taken from outside it with py-spy.

`faulthandler` shows the Python frames of every thread, but not where a thread holding the
interpreter lock is stuck in native code, nor which thread holds it. This takes
`py-spy dump --native` of the parent (each thread's native and Python frames, the lock's
holder marked `+gil`) from a child process, which needs neither the parent's interpreter
lock nor its cooperation, once per loop iteration that passes a threshold:

    with StallDumper("stalls.txt", threshold_ms=150) as dumper:   # in the looping process
        for i in ...:
            dumper.arm(i)        # the iteration starts: a shared 16-byte record
            ...
            dumper.disarm()      # it ended

The child polls that record every `--interval-ms`. The parent allows its child to trace
it (`PR_SET_PTRACER`, where Yama restricts tracing to descendants). A dump stops the
parent while it is taken (tens of milliseconds with --native): the traced runs say where
a stall is, not how long it lasts untraced. Where the host cannot stop a process (gVisor
answers ptrace's interrupt with ENOSYS) the dumps fall back to `--nonblocking`: Python
frames and the lock's holder, read without stopping it. Each dump starts with every
thread's name, scheduler state and CPU time over `--cpu-window-ms` (from /proc), which
names the native threads busy during the stall; a stall that lasts gets up to `--dumps`
dumps, `--every-ms` apart.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_RECORD = struct.Struct("<dq")  # the armed iteration's start (time.monotonic; 0: none), its number
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def py_spy() -> str:
    """The py-spy executable beside this interpreter or on PATH; SystemExit saying how to
    get one where there is none."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.is_file() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("native stall dumps need py-spy on PATH (pip install py-spy; the TPU kit carries it)")
    return found


class StallDumper:
    """Dumps this process's native stacks (py-spy, from a child) for each armed iteration
    that lasts past `threshold_ms`, appended to `path`."""

    def __init__(self, path: str, threshold_ms: float, interval_ms: float = 10.0) -> None:
        self.path = path
        self.threshold_ms = threshold_ms
        self.interval_ms = interval_ms
        self._tmp = tempfile.NamedTemporaryFile(prefix="stall-", suffix=".rec")  # noqa: SIM115 (closed in __exit__)
        self._tmp.write(bytes(_RECORD.size))
        self._tmp.flush()
        self._map = mmap.mmap(self._tmp.fileno(), _RECORD.size)
        self._child: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> StallDumper:
        spy = py_spy()
        try:  # let the child trace its parent where Yama allows only descendants
            ctypes.CDLL(None).prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)
        except (OSError, AttributeError):
            pass
        args = [str(os.getpid()), self._tmp.name, self.path, "--threshold-ms", str(self.threshold_ms)]
        args += ["--interval-ms", str(self.interval_ms), "--py-spy", spy]
        self._child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], stdin=subprocess.PIPE)
        return self

    def arm(self, iteration: int) -> None:
        self._map[:] = _RECORD.pack(time.monotonic(), iteration)

    def disarm(self) -> None:
        self._map[:] = _RECORD.pack(0.0, -1)

    def __exit__(self, *exc: object) -> None:
        self.disarm()
        if self._child is not None:
            self._child.communicate(timeout=60)  # stdin closed: the child ends
        self._map.close()
        self._tmp.close()


def thread_cpu(pid: int) -> dict[int, tuple[str, str, int]]:
    """Each thread of `pid`: (name, scheduler state, user+system CPU ticks), from /proc;
    threads that end while read are left out."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # fields from the state on
        threads[int(tid)] = (name, fields[0], int(fields[11]) + int(fields[12]))
    return threads


def busy_threads(pid: int, window_s: float) -> str:
    """The threads that ran during `window_s` or are runnable at its end, most CPU first:
    one line each, `tid name state cpu_ms`."""
    before = thread_cpu(pid)
    time.sleep(window_s)
    after = thread_cpu(pid)
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    rows = []
    for tid, (name, state, ticks) in after.items():
        spent = (ticks - before[tid][2]) * tick_ms if tid in before else 0.0
        if spent > 0 or state not in ("S", "I"):
            rows.append((spent, tid, name, state))
    rows.sort(reverse=True)
    head = f"threads busy over {window_s * 1e3:.0f} ms ({len(after)} threads):\n"
    return head + "".join(f"  {tid:>7} {name:<16} {state} {spent:6.0f} ms\n" for spent, tid, name, state in rows)


class Dumps:
    """py-spy dumps of one process: native frames until the host refuses to stop it, then
    without stopping it (`--nonblocking`)."""

    def __init__(self, spy: str, pid: int) -> None:
        self.spy, self.pid, self.native = spy, pid, True

    def __call__(self) -> str:
        mode = "--native" if self.native else "--nonblocking"
        dump = subprocess.run([self.spy, "dump", mode, "--pid", str(self.pid)], capture_output=True, text=True)
        if self.native and dump.returncode != 0 and "suspend" in dump.stderr:
            self.native = False
            return f"(py-spy cannot stop the process here: {dump.stderr.splitlines()[0]}; without --native)\n" + self()
        return dump.stdout + dump.stderr


def watch(
    pid: int,
    record: str,
    out: str,
    threshold_s: float,
    interval_s: float,
    spy: str,
    *,
    dumps_per_stall: int = 3,
    every_s: float = 0.15,
    cpu_window_s: float = 0.05,
) -> int:
    """Polls `record` until stdin closes; dumps `pid` when an iteration passes `threshold_s`,
    again every `every_s` while it lasts, at most `dumps_per_stall` times. Returns how many
    dumps it wrote."""
    dumped, last, taken, next_at = 0, -1, 0, 0.0
    dump = Dumps(spy, pid)
    os.set_blocking(sys.stdin.fileno(), False)
    with open(record, "rb") as f, open(out, "a") as sink:
        rec = mmap.mmap(f.fileno(), _RECORD.size, access=mmap.ACCESS_READ)
        while True:
            try:
                if sys.stdin.buffer.read() == b"":  # EOF: the parent is done
                    return dumped
            except BlockingIOError:
                pass
            started, iteration = _RECORD.unpack(rec[:])
            late = started and time.monotonic() - started
            if iteration != last:
                last, taken, next_at = iteration, 0, threshold_s
            if late and late > next_at and taken < dumps_per_stall:
                taken, next_at = taken + 1, late + every_s
                sink.write(f"\n== iteration {iteration}, {late * 1e3:.0f} ms in\n")
                sink.write(busy_threads(pid, cpu_window_s))
                sink.write(dump())
                sink.flush()
                dumped += 1
            time.sleep(interval_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pid", type=int)
    p.add_argument("record")
    p.add_argument("out")
    p.add_argument("--threshold-ms", type=float, required=True)
    p.add_argument("--interval-ms", type=float, default=10.0)
    p.add_argument("--py-spy", default="py-spy")
    p.add_argument("--dumps", type=int, default=3, help="at most this many dumps per stalled iteration")
    p.add_argument("--every-ms", type=float, default=150.0, help="between the dumps of one stall")
    p.add_argument("--cpu-window-ms", type=float, default=50.0, help="each thread's CPU time is taken over this")
    args = p.parse_args()
    watch(
        args.pid,
        args.record,
        args.out,
        args.threshold_ms / 1e3,
        args.interval_ms / 1e3,
        args.py_spy,
        dumps_per_stall=args.dumps,
        every_s=args.every_ms / 1e3,
        cpu_window_s=args.cpu_window_ms / 1e3,
    )


if __name__ == "__main__":
    main()
