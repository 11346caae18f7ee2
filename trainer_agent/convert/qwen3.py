"""Dense Qwen3: MaxText layout -> HF names (facts: docs/maxtext-layout.md).

No query scaling and no RoPE reorder: MaxText's Qwen3 scales queries at run time and
already uses HF's half-split rotary layout.
"""

from __future__ import annotations

from trainer_agent.convert.base import ConverterSpec, by_role
from weightsync.model_families import QWEN3 as QWEN3_TENSORS

GLOBAL_RULES = (
    by_role("token_embedder.embedding", QWEN3_TENSORS, "model.embed_tokens.weight"),
    by_role("decoder_norm.scale", QWEN3_TENSORS, "model.norm.weight"),
    by_role("logits_dense.kernel", QWEN3_TENSORS, "lm_head.weight"),
)

ATTENTION_AND_MLP = (
    by_role("pre_self_attention_layer_norm.scale", QWEN3_TENSORS, "input_layernorm.weight"),
    by_role("post_self_attention_layer_norm.scale", QWEN3_TENSORS, "post_attention_layernorm.weight"),
    by_role("self_attention.query.kernel", QWEN3_TENSORS, "self_attn.q_proj.weight"),
    by_role("self_attention.key.kernel", QWEN3_TENSORS, "self_attn.k_proj.weight"),
    by_role("self_attention.value.kernel", QWEN3_TENSORS, "self_attn.v_proj.weight"),
    by_role("self_attention.out.kernel", QWEN3_TENSORS, "self_attn.o_proj.weight"),
)

QK_NORMS = (
    by_role("self_attention.query_norm.scale", QWEN3_TENSORS, "self_attn.q_norm.weight"),
    by_role("self_attention.key_norm.scale", QWEN3_TENSORS, "self_attn.k_norm.weight"),
)

DENSE_MLP = (
    by_role("mlp.wi_0.kernel", QWEN3_TENSORS, "mlp.gate_proj.weight"),
    by_role("mlp.wi_1.kernel", QWEN3_TENSORS, "mlp.up_proj.weight"),
    by_role("mlp.wo.kernel", QWEN3_TENSORS, "mlp.down_proj.weight"),
)

QWEN3 = ConverterSpec("qwen3", GLOBAL_RULES, ATTENTION_AND_MLP + QK_NORMS + DENSE_MLP)
