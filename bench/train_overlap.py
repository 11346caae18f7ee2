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
  variants  per `--variant` (D2H window, staging threads, worker niceness), another async
            phase with its own publisher, then as many steps without

and prints one JSON object (also written to `--out`): the step times, `async_ratio` (the
async phase's total over as many no-publish steps at the mean of both no-publish phases),
`overlap_ratio` (the same over the steps that ran while a publish was in flight), versions
published and skipped and published per step, the publish-to-ready latency of each
published version (from its `publish_async` call until it was READY: staged and taken by
the coordinator; `--stage-only`: staged) in steps and seconds, D2H + staging GB/s, the
device memory held for pending versions, and the host RSS high-water mark against the RSS
before the publisher started + arena + window + 256 MiB (+ the versions held for async
publishes where the device is host memory).

The publisher needs a coordinator: by default one runs in this process, on 127.0.0.1 or,
where this host has no usable inet sockets (a TPU VM), on a unix socket in a temporary
directory, with the publisher's chunk server on one beside it; `--coordinator-address`
names a running one instead. `--stage-only` runs the same worker, snapshot and staging into an
arena with no coordinator and no servers at all (no socket is opened): the trainer's side.

    python bench/train_overlap.py                                   # CPU: small preset, 8 steps
    JAX_PLATFORMS= python bench/train_overlap.py --preset 0.6b --steps 40 --out $OUT/overlap.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import peak_rss_bytes, rss_bytes  # noqa: E402

from trainer_agent.arena import Arena  # noqa: E402
from trainer_agent.async_publish import PublishQueue, held_bytes, held_params  # noqa: E402
from trainer_agent.device_blocks import Window, block_size, cuts, device_blocks  # noqa: E402
from trainer_agent.params import device_stream  # noqa: E402
from trainer_agent.publisher import ASYNC_WORKER_NICE, PublishResult, WeightPublisher  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from trainer_agent.stage_plan import Stager, plan_staging  # noqa: E402
from weightsync.addresses import inet_refused  # noqa: E402
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
    into an arena of two slots used in turn; `publish_async` returns the same futures."""

    def __init__(self, settings: PublisherSettings, nice: int, stage: bool = True) -> None:
        self.settings = settings
        self.stage = stage
        self.arena = Arena(f"bench-overlap-{id(self):x}", slots=2)
        self._stager = Stager(settings)
        self._async: PublishQueue[PublishResult] = PublishQueue("bench-stage", nice=nice)
        self._next_slot = 0

    def publish(self, params: dict[str, Any], version: int) -> PublishResult:
        started = time.perf_counter()
        if not self.stage:  # the device-to-host copies alone, through the same window and blocks
            s = self.settings
            block = block_size(s.d2h_block_bytes, s.chunk_bytes)
            if block and cuts(params.values()):
                stream = device_blocks(params.items(), "", Window(s.d2h_window_bytes, until_staged=False), block)
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
        held = held_params(params, snapshot=snapshot, weight_dtype=self.settings.weight_dtype)
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


@dataclass(frozen=True)
class Variant:
    """How the async phase publishes: D2H window and block, staging threads, the worker's
    niceness."""

    window_bytes: int
    block_bytes: int
    staging_threads: int
    nice: int
    stage: int = 1  # 0: the worker only brings the bytes to host (--stage-only), nothing staged

    def label(self) -> str:
        label = (
            f"window={self.window_bytes >> 20}M,block={self.block_bytes >> 20}M,"
            f"threads={self.staging_threads},nice={self.nice}"
        )
        return label if self.stage else label + ",stage=0"


def parse_variant(text: str, base: Variant) -> Variant:
    """'window=1G,block=8M,threads=4,nice=0' (any subset) over `base`."""
    fields = {
        "window": "window_bytes",
        "block": "block_bytes",
        "threads": "staging_threads",
        "nice": "nice",
        "stage": "stage",
    }
    changes = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--variant: unknown key {key!r} ({', '.join(fields)})")
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(value[-1:].upper(), 1)
        changes[fields[key]] = int(value[:-1] if scale > 1 else value) * scale
    return replace(base, **changes)


@contextlib.contextmanager
def publisher(args: argparse.Namespace, variant: Variant, coordinator: str, host: str) -> Iterator[Any]:
    """The publisher of one phase; `host` places its chunk server (a unix socket where this
    host has no usable inet sockets)."""
    settings = {
        "d2h_window_bytes": variant.window_bytes,
        "d2h_block_bytes": variant.block_bytes,
        "staging_threads": variant.staging_threads,
    }
    if args.stage_only:
        pub = StageOnly(PublisherSettings(coordinator="127.0.0.1:1", **settings), variant.nice, bool(variant.stage))
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
        yield pub


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

    def alone(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            self.wait(self.step())
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


def async_phase(trainer: Trainer, pub: Any, steps: int, version: int) -> dict[str, Any]:
    """`steps` steps, each followed by publish_async of its parameters (snapshot=True)."""
    iterations: list[float] = []
    overlapped: list[bool] = []
    calls: list[float] = []
    futures = []
    ready: dict[int, float] = {}  # version -> seconds from its publish_async call until READY
    held_max = 0
    skipped0 = pub.publish_skipped
    for _ in range(steps):
        t = time.perf_counter()
        busy_before = pub._async.busy
        loss = trainer.step()
        version += 1
        c = time.perf_counter()
        future = pub.publish_async(trainer.params, version, snapshot=True)
        future.add_done_callback(lambda f, v=version, c=c: ready.__setitem__(v, time.perf_counter() - c))
        futures.append(future)
        calls.append(time.perf_counter() - c)
        held_max = max(held_max, pub.publish_held_bytes)
        trainer.wait(loss)
        iterations.append(time.perf_counter() - t)
        overlapped.append(busy_before or pub._async.busy)
    t = time.perf_counter()
    pub.flush()
    flush_s = time.perf_counter() - t
    results = [f.result() for f in futures if f.exception() is None]
    return {
        "ready_s": [ready[r.version] for r in results],
        "iterations": iterations,
        "overlapped": overlapped,
        "calls": calls,
        "stages": [r.stage_seconds for r in results],
        "published": len(results),
        "skipped": pub.publish_skipped - skipped0,
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
        "publish_async_call_s": _stats(phase["calls"]),
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
    trainer.alone(2)
    base = Variant(args.window_bytes, args.block_bytes, args.staging_threads, args.nice)
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
        "coordinator_address": args.coordinator_address or ("" if args.stage_only else "in-process"),
        "variant": base.label(),
        "compile_s": round(compile_s, 3),
    }
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overlap-")))
        unix = bool(inet_refused())
        host = f"unix:{tmp}/trainer.sock" if unix else "127.0.0.1"
        coordinator = args.coordinator_address
        if not coordinator and not args.stage_only:
            coordinator = stack.enter_context(coordinator_here(tmp / "c.db", f"unix:{tmp}/c.sock" if unix else host))
            out["coordinator_address"] = coordinator
        rss_mark = peak_rss_bytes()  # the high-water mark of building and compiling the model
        rss_baseline = rss_bytes()
        with publisher(args, base, coordinator, host) as pub:
            version = 1
            pub.publish(trainer.params, version)  # the arena made, any staging call compiled
            version += 1
            pub.publish_async(trainer.params, version, snapshot=True).result()  # the snapshot compiled
            alone = trainer.alone(args.steps)
            blocking = blocking_phase(trainer, pub, args.blocking_steps, version)
            first = async_phase(trainer, pub, args.steps, blocking["version"])
            version = first["version"]
        alone2 = trainer.alone(args.steps)
        baseline = statistics.fmean(alone + alone2)
        out |= {
            "step_s": {"alone": _stats(alone), "alone2": _stats(alone2)},
            "blocking": {
                "iteration_s": _stats(blocking["iterations"]),
                "publish_s": _stats(blocking["publishes"]),
                "ratio": round(sum(blocking["iterations"]) / (len(blocking["iterations"]) * baseline), 3),
                "d2h_stage_gbps": round(param_bytes / statistics.fmean(blocking["stages"]) / 1e9, 3),
            },
            "async": summary(first, baseline, param_bytes),
        }
        sweep = {}
        variants = [parse_variant(text, base) for text in args.variant]
        held_max = first["held_max"]
        for variant in variants:
            with publisher(args, variant, coordinator, host) as pub:
                version += 1
                pub.publish(trainer.params, version)
                phase = async_phase(trainer, pub, args.steps, version)
                version = phase["version"]
                held_max = max(held_max, phase["held_max"])
            after = trainer.alone(args.steps)
            sweep[variant.label()] = summary(phase, statistics.fmean(after), param_bytes) | {
                "alone_after_s": _stats(after)
            }
        if sweep:
            out["variants"] = sweep
    stats = device.memory_stats() or {}
    out["device_memory"] = {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}
    peak = peak_rss_bytes()  # VmHWM, or getrusage's ru_maxrss where there is none (gVisor)
    # arena (two slots) + window + 256 MiB over the RSS before the publisher started; on
    # CPU the "device" is host memory, so the versions held for async publishes count too
    held = held_max if device.platform == "cpu" else 0
    window = max(v.window_bytes for v in (base, *variants))
    bound = rss_baseline + 2 * param_bytes + window + (256 << 20) + held
    out |= {
        "rss_peak_bytes": peak,
        "rss_baseline_bytes": rss_baseline,
        "rss_held_versions_bytes": held,
        "rss_bound_bytes": bound,
        "rss_within_bound": peak <= bound,
        # the mark rose after the publisher started: its highest point came while publishing
        # (else it came from building or compiling the model, and the peak is an upper bound)
        "rss_peak_exact": peak > rss_mark,
    }
    return out


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
        "nice, stage); repeatable",
    )
    p.add_argument("--no-donate", dest="donate", action="store_false", help="the step does not donate its state")
    p.add_argument("--read-loss", action="store_true", help="read each step's loss to the host (a D2H per step)")
    p.add_argument("--coordinator-address", default="", help="a running coordinator; default: one in this process")
    p.add_argument("--stage-only", action="store_true", help="no coordinator, no servers: snapshot + D2H + staging")
    p.add_argument("--out", default="", help="also write the JSON object here")
    args = p.parse_args()
    args.blocking_steps = args.blocking_steps or min(args.steps, 10)
    out = run(args)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"results: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
