"""Qwen3-MoE: experts unstacked from the expert axis, optional per-shard 128-lane padding.

Accepted MaxText layout per layer (after the scan axis is removed):
`moe_block.gate.kernel` [D, E] (router), `moe_block.wi_0` / `moe_block.wi_1` [E, D, F],
`moe_block.wo` [E, F, D]. HF/vLLM names: `mlp.gate.weight` [E, D] and
`mlp.experts.{e}.{gate_proj,up_proj}.weight` [F, D], `...down_proj.weight` [D, F].
"""

from __future__ import annotations

from trainer_agent.convert.base import Array, ConverterSpec, ModelDims, Rule, transposed, xp_of
from trainer_agent.convert.qwen3 import ATTENTION_AND_MLP, GLOBAL_RULES, QK_NORMS

LANES = 128


def compute_padded_moe_mlp_dim(h: int, tp: int, lanes: int = LANES) -> int:
    """The MoE mlp dim TPU grouped-matmul kernels want for tensor parallelism `tp`.

    If (h // tp) is not a multiple of 2 * lanes, the next power of two of max(h, 2 * lanes
    * tp); else h. (512, 2) -> 512, (512, 4) -> 1024.
    """
    if (h // tp) % (2 * lanes) != 0:
        return 1 << (max(h, 2 * lanes * tp) - 1).bit_length()
    return h


def pad_rows_per_shard(a: Array, tp: int, padded: int) -> Array:
    """[F, ...] -> [padded, ...]: each of the tp shards keeps its F/tp rows, then zeros."""
    f = a.shape[0]
    if padded == f:
        return a
    if f % tp or padded % tp:
        raise ValueError(f"mlp dim {f} and padded {padded} must both divide by tp={tp}")
    xp = xp_of(a)
    real, per = f // tp, padded // tp
    zeros = xp.zeros((per - real, *a.shape[1:]), a.dtype)
    pieces = []
    for s in range(tp):
        pieces += [a[s * real : (s + 1) * real], zeros]
    return xp.concatenate(pieces, axis=0)


def _experts(proj: str, transpose_to_out: bool) -> object:
    def emit(a: Array, d: ModelDims) -> dict[str, Array]:
        out = {}
        for e in range(a.shape[0]):
            w = a[e].T  # [D, F] -> [F, D] for gate/up; [F, D] -> [D, F] for down
            if d.moe_pad_tp:
                if transpose_to_out:  # down: pad the input (F) axis, i.e. columns
                    padded = compute_padded_moe_mlp_dim(w.shape[1], d.moe_pad_tp)
                    w = pad_rows_per_shard(w.T, d.moe_pad_tp, padded).T
                else:
                    padded = compute_padded_moe_mlp_dim(w.shape[0], d.moe_pad_tp)
                    w = pad_rows_per_shard(w, d.moe_pad_tp, padded)
            out[f"mlp.experts.{e}.{proj}.weight"] = w
        return out

    return emit


QWEN3_MOE = ConverterSpec(
    "qwen3_moe",
    GLOBAL_RULES,
    ATTENTION_AND_MLP
    + QK_NORMS
    + (
        Rule("moe_block.gate.kernel", transposed("mlp.gate.weight")),
        Rule("moe_block.wi_0", _experts("gate_proj", False)),  # type: ignore[arg-type]
        Rule("moe_block.wi_1", _experts("up_proj", False)),  # type: ignore[arg-type]
        Rule("moe_block.wo", _experts("down_proj", True)),  # type: ignore[arg-type]
    ),
)
