"""`bench/stage.py --devices N`: the device path on a model sharded over N devices (FSDP x
TP; on CPU through `--xla_force_host_platform_device_count`), against copy-only
device-to-host methods (bench/d2h.py) of the same shards in the same run.

What it measures, each figure on freshly made arrays (JAX keeps a host copy of an array once
read) and printed as it comes (stderr):

- the peak RSS of the device path at --window-bytes / --block-bytes, in a child process of
  its own that reads its own high-water mark (VmHWM, or getrusage where the kernel has no
  VmHWM, as under gVisor): nothing else of this run raises the mark there. The child runs
  first, before this process opens a device: one process holds a TPU. Bound: arena +
  window + 256 MiB over the RSS before the arena was made;
- the device path (`stage_plan.stage_device`, as a publish runs it) at --window-bytes and
  --block-bytes (the verdict's row: this process's first publish), then the same again
  after the fast copy-only methods (`..._again`: a later publish, in the same run), then at
  each of --blocks-mib and --windows-mib, and with whole shards (block 0); each run's
  staged bytes checked against the devices' own sums;
- the copy-only methods, each `exact` when every byte it brought over sums as on its device.

The device path's ratio is to the best exact copy-only method. The arena's slot is faulted
in before the first row and the first row's configuration runs once untimed (a trainer's
arena and the host memory its copies land in are warm after its first publish), the child's
compiled programs are shared with this process through a compilation cache, and
--deadline-s skips the rows that would end past it (the default configuration runs first
and always), naming them in `skipped`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from common import peak_rss_bytes, reset_peak_rss, rss_bytes
from d2h import Checker, MiB, Unsupported, device_sums, methods

from trainer_agent.device.device_blocks import block_size, cuts, warm
from trainer_agent.device.host_heap import block_heaps, heap_stats
from trainer_agent.publish.stage_plan import stage_device
from trainer_agent.serve.arena import Arena
from trainer_agent.settings import PublisherSettings
from trainer_agent.stage import params as params_module
from trainer_agent.stage.params import shard_metas
from trainer_agent.stage.staging import Layout, plan_layout
from trainer_agent.synthetic import PRESETS, param_shapes
from weightsync import native
from weightsync.dtypes import dtype_info

RSS_SLACK = 256 << 20


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


AGAIN = "_again"  # the label suffix of the default configuration's second row


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def sharded_params(preset: str, dtype: str, mesh: Any, seed: int) -> dict[str, jax.Array]:
    """The preset's tensors made on the mesh, already sharded (rows over "fsdp", columns over
    "tp" where they divide): no whole copy on one device first. Each seed makes fresh arrays."""
    from jax.sharding import NamedSharding, PartitionSpec

    key = jax.random.PRNGKey(seed)
    out = {}
    for i, (name, shape) in enumerate(param_shapes(PRESETS[preset]).items()):
        spec: list[str | None] = [None] * len(shape)
        if shape and shape[0] % mesh.shape["fsdp"] == 0:
            spec[0] = "fsdp"
        if len(shape) > 1 and shape[1] % mesh.shape["tp"] == 0:
            spec[1] = "tp"
        out[name] = _normal(jax.random.fold_in(key, i), shape, dtype, NamedSharding(mesh, PartitionSpec(*spec)))
    return jax.block_until_ready(out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: str, sharding: Any) -> jax.Array:
    return jax.lax.with_sharding_constraint(jax.random.normal(key, shape, jnp.dtype(dtype)), sharding)


def drop(params: dict[str, jax.Array]) -> None:
    """Frees the arrays' device buffers and the host copies JAX kept of them."""
    for v in params.values():
        v.delete()
    params.clear()
    gc.collect()


def replica0(params: dict[str, jax.Array]) -> list[Any]:
    return [s.data for v in params.values() for s in v.addressable_shards if s.replica_id == 0]


