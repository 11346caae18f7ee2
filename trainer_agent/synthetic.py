"""A Qwen3-shaped parameter set in HF layout, trained by a stand-in JAX step.

Used by the demo and tests: the weights really change every step (a jitted update with
fresh noise), deterministically from (preset, seed, step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from functools import partial

import jax
import jax.numpy as jnp

from weightsync.model_shapes import PRESETS, ModelShape, param_shapes

__all__ = ["PRESETS", "ModelShape", "initial_params", "param_shapes", "params_after", "train_step"]


def initial_params(preset: str, seed: int = 0) -> dict[str, jax.Array]:
    """fp32 master weights: norms near 1, matrices ~N(0, 0.02)."""
    shapes = param_shapes(PRESETS[preset])
    return _initial(
        tuple(shapes.items()), _normal(jax.random.PRNGKey(seed), sum(math.prod(s) for s in shapes.values()))
    )


# One normal draw over every element, sliced per tensor, for the initial weights and for
# each step: XLA compiles one random kernel per process instead of one per tensor shape
# (a tiny trainer started in 5.4 s of compiling, eager per-tensor init and a step that
# drew per leaf; 1.3 s this way, measured here). Slices of one draw are independent normals.
@partial(jax.jit, static_argnums=1)
def _normal(key: jax.Array, n: int) -> jax.Array:
    return jax.random.normal(key, (n,), jnp.float32)


def _split(noise: jax.Array, shapes: Iterable[tuple[int, ...]]) -> Iterator[jax.Array]:
    """Consecutive slices of `noise`, one per shape, each reshaped to it (traced in a jit)."""
    at = 0
    for shp in shapes:
        size = math.prod(shp)
        yield noise[at : at + size].reshape(shp)
        at += size


@partial(jax.jit, static_argnums=0)
def _initial(shapes: tuple[tuple[str, tuple[int, ...]], ...], noise: jax.Array) -> dict[str, jax.Array]:
    draws = _split(noise, (shp for _, shp in shapes))
    return {name: 1.0 + 0.1 * x if len(shp) == 1 else 0.02 * x for (name, shp), x in zip(shapes, draws)}


@jax.jit
def _sgd(params: dict[str, jax.Array], noise: jax.Array, lr: float) -> dict[str, jax.Array]:
    leaves, tree = jax.tree_util.tree_flatten(params)
    draws = _split(noise, (p.shape for p in leaves))
    return jax.tree_util.tree_unflatten(tree, [p - lr * x for p, x in zip(leaves, draws)])


def train_step(params: dict[str, jax.Array], step: int, seed: int = 0, lr: float = 1e-3) -> dict[str, jax.Array]:
    """One stand-in optimizer step: every weight moves by lr * fresh noise."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed + 1), step)
    return _sgd(params, _normal(key, sum(int(p.size) for p in params.values())), lr)


def params_after(preset: str, seed: int, steps: int, lr: float = 1e-3) -> dict[str, jax.Array]:
    """The parameters a trainer holds after `steps` steps (step numbers 1..steps)."""
    params = initial_params(preset, seed)
    for step in range(1, steps + 1):
        params = train_step(params, step, seed, lr)
    return params
