"""Shared by the benchmarks (the transfer benchmark's driver and its worker processes among them):
the model, RSS, CPU time, and the `--heaps` choice."""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_agent.device.host_heap import HEAP_BYTES, TOP_PAD_DEFAULT, hold_for_device_path  # noqa: E402
from weightsync.host_memory import lacks, status_lines  # noqa: E402
from weightsync.model_shapes import PRESETS, param_shapes  # noqa: E402

T = TypeVar("T")
PAGE = os.sysconf("SC_PAGE_SIZE")


def shapes(size: str) -> dict[str, tuple[int, ...]]:
    return param_shapes(PRESETS[size])


def model(size: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A Qwen3-shaped model of finite bf16 values (HF names), deterministic in seed."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(PRESETS[size]).items():
        n = int(np.prod(shape))
        bits = rng.integers(0x3800, 0x4000, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
        out[name] = bits.view(ml_dtypes.bfloat16).reshape(shape)
    return out


def model_bytes(size: str) -> int:
    return sum(int(np.prod(s)) * 2 for s in param_shapes(PRESETS[size]).values())


def _status_kib(pid: int | str, key: str) -> int | None:
    """A `/proc/PID/status` field in KiB; None where the host does not give it."""
    for line in status_lines(pid):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def rss_bytes(pid: int | str = "self") -> int:
    return (_status_kib(pid, "VmRSS") or 0) * 1024


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """VmHWM: the largest RSS since start or since reset_peak_rss(). Where the kernel does
    not report it (gVisor, which TPU hosts run under, has no VmHWM), this process's
    getrusage ru_maxrss, which cannot be reset; for another process there, None (unknown)."""
    peak = _status_kib(pid, "VmHWM")
    if peak is None and pid == "self":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None if peak is None else peak * 1024


def cpu_seconds(pids: Iterable[int | str] = ("self",)) -> float:
    """User + system CPU seconds consumed so far by these processes (all their threads);
    "self" to the nanosecond, other processes in clock ticks (/proc/PID/stat)."""
    ticks, own = 0, 0.0
    for pid in pids:
        if pid == "self":
            own += time.process_time()
            continue
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return own + ticks / os.sysconf("SC_CLK_TCK")


@functools.cache
def peak_rss_resettable() -> bool:
    """Whether this process may set its VmHWM back (write to /proc/self/clear_refs): TPU VMs
    and many pods do not let an ordinary user write that file, and gVisor has none."""
    if "clear_refs" in lacks():
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Sets VmHWM back to the current RSS (Linux: write 5 to clear_refs) where this host allows
    it; False where it does not (VmHWM then keeps the high-water mark since the start)."""
    if pid == "self" and not peak_rss_resettable():
        return False
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class PeakRss:
    """This process's RSS high-water mark over a block, from the kernel's VmHWM (no sampling
    thread competes with the measured work for cores).

    Where VmHWM can be reset, it is on entry and `peak` is exact. Where it cannot, `peak` is
    VmHWM on exit: exact when the mark rose inside the block (its highest point came then),
    else an upper bound (`exact` False). Measure such a block before anything else in the
    process raises the mark, or in a fresh process.
    """

    def __enter__(self) -> PeakRss:
        self.reset = reset_peak_rss()
        self.start = peak_rss_bytes()
        self.peak = 0
        self.exact = False
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = peak_rss_bytes()
        self.exact = self.reset or self.peak > self.start


#: a thread arena's heaps, by the benches' `--heaps` choice: the top pad that keeps them (the
#: device path's) or glibc's own, with which a free that empties one unmaps it
HEAP_PADS = {"kept": HEAP_BYTES, "unmapped": TOP_PAD_DEFAULT}


def hold_heaps(choice: str) -> None:
    """The device path's hold, taken now with the top pad of `choice` ("kept": as the device
    path takes it at its first copies, so nothing is done here); exits off glibc."""
    if choice != "kept" and not hold_for_device_path(top_pad_bytes=HEAP_PADS[choice]):
        raise SystemExit(f"--heaps {choice}: this C library has no mallopt")


#: the TPU runtime's host-transfer settings (libtpu reads them when JAX first uses the chip):
#: the size of its premapped, pinned host buffer for DMA (4 GiB by default, Cloud TPU
#: performance guide) and the largest transfer it moves through that buffer
TPU_TRANSFER_ENV = ("TPU_PREMAPPED_BUFFER_SIZE", "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES")


def tpu_transfer_env() -> dict[str, str]:
    """Those of `TPU_TRANSFER_ENV` this process was started with (empty: the runtime's own)."""
    return {k: os.environ[k] for k in TPU_TRANSFER_ENV if k in os.environ}


def on_thread(worker: bool, fn: Callable[..., T], *fn_args: Any) -> T:
    """`fn(*fn_args)`, where `worker` on a thread of its own, as publish_async stages (glibc
    gives such a thread an arena of its own), else on this one; its exception is raised here."""
    if not worker:
        return fn(*fn_args)
    with ThreadPoolExecutor(1, thread_name_prefix="publish-worker") as pool:
        return pool.submit(fn, *fn_args).result()


def emit_json(result: dict[str, Any], out: str = "") -> None:
    """The result as indented JSON on stdout, and into `out` where one is named."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
