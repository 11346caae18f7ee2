"""A MaxText-layout trainer publishing every step through weightsync.

A MaxText trainer holds its parameters as a scanned tree: each decoder weight of every layer
stacked on one axis (`param_scan_axis`, 1) under MaxText's names
(`decoder.layers.self_attention.query.kernel` [D, L, N, H], ...), in float32. vLLM serves
HF names and shapes in bf16. Each step this trainer converts its tree while it stages
(`convert_maxtext`: the layer axis sliced out, kernels reshaped and transposed, cast to
bf16, one tensor of host memory beyond the arena at a time) and publishes it as the step's
version; the rollouts following the session pull it, check every byte against the
manifest, apply it and report, and the trainer waits for the commit.

The model is a tiny Qwen3 (docs/maxtext-layout.md has the mapping), and its training step
a stand-in: every parameter moves along a seeded random direction, as an optimizer step
moves it, without a model's loss. A real trainer publishes its own `state.params` the same
way.

Prerequisites: a coordinator and a rollout that follows the session:

    $ python -m coordinator --port 50051
    $ python -m rollout_agent --coordinator 127.0.0.1:50051 --session maxtext-example

Run:
    $ python examples/maxtext_trainer.py --coordinator 127.0.0.1:50051 --steps 5

It prints one JSON line per step (the version, its state, the bytes staged, the rollouts'
handshakes) and exits 1 when a version does not commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import jax

from trainer_agent import ConvertOptions, ModelDims, PublisherSettings, WeightPublisher, convert_maxtext
from weightsync.client import CoordinatorClient

# A tiny Qwen3: L layers, D embed, N query heads, K kv heads, H head_dim, F mlp dim, V vocab.
L, D, N, K, H, F, V = 2, 64, 4, 2, 16, 128, 256
DIMS = ModelDims(layers=L, heads=N, kv_heads=K, head_dim=H, vocab=V, tied=True)
# Per layer: two norms, q/k/v/o, q/k norms, gate/up/down; plus the embedding and final norm.
HF_TENSORS = 2 + 11 * L
LR = 1e-3


def scanned_shapes() -> dict[str, Any]:
    """MaxText's scanned Qwen3 tree (Linen's `params` root), as shapes: layers on axis 1."""
    return {
        "params": {
            "token_embedder": {"embedding": (V, D)},
            "decoder": {
                "decoder_norm": {"scale": (D,)},
                "layers": {
                    "pre_self_attention_layer_norm": {"scale": (D, L)},
                    "post_self_attention_layer_norm": {"scale": (D, L)},
                    "self_attention": {
                        "query": {"kernel": (D, L, N, H)},
                        "key": {"kernel": (D, L, K, H)},
                        "value": {"kernel": (D, L, K, H)},
                        "out": {"kernel": (N, L, H, D)},
                        "query_norm": {"scale": (H, L)},
                        "key_norm": {"scale": (H, L)},
                    },
                    "mlp": {
                        "wi_0": {"kernel": (D, L, F)},
                        "wi_1": {"kernel": (D, L, F)},
                        "wo": {"kernel": (F, L, D)},
                    },
                },
            },
        }
    }


def init_params(seed: int) -> Any:
    """float32 masters: norm scales near 1, everything else small and random."""
    shapes = scanned_shapes()
    count = len(jax.tree.leaves(shapes, is_leaf=_is_shape))
    keys = iter(jax.random.split(jax.random.key(seed), count))

    def init(path: tuple[Any, ...], shape: tuple[int, ...]) -> jax.Array:
        noise = jax.random.normal(next(keys), shape)  # leaves come in tree order, keys too
        return 1.0 + 0.1 * noise if path[-1].key == "scale" else 0.02 * noise

    return jax.tree_util.tree_map_with_path(init, shapes, is_leaf=_is_shape)


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


@jax.jit
def train_step(params: Any, key: jax.Array) -> Any:
    """The stand-in update: each parameter moves by LR x N(0, 1), a fresh direction per step."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [p + LR * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)])


def step_key(seed: int, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed + 1), step)


def hf_capacity_bytes(params: Any) -> int:
    """The converted model's bytes (bf16; conversion keeps every element, the vocab is not
    padded here), padded 256 per tensor: what a slot must hold."""
    return sum(int(x.size) for x in jax.tree.leaves(params)) * 2 + 256 * HF_TENSORS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", default="127.0.0.1:50051")
    ap.add_argument("--session", default="maxtext-example")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit-timeout-s", type=float, default=60.0)
    args = ap.parse_args(argv)

    params = init_params(args.seed)
    settings = PublisherSettings(coordinator=args.coordinator, session=args.session, weight_dtype="bfloat16")
    with WeightPublisher(settings) as pub, CoordinatorClient(args.coordinator) as client:
        for step in range(1, args.steps + 1):
            params = train_step(params, step_key(args.seed, step))
            # The converter pops the leaves of the mapping it is given: hand it a new root
            # over the same arrays, so the trainer's own tree is left whole.
            stream = convert_maxtext(dict(params), "qwen3", DIMS, ConvertOptions(weight_dtype="bfloat16"))
            result = pub.publish_stream(stream, version=step, capacity_bytes=hf_capacity_bytes(params))
            state = pub.wait_committed(step, timeout_s=args.commit_timeout_s)
            handshakes = [h for h in client.status(args.session).handshakes if h.version == step]
            line = {
                "step": step,
                "version": result.version,
                "state": state,
                "bytes": result.total_bytes,
                "stage_s": round(result.stage_seconds, 4),
                "handshakes_ok": sum(h.ok for h in handshakes),
                "handshakes": len(handshakes),
            }
            print(json.dumps(line), flush=True)
            if state != "COMMITTED":
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