class Model:
    """Fresh sharded arrays of the preset on demand, and their layout."""

    def __init__(self, args: argparse.Namespace) -> None:
        from jax.sharding import Mesh

        if args.force_blocks:  # CPU devices treated as an accelerator's: shards cut into blocks
            params_module.HOST_MEMORY_PLATFORMS = frozenset()
        self.args = args
        self.devices = jax.devices()[: args.devices]
        self.mesh = Mesh(np.array(self.devices).reshape(-1, 2 if len(self.devices) % 2 == 0 else 1), ("fsdp", "tp"))
        self._seeds = iter(range(1 << 30))
        self._unread: dict[str, jax.Array] | None = self.fresh()
        params = self._unread
        self.layout = plan_layout([m for n, v in params.items() for m in shard_metas(n, v)])
        self.nbytes = sum(int(d.nbytes) for d in replica0(params))
        self.cuts = cuts(params.values())

    def fresh(self) -> dict[str, jax.Array]:
        """Arrays no one has read yet: the first ones made, then new ones each call."""
        params, self._unread = getattr(self, "_unread", None), None
        return params or sharded_params(self.args.model_size, self.args.dtype, self.mesh, next(self._seeds))

    def settings(self, window: int, block: int) -> PublisherSettings:
        a = self.args
        return PublisherSettings(
            coordinator="127.0.0.1:1",
            chunk_bytes=a.chunk_bytes,
            staging_threads=a.threads,
            d2h_window_bytes=window,
            d2h_block_bytes=block,
        )


def staged_exactly(slot: np.ndarray, layout: Layout, expected: list[int]) -> bool:
    """Whether every shard's bytes in the slot sum as on its device."""
    check = Checker(expected)
    itemsize = {t.name: np.dtype(dtype_info(t.dtype).numpy).itemsize for t in layout.tensors}
    for i, ((name, _, _), off, n) in enumerate(zip(layout.boxes, layout.offsets, layout.nbytes)):
        check(i, slot[off : off + n], itemsize[name])
    return check.finish()


def measure_rss(args: argparse.Namespace) -> dict[str, Any]:
    """The device path's peak RSS at --window-bytes / --block-bytes, in this (fresh) process,
    over its RSS with the device path's programs compiled."""
    if args.compile_cache:
        share_compiled(args.compile_cache)
    model = Model(args)
    params = model.fresh()
    block = block_size(args.block_bytes, args.chunk_bytes)
    if model.cuts and block:  # the programs compiled first: a trainer compiles them once, at its first publish
        warm(params.items(), "", block)
    gc.collect()
    baseline = rss_bytes()
    reset = reset_peak_rss()  # where this host allows it (not as an ordinary user on a TPU VM)
    mark = peak_rss_bytes()
    arena = Arena("bench-devices-rss", slots=1)
    try:
        arena.ensure_slot_bytes(model.layout.total_bytes)
        stage_device(arena.slot(0), model.layout, params, model.settings(args.window_bytes, args.block_bytes))
        peak = peak_rss_bytes()
        arena_bytes = arena.slots * arena.slot_bytes
    finally:
        arena.close()
    return {
        "peak_rss_over_baseline_bytes": peak - baseline,
        "rss_bound_bytes": arena_bytes + args.window_bytes + RSS_SLACK,
        "rss_exact": reset or peak > mark,  # else exact when the mark rose while staging
        "rss_baseline_bytes": baseline,
        "arena_bytes": arena_bytes,
        "rss_block_heaps": block_heaps.count,  # the heaps its blocks landed in
    }


