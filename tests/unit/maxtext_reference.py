"""Test-side MaxText model: HF weights -> MaxText layouts, and a JAX forward pass on them.

Written from the layout facts in docs/maxtext-layout.md, independently of the
converters: the forward uses MaxText's own conventions (Llama: 1/sqrt(H) folded into the
query kernel, interleaved rotary pairs; Qwen3: run-time query scaling, q/k norms,
half-split rotary), so a converter that gets a step wrong changes the logits.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LAYER_KEYS = {
    "input_layernorm.weight": "pre_self_attention_layer_norm.scale",
    "post_attention_layernorm.weight": "post_self_attention_layer_norm.scale",
    "self_attn.q_proj.weight": "self_attention.query.kernel",
    "self_attn.k_proj.weight": "self_attention.key.kernel",
    "self_attn.v_proj.weight": "self_attention.value.kernel",
    "self_attn.o_proj.weight": "self_attention.out.kernel",
    "self_attn.q_norm.weight": "self_attention.query_norm.scale",
    "self_attn.k_norm.weight": "self_attention.key_norm.scale",
    "mlp.gate_proj.weight": "mlp.wi_0.kernel",
    "mlp.up_proj.weight": "mlp.wi_1.kernel",
    "mlp.down_proj.weight": "mlp.wo.kernel",
}


def interleave(x: np.ndarray) -> np.ndarray:
    """HF half-split rotary layout -> MaxText's interleaved pairs (inverse of de-interleave)."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    out[..., ::2] = x[..., :half]
    out[..., 1::2] = x[..., half:]
    return out


