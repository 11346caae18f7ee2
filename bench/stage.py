"""Staging benchmark: a Qwen3-shaped JAX model into the persistent arena, against memcpy.

Prints GB/s for a cold arena (allocate + populate + stage) and a warm one (steady state),
for the JAX FFI path and the host-pointer path, each with its ratio to a plain memcpy of
the same bytes measured in this run, plus the peak RSS above the pre-staging baseline.
`--json` prints one JSON object instead.

`--devices N` instead stages a model sharded over N devices (FSDP x TP; on CPU through
`--xla_force_host_platform_device_count`) by the device path: per replica-0 shard, the
device-to-host copy issued `--window-bytes` ahead, each shard staged as it lands. It
reports GB/s against the platform's raw device-to-host bound measured in the same run
(every shard copied to warm host memory) and the RSS high-water mark against arena +
window + 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--devices" in sys.argv:  # XLA reads the device count once, at import
    import os

    n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

from trainer_agent.arena import Arena  # noqa: E402
from trainer_agent.ffi_staging import FfiStager  # noqa: E402
from trainer_agent.params import host_shards  # noqa: E402
from trainer_agent.staging import plan_layout, stage_shards  # noqa: E402
from trainer_agent.synthetic import PRESETS, param_shapes  # noqa: E402
from weightsync import native  # noqa: E402
from weightsync.config import bounded_number  # noqa: E402
from weightsync.layout import DEFAULT_CHUNK_BYTES  # noqa: E402
from weightsync.validation import DEFAULT_LIMITS  # noqa: E402


class RssPeak:
    """The kernel's RSS high-water mark over a block (VmHWM, reset on entry): no sampling
    thread competes with the staging threads for the two cores."""

    def __enter__(self) -> RssPeak:
        reset_peak_rss()
        self.peak = 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = peak_rss_bytes()


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
    with RssPeak() as rss:
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
        "arena_bytes": arena_bytes,
    }


def measure_devices(args: argparse.Namespace) -> dict:
    """The device path on a sharded model, against the raw D2H bound of the same shards."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from trainer_agent.params import device_stream, shard_metas
    from trainer_agent.staging import stage_batched

    devices = jax.devices()[: args.devices]
    mesh = Mesh(np.array(devices).reshape(-1, 2 if len(devices) % 2 == 0 else 1), ("fsdp", "tp"))
    params = {}
    for name, value in make_params(args.model_size, args.dtype).items():
        spec = [None] * value.ndim
        if value.ndim and value.shape[0] % mesh.shape["fsdp"] == 0:
            spec[0] = "fsdp"
        if value.ndim > 1 and value.shape[1] % mesh.shape["tp"] == 0:
            spec[1] = "tp"
        params[name] = jax.device_put(value, NamedSharding(mesh, PartitionSpec(*spec)))
    params = jax.block_until_ready(params)
    shards = [s.data for v in params.values() for s in v.addressable_shards if s.replica_id == 0]
    total = sum(int(s.nbytes) for s in shards)
    layout = plan_layout([m for n, v in params.items() for m in shard_metas(n, v)])
    threads = args.threads or native.default_threads()

    # The bound, same shards, same run: each shard's bytes into warm host memory.
    dst = np.empty(total, np.uint8)
    dst[:] = 0
    bound_s = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for s in shards:
            s.copy_to_host_async()
        off = 0
        for s in shards:
            n = int(s.nbytes)
            np.copyto(dst[off : off + n], np.asarray(s).reshape(-1).view(np.uint8))
            off += n
        bound_s.append(time.perf_counter() - t0)
    del dst, shards
    arena = Arena("bench-devices", slots=1)
    baseline = rss_bytes()
    try:
        with RssPeak() as rss:
            arena.ensure_slot_bytes(layout.total_bytes)
            stage_s = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                half = args.window_bytes // 2  # as the publisher: half in flight, half landed
                stage_batched(
                    arena.slot(0),
                    layout,
                    device_stream(params.items(), "", half),
                    args.chunk_bytes,
                    batch_bytes=half,
                    threads=threads,
                )
                stage_s.append(time.perf_counter() - t0)
        arena_bytes = arena.slots * arena.slot_bytes
    finally:
        arena.close()
    d2h = gbps(total, statistics.median(bound_s))
    staged_gbps = gbps(total, statistics.median(stage_s))
    return {
        "model_size": args.model_size,
        "devices": len(devices),
        "platform": devices[0].platform,
        "path": "device",
        "window_bytes": args.window_bytes,
        "model_bytes": total,
        "gbps": round(staged_gbps, 2),
        "d2h_bound_gbps": round(d2h, 2),
        "ratio_to_d2h_bound": round(staged_gbps / d2h, 3),
        "peak_rss_over_baseline_bytes": rss.peak - baseline,
        "rss_bound_bytes": arena_bytes + args.window_bytes + (256 << 20),
    }


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
    p.add_argument("--window-bytes", type=bounded_number(1), default=256 << 20, help="device path: D2H bytes in flight")
    args = p.parse_args()
    if not native.available():
        sys.exit(f"the native shim is not built: {native.missing_reason()}")
    if args.devices:
        result = measure_devices(args)
        if not args.json:
            print(
                f"{result['devices']} {result['platform']} devices, {result['model_bytes'] / 1e9:.3f} GB: device path "
                f"{result['gbps']:.2f} GB/s, D2H bound {result['d2h_bound_gbps']:.2f} GB/s "
                f"(ratio {result['ratio_to_d2h_bound']:.3f}); peak RSS over baseline "
                f"{result['peak_rss_over_baseline_bytes'] / 1e9:.3f} GB "
                f"(bound {result['rss_bound_bytes'] / 1e9:.3f} GB)"
            )
        print(json.dumps(result))
        return 0
    threads = args.threads or native.default_threads()

    params = make_params(args.model_size, args.dtype)
    values = list(params.values())
    host = [s for n, v in params.items() for s in host_shards(n, v)]
    layout = plan_layout(host)
    total = layout.total_bytes
    largest = max(s.nbytes for s in host)

    # The bound, same bytes, same run: one memcpy of the whole model into a warm buffer.
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

    baseline = rss_bytes()
    rows = {}
    with RssPeak() as rss:
        for path in ("ffi", "host") if native.ffi_available() else ("host",):
            rows[path] = measure_path(path, values, host, layout, args.chunk_bytes, threads, args.repeats)
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
    )
    if stream is not None:
        print(
            f"MaxText fp32 -> HF bf16, converted while staging: {stream['convert_stage_seconds']:.2f} s "
            f"({stream['convert_stage_gbps']:.2f} GB/s of output); peak RSS over baseline "
            f"{stream['peak_rss_over_baseline_bytes'] / 1e9:.3f} GB (bound {stream['rss_bound_bytes'] / 1e9:.3f} GB)"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
