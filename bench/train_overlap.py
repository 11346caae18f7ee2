"""Publishing beside a real training step: what each way of publishing costs the trainer.

A Qwen3-shaped model (`--preset`, bf16 parameters, fp32 Adam moments, the step donating
its state) trains on random tokens: forward, cross-entropy, backward, Adam update, one
jitted call. Phases, each timed per loop iteration (the step and, where there is one, the
publish call, until the step's loss is ready; `--read-loss` reads it to the host):

  alone     `--steps` steps, no publish
  blocking  `--blocking-steps` steps, each followed by `publish(params, v)`
  async     `--steps` steps, each followed by `publish_async(params, v, snapshot=True)`: the
            D2H, staging and publish run on the publisher's worker while the next steps
            compute; latest wins
  alone2    `--steps` steps, no publish again (drift between phases shows here)
  variants  per `--variant`, another async phase with its own publisher, then as many
            steps without: D2H window and block, staging threads, worker niceness, the
            interpreter's switch interval, Python's garbage collector during the steps
            (`gc`: auto, freeze, off), glibc's malloc (`malloc`: auto, or held: freed heap
            kept, `hold_freed_memory`; it stays so for later phases; `trim`: held, never;
            `fastbins`: on, off), where a superseded snapshot is dropped (`release`:
            caller, thread), how PublishVersion's requests are built and sent
            (`requests`: first, lazy, loop), which steps offer their version (`offer`:
            every, idle, unqueued), which thread copies the blocks (`d2h`: one, the
            process's D2H thread; caller), and how far each publish goes (`work`:
            publish | stage | d2h | snapshot, the last three with no coordinator: staged
            into an arena, only brought to host, only the device snapshot held), to tell
            apart what costs the steps; a phase repeated is numbered (" #2")

`--base` sets the same keys for the run's own phases (`--base d2h=caller`: the control of
the D2H thread). Before the phases a warm-up publishes once blocking and once async; glibc's
account arena by arena after it and after each async phase (`host_heap.arena_stats`: which
threads' freed blocks the process keeps, and the largest arena's heaps and free chunks:
whether live allocations hold its freed blocks apart; the heaps the device path's blocks
landed in, `host_heap.block_heaps`) and the collector's pauses in the phases without
publishing are printed beside the phases' own. `--block-heaps count` leaves the window at
its limit however many heaps the blocks landed in (the control of the device path's
steering), and `--trace-blocks PATH` writes each block's host buffer as it landed (address,
bytes, the window's room then), when its copy was issued and when it was freed, with glibc's
`malloc_info` at the end.

and prints one JSON object (also written to `--out`) and a line per async phase on
stderr: the step times and how long each step's call took to return (its dispatch: where
the loop waits for the interpreter or the runtime, it shows here), `async_ratio` (the
async phase's total over as many no-publish steps at the mean of both no-publish phases),
`overlap_ratio` (the same over the steps that ran while a publish was in flight), the
process's CPU seconds and page faults per step, versions published and skipped and
published per step, the publish-to-ready latency of each published version (from its
`publish_async` call until it was READY: staged and taken by the coordinator; with no
coordinator: staged) in steps and seconds, D2H + staging GB/s, the device memory held for
pending versions, and each async phase's RSS peak against its bound: the RSS before its
publisher started + arena (two slots) + window + 256 MiB (+ the versions held, where the
device is host memory). The RSS is sampled from another process (`rss_sampler.py`, every
`--rss-interval-ms`; 0: not sampled, no bound judged): gVisor, which TPU hosts run under,
has no high-water mark that can be reset, so the process's own (`ru_maxrss`) keeps the
peak of compiling the model. Each slow iteration is printed with the publish steps it
overlapped (stage, send, and PublishVersion's call within it as rpc, each with the page
faults in it where 1,000 or more) and the garbage collections in it; `--heap-timeline`
adds glibc's account around each step.

The publisher needs a coordinator: by default one runs in a process of its own (as a
deployment runs it beside the trainer), on 127.0.0.1 or, where this host has no usable
inet sockets (a TPU VM), on a unix socket in a temporary directory, with the publisher's
chunk server on one beside it; `--coordinator-in-process` runs it in the trainer's process
(its Python then competes with the training loop for the interpreter), and
`--coordinator-address` names a running one. `--stage-only` runs the same worker, snapshot
and staging into an arena with no coordinator and no servers at all (no socket is
opened): the trainer's side.

    python bench/train_overlap.py                                   # CPU: small preset, 8 steps
    JAX_PLATFORMS= python bench/train_overlap.py --preset 0.6b --steps 40 --out $OUT/overlap.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import gc
import json
import math
import statistics
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import HEAP_PADS, emit_json, hold_heaps, peak_rss_bytes, rss_bytes, tpu_transfer_env  # noqa: E402
from rss_sampler import RssSampler  # noqa: E402
from stall_dumper import StallDumper  # noqa: E402

from trainer_agent.device.device_blocks import Window, block_size, buffer_address, cuts, device_blocks  # noqa: E402
from trainer_agent.device.host_heap import (  # noqa: E402
    MXFAST_DEFAULT,
    arena_stats,
    arenas_summary,
    block_heaps,
    heap_stats,
    hold_freed_memory,
    malloc_info_text,
    set_max_fast,
)
from trainer_agent.publish.async_publish import PublishQueue, held_bytes, held_params  # noqa: E402
from trainer_agent.publish.publisher import ASYNC_WORKER_NICE, PublishResult, WeightPublisher  # noqa: E402
from trainer_agent.publish.stage_plan import Stager, device_window, plan_staging  # noqa: E402
from trainer_agent.serve.arena import Arena  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from trainer_agent.stage import params as params_module  # noqa: E402
from trainer_agent.stage.params import device_stream  # noqa: E402
from weightsync.addresses import inet_refused  # noqa: E402
from weightsync.host_memory import minor_faults  # noqa: E402
from weightsync.model_shapes import PRESETS, ModelShape, param_shapes  # noqa: E402

# -- the model: a Qwen3-shaped decoder (tied embeddings), trained by hand-written Adam ------


def init_params(shape: ModelShape, seed: int = 0) -> dict[str, jax.Array]:
    """bf16 weights: norms 1, matrices ~N(0, 0.02), made on the default device."""
    shapes = param_shapes(shape)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))

    @partial(jax.jit, static_argnums=(1, 2))
    def one(key: jax.Array, shp: tuple[int, ...], norm: bool) -> jax.Array:
        if norm:
            return jnp.ones(shp, jnp.bfloat16)
        return (0.02 * jax.random.normal(key, shp, jnp.float32)).astype(jnp.bfloat16)

    return {name: one(k, shp, len(shp) == 1) for (name, shp), k in zip(shapes.items(), keys)}


def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype) * w


def _layer(shape: ModelShape, p: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    b, t, _ = h.shape
    nh, nk, hd = shape.heads, shape.kv_heads, shape.head_dim
    x = _rms(h, p["input_layernorm.weight"])
    q = (x @ p["self_attn.q_proj.weight"].T).reshape(b, t, nh, hd)
    k = (x @ p["self_attn.k_proj.weight"].T).reshape(b, t, nk, hd)
    v = (x @ p["self_attn.v_proj.weight"].T).reshape(b, t, nk, hd)
    q, k = _rms(q, p["self_attn.q_norm.weight"]), _rms(k, p["self_attn.k_norm.weight"])
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, nh * hd)
    h = h + attn @ p["self_attn.o_proj.weight"].T
    x = _rms(h, p["post_attention_layernorm.weight"])
    gate, up = x @ p["mlp.gate_proj.weight"].T, x @ p["mlp.up_proj.weight"].T
    return h + (jax.nn.silu(gate) * up) @ p["mlp.down_proj.weight"].T


def loss_fn(shape: ModelShape, params: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
    embed = params["model.embed_tokens.weight"]
    h = embed[tokens[:, :-1]]
    for i in range(shape.layers):
        prefix = f"model.layers.{i}."
        layer = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
        h = jax.checkpoint(partial(_layer, shape))(layer, h)  # activations recomputed: HBM for held versions
    h = _rms(h, params["model.norm.weight"])
    logits = (h @ embed.T).astype(jnp.float32)
    labels = tokens[:, 1:]
    logz = jax.nn.logsumexp(logits, -1)
    return jnp.mean(logz - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])


def make_step(shape: ModelShape, lr: float = 1e-4) -> Any:
    """(params, m, v, count, tokens) -> (params, m, v, count, loss), donating its state."""
    b1, b2, eps = 0.9, 0.95, 1e-8

    def step(params: Any, m: Any, v: Any, count: jax.Array, tokens: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(partial(loss_fn, shape))(params, tokens)
        count = count + 1
        c1, c2 = 1 - b1**count, 1 - b2**count

        def update(p: jax.Array, g: jax.Array, mi: jax.Array, vi: jax.Array) -> tuple[jax.Array, ...]:
            g32 = g.astype(jnp.float32)
            mi = b1 * mi + (1 - b1) * g32
            vi = b2 * vi + (1 - b2) * g32 * g32
            p32 = p.astype(jnp.float32) - lr * (mi / c1) / (jnp.sqrt(vi / c2) + eps)
            return p32.astype(p.dtype), mi, vi

        out = {k: update(params[k], grads[k], m[k], v[k]) for k in params}
        new_p = {k: o[0] for k, o in out.items()}
        return new_p, {k: o[1] for k, o in out.items()}, {k: o[2] for k, o in out.items()}, count, loss

    return step


# -- publishers ------------------------------------------------------------------------


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


def loopback_addresses(tmp: Path) -> tuple[str, str]:
    """(the publisher's chunk server host, the coordinator's listen address): unix sockets
    in `tmp` where this host has no usable inet sockets (a TPU VM), else 127.0.0.1."""
    if inet_refused():
        return f"unix:{tmp}/trainer.sock", f"unix:{tmp}/c.sock"
    return "127.0.0.1", "127.0.0.1"


TRACE_COLUMNS = [
    "t_landed", "address", "owner_bytes", "block_bytes", "window_used", "window_room", "t_freed",
    "t_issued", "window_used_at_issue",
]  # fmt: skip


class BlockTrace:
    """Each block's host buffer as the device path's window saw it land: the time, the
    address and bytes of the array that owns the buffer (a pack's, for a packed entry), the
    block's bytes, the room the window had in flight and allowed then, when the owning
    array was freed (a finalizer), and when its copy was issued (its buffer allocated) with
    what the window had in flight just after; glibc's `malloc_info` at the end. Where glibc
    placed the blocks, version after version, and whether any outlived their staging."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.rows: list[list[Any]] = []
        self.owner_bases: collections.Counter[str] = collections.Counter()
        self._owners: dict[int, list[Any]] = {}
        self._issues: weakref.WeakKeyDictionary[Window, collections.deque] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        issued, landed = Window.issued, Window.landed

        def traced_issue(window: Window, nbytes: int) -> None:
            issued(window, nbytes)
            with self._lock:  # a window's copies land in the order they were issued
                self._issues.setdefault(window, collections.deque()).append((self._now(), window._used))

        def traced(window: Window, nbytes: int, buffer: np.ndarray | None = None) -> None:
            landed(window, nbytes, buffer)
            if buffer is not None:
                self.note(window, nbytes, buffer)

        Window.issued = traced_issue  # type: ignore[method-assign]
        Window.landed = traced  # type: ignore[method-assign]

    def _now(self) -> float:
        return round(time.perf_counter() - self.t0, 6)

    def note(self, window: Window, nbytes: int, buffer: np.ndarray) -> None:
        owner = buffer
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        with self._lock:
            self.owner_bases[type(owner.base).__name__] += 1
            issues = self._issues.get(window)
            t_issued, used_at_issue = issues.popleft() if issues else (None, None)
            row = [self._now(), buffer_address(owner), owner.nbytes, nbytes, window._used, window.room_bytes, None]
            row += [t_issued, used_at_issue]
            self.rows.append(row)
            if id(owner) in self._owners:  # a pack's later entry: freed with the pack
                return
            self._owners[id(owner)] = row
        weakref.finalize(owner, self._freed, id(owner))

    def _freed(self, key: int) -> None:
        with self._lock:
            row = self._owners.pop(key, None)
            if row is not None:
                row[6] = self._now()

    def write(self, path: str) -> None:
        with self._lock:
            doc = {
                "columns": TRACE_COLUMNS,
                "rows": self.rows,
                "owner_bases": dict(self.owner_bases),
                "block_heaps": block_heaps.count,
                "malloc_info": malloc_info_text(),
            }
        with open(path, "w") as f:
            json.dump(doc, f)
        print(f"block trace: {len(doc['rows'])} blocks, {path}", file=sys.stderr)


def heap_account() -> dict[str, Any]:
    """glibc's account (`heap_stats`) with its arenas in short (`arenas_summary`) and the
    heaps the device path's blocks landed in (`block_heaps`, counted with the heaps kept)."""
    return heap_stats() | arenas_summary(arena_stats()) | {"block_heaps": block_heaps.count}


@contextlib.contextmanager
def coordinator_process(workdir: Path, host: str) -> Iterator[str]:
    """A coordinator in its own process on `host` (127.0.0.1 on a free port, or
    `unix:/path`), as a deployment runs it: its Python does not share the trainer's
    interpreter; yields its address."""
    from devtools.cluster import Cluster

    with Cluster(workdir) as cluster:
        # no /metrics: a TPU host has no inet socket to serve it on, and nothing reads it here
        yield cluster.start_coordinator(host=host, args=["--metrics-port", "-1"]).address


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


# -- phases ----------------------------------------------------------------------------


class Trainer:
    """The model's state on the device and its jitted, donating step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        shape = PRESETS[args.preset]
        params = init_params(shape, args.seed)
        m = {k: jnp.zeros(p.shape, jnp.float32) for k, p in params.items()}
        v = {k: jnp.zeros(p.shape, jnp.float32) for k, p in params.items()}
        self.state = [params, m, v, jnp.zeros((), jnp.int32)]
        self.tokens = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq + 1), 0, shape.vocab)
        self._step = jax.jit(make_step(shape), donate_argnums=(0, 1, 2, 3) if args.donate else ())

    @property
    def params(self) -> dict[str, jax.Array]:
        return self.state[0]

    def step(self) -> jax.Array:
        *self.state, loss = self._step(*self.state, self.tokens)
        return loss

    def wait(self, loss: jax.Array) -> None:
        float(loss) if self.args.read_loss else loss.block_until_ready()

    def alone(self, steps: int, dispatches: list[float] | None = None) -> list[float]:
        """Each step's time until its loss is ready; with `dispatches`, the time each step's
        call took to return (the dispatch) is appended there."""
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loss = self.step()
            if dispatches is not None:
                dispatches.append(time.perf_counter() - t)
            self.wait(loss)
            times.append(time.perf_counter() - t)
        return times


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


def page_faults() -> int | None:
    """The process's page faults so far (minor: a fresh page mapped in); None where the
    kernel does not count them (gVisor)."""
    return minor_faults()


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


def summary(phase: dict[str, Any], baseline: float, param_bytes: int) -> dict[str, Any]:
    """Ratios of an async phase against the mean no-publish step `baseline`."""
    its, over = phase["iterations"], phase["overlapped"]
    n_over = sum(over)
    ready = phase["ready_s"]
    return {
        "iteration_s": _stats(its),
        "step_dispatch_s": _stats(phase["dispatches"]),
        "publish_async_call_s": _stats(phase["calls"]),
        "cpu_s_per_step": round(phase["cpu_s"] / len(its), 4),
        # the process's page faults (None: the kernel counts none)
        "faults_per_step": None if phase["faults"] is None else round(phase["faults"] / len(its)),
        "gc_pauses": phase["gc"],
        "heap_at_end": phase["heap"],  # glibc's arenas and own mappings when the phase ended
        # each iteration's times, to line up slow ones with pauses
        "each_ms": {
            "iteration": [round(x * 1e3, 1) for x in its],
            "dispatch": [round(x * 1e3, 1) for x in phase["dispatches"]],
            "call": [round(x * 1e3, 1) for x in phase["calls"]],
            "start": [round(x * 1e3, 1) for x in phase["starts"]],
            "published_ready_at": [round(x * 1e3, 1) for x in phase["ready_at"]],  # from the phase's start
        },
        # each publish's staging and sending (step, version, start and end ms from the phase's
        # start), and the slow iterations with the steps they overlapped
        "publish_steps_ms": phase["timeline"],
        "slow_iterations": phase["slow"],
        "not_offered": phase["not_offered"],
        "async_ratio": round(sum(its) / (len(its) * baseline), 3),
        "overlap_ratio": round(sum(t for t, o in zip(its, over) if o) / (n_over * baseline), 3) if n_over else None,
        "overlapped_steps": n_over,
        "published": phase["published"],
        "skipped": phase["skipped"],
        "published_per_step": round(phase["published"] / len(its), 3),
        "publish_to_ready_s": _stats(ready) if ready else None,
        "publish_to_ready_steps": {k: round(v / baseline, 2) for k, v in _stats(ready).items() if k != "total"}
        if ready
        else None,
        "d2h_stage_gbps": round(param_bytes / statistics.fmean(phase["stages"]) / 1e9, 3) if phase["stages"] else None,
        "held_bytes_max": phase["held_max"],
        "flush_s": round(phase["flush_s"], 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = jax.devices()[0]
    trainer = Trainer(args)
    param_bytes = sum(int(p.nbytes) for p in trainer.params.values())
    t = time.perf_counter()
    trainer.wait(trainer.step())
    compile_s = time.perf_counter() - t
    # the heap the compile leaves (JAX's compilation cache, where it hits, leaves far less):
    # every protobuf malloc_trim walks its free chunks (bench/descriptor_trim.py)
    transfer_env = tpu_transfer_env()
    print(
        f"step compiled in {compile_s:.1f} s; glibc's free chunks after it: {heap_stats().get('free_chunks', 0):,}"
        + "".join(f"; {k}={v}" for k, v in transfer_env.items()),
        file=sys.stderr,
    )
    trainer.alone(2)
    base = Variant(args.window_bytes, args.block_bytes, args.staging_threads, args.nice)
    base = parse_variant(args.base, replace(base, work="stage" if args.stage_only else "publish"))
    variants = [parse_variant(text, base) for text in args.variant]
    labels = phase_labels([base, *variants])
    held = [v.malloc == "held" for v in (base, *variants)]
    if any(held) and not all(held[held.index(True) :]):
        raise SystemExit("--variant malloc=held: glibc's thresholds stay set, so later variants must hold too")
    out: dict[str, Any] = {
        "preset": args.preset,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "param_bytes": param_bytes,
        "tensors": len(trainer.params),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "donate": args.donate,
        "read_loss": args.read_loss,
        "mode": "stage-only" if args.stage_only else "coordinator",
        "coordinator_address": args.coordinator_address,
        "coordinator_in_process": args.coordinator_in_process,
        "variant": base.label(),
        "heaps": args.heaps,
        "blocks_forced": args.force_blocks,
        "tpu_transfer_env": transfer_env,
        "compile_s": round(compile_s, 3),
    }
    # the snapshot's program compiled before the baseline: compiling is once per trainer,
    # and the memory it leaves in the heap is not the publish's
    held_params(trainer.params, snapshot=True, block_bytes=block_size(base.block_bytes, PublisherSettings.chunk_bytes))
    # held versions count where the "device" is host memory (CPU)
    held_counted = device.platform == "cpu"
    with contextlib.ExitStack() as stack:
        stalls = None
        if args.trace_stalls_ms:
            path = args.trace_file or "stall-traces.txt"
            native = None
            if args.native_stacks:
                native = stack.enter_context(StallDumper(path + ".native", args.trace_stalls_ms))
            stalls = StallTraces(path, args.trace_stalls_ms, native)
            stack.callback(stalls.close)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overlap-")))
        host, listen = loopback_addresses(tmp)
        coordinator = args.coordinator_address
        if not coordinator and any(v.work == "publish" for v in (base, *variants)):
            if args.coordinator_in_process:
                coordinator = stack.enter_context(coordinator_here(tmp / "c.db", listen))
            else:
                coordinator = stack.enter_context(coordinator_process(tmp / "coordinator", listen))
            out["coordinator_address"] = coordinator
        rss_mark = peak_rss_bytes()  # the high-water mark of building and compiling the model
        rss_baseline = rss_bytes()
        rss = stack.enter_context(RssSampler(args.rss_interval_ms))
        rss.phase("warm-up")
        with publisher(base, coordinator, host) as pub:
            version = 1
            pub.publish(trainer.params, version)  # the arena made, any staging call compiled
            version += 1
            pub.publish_async(trainer.params, version, snapshot=True).result()
            out["heap_after_warm_up"] = heap_account()
            print(
                f"heap after the warm-up's publishes (blocking, async): {_heap_line(out['heap_after_warm_up'])}",
                file=sys.stderr,
            )
            rss.phase("alone")
            dispatches: list[float] = []
            alone_gc = GcPauses()
            gc.callbacks.append(alone_gc)  # what the collector stops the loop for without publishing
            alone = trainer.alone(args.steps, dispatches)
            gc.callbacks.remove(alone_gc)
            rss.phase("blocking")
            blocking = blocking_phase(trainer, pub, args.blocking_steps, version)
            rss.phase("async")
            if stalls:
                stalls.label = base.label()
            first = async_phase(
                trainer,
                pub,
                args.steps,
                blocking["version"],
                stalls,
                offer=base.offer,
                heap_timeline=args.heap_timeline,
            )
            version = first["version"]
        rss.phase("alone2")
        gc.callbacks.append(alone_gc)
        alone2 = trainer.alone(args.steps, dispatches)
        gc.callbacks.remove(alone_gc)
        baseline = statistics.fmean(alone + alone2)
        out |= {
            "step_s": {"alone": _stats(alone), "alone2": _stats(alone2), "dispatch": _stats(dispatches)},
            "gc_pauses_alone": alone_gc.summary(),  # the alone and alone2 phases' collections
            "blocking": {
                "iteration_s": _stats(blocking["iterations"]),
                "publish_s": _stats(blocking["publishes"]),
                "ratio": round(sum(blocking["iterations"]) / (len(blocking["iterations"]) * baseline), 3),
                "d2h_stage_gbps": round(param_bytes / statistics.fmean(blocking["stages"]) / 1e9, 3),
            },
            "async": summary(first, baseline, param_bytes),
        }
        print(f"GC in the {2 * args.steps} steps alone: {out['gc_pauses_alone']}", file=sys.stderr)
        _report(base.label(), out["async"], baseline)
        sweep = {}
        held_max = {base.label(): first["held_max"]}
        baselines = {base.label(): rss_baseline}
        for variant, label in zip(variants, labels[1:], strict=True):
            baselines[label] = rss_bytes()  # what earlier phases left in the heap is not this one's
            with publisher(variant, coordinator, host) as pub:
                version += 1
                pub.publish(trainer.params, version)
                rss.phase(label)
                if stalls:
                    stalls.label = label
                phase = async_phase(
                    trainer, pub, args.steps, version, stalls, offer=variant.offer, heap_timeline=args.heap_timeline
                )
                version = phase["version"]
                held_max[label] = phase["held_max"]
            rss.phase("alone-after:" + label)
            after = trainer.alone(args.steps)
            sweep[label] = summary(phase, statistics.fmean(after), param_bytes) | {"alone_after_s": _stats(after)}
            _report(label, sweep[label], statistics.fmean(after))
        if sweep:
            out["variants"] = sweep
    stats = device.memory_stats() or {}
    out["device_memory"] = {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}
    peak = peak_rss_bytes()  # VmHWM, or getrusage's ru_maxrss where there is none (gVisor)
    # Each async phase's RSS peak (sampled from another process: gVisor has no resettable
    # high-water mark) against the RSS before its publisher started + arena (two slots) +
    # window + 256 MiB (+ the versions held, where they are in host memory)
    bounds = {}
    for v, label in zip((base, *variants), labels, strict=True):
        phase_peak = rss.peaks.get("async" if v is base else label)  # None: unknown (no sample)
        bound = baselines[label] + 2 * param_bytes + v.window_bytes + (256 << 20) + held_max[label] * held_counted
        bounds[label] = {
            "baseline_bytes": baselines[label],
            "peak_bytes": phase_peak,
            "bound_bytes": bound,
            "within": phase_peak <= bound if phase_peak is not None else None,  # None: not sampled
        }
    out |= {
        "rss_baseline_bytes": rss_baseline,
        "rss_phase_peak_bytes": rss.peaks,
        "rss_async_bounds": bounds,
        # the verdict is the async publish's (the first async phase, the run's settings);
        # a variant's baseline is the RSS its earlier phases left, which the TPU runtime and
        # the heap move by GBs between phases: reported, not judged
        "rss_within_bound": bounds[base.label()]["within"],
        # the process's own high-water mark, building and compiling the model included where
        # it cannot be reset: above the mark taken before publishing, publishing set it
        "rss_process_peak_bytes": peak,
        "rss_process_peak_after_publishing": peak > rss_mark,
    }
    if not rss.sampling:
        print(f"RSS: not sampled (--rss-interval-ms 0); process high-water mark {peak / 1e9:.2f} GB", file=sys.stderr)
        return out
    async_peak = bounds[base.label()]["peak_bytes"]
    print(
        f"RSS: async phase peak {'unknown' if async_peak is None else f'{async_peak / 1e9:.2f}'} GB, bound "
        f"{bounds[base.label()]['bound_bytes'] / 1e9:.2f} GB, within: {out['rss_within_bound']}; variants within: "
        f"{[b['within'] for label, b in bounds.items() if label != base.label()]}; "
        f"process high-water mark {peak / 1e9:.2f} GB",
        file=sys.stderr,
    )
    return out


def _count(n: int | None) -> str:
    """`n` with thousands separators; "unknown" for None."""
    return "unknown" if n is None else f"{n:,}"


def _report(label: str, s: dict[str, Any], baseline: float) -> None:
    """One line on stderr per async phase, as it ends."""
    print(
        f"{label}: ratio {s['async_ratio']} (alone {baseline * 1e3:.1f} ms, iterations "
        f"{s['iteration_s']['median'] * 1e3:.1f} median / {s['iteration_s']['mean'] * 1e3:.1f} mean); "
        f"dispatch {s['step_dispatch_s']['median'] * 1e3:.1f} ms, publish_async call "
        f"{s['publish_async_call_s']['median'] * 1e3:.1f} median / "
        f"{s['publish_async_call_s']['max'] * 1e3:.0f} max ms; "
        f"published {s['published']}; to READY {s['publish_to_ready_steps'] or {}}; "
        f"{s['d2h_stage_gbps']} GB/s; CPU {s['cpu_s_per_step'] * 1e3:.0f} ms/step; "
        f"{_count(s['faults_per_step'])} page faults/step; GC {s['gc_pauses']}"
        + (f"; not offered {s['not_offered']}" if s["not_offered"] else ""),
        file=sys.stderr,
    )
    if heap := s["heap_at_end"]:
        print(f"  heap at its end: {_heap_line(heap)}", file=sys.stderr)
    for line in s["slow_iterations"]:
        print(f"  slow {line}", file=sys.stderr)


def _heap_line(heap: dict[str, Any]) -> str:
    """glibc's account in a line: '4.43 GB free of 5.01 GB in 9 arenas; 64 MiB or more:
    main 2.10/1.90 GB, 1.22/1.20 GB; the largest in 19 heaps, free in 25 chunks, the
    largest 64.0 MiB; blocks in 17 heaps' (each arena's bytes from the kernel / free; the
    largest arena's heaps and free chunks: with nothing live in it, one chunk a heap; the
    heaps the device path's blocks landed in)."""
    gb = lambda pair: f"{pair[0] / 1e9:.2f}/{pair[1] / 1e9:.2f} GB"  # noqa: E731
    large = [gb(p) for p in heap.get("large", [])]
    if heap.get("main") in heap.get("large", []):
        large[heap["large"].index(heap["main"])] = "main " + gb(heap["main"])
    top = heap.get("largest") or {}
    where = f"in {top.get('heaps')} heaps" if top.get("heaps") else "(the main one)"
    chunks = (
        f"; the largest {where}, free in {top.get('free_chunks', 0)} chunks, the largest "
        f"{top.get('largest_free', 0) / (1 << 20):.1f} MiB"
        if top
        else ""
    )
    return (
        f"{heap.get('free', 0) / 1e9:.2f} GB free of {heap.get('arena', 0) / 1e9:.2f} GB in {heap.get('arenas', 0)} "
        f"arenas; 64 MiB or more: {', '.join(large) or 'none'}{chunks}"
        + (f"; blocks in {heap['block_heaps']} heaps" if heap.get("block_heaps") else "")
    )


def _stats(xs: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(xs), 5),
        "median": round(statistics.median(xs), 5),
        "max": round(max(xs), 5),
        "total": round(math.fsum(xs), 4),
    }


