"""What a `Sample` call asks of an engine and what it returns, checked before the engine sees it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.errors import InvalidArgument
from weightsync.provenance import VersionSpan, fingerprint, versions_used
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
    it, and those weights: one span per version, with the version's manifest digest and
    its tokens (more than one where the generation spanned a flip)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    spans: tuple[VersionSpan, ...]

    @property
    def version(self) -> int:
        """The version that sampled its first token (every token, with one span; 0: the
        weights the engine started with)."""
        return self.spans[0].version if self.spans else 0

    @property
    def fingerprint(self) -> str:
        """Its versions as one string, as vLLM's OpenAI server writes `system_fingerprint`."""
        return fingerprint(versions_used([self.spans])) if self.spans else ""


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
