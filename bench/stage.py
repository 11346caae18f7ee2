"""Staging benchmark: a Qwen3-shaped JAX model into the persistent arena, against memcpy.

Prints GB/s for a cold arena (allocate + populate + stage) and a warm one (steady state),
for the JAX FFI path and the host-pointer path, each with its ratio to a plain memcpy of
the same bytes measured in this run, plus the peak RSS above the pre-staging baseline.
`--json` prints one JSON object instead.

`--devices N` instead stages a model sharded over N devices (FSDP x TP; on CPU through
`--xla_force_host_platform_device_count`) by the device path: per replica-0 shard, the
device-to-host copy issued ahead within a window, each shard staged as it lands. Beside it,
in the same run, on shards of the same shapes and shardings, it times copy-only device-to-host methods that
stage nothing (bench/d2h.py: windows of copies in flight, every copy at once, device_get,
pinned_host, chunked copies, several threads) and reports the device path's ratio to the
best of them, at --window-bytes and at the best of --windows-mib; every figure on freshly
made arrays (JAX keeps a host copy of an array once read). Peak RSS is measured at
--window-bytes, against arena + window + 256 MiB, first in the process so that it is exact
where VmHWM cannot be reset (an ordinary user on a TPU VM).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--devices" in sys.argv:  # XLA reads the device count once, at import
    import os

    n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import PeakRss, rss_bytes  # noqa: E402
from d2h import MiB, Unsupported, methods  # noqa: E402

from trainer_agent.arena import Arena  # noqa: E402
from trainer_agent.ffi_staging import FfiStager  # noqa: E402
from trainer_agent.params import DEFAULT_WINDOW_BYTES, host_shards  # noqa: E402
from trainer_agent.staging import plan_layout, stage_shards  # noqa: E402
from trainer_agent.synthetic import PRESETS, param_shapes  # noqa: E402
from weightsync import native  # noqa: E402
from weightsync.config import bounded_number  # noqa: E402
from weightsync.layout import DEFAULT_CHUNK_BYTES  # noqa: E402
from weightsync.validation import DEFAULT_LIMITS  # noqa: E402


def make_params(preset: str, dtype: str) -> dict[str, jax.Array]:
    key = jax.random.PRNGKey(0)
    out = {}
    for i, (name, shape) in enumerate(param_shapes(PRESETS[preset]).items()):
        out[name] = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.dtype(dtype))
    return jax.block_until_ready(out)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure_path(path: str, values: list, host: list, layout, chunk_bytes: int, threads: int, repeats: int) -> dict:  # noqa: ANN001
    """Cold (allocate + populate + first staging) and warm (median) GB/s of one path."""
    arena = Arena(f"bench-{path}", slots=2)
    stager = FfiStager(threads) if path == "ffi" else None
    total = layout.total_bytes

    def stage_once(slot: int) -> None:
        if stager is not None:
            stager.stage(arena.buffer(), slot * arena.slot_bytes, values, layout, chunk_bytes, None)
        else:
            stage_shards(arena.slot(slot), host, layout, chunk_bytes, engine="native", threads=threads)

    try:
        t0 = time.perf_counter()
        arena.ensure_slot_bytes(total)
        populate_s = time.perf_counter() - t0
        compile_s = 0.0
        if stager is not None:  # XLA compiles once per layout and arena: keep it out of the timings
            t0 = time.perf_counter()
            stage_once(1)
            compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        stage_once(0)
        cold_s = populate_s + time.perf_counter() - t0
        warm = []
        for i in range(repeats):
            t0 = time.perf_counter()
            stage_once((i + 1) % 2)
            warm.append(time.perf_counter() - t0)
    finally:
        arena.close()
    return {
        "cold_gbps": gbps(total, cold_s),
        "warm_gbps": gbps(total, statistics.median(warm)),
        "warm_seconds": statistics.median(warm),
        "populate_seconds": populate_s,
        "first_call_seconds": compile_s,
    }


def measure_maxtext_stream(preset: str, chunk_bytes: int) -> dict:
    """Convert a scanned fp32 MaxText tree to bf16 HF tensors while staging, one at a time.

    RSS is sampled from just before conversion: source leaves are popped as they are
    converted, so the peak should stay near arena + the largest converted tensor.
    """
    from trainer_agent.convert import ConvertOptions, ModelDims, convert_maxtext
    from trainer_agent.params import host_shards
    from trainer_agent.staging import stage_streamed

    shape = PRESETS[preset]
    d, h, L = shape.hidden, shape.head_dim, shape.layers
    tree: dict[str, jax.Array] = {}

    def leaf(*dims_: int) -> jax.Array:
        return jnp.full(dims_, 0.01, jnp.float32)

    tree["params-token_embedder-embedding"] = leaf(shape.vocab, d)
    tree["params-decoder-decoder_norm-scale"] = leaf(d)
    lay = "params-decoder-layers-"
    tree[lay + "pre_self_attention_layer_norm-scale"] = leaf(d, L)
    tree[lay + "post_self_attention_layer_norm-scale"] = leaf(d, L)
    tree[lay + "self_attention-query-kernel"] = leaf(d, L, shape.heads, h)
    tree[lay + "self_attention-key-kernel"] = leaf(d, L, shape.kv_heads, h)
    tree[lay + "self_attention-value-kernel"] = leaf(d, L, shape.kv_heads, h)
    tree[lay + "self_attention-out-kernel"] = leaf(shape.heads, L, h, d)
    tree[lay + "self_attention-query_norm-scale"] = leaf(h, L)
    tree[lay + "self_attention-key_norm-scale"] = leaf(h, L)
    tree[lay + "mlp-wi_0-kernel"] = leaf(d, L, shape.intermediate)
    tree[lay + "mlp-wi_1-kernel"] = leaf(d, L, shape.intermediate)
    tree[lay + "mlp-wo-kernel"] = leaf(shape.intermediate, L, d)
    source_bytes = sum(a.nbytes for a in tree.values())
    model_bytes = source_bytes // 2  # fp32 -> bf16
    largest = shape.vocab * d * 2  # the bf16 embedding is the largest converted tensor
    dims = ModelDims(
        layers=L, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=h, vocab=shape.vocab, tied=shape.tied
    )
    arena = Arena("bench-stream", slots=2)
    arena.ensure_slot_bytes(model_bytes + 256 * 4096)
    baseline = rss_bytes()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        items = convert_maxtext(tree, "qwen3", dims, ConvertOptions(weight_dtype="bfloat16"))
        staged, _ = stage_streamed(arena.slot(0), (hs for n, v in items for hs in host_shards(n, v)), chunk_bytes)
        seconds = time.perf_counter() - t0
    arena_bytes = arena.nbytes
    arena.close()
    return {
        "convert_stage_seconds": round(seconds, 3),
        "convert_stage_gbps": round(staged.total_bytes / seconds / 1e9, 3),
        "source_bytes": source_bytes,
        "converted_bytes": staged.total_bytes,
        "peak_rss_over_baseline_bytes": rss.peak - baseline,
        "rss_bound_bytes": arena_bytes + largest + (256 << 20),
        "rss_exact": rss.exact,
        "arena_bytes": arena_bytes,
    }


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


def measure_devices(args: argparse.Namespace) -> dict:
    """The device path on a sharded model at each window, against copy-only D2H methods of
    the same shards in the same run, every measurement on freshly made arrays."""
    from jax.sharding import Mesh

    from trainer_agent.params import device_stream, shard_metas
    from trainer_agent.staging import stage_batched

    devices = jax.devices()[: args.devices]
    mesh = Mesh(np.array(devices).reshape(-1, 2 if len(devices) % 2 == 0 else 1), ("fsdp", "tp"))
    seeds = iter(range(1 << 30))

    def fresh() -> dict[str, jax.Array]:
        return sharded_params(args.model_size, args.dtype, mesh, next(seeds))

    params = fresh()
    layout = plan_layout([m for n, v in params.items() for m in shard_metas(n, v)])
    total = sum(int(d.nbytes) for d in replica0(params))
    threads = args.threads or native.default_threads()
    windows = sorted({w * MiB for w in args.windows_mib} | {args.window_bytes})

    def stage(slot: np.ndarray, params: dict[str, jax.Array], window: int) -> float:
        half = max(1, window // 2)  # as the publisher: half in flight, half landed
        t0 = time.perf_counter()
        stage_batched(
            slot, layout, device_stream(params.items(), "", half), args.chunk_bytes, batch_bytes=half, threads=threads
        )
        return time.perf_counter() - t0

    # The device path first, at --window-bytes, while nothing else has raised the process's
    # RSS high-water mark (exact where VmHWM cannot be reset); then the other windows.
    arena = Arena("bench-devices", slots=1)
    device_s: dict[int, list[float]] = {w: [] for w in windows}
    baseline = rss_bytes()
    try:
        with PeakRss() as rss:
            arena.ensure_slot_bytes(layout.total_bytes)
            for r in range(args.repeats):
                if r:
                    drop(params)
                    params = fresh()
                device_s[args.window_bytes].append(stage(arena.slot(0), params, args.window_bytes))
        # What dropping the staged arrays gives back: on an accelerator, the host copies JAX
        # kept of what the device path read; on CPU devices, the arrays themselves.
        held = rss_bytes()
        drop(params)
        held -= rss_bytes()
        arena_bytes = arena.slots * arena.slot_bytes
        for w in windows:
            for _ in range(args.repeats if w != args.window_bytes else 0):
                params = fresh()
                device_s[w].append(stage(arena.slot(0), params, w))
                drop(params)
    finally:
        arena.close()

    dst = np.empty(total, np.uint8)
    dst[:] = 0  # warm
    copy_s: dict[str, list[float] | str] = {}
    for m in methods(windows, args.piece_mib * MiB, args.d2h_threads, dst):
        times: list[float] = []
        for _ in range(args.repeats):
            params = fresh()
            datas, values = replica0(params), list(params.values())
            try:
                m.prepare(datas, values)
                t0 = time.perf_counter()
                m.run(datas, values)
                times.append(time.perf_counter() - t0)
            except Unsupported as e:
                copy_s[m.name] = f"unsupported: {e}"
                break
            finally:
                del datas, values
                drop(params)
        copy_s.setdefault(m.name, times)
    del dst

    device_gbps = {w: gbps(total, statistics.median(t)) for w, t in device_s.items()}
    copy_gbps = {k: gbps(total, statistics.median(t)) for k, t in copy_s.items() if not isinstance(t, str)}
    best_copy = max(copy_gbps, key=copy_gbps.__getitem__)
    best_window = max(device_gbps, key=device_gbps.__getitem__)
    staged_gbps = device_gbps[args.window_bytes]
    d2h = copy_gbps["into_warm_memory"]
    return {
        "model_size": args.model_size,
        "devices": len(devices),
        "platform": devices[0].platform,
        "path": "device",
        "window_bytes": args.window_bytes,
        "model_bytes": total,
        "gbps": round(staged_gbps, 3),
        "d2h_bound_gbps": round(d2h, 3),
        "ratio_to_d2h_bound": round(staged_gbps / d2h, 3),
        "peak_rss_over_baseline_bytes": rss.peak - baseline,
        "rss_bound_bytes": arena_bytes + args.window_bytes + (256 << 20),
        "rss_exact": rss.exact,
        "rss_released_by_dropping_staged_arrays_bytes": held,
        "repeats": args.repeats,
        "device_path_gbps": {str(w): round(g, 3) for w, g in device_gbps.items()},
        "best_window_bytes": best_window,
        "best_window_gbps": round(device_gbps[best_window], 3),
        "default_window_bytes": DEFAULT_WINDOW_BYTES,
        "copy_only_gbps": {k: (round(copy_gbps[k], 3) if k in copy_gbps else t) for k, t in copy_s.items()},
        "best_copy_only": best_copy,
        "best_copy_only_gbps": round(copy_gbps[best_copy], 3),
        "ratio_to_best_copy_only": round(staged_gbps / copy_gbps[best_copy], 3),
        "best_window_ratio_to_best_copy_only": round(device_gbps[best_window] / copy_gbps[best_copy], 3),
    }


def print_devices(r: dict) -> None:
    print(
        f"{r['devices']} {r['platform']} device(s), {r['model_size']}: {r['model_bytes'] / 1e9:.3f} GB, "
        f"{r['repeats']} run(s) per figure, each on fresh arrays"
    )
    if r["platform"] == "cpu":
        print("(CPU devices: device memory is host memory, so the copy-only methods move no bytes)")
    print("copy-only device-to-host methods, GB/s:")
    for k, g in r["copy_only_gbps"].items():
        print(f"  {k:34} {g if isinstance(g, str) else f'{g:8.3f}'}")
    print("device path into the arena (window: half in flight, half landed), GB/s:")
    for w, g in r["device_path_gbps"].items():
        mark = " (--window-bytes)" if int(w) == r["window_bytes"] else ""
        print(f"  window {int(w) >> 20:6} MiB {g:8.3f}{mark}")
    print(
        f"best copy-only: {r['best_copy_only']} {r['best_copy_only_gbps']:.3f} GB/s; device path at "
        f"{r['window_bytes'] >> 20} MiB: ratio {r['ratio_to_best_copy_only']:.3f}; best window "
        f"{r['best_window_bytes'] >> 20} MiB: ratio {r['best_window_ratio_to_best_copy_only']:.3f} "
        f"(the publisher's default window: {r['default_window_bytes'] >> 20} MiB)"
    )
    exact = "" if r["rss_exact"] else " (an upper bound: VmHWM could not be reset and did not rise)"
    print(
        f"peak RSS over baseline {r['peak_rss_over_baseline_bytes'] / 1e9:.3f} GB{exact}, bound arena + window + "
        f"256 MiB = {r['rss_bound_bytes'] / 1e9:.3f} GB; RSS released by dropping the staged arrays "
        f"{r['rss_released_by_dropping_staged_arrays_bytes'] / 1e9:.3f} GB ("
        + ("the arrays themselves: CPU devices" if r["platform"] == "cpu" else "host copies JAX kept of them")
        + ")"
    )


def _mib_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of MiB: {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"needs at least one window of 1 MiB or more: {text!r}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-size", default="0.6b", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="bfloat16", help="dtype of the JAX params (staged as is)")
    p.add_argument("--repeats", type=bounded_number(1), default=5)
    p.add_argument("--threads", type=bounded_number(0), default=0, help="staging threads (0 = every core)")
    p.add_argument(
        "--chunk-bytes",
        type=bounded_number(DEFAULT_LIMITS.min_chunk_bytes, high=DEFAULT_LIMITS.max_chunk_bytes),
        default=DEFAULT_CHUNK_BYTES,
        help="the publisher's default",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--maxtext", action="store_true", help="also convert + stage a MaxText fp32 tree (streaming)")
    p.add_argument(
        "--devices", type=bounded_number(0), default=0, help="stage a model sharded over N devices (device path)"
    )
    p.add_argument(
        "--window-bytes",
        type=bounded_number(1),
        default=DEFAULT_WINDOW_BYTES,
        help="device path: the window its peak RSS is measured at (default: the publisher's)",
    )
    p.add_argument(
        "--windows-mib",
        type=_mib_list,
        default=[64, 256, 1024, 2048],
        help="device path and copy-only windows compared, MiB (comma-separated)",
    )
    p.add_argument("--piece-mib", type=bounded_number(1), default=16, help="chunked copies: block size, MiB")
    p.add_argument("--d2h-threads", type=bounded_number(1, high=64), default=4, help="threaded copies: threads")
    args = p.parse_args()
    if not native.available():
        sys.exit(f"the native shim is not built: {native.missing_reason()}")
    if args.devices:
        result = measure_devices(args)
        if not args.json:
            print_devices(result)
        print(json.dumps(result))
        return 0
    threads = args.threads or native.default_threads()

    params = make_params(args.model_size, args.dtype)
    values = list(params.values())
    host = [s for n, v in params.items() for s in host_shards(n, v)]
    layout = plan_layout(host)
    total = layout.total_bytes
    largest = max(s.nbytes for s in host)

    baseline = rss_bytes()
    rows = {}
    with PeakRss() as rss:
        for path in ("ffi", "host") if native.ffi_available() else ("host",):
            rows[path] = measure_path(path, values, host, layout, args.chunk_bytes, threads, args.repeats)
    # The bound, same bytes, same run: one memcpy of the whole model into a warm buffer (after
    # the staging, whose peak RSS is exact then where VmHWM cannot be reset).
    src = np.empty(total, np.uint8)
    dst = np.empty(total, np.uint8)
    src[:] = 1
    dst[:] = 0
    memcpy_s = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy_s.append(time.perf_counter() - t0)
    memcpy_gbps = gbps(total, statistics.median(memcpy_s))
    del src, dst

    stream = measure_maxtext_stream(args.model_size, args.chunk_bytes) if args.maxtext else None
    best = max(rows, key=lambda k: rows[k]["warm_gbps"])
    result = {
        "model_size": args.model_size,
        "arena_bytes": 2 * total,
        "model_bytes": total,
        "largest_tensor_bytes": largest,
        "threads": threads,
        "memcpy_gbps": round(memcpy_gbps, 2),
        "warm_gbps": round(rows[best]["warm_gbps"], 2),
        "cold_gbps": round(rows[best]["cold_gbps"], 2),
        "ratio_to_memcpy": round(rows[best]["warm_gbps"] / memcpy_gbps, 3),
        "ffi_used": best == "ffi",
        "peak_rss_over_baseline_bytes": rss.peak - baseline,
        "rss_bound_bytes": 2 * total + largest + (256 << 20),
        "rss_exact": rss.exact,
        "paths": {k: {m: round(v, 3) for m, v in r.items()} for k, r in rows.items()},
        "maxtext_stream": stream,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"model {args.model_size}: {total / 1e9:.3f} GB in {len(host)} tensors, "
        f"largest {largest / 1e6:.1f} MB, {threads} thread(s)"
    )
    print(f"memcpy (np.copyto, same bytes, this run): {memcpy_gbps:.2f} GB/s")
    print(f"{'path':6} {'cold GB/s':>10} {'warm GB/s':>10} {'warm/memcpy':>12} {'populate s':>11}")
    for k, r in rows.items():
        print(
            f"{k:6} {r['cold_gbps']:>10.2f} {r['warm_gbps']:>10.2f} "
            f"{r['warm_gbps'] / memcpy_gbps:>12.3f} {r['populate_seconds']:>11.3f}"
        )
    print(
        f"peak RSS over baseline: {result['peak_rss_over_baseline_bytes'] / 1e9:.3f} GB "
        f"(bound: arena {2 * total / 1e9:.3f} + largest tensor + 256 MiB = {result['rss_bound_bytes'] / 1e9:.3f} GB)"
        + ("" if rss.exact else "; an upper bound: VmHWM could not be reset and did not rise")
    )
    if stream is not None:
        print(
            f"MaxText fp32 -> HF bf16, converted while staging: {stream['convert_stage_seconds']:.2f} s "
            f"({stream['convert_stage_gbps']:.2f} GB/s of output); peak RSS over baseline "
            f"{stream['peak_rss_over_baseline_bytes'] / 1e9:.3f} GB (bound {stream['rss_bound_bytes'] / 1e9:.3f} GB)"
            + ("" if stream["rss_exact"] else "; an upper bound: VmHWM could not be reset and did not rise")
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