def main() -> None:
    on_accel = jax.default_backend() != "cpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="0.6b" if on_accel else "small")
    p.add_argument("--steps", type=int, default=40 if on_accel else 8, help="steps per phase")
    p.add_argument("--blocking-steps", type=int, default=0, help="steps of the blocking phase; 0: --steps, at most 10")
    p.add_argument("--batch", type=int, default=4 if on_accel else 2)
    p.add_argument("--seq", type=int, default=512 if on_accel else 64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-bytes", type=int, default=PublisherSettings.d2h_window_bytes)
    p.add_argument("--block-bytes", type=int, default=PublisherSettings.d2h_block_bytes)
    p.add_argument("--staging-threads", type=int, default=0, help="threads of the staging pass; 0 = every core")
    p.add_argument("--nice", type=int, default=ASYNC_WORKER_NICE, help="niceness added to the publish worker")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="another async phase, e.g. 'window=1G,block=8M,threads=4,nice=0' (keys window, block, threads, "
        "nice, work, switch, gc, malloc, trim, fastbins, release, requests, offer, d2h); repeatable",
    )
    p.add_argument(
        "--base",
        default="",
        help="the run's own settings (the warm-up, blocking and first async phases), in --variant's form, "
        "e.g. 'd2h=caller'",
    )
    p.add_argument("--no-donate", dest="donate", action="store_false", help="the step does not donate its state")
    p.add_argument("--read-loss", action="store_true", help="read each step's loss to the host (a D2H per step)")
    p.add_argument(
        "--coordinator-address", default="", help="a running coordinator; default: one started in a process of its own"
    )
    p.add_argument(
        "--coordinator-in-process",
        action="store_true",
        help="run the coordinator in this process instead (its Python then takes the trainer's interpreter lock)",
    )
    p.add_argument("--stage-only", action="store_true", help="no coordinator, no servers: snapshot + D2H + staging")
    p.add_argument("--out", default="", help="also write the JSON object here")
    p.add_argument(
        "--trace-stalls-ms",
        type=float,
        default=0,
        help="write every thread's stack when an async iteration passes this many ms (0: never)",
    )
    p.add_argument("--trace-file", default="", help="where --trace-stalls-ms writes (default stall-traces.txt)")
    p.add_argument(
        "--native-stacks",
        action="store_true",
        help="with --trace-stalls-ms: also each thread's native stack (py-spy), in the trace file + .native",
    )
    p.add_argument(
        "--rss-interval-ms",
        type=float,
        default=1.0,
        help="how often another process reads this one's RSS (/proc/PID/status) for each phase's peak; 0: never "
        "(no RSS bound judged: whether the sampling costs the steps)",
    )
    p.add_argument(
        "--heap-timeline",
        action="store_true",
        help="read glibc's arenas, mappings and free chunks around each publish step (mallinfo2: it locks "
        "each arena while it counts, tens of ms on a heap of millions of free chunks)",
    )
    p.add_argument(
        "--heaps",
        choices=tuple(HEAP_PADS),
        default="kept",
        help="a thread arena's heaps, for the whole run: kept as the device path holds them, or unmapped when a "
        "free empties one (glibc's own top pad; the device path's hold takes it)",
    )
    p.add_argument(
        "--block-heaps",
        choices=("steer", "count"),
        default="steer",
        help="the heaps the device path's blocks landed in, for the whole run: past the window, taken off what may be "
        "in flight (steer, the device path's own) or only counted (count, the control)",
    )
    p.add_argument(
        "--trace-blocks",
        default="",
        help="write here (JSON) each block's host buffer as it landed (its address and bytes, the window's room "
        "in flight then), when its copy was issued (its buffer allocated) and when it was freed, and glibc's "
        "malloc_info at the end",
    )
    p.add_argument(
        "--force-blocks",
        action="store_true",
        help="cut shards into blocks on CPU devices too (the accelerator's branch, its held heap included)",
    )
    args = p.parse_args()
    args.blocking_steps = args.blocking_steps or min(args.steps, 10)
    if args.force_blocks:
        params_module.HOST_MEMORY_PLATFORMS = frozenset()
    hold_heaps(args.heaps)
    block_heaps.steer = args.block_heaps == "steer"
    trace = BlockTrace() if args.trace_blocks else None
    out = run(args)
    if trace is not None:
        trace.write(args.trace_blocks)
    emit_json(out, args.out)
    if args.out:
        print(f"results: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
