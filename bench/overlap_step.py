"""The overlap bench's training step (bench/train_overlap.py): a Qwen3-shaped decoder (tied
embeddings, bf16 parameters, fp32 Adam moments) trained by hand-written Adam on random
tokens, forward, cross-entropy, backward and update in one jitted call that donates its
state; `Trainer` holds that state on the device and times steps run alone."""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightsync.model_shapes import PRESETS, ModelShape, param_shapes  # noqa: E402


def init_params(shape: ModelShape, seed: int = 0) -> dict[str, jax.Array]:
    """bf16 weights: norms 1, matrices ~N(0, 0.02), made on the default device."""
    shapes = param_shapes(shape)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))

    @partial(jax.jit, static_argnums=(1, 2))
    def one(key: jax.Array, shp: tuple[int, ...], norm: bool) -> jax.Array:
        if norm:
            return jnp.ones(shp, jnp.bfloat16)
        return (0.02 * jax.random.normal(key, shp, jnp.float32)).astype(jnp.bfloat16)

    return {name: one(k, shp, len(shp) == 1) for (name, shp), k in zip(shapes.items(), keys)}


def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype) * w


def _layer(shape: ModelShape, p: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    b, t, _ = h.shape
    nh, nk, hd = shape.heads, shape.kv_heads, shape.head_dim
    x = _rms(h, p["input_layernorm.weight"])
    q = (x @ p["self_attn.q_proj.weight"].T).reshape(b, t, nh, hd)
    k = (x @ p["self_attn.k_proj.weight"].T).reshape(b, t, nk, hd)
    v = (x @ p["self_attn.v_proj.weight"].T).reshape(b, t, nk, hd)
    q, k = _rms(q, p["self_attn.q_norm.weight"]), _rms(k, p["self_attn.k_norm.weight"])
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, nh * hd)
    h = h + attn @ p["self_attn.o_proj.weight"].T
    x = _rms(h, p["post_attention_layernorm.weight"])
    gate, up = x @ p["mlp.gate_proj.weight"].T, x @ p["mlp.up_proj.weight"].T
    return h + (jax.nn.silu(gate) * up) @ p["mlp.down_proj.weight"].T


def loss_fn(shape: ModelShape, params: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
    embed = params["model.embed_tokens.weight"]
    h = embed[tokens[:, :-1]]
    for i in range(shape.layers):
        prefix = f"model.layers.{i}."
        layer = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
        h = jax.checkpoint(partial(_layer, shape))(layer, h)  # activations recomputed: HBM for held versions
    h = _rms(h, params["model.norm.weight"])
    logits = (h @ embed.T).astype(jnp.float32)
    labels = tokens[:, 1:]
    logz = jax.nn.logsumexp(logits, -1)
    return jnp.mean(logz - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])


def make_step(shape: ModelShape, lr: float = 1e-4) -> Any:
    """(params, m, v, count, tokens) -> (params, m, v, count, loss), donating its state."""
    b1, b2, eps = 0.9, 0.95, 1e-8

    def step(params: Any, m: Any, v: Any, count: jax.Array, tokens: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(partial(loss_fn, shape))(params, tokens)
        count = count + 1
        c1, c2 = 1 - b1**count, 1 - b2**count

        def update(p: jax.Array, g: jax.Array, mi: jax.Array, vi: jax.Array) -> tuple[jax.Array, ...]:
            g32 = g.astype(jnp.float32)
            mi = b1 * mi + (1 - b1) * g32
            vi = b2 * vi + (1 - b2) * g32 * g32
            p32 = p.astype(jnp.float32) - lr * (mi / c1) / (jnp.sqrt(vi / c2) + eps)
            return p32.astype(p.dtype), mi, vi

        out = {k: update(params[k], grads[k], m[k], v[k]) for k in params}
        new_p = {k: o[0] for k, o in out.items()}
        return new_p, {k: o[1] for k, o in out.items()}, {k: o[2] for k, o in out.items()}, count, loss

    return step


class Trainer:
    """The model's state on the device and its jitted, donating step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        shape = PRESETS[args.preset]
        params = init_params(shape, args.seed)
        m = {k: jnp.zeros(p.shape, jnp.float32) for k, p in params.items()}
        v = {k: jnp.zeros(p.shape, jnp.float32) for k, p in params.items()}
        self.state = [params, m, v, jnp.zeros((), jnp.int32)]
        self.tokens = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq + 1), 0, shape.vocab)
        self._step = jax.jit(make_step(shape), donate_argnums=(0, 1, 2, 3) if args.donate else ())

    @property
    def params(self) -> dict[str, jax.Array]:
        return self.state[0]

    def step(self) -> jax.Array:
        *self.state, loss = self._step(*self.state, self.tokens)
        return loss

    def wait(self, loss: jax.Array) -> None:
        float(loss) if self.args.read_loss else loss.block_until_ready()

    def alone(self, steps: int, dispatches: list[float] | None = None) -> list[float]:
        """Each step's time until its loss is ready; with `dispatches`, the time each step's
        call took to return (the dispatch) is appended there."""
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loss = self.step()
            if dispatches is not None:
                dispatches.append(time.perf_counter() - t)
            self.wait(loss)
            times.append(time.perf_counter() - t)
        return times
