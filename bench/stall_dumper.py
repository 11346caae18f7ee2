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
a stall is, not how long it lasts untraced.
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


def watch(pid: int, record: str, out: str, threshold_s: float, interval_s: float, spy: str) -> int:
    """Polls `record` until stdin closes; dumps `pid` once per iteration past `threshold_s`.
    Returns how many dumps it wrote."""
    dumped, last = 0, -1
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
            if late and late > threshold_s and iteration != last:
                last = iteration
                sink.write(f"\n== iteration {iteration}, {late * 1e3:.0f} ms in\n")
                sink.flush()
                dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
                sink.write(dump.stdout + dump.stderr)
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
    args = p.parse_args()
    watch(args.pid, args.record, args.out, args.threshold_ms / 1e3, args.interval_ms / 1e3, args.py_spy)


if __name__ == "__main__":
    main()
