"""Dense Qwen3 model shapes by preset name, and their HF parameter names and shapes.

Shared by the synthetic trainer and the tiny checkpoints rollouts serve, so both sides
of the demo agree on every name and shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.model_families import QWEN3, hf_shapes


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a dense Qwen3 model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(64, 2, 4, 2, 32, 128, 1024),
    "small": ModelShape(256, 4, 8, 4, 32, 768, 8192),
    "medium": ModelShape(1024, 8, 16, 8, 64, 3072, 32000),
    "0.6b": ModelShape(1024, 28, 16, 8, 128, 3072, 151936),  # Qwen3-0.6B: ~1.19 GB in bf16
    "1.7b": ModelShape(2048, 28, 16, 8, 128, 6144, 151936),  # Qwen3-1.7B: ~3.44 GB in bf16
    "4b": ModelShape(2560, 36, 32, 8, 128, 9728, 151936),  # Qwen3-4B: ~8.05 GB in bf16, 398 tensors
}


def param_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of every parameter, in checkpoint order."""
    return hf_shapes(QWEN3, shape, shape.layers, shape.tied)