def hf_layer_to_maxtext(name: str, w: np.ndarray, family: str, heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    if name == "self_attn.q_proj.weight":
        q = w.T.reshape(w.shape[1], heads, head_dim)
        return interleave(q) / math.sqrt(head_dim) if family == "llama3" else q
    if name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        k = w.T.reshape(w.shape[1], kv_heads, head_dim)
        return interleave(k) if family == "llama3" and name.startswith("self_attn.k") else k
    if name == "self_attn.o_proj.weight":
        return w.T.reshape(heads, head_dim, w.shape[0])
    if name.startswith("mlp."):
        return w.T
    return w


def to_maxtext(
    hf: dict[str, np.ndarray],
    family: str,
    *,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab_pad: int = 0,
    scanned: bool = True,
    axis: int = 1,
    cycle: int = 1,
    cycle_layout: str = "slots",
) -> dict[str, np.ndarray]:
    """Dotted MaxText paths (normalised, no 'params'/'base' root) -> arrays."""
    rng = np.random.default_rng(1)
    emb = hf["model.embed_tokens.weight"]
    out = {
        "token_embedder.embedding": np.concatenate(
            [emb, rng.standard_normal((vocab_pad, emb.shape[1])).astype(emb.dtype)]
        )
    }
    out["decoder.decoder_norm.scale"] = hf["model.norm.weight"]
    if "lm_head.weight" in hf:
        head = hf["lm_head.weight"].T
        out["decoder.logits_dense.kernel"] = np.concatenate(
            [head, rng.standard_normal((head.shape[0], vocab_pad)).astype(head.dtype)], 1
        )
    for hf_key, mt_key in LAYER_KEYS.items():
        if f"model.layers.0.{hf_key}" not in hf:
            continue
        per = [
            hf_layer_to_maxtext(hf_key, hf[f"model.layers.{i}.{hf_key}"], family, heads, kv_heads, head_dim)
            for i in range(layers)
        ]
        if not scanned:
            for i, w in enumerate(per):
                out[f"decoder.layers_{i}.{mt_key}"] = w
        elif cycle == 1:
            out[f"decoder.layers.{mt_key}"] = np.stack(per, axis=axis)
        elif cycle_layout == "slots":
            for s in range(cycle):
                out[f"decoder.layers.layer_{s}.{mt_key}"] = np.stack(per[s::cycle], axis=axis)
        else:
            repeats = layers // cycle
            local = [np.stack([per[r * cycle + s] for s in range(cycle - 1)], axis=axis) for r in range(repeats)]
            out[f"decoder.layers.local_layers.{mt_key}"] = np.stack(local, axis=axis)
            out[f"decoder.layers.global_layer.{mt_key}"] = np.stack(per[cycle - 1 :: cycle], axis=axis)
    return out


def with_style(flat: dict[str, np.ndarray], style: str) -> dict[str, Any]:
    """nnx: 'base.decoder...'; linen: 'params-decoder-...'; nested: dicts under 'params'."""
    if style == "nnx":
        return {f"base.{k}": v for k, v in flat.items()}
    if style == "linen":
        return {"params-" + k.replace(".", "-"): v for k, v in flat.items()}
    nested: dict[str, Any] = {}
    for k, v in flat.items():
        node = nested.setdefault("params", {})
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return nested


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: jax.Array, theta: float, interleaved: bool) -> jax.Array:
    t, _, h = x.shape
    inv = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    if interleaved:
        a, b = x[..., ::2], x[..., 1::2]
        return jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    a, b = x[..., : h // 2], x[..., h // 2 :]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def forward(
    mt: dict[str, np.ndarray], family: str, tokens: np.ndarray, *, layers: int, vocab: int, eps: float, theta: float
) -> np.ndarray:
    """Logits [T, vocab] of the MaxText-layout model (scanned, axis 1), MaxText conventions,
    computed on the CPU: a float reference (a TPU's default matmul precision agrees with it
    to about three digits)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return _forward(mt, family, tokens, layers=layers, vocab=vocab, eps=eps, theta=theta)


def _forward(
    mt: dict[str, np.ndarray], family: str, tokens: np.ndarray, *, layers: int, vocab: int, eps: float, theta: float
) -> np.ndarray:
    x = jnp.asarray(mt["token_embedder.embedding"])[tokens]
    llama = family == "llama3"
    t = len(tokens)
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(layers):

        def w(key: str, i: int = i) -> jax.Array:
            return jnp.take(jnp.asarray(mt[f"decoder.layers.{key}"]), i, axis=1)

        h = _rms(x, w("pre_self_attention_layer_norm.scale"), eps)
        q = jnp.einsum("td,dnh->tnh", h, w("self_attention.query.kernel"))
        k = jnp.einsum("td,dnh->tnh", h, w("self_attention.key.kernel"))
        v = jnp.einsum("td,dnh->tnh", h, w("self_attention.value.kernel"))
        if not llama:
            q = _rms(q, w("self_attention.query_norm.scale"), eps)
            k = _rms(k, w("self_attention.key_norm.scale"), eps)
        q, k = _rope(q, theta, llama), _rope(k, theta, llama)
        if not llama:  # Qwen3 scales at run time; Llama's scale is folded into the kernel
            q = q / math.sqrt(q.shape[-1])
        rep = q.shape[1] // k.shape[1]
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
        s = jnp.einsum("qnh,knh->nqk", q, k)
        s = jnp.where(mask[None], s, -1e30)
        a = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("nqk,knh->qnh", a, v)
        x = x + jnp.einsum("tnh,nhd->td", o, w("self_attention.out.kernel"))
        h = _rms(x, w("post_self_attention_layer_norm.scale"), eps)
        mlp = jax.nn.silu(h @ w("mlp.wi_0.kernel")) * (h @ w("mlp.wi_1.kernel"))
        x = x + mlp @ w("mlp.wo.kernel")
    x = _rms(x, jnp.asarray(mt["decoder.decoder_norm.scale"]), eps)
    head = (
        jnp.asarray(mt["decoder.logits_dense.kernel"])
        if "decoder.logits_dense.kernel" in mt
        else jnp.asarray(mt["token_embedder.embedding"]).T
    )
    return np.asarray(x @ head)[:, :vocab]