def share_compiled(cache_dir: str) -> None:
    """Keeps every compiled program in `cache_dir` and reuses what is there: the RSS child
    compiles the device path's programs, this process loads them (one process holds a TPU,
    so the two run one after the other)."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def rss_in_child(argv: list[str], cache_dir: str) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, sys.argv[0], *argv, "--rss-child", "--compile-cache", cache_dir],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0:
        raise RuntimeError(f"the RSS child failed: {run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def device_config(
    model: Model,
    arena: Arena,
    label: str,
    config: tuple[int, int, int],
    out: dict[str, Any],
    t0: float,
    warmups: int = 0,
) -> None:
    """The device path at one (window, block bytes, runs), each run on fresh arrays and its
    staged bytes checked against the devices' own sums, after `warmups` runs untimed; its
    row in `out`."""
    window, blk, runs = config
    args, layout = model.args, model.layout
    settings = model.settings(window, blk)
    times, exact = [], True
    for run in range(runs + warmups):
        params = model.fresh()
        datas = replica0(params)
        if model.cuts and blk and run == 0:  # the slices and packs compiled (every run has these shapes), untimed
            warm(params.items(), "", block_size(blk, args.chunk_bytes))
        expected = device_sums(datas)
        del datas
        t = time.perf_counter()
        stage_device(arena.slot(0), layout, params, settings)
        if run >= warmups:
            times.append(time.perf_counter() - t)
        exact = exact and staged_exactly(arena.slot(0), layout, expected)
        drop(params)
    out[label] = {
        "gbps": round(gbps(model.nbytes, statistics.median(times)), 3),
        "exact": exact,
        "runs": runs,
        "window_bytes": window,
        "block_bytes": block_size(blk, args.chunk_bytes),
        "heap_at_end": heap_stats(),  # glibc's: whether the copies' host buffers stay in its heap
        "block_heaps": block_heaps.count,  # the heaps the process's blocks landed in so far
    }
    progress(f"[{time.perf_counter() - t0:5.0f} s] device path {label:34} {out[label]['gbps']:8.3f} GB/s"
             f"{'' if exact else '  NOT EXACT'}; blocks in {block_heaps.count} heaps so far")  # fmt: skip


def copy_method(model: Model, m: Any, out: dict[str, Any], t0: float) -> None:
    """One copy-only method, each run on fresh arrays, `exact` when every byte it brought
    over sums as on its device; its row in `out`."""
    args = model.args
    times, exact = [], True
    for _ in range(args.slow_repeats if m.slow else args.repeats):
        params = model.fresh()
        datas, values = replica0(params), list(params.values())
        try:
            m.prepare(datas, values)
            check = Checker(device_sums(datas))
            t = time.perf_counter()
            m.run(datas, values, check)
            exact = check.finish() and exact
            times.append(time.perf_counter() - t)
        except Unsupported as e:
            out[m.name] = {"unsupported": str(e)}
            break
        finally:
            del datas, values
            drop(params)
    if m.name not in out:
        out[m.name] = {
            "gbps": round(gbps(model.nbytes, statistics.median(times)), 3),
            "exact": exact,
            "runs": len(times),
        }
    row = out[m.name]
    shown = f"{row['gbps']:8.3f} GB/s{'' if row['exact'] else '  NOT EXACT'}" if "gbps" in row else row["unsupported"]
    progress(f"[{time.perf_counter() - t0:5.0f} s] copy-only {m.name:36} {shown}")


class Rows:
    """Runs the bench's rows while --deadline-s allows: a row is skipped when the longest
    row so far but the first (which compiles) would not end before the deadline (0: no
    deadline). The first row (the default configuration: the verdict's) always runs."""

    def __init__(self, t0: float, deadline_s: float) -> None:
        self.t0 = t0
        self.deadline = t0 + deadline_s if deadline_s else 0.0
        self.longest = 0.0
        self.ran = 0
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, label: str, row: Any) -> None:
        now = time.perf_counter()
        if self.ran and self.deadline and now + self.longest > self.deadline:
            self.skipped.append(label)
            progress(f"[{self.elapsed():5.0f} s] skipped {label}: it would end past --deadline-s")
            return
        row()
        if self.ran:
            self.longest = max(self.longest, time.perf_counter() - now)
        self.ran += 1


