"""Dense Qwen3: MaxText layout -> HF names (facts: docs/maxtext-layout.md).

No query scaling and no RoPE reorder: MaxText's Qwen3 scales queries at run time and
already uses HF's half-split rotary layout.
"""

from __future__ import annotations

from trainer_agent.convert.base import ConverterSpec, Rule, embedding, heads_in, heads_out, lm_head, same, transposed

GLOBAL_RULES = (
    Rule("token_embedder.embedding", embedding("model.embed_tokens.weight")),
    Rule("decoder_norm.scale", same("model.norm.weight")),
    Rule("logits_dense.kernel", lm_head("lm_head.weight")),
)

ATTENTION_AND_MLP = (
    Rule("pre_self_attention_layer_norm.scale", same("input_layernorm.weight")),
    Rule("post_self_attention_layer_norm.scale", same("post_attention_layernorm.weight")),
    Rule("self_attention.query.kernel", heads_in("self_attn.q_proj.weight")),
    Rule("self_attention.key.kernel", heads_in("self_attn.k_proj.weight")),
    Rule("self_attention.value.kernel", heads_in("self_attn.v_proj.weight")),
    Rule("self_attention.out.kernel", heads_out("self_attn.o_proj.weight")),
)

QK_NORMS = (
    Rule("self_attention.query_norm.scale", same("self_attn.q_norm.weight")),
    Rule("self_attention.key_norm.scale", same("self_attn.k_norm.weight")),
)

DENSE_MLP = (
    Rule("mlp.wi_0.kernel", transposed("mlp.gate_proj.weight")),
    Rule("mlp.wi_1.kernel", transposed("mlp.up_proj.weight")),
    Rule("mlp.wo.kernel", transposed("mlp.down_proj.weight")),
)

QWEN3 = ConverterSpec("qwen3", GLOBAL_RULES, ATTENTION_AND_MLP + QK_NORMS + DENSE_MLP)
