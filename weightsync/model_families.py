"""What each model family's HF-named tensors are: one table per family, shared by the
trainer's converters (MaxText -> HF) and the rollouts' name maps (HF -> an engine's leaves).

A tensor's `Role` fixes its HF layout in the model's dimensions (`axes`, read with
`role_shape`): attention projections are head-major on their head side ([N·H, D] for a
query, [D, N·H] for the output), MLP and LM-head matrices are [out, in]. Which head count
a projection uses (`heads` or `kv_heads`) is part of the entry, so a converter checking a
kernel's head axes and a name map splitting a projection into heads read the same fact.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


class Role(enum.Enum):
    """What a tensor is, hence its HF layout (axes named as in `Family.axes`)."""

    EMBEDDING = "embedding"  # [vocab, hidden]
    LM_HEAD = "lm_head"  # [vocab, hidden]
    NORM = "norm"  # [width]
    HEADS_IN = "heads_in"  # [count · head_dim, hidden]: q/k/v projections
    HEADS_OUT = "heads_out"  # [hidden, count · head_dim]: the attention output projection
    MLP_IN = "mlp_in"  # [intermediate, hidden]: gate, up
    MLP_OUT = "mlp_out"  # [hidden, intermediate]: down


# A role's HF axes, each a dims field (a product of fields where the tensor fuses two).
ROLE_AXES: dict[Role, tuple[tuple[str, ...], ...]] = {
    Role.EMBEDDING: (("vocab",), ("hidden",)),
    Role.LM_HEAD: (("vocab",), ("hidden",)),
    Role.NORM: (("width",),),
    Role.HEADS_IN: (("count", "head_dim"), ("hidden",)),
    Role.HEADS_OUT: (("hidden",), ("count", "head_dim")),
    Role.MLP_IN: (("intermediate",), ("hidden",)),
    Role.MLP_OUT: (("hidden",), ("intermediate",)),
}


class Dims(Protocol):
    """The model dimensions a shape needs (`model_shapes.ModelShape` has them all)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class Tensor:
    """One HF tensor of a family: its name (relative to the layer prefix inside a layer),
    its role, and for attention projections the head count it uses, for norms the width."""

    name: str
    role: Role
    count: str = ""  # "heads" or "kv_heads" (HEADS_IN / HEADS_OUT)
    width: str = ""  # "hidden" or "head_dim" (NORM)

    def size_of(self, axis: str, dims: Dims) -> int:
        """The size of one named axis of this tensor (`count` and `width` resolved)."""
        field = {"count": self.count, "width": self.width}.get(axis, axis)
        return int(getattr(dims, field))


@dataclass(frozen=True)
class Family:
    """A model family's HF tensors in checkpoint order: `head` before the layers, `layer`
    per layer (under `layer_prefix`), `tail` after. `lm_head` is left out of tied models."""

    name: str
    head: tuple[Tensor, ...]
    layer: tuple[Tensor, ...]
    tail: tuple[Tensor, ...]
    layer_prefix: str = "model.layers.{i}."

    def tensor(self, name: str) -> Tensor:
        """The entry of an HF name (a layer's tensor by its suffix, or a global one)."""
        for t in self.head + self.layer + self.tail:
            if t.name == name:
                return t
        raise KeyError(f"family {self.name!r} has no tensor {name!r}")

    def names(self, layers: int, tied: bool) -> Iterator[tuple[str, Tensor]]:
        """Every HF name of a model with `layers` layers, in checkpoint order."""
        for t in self.head:
            yield t.name, t
        for i in range(layers):
            prefix = self.layer_prefix.format(i=i)
            for t in self.layer:
                yield prefix + t.name, t
        for t in self.tail:
            if not (tied and t.role is Role.LM_HEAD):
                yield t.name, t


def role_shape(t: Tensor, dims: Dims) -> tuple[int, ...]:
    """The HF shape of tensor `t` in a model of `dims`."""
    out = []
    for parts in ROLE_AXES[t.role]:
        n = 1
        for axis in parts:
            n *= t.size_of(axis, dims)
        out.append(n)
    return tuple(out)


def _attention(q_k_norms: bool) -> tuple[Tensor, ...]:
    qkv = (
        Tensor("self_attn.q_proj.weight", Role.HEADS_IN, count="heads"),
        Tensor("self_attn.k_proj.weight", Role.HEADS_IN, count="kv_heads"),
        Tensor("self_attn.v_proj.weight", Role.HEADS_IN, count="kv_heads"),
        Tensor("self_attn.o_proj.weight", Role.HEADS_OUT, count="heads"),
    )
    norms = (
        Tensor("self_attn.q_norm.weight", Role.NORM, width="head_dim"),
        Tensor("self_attn.k_norm.weight", Role.NORM, width="head_dim"),
    )
    return qkv + (norms if q_k_norms else ())


_MLP = (
    Tensor("mlp.gate_proj.weight", Role.MLP_IN),
    Tensor("mlp.up_proj.weight", Role.MLP_IN),
    Tensor("mlp.down_proj.weight", Role.MLP_OUT),
)
_EMBED = (Tensor("model.embed_tokens.weight", Role.EMBEDDING),)
_TAIL = (Tensor("model.norm.weight", Role.NORM, width="hidden"), Tensor("lm_head.weight", Role.LM_HEAD))


def _norm(name: str) -> Tensor:
    return Tensor(name, Role.NORM, width="hidden")


QWEN3 = Family(
    "qwen3",
    _EMBED,
    (_norm("input_layernorm.weight"), *_attention(True), _norm("post_attention_layernorm.weight"), *_MLP),
    _TAIL,
)
LLAMA3 = Family(
    "llama3",
    _EMBED,
    (_norm("input_layernorm.weight"), *_attention(False), _norm("post_attention_layernorm.weight"), *_MLP),
    _TAIL,
)
# Gemma 2 adds norms around the MLP; Gemma 3 adds query/key norms too. (Their norms scale
# by 1 + w and their embeddings by sqrt(hidden) at run time: a forward's business, not a layout's.)
GEMMA2 = Family(
    "gemma2",
    _EMBED,
    (
        _norm("input_layernorm.weight"),
        *_attention(False),
        _norm("post_attention_layernorm.weight"),
        _norm("pre_feedforward_layernorm.weight"),
        _norm("post_feedforward_layernorm.weight"),
        *_MLP,
    ),
    _TAIL,
)
GEMMA3 = Family(
    "gemma3",
    _EMBED,
    (
        _norm("input_layernorm.weight"),
        *_attention(True),
        _norm("post_attention_layernorm.weight"),
        _norm("pre_feedforward_layernorm.weight"),
        _norm("post_feedforward_layernorm.weight"),
        *_MLP,
    ),
    _TAIL,
)

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN3, LLAMA3, GEMMA2, GEMMA3)}


def family(name: str) -> Family:
    """A family by name; KeyError lists the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None


def hf_shapes(fam: Family, dims: Dims, layers: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of every tensor of a `fam` model, in checkpoint order."""
    return {name: role_shape(t, dims) for name, t in fam.names(layers, tied)}
