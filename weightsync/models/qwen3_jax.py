"""A Qwen3 forward in pure JAX over HF-named parameters: logits and per-token log-probs.

The parameters are the dict a trainer publishes (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ...; HF layouts, [out, in] matrices), so the
same dict is trained, published and served. The math follows transformers'
`Qwen3ForCausalLM`: RMSNorm in float32, q/k RMSNorm per head before RoPE (rotate-half,
`rope_theta`), grouped-query attention, SwiGLU MLP, tied or untied LM head.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weightsync.model_shapes import ModelShape, param_shapes

Params = Mapping[str, jax.Array]


@dataclass(frozen=True)
class Qwen3Config(ModelShape):
    """A Qwen3 model's shape and the constants its forward needs (a subset of HF's
    config.json)."""

    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> Qwen3Config:
        """From a parsed HF `config.json` of a Qwen3 model."""
        rope = config.get("rope_parameters") or {}  # transformers 5 nests rope_theta here
        return cls(
            vocab=int(config["vocab_size"]),
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=int(config["num_attention_heads"]),
            kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
            intermediate=int(config["intermediate_size"]),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's HF name and shape, in checkpoint order."""
        return param_shapes(self)


def load_checkpoint(path: str | Path) -> tuple[Qwen3Config, dict[str, np.ndarray]]:
    """The config and float32 weights of an HF checkpoint directory (safetensors)."""
    from safetensors.numpy import load_file

    path = Path(path)
    cfg = Qwen3Config.from_hf(json.loads((path / "config.json").read_text()))
    params: dict[str, np.ndarray] = {}
    for part in sorted(path.glob("*.safetensors")):
        params.update({k: np.asarray(v, np.float32) for k, v in load_file(part).items()})
    check_params(params, cfg)
    return cfg, params


def check_params(params: Mapping[str, Any], cfg: Qwen3Config) -> None:
    """ValueError naming the first missing, unexpected or misshapen parameter."""
    want = cfg.param_shapes()
    for name, shape in want.items():
        if name not in params:
            raise ValueError(f"{name}: missing")
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(params[name].shape)}, the config says {shape}")
    extra = sorted(set(params) - set(want))
    if extra:
        raise ValueError(f"{extra[0]}: not a parameter of this config ({len(extra)} unexpected)")


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return weight * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE (HF's layout: the first half of each head pairs with the second)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) / half))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, half]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _repeat_kv(x: jax.Array, cfg: Qwen3Config) -> jax.Array:
    """[B, T, kv_heads, H] -> [B, T, heads, H]: query head n reads kv head n // group (HF's repeat_kv)."""
    return jnp.repeat(x, cfg.heads // cfg.kv_heads, axis=2)


def _attention(p: Params, prefix: str, cfg: Qwen3Config, h: jax.Array, positions: jax.Array, bias: jax.Array):
    b, t, _ = h.shape
    q = (h @ p[prefix + "q_proj.weight"].T).reshape(b, t, cfg.heads, cfg.head_dim)
    k = (h @ p[prefix + "k_proj.weight"].T).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = (h @ p[prefix + "v_proj.weight"].T).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    q = _rope(_rms_norm(q, p[prefix + "q_norm.weight"], cfg.rms_norm_eps), positions, cfg.rope_theta)
    k = _rope(_rms_norm(k, p[prefix + "k_norm.weight"], cfg.rms_norm_eps), positions, cfg.rope_theta)
    k, v = _repeat_kv(k, cfg), _repeat_kv(v, cfg)
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / jnp.sqrt(jnp.float32(cfg.head_dim)) + bias
    out = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, cfg.heads * cfg.head_dim)
    return out @ p[prefix + "o_proj.weight"].T


def forward(
    params: Params,
    cfg: Qwen3Config,
    tokens: jax.Array,
    mask: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Logits [B, T, vocab] (float32) of `tokens` [B, T].

    `mask` [B, T] is 1 for real tokens and 0 for padding (left or right); pads are never
    attended to. `positions` default to each row's count of real tokens before it (so a
    left-padded row starts at 0). Logits at pad positions are meaningless.
    """
    tokens = jnp.asarray(tokens)
    mask = jnp.ones(tokens.shape, jnp.int32) if mask is None else jnp.asarray(mask).astype(jnp.int32)
    if positions is None:
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    t = tokens.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool))[None, None] & (mask[:, None, None, :] > 0)
    # the most negative float, not -inf: a pad query with nothing to attend to gets a
    # uniform row instead of NaNs that would leak into gradients
    bias = jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min)
    p = params
    x = p["model.embed_tokens.weight"][tokens].astype(jnp.float32)
    for i in range(cfg.layers):
        prefix = f"model.layers.{i}."
        h = _rms_norm(x, p[prefix + "input_layernorm.weight"], cfg.rms_norm_eps)
        x = x + _attention(p, prefix + "self_attn.", cfg, h, positions, bias)
        h = _rms_norm(x, p[prefix + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = h @ p[prefix + "mlp.gate_proj.weight"].T
        up = h @ p[prefix + "mlp.up_proj.weight"].T
        x = x + (jax.nn.silu(gate) * up) @ p[prefix + "mlp.down_proj.weight"].T
    x = _rms_norm(x, p["model.norm.weight"], cfg.rms_norm_eps)
    head = p["model.embed_tokens.weight"] if cfg.tied else p["lm_head.weight"]
    return x @ head.T


def token_logprobs(params: Params, cfg: Qwen3Config, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for t in [0, T-1): shape [B, T-1].

    Entries whose target is padding are 0.
    """
    logits = forward(params, cfg, tokens, mask)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.asarray(tokens)[:, 1:]
    picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    if mask is None:
        return picked
    return jnp.where(jnp.asarray(mask)[:, 1:] > 0, picked, 0.0)
