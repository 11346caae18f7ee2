"""A Qwen3-shaped parameter set in HF layout, trained by a stand-in JAX step.

Used by the demo and tests: the weights really change every step (a jitted update with
fresh noise), deterministically from (preset, seed, step). Init and update go piece by
piece: runs of whole leaves, and blocks of rows of a leaf larger than a piece, each piece
at most `BLOCK` elements and updated in place (donated). A step needs the model's bytes
and one piece's noise and temporaries, so `4b` trains on a 16 GB chip. Every piece draws
its noise with one random kernel of one size (compiling a random kernel takes about half
a second on a CPU core, one that slices and adds far less), and a model of at most
`BLOCK` elements is one piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from weightsync.model_shapes import PRESETS, ModelShape, param_shapes

__all__ = ["PRESETS", "ModelShape", "initial_params", "master_dtype", "param_shapes", "params_after", "train_step"]

BLOCK = 1 << 22  # elements of noise drawn at once: 16 MiB in fp32
FP32_MASTERS_MAX_BYTES = 8 << 30


def master_dtype(preset: str) -> jnp.dtype:
    """fp32, or bf16 where fp32 masters would pass 8 GiB (4b: 16 GB, a whole v5e chip).
    A bf16 master rounds every step: a step far below a value's bf16 spacing leaves it."""
    elements = sum(math.prod(s) for s in param_shapes(PRESETS[preset]).values())
    return jnp.dtype(jnp.float32 if 4 * elements <= FP32_MASTERS_MAX_BYTES else jnp.bfloat16)


def initial_params(preset: str, seed: int = 0, dtype: DTypeLike | None = None) -> dict[str, jax.Array]:
    """Master weights in `dtype` (default `master_dtype(preset)`): norms 1 + N(0, 0.1),
    matrices N(0, 0.02)."""
    shapes = param_shapes(PRESETS[preset])
    dt = master_dtype(preset) if dtype is None else jnp.dtype(dtype)
    key, n = jax.random.PRNGKey(seed), _draw_size(shapes)
    out: dict[str, jax.Array] = {}
    for i, (run, start, rows) in enumerate(_pieces(shapes, n)):
        noise = _normal(key, i, n)
        if rows:  # a block of a large leaf: from its mean, in place
            mean, spread = _start(shapes[run[0]])
            leaf = out.get(run[0])
            leaf = jnp.full(shapes[run[0]], mean, dt) if leaf is None else leaf
            out[run[0]] = _add_rows(leaf, noise, start, spread, rows)
        else:
            out.update(zip(run, _initial(tuple(shapes[name] for name in run), dt, noise)))
    return {name: out[name] for name in shapes}


def train_step(params: dict[str, jax.Array], step: int, seed: int = 0, lr: float = 1e-3) -> dict[str, jax.Array]:
    """One stand-in optimizer step: every weight moves by lr * fresh noise (computed in
    fp32, rounded to the weight's dtype). Consumes `params`: their buffers are donated to
    the result where nothing else holds them."""
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    key, n = jax.random.fold_in(jax.random.PRNGKey(seed + 1), step), _draw_size(shapes)
    out = dict(params)
    for i, (run, start, rows) in enumerate(_pieces(shapes, n)):
        noise = _normal(key, i, n)
        if rows:
            out[run[0]] = _add_rows(out[run[0]], noise, start, -lr, rows)
        else:
            out.update(zip(run, _sgd(tuple(out[name] for name in run), noise, -lr)))
    return out


def params_after(preset: str, seed: int, steps: int, lr: float = 1e-3) -> dict[str, jax.Array]:
    """The parameters a trainer holds after `steps` steps (step numbers 1..steps)."""
    params = initial_params(preset, seed)
    for step in range(1, steps + 1):
        params = train_step(params, step, seed, lr)
    return params


def _draw_size(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Elements of noise every piece draws: `BLOCK`, or the whole model where smaller."""
    return min(BLOCK, sum(math.prod(s) for s in shapes.values()))


def _pieces(shapes: Mapping[str, tuple[int, ...]], n: int) -> Iterator[tuple[tuple[str, ...], int, int]]:
    """(names, start, rows): the leaves in sorted name order cut into pieces of at most n
    elements, piece i drawing its noise from fold_in(key, i). A run of whole leaves has
    rows 0; a leaf of more than n elements comes as blocks of rows, a multiple of 16 of
    them where it has that many (whole TPU tiles)."""
    run: list[str] = []
    size = 0
    for name in sorted(shapes):
        shp = shapes[name]
        k = math.prod(shp)
        if run and size + k > n:
            yield tuple(run), 0, 0
            run, size = [], 0
        if k > n:
            per = n // math.prod(shp[1:])
            per -= per % 16 if per >= 16 else 0
            for start in range(0, shp[0], per):
                yield (name,), start, min(per, shp[0] - start)
        else:
            run.append(name)
            size += k
    if run:
        yield tuple(run), 0, 0


def _start(shape: tuple[int, ...]) -> tuple[float, float]:
    """A leaf's initial mean and spread: a norm's (1-D) 1 and 0.1, a matrix's 0 and 0.02."""
    return (1.0, 0.1) if len(shape) == 1 else (0.0, 0.02)


@partial(jax.jit, static_argnums=2)
def _normal(key: jax.Array, index: int | jax.Array, n: int) -> jax.Array:
    """Piece `index`'s noise: n draws of N(0, 1) from fold_in(key, index)."""
    return jax.random.normal(jax.random.fold_in(key, index), (n,), jnp.float32)


def _slices(noise: jax.Array, shapes: Iterable[tuple[int, ...]]) -> Iterator[jax.Array]:
    """Consecutive slices of `noise`, one per shape, each reshaped to it (traced in a jit)."""
    at = 0
    for shp in shapes:
        size = math.prod(shp)
        yield noise[at : at + size].reshape(shp)
        at += size


@partial(jax.jit, static_argnums=(0, 1))
def _initial(shapes: tuple[tuple[int, ...], ...], dtype: jnp.dtype, noise: jax.Array) -> tuple[jax.Array, ...]:
    """Leaves of `shapes`: each its mean + spread * its slice of `noise`, rounded to `dtype`."""
    out = []
    for shp, x in zip(shapes, _slices(noise, shapes)):
        mean, spread = _start(shp)
        out.append((mean + spread * x).astype(dtype))
    return tuple(out)


@partial(jax.jit, donate_argnums=0)
def _sgd(leaves: tuple[jax.Array, ...], noise: jax.Array, scale: float | jax.Array) -> tuple[jax.Array, ...]:
    """Each leaf + scale * its slice of `noise`, in fp32, rounded to the leaf's dtype."""
    draws = _slices(noise, (p.shape for p in leaves))
    return tuple((p.astype(jnp.float32) + scale * x).astype(p.dtype) for p, x in zip(leaves, draws))


@partial(jax.jit, donate_argnums=0, static_argnums=4)
def _add_rows(p: jax.Array, noise: jax.Array, start: int | jax.Array, scale: float | jax.Array, rows: int) -> jax.Array:
    """`p` with rows [start, start + rows) + scale * the first of `noise`, in fp32, rounded
    to p's dtype, in place."""
    x = lax.dynamic_slice_in_dim(p, start, rows)
    (y,) = _slices(noise, [x.shape])
    return lax.dynamic_update_slice_in_dim(p, (x.astype(jnp.float32) + scale * y).astype(p.dtype), start, 0)
