"""What a `Sample` call asks of an engine and what it returns, checked before the engine sees it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.errors import InvalidArgument
from weightsync.validation import INT64_MAX, check_int_arg

MAX_SAMPLES = 256  # completions per call
MAX_SAMPLE_TOKENS = 1024  # tokens per completion
MAX_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class SampleSpec:
    """Sample `n` completions of `max_tokens` tokens each after `prompt` (token ids), seeded."""

    prompt: tuple[int, ...]
    n: int
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class SampledCompletion:
    """One completion: its tokens, each token's log-prob under the weights that sampled
    it, and that weights version (0: the weights the engine started with)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int


def sample_spec(prompt: Sequence[int], n: int, max_tokens: int, seed: int) -> SampleSpec:
    """A checked spec; InvalidArgument names the field (limits the engine knows, the vocabulary
    and the model length, it checks itself)."""
    if not prompt:
        raise InvalidArgument("must hold at least one token id", field="prompt_token_ids")
    if len(prompt) > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"{len(prompt)} ids, more than {MAX_PROMPT_TOKENS}", field="prompt_token_ids")
    return SampleSpec(
        tuple(int(t) for t in prompt),
        check_int_arg(n, "n", 1, MAX_SAMPLES),
        check_int_arg(max_tokens, "max_tokens", 1, MAX_SAMPLE_TOKENS),
        check_int_arg(seed, "seed", 0, INT64_MAX),
    )


def check_fits(spec: SampleSpec, vocab: int, max_model_len: int) -> None:
    """InvalidArgument where the engine's model cannot take `spec`."""
    bad = next((t for t in spec.prompt if t >= vocab), None)
    if bad is not None:
        raise InvalidArgument(f"id {bad} is not below the vocabulary size {vocab}", field="prompt_token_ids")
    if len(spec.prompt) + spec.max_tokens > max_model_len:
        raise InvalidArgument(
            f"{len(spec.prompt)} prompt ids + {spec.max_tokens} exceed the engine's max_model_len {max_model_len}",
            field="max_tokens",
        )


def version_of_label(label: str | None) -> int:
    """The weights version an engine's label names: what `finish_weight_update` set, or 0
    for the label an engine starts with ("default")."""
    if label is None or not label.isdigit():
        return 0
    return int(label)
