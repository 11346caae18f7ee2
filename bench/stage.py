"""Staging benchmark: a Qwen3-shaped JAX model into the persistent arena, against memcpy.

Prints GB/s for a cold arena (allocate + populate + stage) and a warm one (steady state),
for the JAX FFI path and the host-pointer path, each with its ratio to a plain memcpy of
the same bytes measured in this run, plus the peak RSS above the pre-staging baseline.
`--json` prints one JSON object instead.

`--devices N` instead stages a model sharded over N devices by the device path, beside
copy-only device-to-host methods of the same shards in the same run, every byte checked
(bench/stage_devices.py says what and how; bench/d2h.py has the methods). Progress goes
to stderr as each figure comes. `--publish-thread` stages there on a worker thread, as
`publish_async` does (the device path's copies still run on the process's D2H thread,
`d2h_one_thread`; the copy-only rows on the staging thread), and `--heaps unmapped` gives
glibc's own top pad to the device path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
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
from common import HEAP_PADS, PeakRss, hold_heaps, on_thread, rss_bytes, tpu_transfer_env  # noqa: E402
from stage_devices import measure_devices, measure_rss, print_devices  # noqa: E402

from trainer_agent.device.device_blocks import DEFAULT_BLOCK_BYTES  # noqa: E402
from trainer_agent.serve.arena import Arena  # noqa: E402
from trainer_agent.stage.ffi_staging import FfiStager  # noqa: E402
from trainer_agent.stage.params import DEFAULT_WINDOW_BYTES, host_shards  # noqa: E402
from trainer_agent.stage.staging import plan_layout, stage_shards  # noqa: E402
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


def _named(fn: Callable[..., dict[str, Any]], *fn_args: Any) -> dict[str, Any]:
    return {**fn(*fn_args), "staging_thread": threading.current_thread().name}


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
    from trainer_agent.stage.params import host_shards
    from trainer_agent.stage.stream_staging import stage_streamed

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


def _mib_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of MiB: {text!r}") from None
    if min(out, default=1) < 1:
        raise argparse.ArgumentTypeError(f"sizes are 1 MiB or more: {text!r}")
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
        help="device path: its window, where its peak RSS is measured (default: the publisher's)",
    )
    p.add_argument(
        "--block-bytes",
        type=bounded_number(0),
        default=DEFAULT_BLOCK_BYTES,
        help="device path: its block size, rounded to a multiple of --chunk-bytes (default: the publisher's)",
    )
    p.add_argument(
        "--blocks-mib", type=_mib_list, default=[12, 24], help="device path: other block sizes, MiB (comma-separated)"
    )
    p.add_argument(
        "--windows-mib",
        type=_mib_list,
        default=[256, 2048],
        help="device path: other windows, MiB (comma-separated)",
    )
    p.add_argument("--rows-mib", type=_mib_list, default=[8, 16], help="copy-only row blocks compared, MiB")
    p.add_argument("--d2h-threads", type=bounded_number(1, high=64), default=4, help="threaded copies: threads")
    p.add_argument(
        "--slow-repeats",
        type=bounded_number(1),
        default=1,
        help="runs of the whole-buffer methods (bound by faulting in fresh host memory: ~1 GB/s on a TPU host)",
    )
    p.add_argument(
        "--force-blocks",
        action="store_true",
        help="cut shards into blocks on CPU devices too (the accelerator's branch)",
    )
    p.add_argument(
        "--deadline-s",
        type=bounded_number(0),
        default=0,
        help="device path: skip the rows that would end past this many seconds (0: none); the verdict comes first",
    )
    p.add_argument(
        "--publish-thread",
        action="store_true",
        help="device path: stage on a worker thread, as publish_async does, not the main one (the copy-only rows' "
        "buffers then come from its own glibc arena; the device path's from the D2H thread's)",
    )
    p.add_argument(
        "--heaps",
        choices=tuple(HEAP_PADS),
        default="kept",
        help="device path: a thread arena's heaps kept as the device path holds them, or unmapped when a free "
        "empties one (glibc's own top pad)",
    )
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile-cache", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not native.available():
        sys.exit(f"the native shim is not built: {native.missing_reason()}")
    hold_heaps(args.heaps)
    if args.devices and args.rss_child:
        print(json.dumps(on_thread(args.publish_thread, measure_rss, args)))
        return 0
    if args.devices:
        measured = on_thread(args.publish_thread, _named, measure_devices, args, sys.argv[1:])
        result = {**measured, "heaps": args.heaps, "tpu_transfer_env": tpu_transfer_env()}
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
