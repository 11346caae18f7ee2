"""The overlap bench's phases (bench/train_overlap.py): `blocking_phase` (each step followed
by `publish`) and `async_phase` (each step followed by `publish_async`, timed per loop
iteration), and what watches them: `PublishTimeline` (when each publish staged and sent),
`GcPauses` (the collector's pauses), `StallTraces` (every thread's stack in a slow
iteration) and `slow_iterations`, which lines the slow ones up with the rest."""

from __future__ import annotations

import faulthandler
import gc
import statistics
import time
from typing import Any

from overlap_memory import heap_account, heap_stats, page_faults
from overlap_step import Trainer
from stall_dumper import StallDumper


def blocking_phase(trainer: Trainer, pub: Any, steps: int, version: int) -> dict[str, Any]:
    iterations, publishes, stages = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        trainer.wait(trainer.step())
        t_step = time.perf_counter() - t
        version += 1
        result = pub.publish(trainer.params, version)
        iterations.append(time.perf_counter() - t)
        publishes.append(iterations[-1] - t_step)
        stages.append(result.stage_seconds)
    return {"iterations": iterations, "publishes": publishes, "stages": stages, "version": version}


class StallTraces:
    """Every thread's Python stack, written to `path` when a loop iteration passes
    `threshold_ms` (once: `faulthandler`'s watchdog, which needs no interpreter lock: it sees the
    thread that holds the lock and where); with a `native` dumper (`stall_dumper.py`), also
    every thread's native stack and which holds the lock, armed with the same iterations."""

    def __init__(self, path: str, threshold_ms: float, native: StallDumper | None = None) -> None:
        self.file = open(path, "a")  # noqa: SIM115 (open for the run, closed in close())
        self.threshold_s = threshold_ms / 1e3
        self.label = ""
        self.native = native  # entered and left by the caller

    def arm(self, iteration: int) -> None:
        self.file.write(f"\n== {self.label} iteration {iteration} at {time.perf_counter():.4f}\n")
        self.file.flush()
        if self.native:
            self.native.arm(iteration)
        faulthandler.dump_traceback_later(self.threshold_s, file=self.file)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self.native:
            self.native.disarm()

    def close(self) -> None:
        self.disarm()
        self.file.close()


