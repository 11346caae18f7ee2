"""The learning demo's RL pieces: the reward, group-relative advantages, the clipped
policy-gradient loss over the JAX Qwen3 policy, Adam, and the staleness filter.

Pure functions over arrays (no processes, no sockets), so each is tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from weightsync.models import qwen3_jax

# The tiny checkpoints' word-level tokenizer: ids 0-3 are <pad> <s> </s> <unk>, id i + 4 is "w{i}".
FIRST_WORD_ID = 4
TARGET_WORDS = 10  # the reward counts w0..w9: the single-digit words
TARGET_IDS = frozenset(range(FIRST_WORD_ID, FIRST_WORD_ID + TARGET_WORDS))


def word(token_id: int) -> str:
    """The tiny tokenizer's text of a token id."""
    specials = ("<pad>", "<s>", "</s>", "<unk>")
    return specials[token_id] if token_id < FIRST_WORD_ID else f"w{token_id - FIRST_WORD_ID}"


def reward(completion: Sequence[int], targets: frozenset[int] = TARGET_IDS) -> float:
    """The share of a completion's tokens that are target words (single-digit words by default), in [0, 1]."""
    if not completion:
        return 0.0
    return sum(t in targets for t in completion) / len(completion)


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> np.ndarray:
    """GRPO's advantage: each reward minus its group's mean, over the group's standard
    deviation (a group whose rewards are all equal teaches nothing: zeros)."""
    r = np.asarray(rewards, np.float32)
    std = float(r.std())
    if std < eps:
        return np.zeros_like(r)
    return (r - r.mean()) / (std + eps)


@dataclass(frozen=True)
class Sample:
    """One completion as a rollout sampled it: the weights version its engine served, the
    prompt and completion token ids, the engine's log-prob of each completion token, and
    the response's provenance (`weightsync.provenance.fingerprint`: its versions and their
    manifest digests)."""

    rollout: str
    version: int
    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    logprobs: tuple[float, ...]
    fingerprint: str = ""


def split_by_staleness(
    samples: Iterable[Sample], current: int, max_behind: int = 1
) -> tuple[list[Sample], list[Sample]]:
    """(usable, dropped): samples of `current` or at most `max_behind` versions older are
    usable; older ones are dropped. A sample newer than `current` is a bug upstream."""
    usable, dropped = [], []
    for s in samples:
        if s.version > current:
            raise ValueError(f"a sample of version {s.version} reached the trainer at version {current}")
        (usable if current - s.version <= max_behind else dropped).append(s)
    return usable, dropped


@dataclass(frozen=True)
class Batch:
    """Samples as arrays: tokens [B, L] (prompt then completion, all one length),
    `completion` [B, L-1] marking which next-token log-probs are completion tokens,
    `behavior` [B, L-1] the engine's log-probs there, `advantages` [B]."""

    tokens: np.ndarray
    completion: np.ndarray
    behavior: np.ndarray
    advantages: np.ndarray


def make_batch(samples: Sequence[Sample], advantages: Sequence[float]) -> Batch:
    """Stacks samples whose prompt and completion lengths agree (one prompt length, one
    `max_tokens`, no early stop: the demo's engines sample with ignore_eos)."""
    lengths = {(len(s.prompt), len(s.completion)) for s in samples}
    if len(lengths) != 1:
        raise ValueError(f"samples of several (prompt, completion) lengths: {sorted(lengths)}")
    (p, c), n = lengths.pop(), len(samples)
    tokens = np.array([s.prompt + s.completion for s in samples], np.int32)
    completion = np.zeros((n, p + c - 1), np.float32)
    completion[:, p - 1 :] = 1.0
    behavior = np.zeros((n, p + c - 1), np.float32)
    behavior[:, p - 1 :] = np.array([s.logprobs for s in samples], np.float32)
    return Batch(tokens, completion, behavior, np.asarray(advantages, np.float32))


def clipped_pg_loss(
    params: Mapping[str, jax.Array], cfg: qwen3_jax.Qwen3Config, batch: Batch, clip: float = 0.2
) -> jax.Array:
    """PPO's clipped surrogate, negated, averaged over completion tokens: each token's
    ratio pi_theta / pi_behavior (1 on policy, where its gradient is REINFORCE's:
    advantage x grad log pi) times its sample's advantage, the ratio held in
    [1 - clip, 1 + clip] where moving it further would gain."""
    logp = qwen3_jax.token_logprobs(params, cfg, batch.tokens)
    ratio = jnp.exp(logp - batch.behavior)
    adv = batch.advantages[:, None]
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * adv)
    return -jnp.sum(objective * batch.completion) / jnp.sum(batch.completion)


@dataclass
class Adam:
    """Adam's moments for a dict of parameters (float32)."""

    lr: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    step: int = 0
    m: dict[str, jax.Array] | None = None
    v: dict[str, jax.Array] | None = None

    def update(self, params: dict[str, jax.Array], grads: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The parameters after one step along `grads`."""
        if self.m is None or self.v is None:
            self.m = {k: jnp.zeros_like(g) for k, g in grads.items()}
            self.v = {k: jnp.zeros_like(g) for k, g in grads.items()}
        self.step += 1
        params, self.m, self.v = _adam(params, grads, self.m, self.v, self.step, self.lr, self.b1, self.b2, self.eps)
        return params


@partial(jax.jit, static_argnums=(5, 6, 7, 8))
def _adam(params, grads, m, v, step, lr, b1, b2, eps):
    m = {k: b1 * m[k] + (1 - b1) * g for k, g in grads.items()}
    v = {k: b2 * v[k] + (1 - b2) * g * g for k, g in grads.items()}
    scale = lr * jnp.sqrt(1 - b2**step) / (1 - b1**step)
    return {k: params[k] - scale * m[k] / (jnp.sqrt(v[k]) + eps) for k in params}, m, v


def loss_and_grad(cfg: qwen3_jax.Qwen3Config, clip: float = 0.2):
    """`(params, batch) -> (loss, grads)` of `clipped_pg_loss`, compiled once per config,
    clip and batch shape."""
    return lambda params, b: _value_and_grad(params, cfg, b.tokens, b.completion, b.behavior, b.advantages, clip)


def _loss(params, cfg, tokens, completion, behavior, advantages, clip):
    return clipped_pg_loss(params, cfg, Batch(tokens, completion, behavior, advantages), clip)


_value_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnums=(1, 6))


def max_logprob_gap(params: Mapping[str, jax.Array], cfg: qwen3_jax.Qwen3Config, samples: Sequence[Sample]) -> float:
    """The largest |trainer log-prob - engine log-prob| over the samples' completion
    tokens, the trainer's computed with `params` (the weights of the samples' version)."""
    if not samples:
        return 0.0
    b = make_batch(samples, [0.0] * len(samples))
    ours = np.asarray(_token_logprobs(params, cfg, b.tokens))
    gap = np.abs(ours - b.behavior) * b.completion
    return float(gap.max())


@partial(jax.jit, static_argnums=1)
def _token_logprobs(params, cfg, tokens):
    return qwen3_jax.token_logprobs(params, cfg, tokens)


def mean(values: Iterable[float]) -> float:
    xs = list(values)
    return math.fsum(xs) / len(xs) if xs else 0.0
