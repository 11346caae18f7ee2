"""How a phase of the overlap bench (bench/train_overlap.py) publishes: its `Variant` (D2H
window and block, staging threads, the worker's niceness, the interpreter's switch
interval, the collector, glibc's malloc, and how far each publish goes), parsed from
`--variant`'s text; the publisher it runs (`WeightPublisher`, or `StageOnly`: the same
snapshot, worker and staging with no coordinator and no servers); and the coordinator it
publishes to (in this process or in one of its own)."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_agent.device.device_blocks import block_size, cuts, device_blocks  # noqa: E402
from trainer_agent.device.host_heap import MXFAST_DEFAULT, hold_freed_memory, set_max_fast  # noqa: E402
from trainer_agent.publish.async_publish import PublishQueue, held_bytes, held_params  # noqa: E402
from trainer_agent.publish.publisher import PublishResult, WeightPublisher  # noqa: E402
from trainer_agent.publish.stage_plan import Stager, device_window, plan_staging  # noqa: E402
from trainer_agent.serve.arena import Arena  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from trainer_agent.stage.params import device_stream  # noqa: E402
from weightsync.addresses import inet_refused  # noqa: E402

CHOICES = {
    "work": ("publish", "stage", "d2h", "snapshot"),
    "gc": ("auto", "freeze", "off"),
    "malloc": ("auto", "held"),
    "trim": ("held", "never"),
    "fastbins": ("on", "off"),
    "release": ("caller", "thread"),
    "requests": ("first", "lazy", "loop"),
    "offer": ("every", "idle", "unqueued"),
    "d2h": ("one", "caller"),
}


@dataclass(frozen=True)
class Variant:
    """How the async phase publishes: D2H window and block, staging threads, the worker's
    niceness; how far each publish goes (`work`: "publish" through the coordinator, or
    with no coordinator "stage", "d2h", "snapshot", as `StageOnly`); and the interpreter's
    thread switch interval during the phase (`switch_us`, 0: Python's own, 5 ms); and how
    the trainer runs Python's garbage collector (`gc`: "auto" as Python does, "freeze":
    `gc.freeze()` before the phase, as vLLM does after it starts, "off": disabled during
    the phase, as trainers that collect on a schedule do); and glibc's malloc (`malloc`:
    "auto" as glibc does, "held": `hold_freed_memory()` from the phase on); and where a
    superseded version's snapshot is dropped (`release`: "caller", the training loop's
    thread, or "thread", a thread of the publisher's own); and where PublishVersion's
    requests are built and sent (`requests`: "first", serialized by the publish before its
    call; "lazy", as gRPC's per-call thread reads them; "loop", serialized first and sent
    from the client's own loop thread); and which steps offer their version
    (`offer`: "every" step, the newest waiting one superseded; "idle", only where no
    publish runs or waits; "unqueued", only where none waits: no snapshot taken that
    would be superseded, the worker kept busy); and which thread issues the blocks' copies
    (`d2h`: "one", the process's D2H thread; "caller", the publishing thread:
    `d2h_one_thread` false)."""

    window_bytes: int
    block_bytes: int
    staging_threads: int
    nice: int
    work: str = "publish"
    switch_us: int = 0
    gc: str = "auto"
    malloc: str = "auto"
    trim: str = "held"
    fastbins: str = "on"
    release: str = "caller"
    requests: str = "first"
    offer: str = "every"
    d2h: str = "one"

    def label(self) -> str:
        # the keys of CHOICES that differ from their first value (each one's default)
        chosen = {k: getattr(self, k) for k, values in CHOICES.items() if getattr(self, k) != values[0]}
        label = (
            f"window={self.window_bytes >> 20}M,block={self.block_bytes >> 20}M,"
            f"threads={self.staging_threads},nice={self.nice}"
        )
        label += f",work={chosen.pop('work')}" if "work" in chosen else ""
        label += f",switch={self.switch_us}" if self.switch_us else ""
        return label + "".join(f",{k}={v}" for k, v in chosen.items())


def phase_labels(phases: Sequence[Variant]) -> list[str]:
    """Each phase's label, a repeat of an earlier one's numbered (" #2"): the phases of an
    ABAB comparison are reported and bounded each on its own."""
    seen: dict[str, int] = {}
    out = []
    for v in phases:
        label = v.label()
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def parse_variant(text: str, base: Variant) -> Variant:
    """'window=1G,block=8M,threads=4,nice=0,work=d2h,switch=500,gc=off,malloc=held' (any subset)
    over `base`."""
    fields = {
        "window": "window_bytes",
        "block": "block_bytes",
        "threads": "staging_threads",
        "nice": "nice",
        "switch": "switch_us",
        **{key: key for key in CHOICES},
    }
    changes: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--variant: unknown key {key!r} ({', '.join(fields)})")
        if key in CHOICES:
            if value not in CHOICES[key]:
                raise SystemExit(f"--variant: {key}={value!r}: one of {', '.join(CHOICES[key])}")
            changes[key] = value
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(value[-1:].upper(), 1)
        changes[fields[key]] = int(value[:-1] if scale > 1 else value) * scale
    return replace(base, **changes)


class StageOnly:
    """The publisher's trainer-side work with no coordinator and no servers: the same
    snapshot, worker (`PublishQueue`, latest wins) and staging (`plan_staging`, `Stager`)
    into an arena of two slots used in turn; `publish_async` returns the same futures.
    `work` says how far each publish goes: "stage" (into the arena), "d2h" (the copies to
    host through the same window and blocks, nothing staged) or "snapshot" (the version is
    held and let go: the snapshot's device copy alone)."""

    def __init__(self, settings: PublisherSettings, nice: int, work: str = "stage") -> None:
        self.settings = settings
        self.work = work
        self.arena = Arena(f"bench-overlap-{id(self):x}", slots=2)
        self._stager = Stager(settings)
        self._async: PublishQueue[PublishResult] = PublishQueue("bench-stage", nice=nice)
        self._next_slot = 0

    def publish(self, params: dict[str, Any], version: int) -> PublishResult:
        started = time.perf_counter()
        if self.work == "snapshot":
            return PublishResult(version, "HELD", False, 0, time.perf_counter() - started, 0.0, 0)
        if self.work == "d2h":
            s = self.settings
            block = block_size(s.d2h_block_bytes, s.chunk_bytes)
            if block and cuts(params.values()):
                window = device_window(s, until_staged=False)
                stream = device_blocks(params.items(), "", window, block)
            else:
                stream = device_stream(params.items(), "", s.d2h_window_bytes)
            total = sum(b.nbytes for b in stream)
            return PublishResult(version, "COPIED", False, total, time.perf_counter() - started, 0.0, 0)
        plan = plan_staging(params, self.settings)
        slot, self._next_slot = self._next_slot, 1 - self._next_slot
        self.arena.ensure_slot_bytes(plan.layout.total_bytes)
        self._stager.stage(
            plan, params, self.arena.buffer(), slot * self.arena.slot_bytes, self.arena.slot(slot), base=None
        )
        total = plan.layout.total_bytes
        return PublishResult(version, "STAGED", False, total, time.perf_counter() - started, 0.0, slot)

    def publish_async(self, params: dict[str, Any], version: int, *, snapshot: bool) -> Future:
        s = self.settings  # the snapshot cuts the device path's blocks, as WeightPublisher's does
        block = block_size(s.d2h_block_bytes, s.chunk_bytes)
        held = held_params(params, snapshot=snapshot, weight_dtype=s.weight_dtype, block_bytes=block)
        return self._async.submit(version, lambda: self.publish(held, version), held_bytes(held))

    @property
    def publish_skipped(self) -> int:
        return self._async.skipped

    @property
    def publish_held_bytes(self) -> int:
        return self._async.held_bytes

    def flush(self) -> None:
        self._async.drain()
        self._async.raise_failure()

    def close(self) -> None:
        self._async.close(cancel_pending=False)
        self.arena.close()


@contextlib.contextmanager
def coordinator_here(db: Path, host: str) -> Iterator[str]:
    """A coordinator in this process on `host` (127.0.0.1 on a free port, or `unix:/path`);
    yields its address."""
    from coordinator.config import CoordinatorConfig
    from coordinator.servicer import CoordinatorServicer, coordinator_service
    from coordinator.store import SessionStore
    from coordinator.watch import WatchHub
    from weightsync.metrics import build_metrics
    from weightsync.server import start_server

    hub = WatchHub()
    store = SessionStore(db, listener=hub)
    metrics = build_metrics("coordinator")
    servicer = CoordinatorServicer(store, hub, metrics)
    running = start_server(
        [coordinator_service(servicer)],
        host=host,
        port=0,
        metrics=metrics,
        metrics_port=-1,
        max_workers=CoordinatorConfig.max_workers,
    )
    try:
        yield running.address
    finally:
        hub.close()
        running.stop(0.5)
        servicer.close()
        store.close()


def loopback_addresses(tmp: Path) -> tuple[str, str]:
    """(the publisher's chunk server host, the coordinator's listen address): unix sockets
    in `tmp` where this host has no usable inet sockets (a TPU VM), else 127.0.0.1."""
    if inet_refused():
        return f"unix:{tmp}/trainer.sock", f"unix:{tmp}/c.sock"
    return "127.0.0.1", "127.0.0.1"


@contextlib.contextmanager
def coordinator_process(workdir: Path, host: str) -> Iterator[str]:
    """A coordinator in its own process on `host` (127.0.0.1 on a free port, or
    `unix:/path`), as a deployment runs it: its Python does not share the trainer's
    interpreter; yields its address."""
    from devtools.cluster import Cluster

    with Cluster(workdir) as cluster:
        # no /metrics: a TPU host has no inet socket to serve it on, and nothing reads it here
        yield cluster.start_coordinator(host=host, args=["--metrics-port", "-1"]).address


@contextlib.contextmanager
def publisher(variant: Variant, coordinator: str, host: str) -> Iterator[Any]:
    """The publisher of one phase (a `StageOnly` unless its work is "publish"); `host`
    places its chunk server (a unix socket where this host has no usable inet sockets)."""
    settings = {
        "d2h_window_bytes": variant.window_bytes,
        "d2h_block_bytes": variant.block_bytes,
        "staging_threads": variant.staging_threads,
        "d2h_one_thread": variant.d2h == "one",
    }
    switch, collecting = sys.getswitchinterval(), gc.isenabled()
    if variant.switch_us:
        sys.setswitchinterval(variant.switch_us / 1e6)
    if variant.malloc == "held" and not hold_freed_memory():
        raise SystemExit("--variant malloc=held: this C library has no mallopt")
    if variant.trim == "never" and not hold_freed_memory(trim_bytes=None):
        raise SystemExit("--variant trim=never: this C library has no mallopt")
    if variant.fastbins == "off" and not set_max_fast(0):
        raise SystemExit("--variant fastbins=off: this C library has no mallopt")
    if variant.gc == "freeze":
        gc.freeze()
    elif variant.gc == "off":
        gc.disable()
    try:
        if variant.work != "publish":
            pub = StageOnly(PublisherSettings(coordinator="127.0.0.1:1", **settings), variant.nice, variant.work)
            try:
                yield pub
            finally:
                pub.close()
            return
        session = f"overlap-{time.monotonic_ns() % 10**9}"
        with WeightPublisher(
            PublisherSettings(coordinator=coordinator, session=session, weight_sync_mode="shm", host=host, **settings)
        ) as pub:
            pub._async.nice = variant.nice  # read when its worker starts, at the first publish_async
            pub._async.release_apart = variant.release == "thread"
            pub.client.publish_requests = variant.requests
            yield pub
    finally:
        sys.setswitchinterval(switch)
        if variant.gc == "freeze":
            gc.unfreeze()
        if collecting:
            gc.enable()
        if variant.trim == "never":  # back to what the device path holds on an accelerator (2 GiB)
            hold_freed_memory()
        if variant.fastbins == "off":
            set_max_fast(MXFAST_DEFAULT)