class GcPauses:
    """A `gc.callbacks` entry: how long each collection of Python's garbage collector
    stopped the interpreter, by generation."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []  # (generation, seconds, perf_counter at its start)
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._started, self._started))

    def during(self, start: float, end: float, min_s: float = 0.01) -> list[str]:
        """The collections of at least `min_s` that began in [start, end) (perf_counter
        seconds), as 'gc2 70 ms'."""
        return [f"gc{g} {d * 1e3:.0f} ms" for g, d, t in self.pauses if start <= t < end and d >= min_s]

    def summary(self) -> dict[str, Any]:
        return {
            f"gen{g}": {
                "count": len(ds),
                "total_ms": round(sum(ds) * 1e3, 1),
                "max_ms": round(max(ds) * 1e3, 1),
            }
            for g in (0, 1, 2)
            if (ds := [d for gen, d, _ in self.pauses if gen == g])
        }


class PublishTimeline:
    """When each publish of a phase staged and when it sent its part (ms from the phase's
    start; within the send, PublishVersion's call as "rpc"), from wrappers around the
    publisher's own steps: where in a publish a slow iteration falls. With `memory`, also
    glibc's account at each step's start and end (`heap_stats`: its arenas, its own
    mappings, the free chunks): a heap given back to the kernel, or one of millions of free
    chunks, shows there. That reading locks each arena while it walks its free chunks
    (about 20 ms a call on a v5e trainer's heap), so it is asked for (`--heap-timeline`),
    not taken by default. A `StageOnly` publisher has no such steps."""

    def __init__(self, pub: Any, started: float, *, memory: bool = False) -> None:
        self.started = started
        # (step, version, start ms, end ms, memory at its start, memory at its end: `memory()`)
        self.events: list[tuple[str, int, float, float, tuple[int | None, ...], tuple[int | None, ...]]] = []
        self._version = 0
        self._memory = memory
        for name in ("_stage", "_send"):
            if hasattr(pub, name):
                setattr(pub, name, self._timed(name[1:], getattr(pub, name)))
        # within a send, PublishVersion's call itself (its requests serialized before it):
        # the transport and the coordinator's handling, apart from the trainer's own work
        client = getattr(pub, "client", None)
        if hasattr(client, "_publish_bytes"):
            client._publish_bytes = self._timed("rpc", client._publish_bytes)

    def memory(self) -> tuple[int | None, ...]:
        """(bytes of glibc's arenas, bytes of its own mappings, its free chunks in bins, in
        fastbins: None where unknown or not asked for; the process's page faults so far,
        always where the kernel counts them: getrusage costs microseconds)."""
        if not self._memory:
            return None, None, None, None, page_faults()
        heap = heap_stats()
        return (*(heap.get(k) for k in ("arena", "mapped", "free_chunks", "fast_chunks")), page_faults())

    def _timed(self, step: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if step == "stage":
                self._version = args[1]  # _stage(params, version, idempotency_key)
            before = self.memory()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                ms = lambda t: round((t - self.started) * 1e3, 1)  # noqa: E731
                t1 = ms(time.perf_counter())
                self.events.append((step, self._version, ms(t0), t1, before, self.memory()))

        return timed

    def during(self, start_ms: float, end_ms: float) -> list[str]:
        """The steps that overlap [start_ms, end_ms], as 'send v12 1151.0-1405.2', with the
        memory changes of 64 MiB or more ('heap -2.06 GB', 'mapped +1.20 GB'), glibc's free
        chunks at the step's end where it read them ('1,210,000 free chunks, 3,000 in
        fastbins') and the process's page faults in the step, 1,000 or more ('26,537
        faults': fresh pages, 4 KiB each without transparent hugepages)."""
        out = []
        for s, v, a, b, before, after in self.events:
            if a < end_ms and b > start_ms:
                (h0, m0, _, _, f0), (h1, m1, chunks, fast, f1) = before, after
                notes = [
                    f"{k} {(y - x) / 1e9:+.2f} GB"
                    for k, x, y in (("heap", h0, h1), ("mapped", m0, m1))
                    if x is not None and y is not None and abs(y - x) >= 64 << 20
                ]
                notes += [f"{chunks or 0:,} free chunks, {fast or 0:,} in fastbins"] if chunks or fast else []
                notes += [f"{f1 - f0:,} faults"] if f0 is not None and f1 is not None and f1 - f0 >= 1000 else []
                out.append(f"{s} v{v} {a}-{b}" + "".join(f" {n}" for n in notes))
        return out


def slow_iterations(
    iterations_ms: list[float], starts_ms: list[float], timeline: PublishTimeline, pauses: GcPauses | None = None
) -> list[str]:
    """Each iteration past 1.5 times the median, with the publish steps it overlapped and
    the garbage collections of 10 ms or more that began in it: 'it 12 259 ms: send v9
    1151.0-1405.2, gc2 70 ms'."""
    limit = 1.5 * statistics.median(iterations_ms)
    out = []
    for i, (t, s) in enumerate(zip(iterations_ms, starts_ms, strict=True)):
        if t > limit:
            seen = timeline.during(s, s + t)
            if pauses is not None:
                at = lambda ms: timeline.started + ms / 1e3  # noqa: E731
                seen += pauses.during(at(s), at(s + t))
            out.append(f"it {i} {t:.0f} ms: " + (", ".join(seen) or "no publish step"))
    return out


def async_phase(
    trainer: Trainer,
    pub: Any,
    steps: int,
    version: int,
    stalls: StallTraces | None = None,
    *,
    offer: str = "every",
    heap_timeline: bool = False,
) -> dict[str, Any]:
    """`steps` steps, each followed by publish_async of its parameters (snapshot=True), or
    with `offer` "idle" only those where no publish runs or waits, "unqueued" only those
    where none waits; `stalls` traces the
    iterations that pass its threshold; `heap_timeline` reads glibc's account around each
    publish step (`PublishTimeline`)."""
    iterations: list[float] = []
    overlapped: list[bool] = []
    dispatches: list[float] = []
    calls: list[float] = []
    futures = []
    ready: dict[int, float] = {}  # version -> seconds from its publish_async call until READY
    started = time.perf_counter()
    starts: list[float] = []  # each iteration's start, from the phase's
    ends: dict[int, float] = {}  # version -> when it was READY, from the phase's start
    held_max = 0
    skipped0 = pub.publish_skipped
    cpu0, faults0 = time.process_time(), page_faults()
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    timeline = PublishTimeline(pub, started, memory=heap_timeline)
    not_offered = 0
    for i in range(steps):
        if stalls:
            stalls.arm(i)
        t = time.perf_counter()
        starts.append(t - started)
        busy_before = pub._async.busy
        loss = trainer.step()
        version += 1
        c = time.perf_counter()
        dispatches.append(c - t)
        if (offer == "idle" and pub.publish_held_bytes) or (offer == "unqueued" and pub.publish_waiting):
            not_offered += 1  # a publish runs or waits, or one waits (public: a trainer can do this)
        else:
            future = pub.publish_async(trainer.params, version, snapshot=True)
            future.add_done_callback(lambda f, v=version, c=c: ready.__setitem__(v, time.perf_counter() - c))
            future.add_done_callback(lambda f, v=version: ends.__setitem__(v, time.perf_counter() - started))
            futures.append(future)
        calls.append(time.perf_counter() - c)
        held_max = max(held_max, pub.publish_held_bytes)
        trainer.wait(loss)
        iterations.append(time.perf_counter() - t)
        if stalls:
            stalls.disarm()
        overlapped.append(busy_before or pub._async.busy)
    cpu_s, faults1 = time.process_time() - cpu0, page_faults()
    faults = None if faults0 is None or faults1 is None else faults1 - faults0
    gc.callbacks.remove(pauses)
    t = time.perf_counter()
    pub.flush()
    flush_s = time.perf_counter() - t
    results = [f.result() for f in futures if f.exception() is None]
    return {
        "ready_s": [ready[r.version] for r in results],
        "starts": starts,
        "ready_at": [ends[r.version] for r in results],
        "iterations": iterations,
        "dispatches": dispatches,
        "cpu_s": cpu_s,
        "faults": faults,
        "heap": heap_account(),
        "gc": pauses.summary(),
        "overlapped": overlapped,
        "calls": calls,
        "stages": [r.stage_seconds for r in results if r.total_bytes],  # none where only held
        "published": len(results),
        "skipped": pub.publish_skipped - skipped0,
        "not_offered": not_offered,
        "timeline": timeline.events,
        "slow": slow_iterations([x * 1e3 for x in iterations], [x * 1e3 for x in starts], timeline, pauses),
        "held_max": held_max,
        "flush_s": flush_s,
        "version": version,
    }
