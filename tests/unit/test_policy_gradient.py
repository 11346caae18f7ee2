"""The learning demo's RL pieces on fixed inputs: reward, advantages, the loss gradient's
direction, the clip, the staleness filter, Adam, and the trainer/engine log-prob gap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from devtools import policy_gradient as pg
from weightsync.models import qwen3_jax

CFG = qwen3_jax.Qwen3Config(vocab=48, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64)
PROMPT = (5, 6, 7)
W = pg.FIRST_WORD_ID  # id of "w0"


def _params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        k: jnp.asarray(1.0 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.3 * rng.standard_normal(s), jnp.float32)
        for k, s in CFG.param_shapes().items()
    }


def _sample(params, completion: tuple[int, ...], version: int = 1, rollout: str = "r0") -> pg.Sample:
    """A sample whose engine log-probs are exactly the policy's (as a perfect engine would report)."""
    tokens = np.asarray([PROMPT + completion])
    lp = np.asarray(pg._token_logprobs(params, CFG, tokens))[0, len(PROMPT) - 1 :]
    return pg.Sample(rollout, version, PROMPT, completion, tuple(float(x) for x in lp))


def test_the_reward_is_the_share_of_single_digit_words() -> None:
    assert [pg.word(t) for t in (0, 2, W, W + 9, W + 10)] == ["<pad>", "</s>", "w0", "w9", "w10"]
    assert pg.reward((W, W + 9, W + 10, 3)) == 0.5
    assert pg.reward((W + 10, W + 11)) == 0.0 and pg.reward((W + 3,) * 4) == 1.0
    assert pg.reward(()) == 0.0


def test_group_advantages_are_centred_and_scaled_and_zero_for_a_flat_group() -> None:
    adv = pg.group_advantages([0.0, 0.5, 1.0, 0.5])
    assert abs(adv.sum()) < 1e-6 and abs(adv.std() - 1.0) < 1e-4 and adv[2] > adv[1] > adv[0]
    assert not pg.group_advantages([0.25, 0.25, 0.25]).any()


def _loss_grad(params, samples, advantages, behavior_shift: float = 0.0):
    batch = pg.make_batch(samples, advantages)
    batch = pg.Batch(batch.tokens, batch.completion, batch.behavior + behavior_shift, batch.advantages)
    return pg.loss_and_grad(CFG)(params, batch)


def _mean_logprob(params, sample: pg.Sample) -> float:
    tokens = np.asarray([sample.prompt + sample.completion])
    return float(np.asarray(pg._token_logprobs(params, CFG, tokens))[0, len(PROMPT) - 1 :].mean())


def test_a_step_down_the_gradient_favours_the_better_samples() -> None:
    """Fixed batch: two completions of single-digit words, two of others. One small step
    against the loss gradient raises the log-prob of the first two and lowers the others',
    and raises the probability of a single-digit word after the prompt."""
    params = _params()
    good = [(W + 1, W + 2, W + 3, W + 1), (W + 4, W + 4, W + 5, W + 6)]
    bad = [(W + 20, W + 30, W + 21, W + 40), (W + 33, W + 22, W + 25, W + 31)]
    samples = [_sample(params, c) for c in good + bad]
    adv = pg.group_advantages([pg.reward(s.completion) for s in samples])
    assert list(adv > 0) == [True, True, False, False]
    _, grads = _loss_grad(params, samples, adv)
    stepped = {k: params[k] - 1e-2 * grads[k] for k in params}
    for s, a in zip(samples, adv):
        moved = _mean_logprob(stepped, s) - _mean_logprob(params, s)
        assert moved > 0 if a > 0 else moved < 0, (s.completion, moved)

    @jax.jit
    def p_target(p):
        probs = jax.nn.softmax(qwen3_jax.forward(p, CFG, np.asarray([PROMPT]))[0, -1])
        return probs[W : W + pg.TARGET_WORDS].sum()

    assert float(p_target(stepped)) > float(p_target(params))


