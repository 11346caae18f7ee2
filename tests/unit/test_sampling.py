"""A rollout's Sample request, checked before its engine sees it."""

from __future__ import annotations

import pytest

from rollout_agent.sampling import (
    MAX_SAMPLE_TOKENS,
    MAX_SAMPLES,
    check_fits,
    sample_spec,
)
from weightsync.errors import InvalidArgument


def test_a_good_request_becomes_a_spec() -> None:
    spec = sample_spec([5, 6, 7], 16, 8, 3)
    assert (spec.prompt, spec.n, spec.max_tokens, spec.seed) == ((5, 6, 7), 16, 8, 3)
    check_fits(spec, vocab=1024, max_model_len=11)


@pytest.mark.parametrize(
    ("prompt", "n", "max_tokens", "field"),
    [
        ([], 1, 1, "prompt_token_ids"),
        ([5] * 5000, 1, 1, "prompt_token_ids"),
        ([5], 0, 1, "n"),
        ([5], MAX_SAMPLES + 1, 1, "n"),
        ([5], 1, 0, "max_tokens"),
        ([5], 1, MAX_SAMPLE_TOKENS + 1, "max_tokens"),
    ],
)
def test_a_bad_request_names_its_field(prompt: list[int], n: int, max_tokens: int, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        sample_spec(prompt, n, max_tokens, 0)
    assert e.value.field == field and e.value.message.startswith(f"{field}: ")


def test_what_the_engine_cannot_take_is_named() -> None:
    with pytest.raises(InvalidArgument, match=r"prompt_token_ids: id 1024 is not below the vocabulary size 1024"):
        check_fits(sample_spec([5, 1024], 1, 1, 0), vocab=1024, max_model_len=256)
    with pytest.raises(InvalidArgument, match=r"max_tokens: 3 prompt ids \+ 9 exceed the engine's max_model_len 11"):
        check_fits(sample_spec([5, 6, 7], 1, 9, 0), vocab=1024, max_model_len=11)


def test_only_a_trainer_or_an_admin_token_may_make_a_rollout_sample() -> None:
    from weightsync.errors import PermissionDenied
    from weightsync.security import BearerAuth

    tokens = {"trainer": "t" * 20, "rollout": "r" * 20, "admin": "a" * 20}
    auth = BearerAuth(tokens)
    method = "/weightsync.v1.RolloutAgent/Sample"
    for role in ("trainer", "admin"):
        auth.before_read(method, [("authorization", f"Bearer {tokens[role]}")])
    with pytest.raises(PermissionDenied, match="role 'rollout' may not call Sample"):
        auth.before_read(method, [("authorization", f"Bearer {tokens['rollout']}")])
