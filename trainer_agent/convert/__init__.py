"""MaxText -> HF converters: declarative per family, streaming (source leaves popped)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from trainer_agent.convert.base import ConverterSpec, ConvertOptions, ModelDims, UnknownKey, convert, passthrough
from trainer_agent.convert.llama3 import LLAMA3
from trainer_agent.convert.qwen3 import QWEN3
from trainer_agent.convert.qwen3_moe import QWEN3_MOE, compute_padded_moe_mlp_dim

__all__ = [
    "FAMILIES",
    "ConvertOptions",
    "ConverterSpec",
    "ModelDims",
    "UnknownKey",
    "compute_padded_moe_mlp_dim",
    "convert_maxtext",
    "passthrough",
]

FAMILIES: dict[str, ConverterSpec] = {"qwen3": QWEN3, "llama3": LLAMA3, "qwen3_moe": QWEN3_MOE}


def convert_maxtext(
    tree: Mapping[str, Any], family: str, dims: ModelDims, options: ConvertOptions | None = None
) -> Iterator[tuple[str, Any]]:
    """Streams (hf_name, array) from a MaxText tree of `family`; consumes a mutable tree."""
    try:
        spec = FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; available: {', '.join(sorted(FAMILIES))}") from None
    return convert(tree, spec, dims, options)
