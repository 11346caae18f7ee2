"""One trainer host with sharded JAX arrays on CPU devices, run as its own process by
tests/integration/test_sharded_publish.py (XLA's device count is fixed at import).

    python sharded_publisher.py SPEC_JSON

SPEC: coordinator, session, process_id, processes, jax_port (multi-process), devices (this
process's), use_ffi, weight_dtype, window_bytes, block_bytes (optional), model ("mesh": FSDP
x TP shardings of a small tree; "big": a model many windows large, for the RSS bound;
"maxtext": a sharded MaxText tree converted while it streams), both_ways (optional: the
mesh tree published as version 1 by the CPU devices' own path, then as version 2 cut into
blocks as an accelerator's arrays are; prints both paths and exits). Prints one JSON line:
path, bytes, the RSS high-water mark above the pre-publish baseline, the arena size; then
waits for the commit.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

# name -> (shape, partition spec over the ("fsdp", "tp") mesh); importable without jax
MESH_TREE: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {
    "model.embed_tokens.weight": ((1024, 64), ("fsdp", "tp")),
    "model.layers.0.mlp.up_proj.weight": ((96, 64), ("tp", "fsdp")),
    "model.layers.0.self_attn.q_proj.weight": ((64, 64), ("fsdp", None)),
    "model.layers.0.input_layernorm.weight": ((64,), ("tp",)),
    "model.norm.weight": ((64,), ()),  # replicated: only replica 0 is staged
}


def global_value(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic fp32 contents every process (and the test) can rebuild."""
    seed = sum(map(ord, name))
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def sharded(mesh: Any, value: np.ndarray, spec: tuple[str | None, ...]) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, PartitionSpec(*spec)), lambda idx: value[idx])


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_bytes(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key}")


def peak_rss() -> int:
    return _status_bytes("VmHWM")


def main(spec: dict[str, Any]) -> int:
    global SPEC
    SPEC = spec
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={SPEC['devices']}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.sharding import Mesh

    from trainer_agent.publish.publisher import WeightPublisher
    from trainer_agent.settings import PublisherSettings

    if SPEC["processes"] > 1:
        jax.distributed.initialize(
            f"127.0.0.1:{SPEC['jax_port']}", num_processes=SPEC["processes"], process_id=SPEC["process_id"]
        )
    mesh = Mesh(np.array(jax.devices()).reshape(-1, 2), ("fsdp", "tp"))
    settings = PublisherSettings(
        coordinator=SPEC["coordinator"],
        session=SPEC["session"],
        rank=SPEC["process_id"],
        world_size=SPEC["processes"],
        incarnation="sharded-run",
        weight_dtype=SPEC["weight_dtype"],
        use_ffi=SPEC["use_ffi"],
        chunk_bytes=SPEC.get("chunk_bytes", 65536),
        slots=2 if SPEC.get("both_ways") else 1,
        d2h_window_bytes=SPEC["window_bytes"],
        **({"d2h_block_bytes": SPEC["block_bytes"]} if "block_bytes" in SPEC else {}),
    )
    with WeightPublisher(settings) as pub:
        if SPEC["model"] == "big":  # 24 tensors of 64 MiB fp32: 1.5 GiB, staged as bf16
            params = {
                f"model.layers.{i}.mlp.up_proj.weight": sharded(
                    mesh, np.full((4096, 4096), i + 0.5, np.float32), ("fsdp", "tp")
                )
                for i in range(24)
            }
        elif SPEC["model"] == "maxtext":
            sys.path.insert(0, SPEC["repo"])
            from tests.unit.maxtext_reference import to_maxtext, with_style
            from tests.unit.test_convert import H, K, L, N, hf_weights
            from trainer_agent.convert import ConvertOptions, ModelDims, convert_maxtext

            tree = with_style(
                to_maxtext(hf_weights("llama3"), "llama3", layers=L, heads=N, kv_heads=K, head_dim=H, vocab_pad=8),
                "linen",
            )
            fsdp = mesh.shape["fsdp"]
            tree = {
                k: sharded(mesh, np.asarray(v), ("fsdp",) if np.ndim(v) and np.shape(v)[0] % fsdp == 0 else ())
                for k, v in tree.items()
            }
            dims = ModelDims(layers=L, heads=N, kv_heads=K, head_dim=H, vocab=128)
            stream = convert_maxtext(tree, "llama3", dims, ConvertOptions(weight_dtype="bfloat16"))
            result = pub.publish_stream(stream, 1, capacity_bytes=SPEC["capacity_bytes"])
            print(json.dumps({"path": pub.last_path, "bytes": result.total_bytes}), flush=True)
            return 0 if pub.wait_committed(1, 120) == "COMMITTED" else 1
        else:
            params = {n: sharded(mesh, global_value(n, shape), spec) for n, (shape, spec) in MESH_TREE.items()}
        jax.block_until_ready(params)
        if SPEC.get("both_ways"):
            from trainer_agent.stage import params as params_module

            pub.publish(params, 1)
            paths = [pub.last_path]
            params_module.HOST_MEMORY_PLATFORMS = frozenset()  # the accelerator's branch: blocks
            pub.publish(params, 2)
            print(json.dumps({"paths": [*paths, pub.last_path]}), flush=True)
            return 0
        baseline = _status_bytes("VmRSS")
        reset_peak_rss()
        result = pub.publish(params, 1)
        line = {
            "path": pub.last_path,
            "bytes": result.total_bytes,
            "peak_rss_over_baseline_bytes": max(0, peak_rss() - baseline),
            "arena_bytes": pub.arena.slots * pub.arena.slot_bytes,
        }
        print(json.dumps(line), flush=True)
        state = pub.wait_committed(1, 120)
    if SPEC["processes"] > 1:
        jax.distributed.shutdown()
    return 0 if state == "COMMITTED" else 1


SPEC: dict[str, Any] = {}

if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