def measure_devices(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Everything above, in order: the RSS child, the device path at its defaults, the fast
    copy-only methods, the device path's other configurations, the whole-buffer methods.
    With --deadline-s, a row that would likely end past it is skipped (named in `skipped`),
    so the verdict is printed in time."""
    with tempfile.TemporaryDirectory(prefix="ws-stage-xla-") as cache:
        return _measure_devices(args, argv, cache)


def _measure_devices(args: argparse.Namespace, argv: list[str], cache: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    rows = Rows(t0, args.deadline_s)
    rss = rss_in_child(argv, cache)  # before this process opens a device
    progress(
        f"[{rows.elapsed():5.0f} s] peak RSS over baseline {rss['peak_rss_over_baseline_bytes'] / 2**20:.0f} "
        f"MiB, bound arena + window + 256 MiB = {rss['rss_bound_bytes'] / 2**20:.0f} MiB"
        + ("" if rss["rss_exact"] else " (an upper bound: the mark did not rise while staging)")
    )
    share_compiled(cache)
    model = Model(args)
    total, layout = model.nbytes, model.layout
    block = block_size(args.block_bytes, args.chunk_bytes)
    progress(
        f"[{rows.elapsed():5.0f} s] {len(model.devices)} {model.devices[0].platform} device(s), {args.model_size}: "
        f"{total / 1e9:.3f} GB in {len(layout.offsets)} shards; blocks "
        f"{'cut' if model.cuts else 'not cut (host memory: shards read in place)'}"
    )
    configs: dict[str, tuple[int, int, int]] = {}  # label -> (window, block bytes, runs)

    def add(window: int, blk: int, runs: int) -> None:  # labelled by the blocks cut: whole chunks
        configs.setdefault(
            f"window_{window // MiB}MiB_block_{block_size(blk, args.chunk_bytes) / MiB:g}MiB", (window, blk, runs)
        )

    add(args.window_bytes, args.block_bytes, args.repeats)
    if model.cuts:
        for b in args.blocks_mib:
            add(args.window_bytes, b * MiB, args.repeats)
    for w in args.windows_mib:
        add(w * MiB, args.block_bytes, args.repeats)
    add(args.window_bytes, 0, args.slow_repeats)  # whole shards
    device: dict[str, dict[str, Any]] = {}
    copy: dict[str, dict[str, Any]] = {}
    labels = list(configs)
    copy_only = methods(args.window_bytes, block, args.rows_mib, args.d2h_threads)
    # What the verdict needs first (the default configuration and the fast copy-only methods),
    # then the sweep, then the whole-buffer methods (~1 GB/s on a TPU host): a run cut short
    # at its budget has printed the comparison already.
    arena = Arena("bench-devices", slots=1)
    try:
        arena.ensure_slot_bytes(layout.total_bytes)
        # A trainer's arena is written every version: its pages are faulted in once, at the
        # first publish (on a TPU host, under gVisor, at ~1 GB/s). The rows are steady state.
        t = time.perf_counter()
        arena.slot(0).fill(0)
        progress(f"[{rows.elapsed():5.0f} s] the arena's slot faulted in: {time.perf_counter() - t:.1f} s (untimed)")
        # one untimed run first: the host memory the copies land in is warm in a trainer
        rows.run(labels[0], lambda: device_config(model, arena, labels[0], configs[labels[0]], device, t0, warmups=1))
        for m in (m for m in copy_only if not m.slow):
            rows.run(m.name, lambda m=m: copy_method(model, m, copy, t0))
        # the default again: a process's first publish beside a later one, in one run
        again = labels[0] + AGAIN
        rows.run(again, lambda: device_config(model, arena, again, configs[labels[0]], device, t0))
        for label in labels[1:]:
            rows.run(label, lambda label=label: device_config(model, arena, label, configs[label], device, t0))
    finally:
        arena.close()
    for m in (m for m in copy_only if m.slow):
        rows.run(m.name, lambda m=m: copy_method(model, m, copy, t0))

    default = next(iter(device))
    best_device = max(device, key=lambda k: device[k]["gbps"])
    exact_copy = {k: r["gbps"] for k, r in copy.items() if r.get("exact")}
    best_copy = max(exact_copy, key=exact_copy.__getitem__) if exact_copy else ""
    best_gbps = exact_copy.get(best_copy, 0.0)
    staged = device[default]["gbps"]
    later = device.get(default + AGAIN, {}).get("gbps")
    return {
        "model_size": args.model_size,
        "devices": len(model.devices),
        "platform": model.devices[0].platform,
        "path": "device",
        "blocks_cut": model.cuts,
        "model_bytes": total,
        "chunk_bytes": args.chunk_bytes,
        "window_bytes": args.window_bytes,
        "block_bytes": block,
        "staging_threads": args.threads or native.default_threads(),
        "gbps": staged,
        "exact": device[default]["exact"],
        "best_copy_only": best_copy,
        "best_copy_only_gbps": best_gbps,
        "ratio_to_best_copy_only": round(staged / best_gbps, 3) if best_gbps else None,
        "gbps_again": later,  # the default configuration after the copy-only rows (None: skipped)
        "ratio_again_to_best_copy_only": round(later / best_gbps, 3) if later and best_gbps else None,
        "best_config": best_device,
        "best_config_gbps": device[best_device]["gbps"],
        "best_config_ratio_to_best_copy_only": round(device[best_device]["gbps"] / best_gbps, 3) if best_gbps else None,
        **rss,
        "repeats": args.repeats,
        "slow_repeats": args.slow_repeats,
        "device_path": device,
        "copy_only": copy,
        "skipped": rows.skipped,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def print_devices(r: dict[str, Any]) -> None:
    print(
        f"{r['devices']} {r['platform']} device(s), {r['model_size']}: {r['model_bytes'] / 1e9:.3f} GB; "
        f"{r['repeats']} run(s) per figure ({r['slow_repeats']} of whole-buffer methods), each on fresh arrays"
    )
    if r["platform"] == "cpu":
        print("(CPU devices: device memory is host memory, so the copy-only methods move no bytes)")
    print("copy-only device-to-host methods, GB/s (exact: every byte summed as on its device):")
    for k, row in r["copy_only"].items():
        shown = (
            f"{row['gbps']:8.3f} {'exact' if row['exact'] else 'NOT EXACT'}" if "gbps" in row else row["unsupported"]
        )
        print(f"  {k:40} {shown}")
    print("device path into the arena, GB/s:")
    for k, row in r["device_path"].items():
        print(f"  {k:40} {row['gbps']:8.3f} {'exact' if row['exact'] else 'NOT EXACT'}")
    ratio = r["ratio_to_best_copy_only"]
    if r["gbps_again"] is not None:
        print(f"the default configuration again, after the copy-only rows: {r['gbps_again']:.3f} GB/s, ratio "
              f"{r['ratio_again_to_best_copy_only']}")  # fmt: skip
    print(
        f"best exact copy-only: {r['best_copy_only']} {r['best_copy_only_gbps']:.3f} GB/s; device path at window "
        f"{r['window_bytes'] >> 20} MiB, block {r['block_bytes'] / MiB:g} MiB: {r['gbps']:.3f} GB/s, ratio "
        f"{ratio if ratio is not None else 'n/a'}; best configuration {r['best_config']} {r['best_config_gbps']:.3f}"
    )
    exact = "" if r["rss_exact"] else " (an upper bound: the mark did not rise while staging)"
    print(
        f"peak RSS over baseline {r['peak_rss_over_baseline_bytes'] / 2**20:.0f} MiB{exact}, bound arena + window + "
        f"256 MiB = {r['rss_bound_bytes'] / 2**20:.0f} MiB (in a child process of its own; its blocks in "
        f"{r.get('rss_block_heaps', 0)} heaps)"
    )
    print(f"{r['seconds']:.0f} s in all")
