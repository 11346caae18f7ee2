"""The NumPy engine's Sample: tokens read out of the arrays it serves (engines/readout.py),
one version's bytes each, tagged with that version; a torn mix reads as neither version."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.engines.readout import LOGPROB, VOCAB, readout_tokens, weights_readout
from rollout_agent.sampling import sample_spec
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.manifest import TensorSpec
from weightsync.provenance import Provenance

NAMES = ("a", "b")


def weights(version: int) -> dict[str, np.ndarray]:
    return {n: np.full((64, 64), version + i, dtype=np.float32) for i, n in enumerate(NAMES)}


def applied(versions: list[int]) -> DictApplier:
    engine = DictApplier()
    for v in versions:
        ws = weights(v)
        engine.begin_update(v, {n: TensorSpec(n, "float32", a.shape) for n, a in ws.items()})
        engine.apply(list(ws.items()))
        engine.commit_update(v)
    return engine


def digest_of(v: int) -> Provenance:
    return Provenance(v, f"{v:064x}")


SPEC = sample_spec([1, 2, 3], n=3, max_tokens=5, seed=9)


def test_a_sample_is_the_readout_of_the_version_served_tagged_with_it() -> None:
    engine = applied([1, 2])
    got = engine.sample(SPEC, digest_of)
    want = readout_tokens(weights_readout(weights(2)), SPEC)
    assert [c.token_ids for c in got] == want
    for c in got:
        assert (c.version, c.spans[0].manifest_digest, c.spans[0].start, c.spans[0].end) == (2, f"{2:064x}", 0, 5)
        assert c.logprobs == (LOGPROB,) * 5 and all(0 <= t < VOCAB for t in c.token_ids)
    assert [c.token_ids for c in applied([1]).sample(SPEC, digest_of)] != want  # another version, other tokens
    assert applied([]).sample(SPEC, digest_of)[0].spans[0].manifest_digest == ""  # version 0: no manifest


def test_a_torn_mix_reads_as_neither_version() -> None:
    torn = {**weights(1), "b": weights(2)["b"]}
    mix = readout_tokens(weights_readout(torn), SPEC)
    assert mix != readout_tokens(weights_readout(weights(1)), SPEC)
    assert mix != readout_tokens(weights_readout(weights(2)), SPEC)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 2**63 - 1),
)
def test_the_same_weights_prompt_and_seed_give_the_same_tokens(prompt: list[int], n: int, k: int, seed: int) -> None:
    spec = sample_spec(prompt, n, k, seed)
    r = weights_readout(weights(3))
    assert readout_tokens(r, spec) == readout_tokens(r, spec)
    assert all(len(c) == k for c in readout_tokens(r, spec))


def test_a_prompt_id_past_the_vocabulary_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument) as e:
        applied([1]).sample(sample_spec([VOCAB], 1, 1, 0), digest_of)
    assert e.value.field == "prompt_token_ids"


def test_a_sample_waits_for_an_open_round_and_reads_one_version() -> None:
    """An in-place round holds the lock until its commit: a sample meanwhile reads the
    version after it, whole, never the arrays half overwritten."""
    engine = applied([1])
    ws = weights(2)
    engine.begin_update(2, {n: TensorSpec(n, "float32", a.shape) for n, a in ws.items()})
    engine.apply([("a", ws["a"])])  # half the version written
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.extend(c.version for c in engine.sample(SPEC, digest_of)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # held by the round
    engine.apply([("b", ws["b"])])
    engine.commit_update(2)
    reader.join(10)
    assert got == [2, 2, 2]


def test_an_apply_abandoned_part_way_samples_nothing_until_a_version_applies_whole() -> None:
    engine = applied([1])
    ws = weights(2)
    engine.begin_update(2, {n: TensorSpec(n, "float32", a.shape) for n, a in ws.items()})
    engine.apply([("a", ws["a"])])
    engine.abort_update()  # "a" is version 2's, "b" version 1's
    with pytest.raises(FailedPrecondition) as e:
        engine.sample(SPEC, digest_of)
    assert "mix of versions" in e.value.message
    engine.begin_update(2, {n: TensorSpec(n, "float32", a.shape) for n, a in ws.items()})
    engine.apply(list(ws.items()))
    engine.commit_update(2)
    assert [c.version for c in engine.sample(SPEC, digest_of)] == [2, 2, 2]
    engine.begin_update(3, {n: TensorSpec(n, "float32", a.shape) for n, a in ws.items()})
    engine.abort_update()  # nothing written: still version 2, whole
    assert [c.version for c in engine.sample(SPEC, digest_of)] == [2, 2, 2]