def test_on_policy_the_clipped_loss_has_reinforces_gradient() -> None:
    """At ratio 1 (behavior log-probs = the policy's) the surrogate's gradient is
    -mean(advantage x grad log pi) over completion tokens."""
    params = _params(1)
    completions = [(W, W + 11, W + 2, W), (W + 30, W + 31, W + 3, W), (W + 1, W + 1, W + 1, W), (W + 9,) * 4]
    samples = [_sample(params, c) for c in completions]
    adv = np.asarray([0.5, -1.2, 0.7, 0.0], np.float32)
    _, grads = _loss_grad(params, samples, adv)
    tokens = np.asarray([s.prompt + s.completion for s in samples])

    def reinforce(p):
        logp = qwen3_jax.token_logprobs(p, CFG, tokens)[:, len(PROMPT) - 1 :]
        return -jnp.mean(adv[:, None] * logp)

    want = jax.jit(jax.grad(reinforce))(params)
    for k in params:
        np.testing.assert_allclose(grads[k], want[k], atol=1e-6, rtol=1e-4)


def test_the_clip_stops_pushing_a_ratio_already_past_it() -> None:
    """Behavior log-probs 0.5 below the policy's (ratio e^0.5 > 1.2) with a positive
    advantage: nothing more to gain, the gradient is zero; with a negative one it is not."""
    params = _params(2)
    samples = [_sample(params, (W + i, W + 1, W + 2, W + 20 + i)) for i in range(4)]
    _, grads = _loss_grad(params, samples, np.ones(4, np.float32), behavior_shift=-0.5)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in grads.values())
    _, grads = _loss_grad(params, samples, -np.ones(4, np.float32), behavior_shift=-0.5)
    assert max(float(jnp.abs(g).max()) for g in grads.values()) > 0


def test_the_staleness_filter_keeps_one_version_back_and_drops_older() -> None:
    params = _params()
    samples = [_sample(params, (W,) * 4, version=v) for v in (7, 6, 5, 3)]
    usable, dropped = pg.split_by_staleness(samples, current=7, max_behind=1)
    assert [s.version for s in usable] == [7, 6] and [s.version for s in dropped] == [5, 3]
    usable, dropped = pg.split_by_staleness(samples, current=7, max_behind=0)
    assert [s.version for s in usable] == [7] and len(dropped) == 3
    with pytest.raises(ValueError, match="version 8 reached the trainer at version 7"):
        pg.split_by_staleness([pg.Sample("r0", 8, PROMPT, (W,), (0.0,))], current=7)


def test_a_batch_marks_completion_tokens_and_refuses_ragged_samples() -> None:
    params = _params()
    samples = [_sample(params, (W, W + 1, W, W)), _sample(params, (W + 2, W + 3, W, W))]
    b = pg.make_batch(samples, [1.0, -1.0])
    assert b.tokens.shape == (2, 7) and b.completion.tolist() == [[0, 0, 1, 1, 1, 1]] * 2
    assert np.array_equal(b.behavior[:, 2:], np.asarray([s.logprobs for s in samples], np.float32))
    with pytest.raises(ValueError, match="several"):
        pg.make_batch([samples[0], pg.Sample("r0", 1, PROMPT, (W,), (0.0,))], [0.0, 0.0])


def test_the_logprob_gap_is_zero_for_the_policys_own_numbers_and_sees_a_shift() -> None:
    params = _params(3)
    samples = [_sample(params, (W, W + 5, W + 17, W)), _sample(params, (W + 2, W + 2, W + 9, W))]
    assert pg.max_logprob_gap(params, CFG, samples) < 1e-5
    off = pg.Sample("r0", 1, PROMPT, samples[1].completion, (samples[1].logprobs[0] + 0.01, *samples[1].logprobs[1:]))
    assert abs(pg.max_logprob_gap(params, CFG, [samples[0], off]) - 0.01) < 1e-5
    assert pg.max_logprob_gap(_params(4), CFG, samples) > 0.1  # other weights: the gap shows


def test_adam_matches_the_textbook_update() -> None:
    opt = pg.Adam(lr=0.1)
    p = {"w": jnp.asarray([1.0, -2.0])}
    m = v = np.zeros(2)
    want = np.asarray([1.0, -2.0])
    for t, g in enumerate(([0.5, -1.0], [0.1, 0.3], [-0.2, 0.0]), start=1):
        g = np.asarray(g)
        p = opt.update(p, {"w": jnp.asarray(g, jnp.float32)})
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        want = want - 0.1 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        np.testing.assert_allclose(np.asarray(p["w"]), want, rtol=1e-5)
