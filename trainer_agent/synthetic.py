"""A Qwen3-shaped parameter set in HF layout, trained by a stand-in JAX step.

Used by the demo and tests: the weights really change every step (a jitted update with
fresh noise), deterministically from (preset, seed, step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from weightsync.model_shapes import PRESETS, ModelShape, param_shapes

__all__ = ["PRESETS", "ModelShape", "initial_params", "param_shapes", "params_after", "train_step"]


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
