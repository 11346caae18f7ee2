"""A Qwen3-shaped parameter set in HF layout, trained by a stand-in JAX step.

Used by the demo and tests: the weights really change every step (a jitted update with
fresh noise), deterministically from (preset, seed, step).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a dense Qwen3 model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(64, 2, 4, 2, 32, 128, 1024),
    "small": ModelShape(256, 4, 8, 4, 32, 768, 8192),
    "medium": ModelShape(1024, 8, 16, 8, 64, 3072, 32000),
    "0.6b": ModelShape(1024, 28, 16, 8, 128, 3072, 151936),  # Qwen3-0.6B: ~1.19 GB in bf16
}


def param_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of every parameter, in checkpoint order."""
    d, h = shape.hidden, shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, d)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "self_attn.q_proj.weight"] = (shape.heads * h, d)
        out[p + "self_attn.k_proj.weight"] = (shape.kv_heads * h, d)
        out[p + "self_attn.v_proj.weight"] = (shape.kv_heads * h, d)
        out[p + "self_attn.o_proj.weight"] = (d, shape.heads * h)
        out[p + "self_attn.q_norm.weight"] = (h,)
        out[p + "self_attn.k_norm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (shape.intermediate, d)
        out[p + "mlp.up_proj.weight"] = (shape.intermediate, d)
        out[p + "mlp.down_proj.weight"] = (d, shape.intermediate)
    out["model.norm.weight"] = (d,)
    if not shape.tied:
        out["lm_head.weight"] = (shape.vocab, d)
    return out


def initial_params(preset: str, seed: int = 0) -> dict[str, jax.Array]:
    """fp32 master weights: norms near 1, matrices ~N(0, 0.02)."""
    shapes = param_shapes(PRESETS[preset])
    key = jax.random.PRNGKey(seed)
    out = {}
    for i, (name, shp) in enumerate(shapes.items()):
        k = jax.random.fold_in(key, i)
        if len(shp) == 1:
            out[name] = 1.0 + 0.1 * jax.random.normal(k, shp, jnp.float32)
        else:
            out[name] = 0.02 * jax.random.normal(k, shp, jnp.float32)
    return out


@jax.jit
def _sgd(params: dict[str, jax.Array], key: jax.Array, lr: float) -> dict[str, jax.Array]:
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    new = [p - lr * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, new)


def train_step(params: dict[str, jax.Array], step: int, seed: int = 0, lr: float = 1e-3) -> dict[str, jax.Array]:
    """One stand-in optimizer step: every weight moves by lr * fresh noise."""
    return _sgd(params, jax.random.fold_in(jax.random.PRNGKey(seed + 1), step), lr)


def params_after(preset: str, seed: int, steps: int, lr: float = 1e-3) -> dict[str, jax.Array]:
    """The parameters a trainer holds after `steps` steps (step numbers 1..steps)."""
    params = initial_params(preset, seed)
    for step in range(1, steps + 1):
        params = train_step(params, step, seed, lr)
    return params
