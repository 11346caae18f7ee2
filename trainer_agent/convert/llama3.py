"""Llama 3: the Qwen3 table without q/k norms, untied lm_head, plus two query/key steps.

MaxText folds 1/sqrt(head_dim) into the query kernel and uses an interleaved rotary
layout; HF does neither. In this order: query x sqrt(H), then de-interleave q and k on
the head axis (`concat(x[..., ::2], x[..., 1::2])`), then reshape/transpose.
"""

from __future__ import annotations

import dataclasses
import math

from trainer_agent.convert.base import Array, ConverterSpec, ModelDims, xp_of
from trainer_agent.convert.qwen3 import ATTENTION_AND_MLP, DENSE_MLP, GLOBAL_RULES


def deinterleave(x: Array) -> Array:
    """Interleaved rotary pairs (x0, x1), (x2, x3)... -> HF's half-split layout."""
    return xp_of(x).concatenate([x[..., ::2], x[..., 1::2]], axis=-1)


def _query(a: Array, d: ModelDims) -> dict[str, Array]:
    q = deinterleave(a * xp_of(a).asarray(math.sqrt(d.head_dim), dtype=a.dtype))
    return {"self_attn.q_proj.weight": q.reshape(q.shape[0], -1).T}


def _key(a: Array, d: ModelDims) -> dict[str, Array]:
    k = deinterleave(a)
    return {"self_attn.k_proj.weight": k.reshape(k.shape[0], -1).T}


_OVERRIDES = {"self_attention.query.kernel": _query, "self_attention.key.kernel": _key}
LLAMA3 = ConverterSpec(
    "llama3",
    GLOBAL_RULES,
    tuple(dataclasses.replace(r, emit=_OVERRIDES[r.key]) if r.key in _OVERRIDES else r for r in ATTENTION_AND_MLP)
    + DENSE_MLP,
)
