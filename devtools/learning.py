"""The demo's learning trainer: a JAX Qwen3 policy trained with GRPO on completions the
rollouts' vLLM engines sample, each new version published through weightsync.

Synchronous: every step samples a group per rollout from the version all of them serve,
updates, publishes the next version and waits for its commit. Asynchronous: each rollout
samples its next group (one thread each) while the version just published syncs; a sample
at most one version older than the trainer's is used (its PPO ratio corrects for it), an
older one is dropped and counted.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from devtools import policy_gradient as pg
from weightsync import rpc
from weightsync._proto import rollout_agent_pb2 as rpb
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc
from weightsync.models import qwen3_jax
from weightsync.provenance import DIGEST_CHARS, parse_fingerprint
from weightsync.security import Security
from weightsync.signal_wait import wait_in_slices


@dataclass(frozen=True)
class LearnConfig:
    """How the trainer learns: `group` completions of `max_tokens` tokens per rollout and
    step, Adam at `lr`, `steps` updates."""

    steps: int
    group: int
    max_tokens: int
    lr: float
    prompt: tuple[int, ...]
    seed: int = 0
    async_mode: bool = False
    clip: float = 0.2
    max_behind: int = 1  # asynchronous: the oldest usable sample is this many versions behind
    sample_timeout_s: float = 120.0


@dataclass
class StepRecord:
    """What one update saw and did."""

    step: int
    version: int  # the trainer's version the update started from (it publishes version + 1)
    reward_mean: float
    reward_best: float
    sampled: dict[str, list[int]]  # rollout -> versions its used samples came from
    responses: dict[str, dict[str, int]]  # rollout -> each response's fingerprint -> responses (used ones)
    mismatch: float  # max |trainer log-prob - engine log-prob| over the used samples' tokens
    samples: int  # used
    stale: int  # used samples older than `version`
    dropped: int  # samples too old to use, seen while gathering this step's
    best_text: str
    step_s: float = 0.0
    sync_s: float = 0.0  # publish of the next version until its commit (synchronous mode)

    def summary(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "reward_mean": round(self.reward_mean, 4),
            "reward_best": round(self.reward_best, 4),
            "sampled": self.sampled,
            "responses": self.responses,
            "logprob_mismatch": float(f"{self.mismatch:.3g}"),
            "samples": self.samples,
            "stale": self.stale,
            "dropped": self.dropped,
            "step_s": round(self.step_s, 3),
            "sync_s": round(self.sync_s, 3),
        }


class RolloutSampler:
    """One rollout's `Sample` RPC."""

    def __init__(self, name: str, address: str, security: Security | None) -> None:
        self.name = name
        self._channel = rpc.channel(address, security)
        self._stub = rpb_grpc.RolloutAgentStub(self._channel)

    def sample(self, prompt: Sequence[int], n: int, max_tokens: int, seed: int, timeout_s: float) -> list[pg.Sample]:
        req = rpb.SampleRequest(prompt_token_ids=list(prompt), n=n, max_tokens=max_tokens, seed=seed)
        resp = self._stub.Sample(req, timeout=timeout_s)
        return [
            pg.Sample(self.name, c.version, tuple(prompt), tuple(c.token_ids), tuple(c.logprobs), c.fingerprint)
            for c in resp.completions
        ]

    def close(self) -> None:
        self._channel.close()


class Publisher(Protocol):
    """What the learner needs of a `WeightPublisher` (the demo passes one)."""

    def publish(self, params: Mapping[str, Any], version: int) -> Any: ...

    def wait_committed(self, version: int, timeout_s: float = 120.0) -> str: ...


class Learner:
    """Holds the policy, its optimizer and the versions it published."""

    def __init__(
        self,
        cfg: LearnConfig,
        model: qwen3_jax.Qwen3Config,
        params: Mapping[str, np.ndarray],
        publisher: Publisher,
        samplers: Sequence[RolloutSampler],
        *,
        should_stop: Callable[[], bool] = lambda: False,
        on_step: Callable[[StepRecord], None] = lambda r: None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
        self.publisher = publisher
        self.samplers = list(samplers)
        self.should_stop = should_stop
        self.on_step = on_step
        self.optimizer = pg.Adam(lr=cfg.lr)
        self._loss_and_grad = pg.loss_and_grad(model, cfg.clip)
        self.version = 0
        self._by_version: dict[int, dict[str, jax.Array]] = {}  # the last few versions' weights
        self.records: list[StepRecord] = []
        self.committed = 0  # versions seen COMMITTED

    def _publish(self, wait: bool) -> float:
        """Publishes the current params as the next version; the seconds until its commit
        (0 without waiting)."""
        self.version += 1
        self._by_version[self.version] = self.params
        for old in [v for v in self._by_version if v < self.version - self.cfg.max_behind - 1]:
            del self._by_version[old]
        started = time.perf_counter()
        self.publisher.publish(self.params, self.version)
        if not wait:
            return 0.0
        self._commit(self.version)
        return time.perf_counter() - started

    def _commit(self, version: int) -> None:
        state = self.publisher.wait_committed(version)
        if state != "COMMITTED":
            raise RuntimeError(f"version {version} ended {state}")
        self.committed = max(self.committed, version)

    def _sample_group(self, rollout: int, call: int) -> list[pg.Sample]:
        """One group from rollout number `rollout`, its `call`-th; seeds differ per rollout
        (engines holding the same weights would otherwise sample alike) and per call."""
        seed = (self.cfg.seed * 1_000_003 + call) * len(self.samplers) + rollout
        c = self.cfg
        return self.samplers[rollout].sample(c.prompt, c.group, c.max_tokens, seed, c.sample_timeout_s)

    def _update(self, step: int, groups: Sequence[list[pg.Sample]], dropped: int) -> StepRecord:
        """One optimizer step on `groups` (one group per rollout batch); what it saw."""
        samples = [s for g in groups for s in g]
        rewards = [pg.reward(s.completion) for s in samples]
        advantages = np.concatenate([pg.group_advantages([pg.reward(s.completion) for s in g]) for g in groups])
        versions = sorted({s.version for s in samples})
        mismatch = max(self._logprob_gap(v, [s for s in samples if s.version == v]) for v in versions)
        _, grads = self._loss_and_grad(self.params, pg.make_batch(samples, advantages))
        self.params = self.optimizer.update(self.params, grads)
        sampled: dict[str, set[int]] = {}
        responses: dict[str, dict[str, int]] = {}
        for s in samples:
            sampled.setdefault(s.rollout, set()).add(s.version)
            named = responses.setdefault(s.rollout, {})
            named[s.fingerprint] = named.get(s.fingerprint, 0) + 1
        best = samples[int(np.argmax(rewards))]
        return StepRecord(
            step=step,
            version=self.version,
            reward_mean=pg.mean(rewards),
            reward_best=max(rewards),
            sampled={k: sorted(v) for k, v in sorted(sampled.items())},
            responses=dict(sorted(responses.items())),
            mismatch=mismatch,
            samples=len(samples),
            stale=sum(s.version < self.version for s in samples),
            dropped=dropped,
            best_text=" ".join(pg.word(t) for t in best.completion),
        )

    def _logprob_gap(self, version: int, samples: Sequence[pg.Sample]) -> float:
        """The largest |trainer - engine| log-prob over `samples`, all of `version`, the
        trainer's computed with that version's weights."""
        if version not in self._by_version:
            raise RuntimeError(
                f"samples of version {version}, whose weights the trainer does not hold (it holds "
                f"{sorted(self._by_version)}): the engine serves something this trainer did not just publish"
            )
        return pg.max_logprob_gap(self._by_version[version], self.model, samples)

    def _record(self, rec: StepRecord, started: float, sync_s: float = 0.0) -> None:
        rec.sync_s = sync_s
        rec.step_s = time.perf_counter() - started
        self.records.append(rec)
        self.on_step(rec)

    def run(self) -> list[StepRecord]:
        """Publishes the initial weights as version 1, then `steps` updates (versions 2..)."""
        self._publish(wait=True)
        if self.cfg.async_mode:
            self._run_async()
        else:
            self._run_sync()
        return self.records

    def _run_sync(self) -> None:
        for step in range(1, self.cfg.steps + 1):
            if self.should_stop():
                return
            started = time.perf_counter()
            groups = _in_parallel([functools.partial(self._sample_group, i, step) for i in range(len(self.samplers))])
            rec = self._update(step, groups, 0)
            self._record(rec, started, self._publish(wait=True))

    def _run_async(self) -> None:
        # One slot per rollout, refilled as soon as the trainer takes its batch: the next
        # batch is sampled with what the engine serves then, while the version just
        # published syncs, and waits there (one version old) for the next step.
        slots: list[queue.Queue[list[pg.Sample] | BaseException]] = [queue.Queue(maxsize=1) for _ in self.samplers]
        wanted = [threading.Event() for _ in self.samplers]
        stop = threading.Event()
        threads = [
            threading.Thread(target=self._sample_on_request, args=(i, slots[i], wanted[i], stop), daemon=True)
            for i in range(len(self.samplers))
        ]
        for w in wanted:
            w.set()
        for t in threads:
            t.start()
        try:
            for step in range(1, self.cfg.steps + 1):
                if self.should_stop():
                    return
                started = time.perf_counter()
                # At most one version in flight: the last one commits before its successor
                # is trained on samples of it or of the one before.
                self._commit(self.version)
                groups: list[list[pg.Sample]] = []
                dropped = 0
                for slot, want in zip(slots, wanted):
                    while True:
                        got = _get(slot, self.cfg.sample_timeout_s, self.should_stop)
                        if got is None:
                            return
                        want.set()
                        if isinstance(got, BaseException):
                            raise got
                        usable, old = pg.split_by_staleness(got, self.version, self.cfg.max_behind)
                        dropped += len(old)
                        if usable:
                            groups.append(usable)
                            break
                rec = self._update(step, groups, dropped)
                self._publish(wait=False)
                self._record(rec, started)
            self._commit(self.version)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=self.cfg.sample_timeout_s)

    def _sample_on_request(self, index: int, slot: queue.Queue, wanted: threading.Event, stop: threading.Event) -> None:
        """Samples a group into `slot` each time `wanted` is set, until `stop`; a failure is
        handed to the trainer, which raises it."""
        call = 0
        while not stop.is_set():
            if not wanted.wait(0.2):
                continue
            wanted.clear()
            call += 1
            try:
                got: list[pg.Sample] | BaseException = self._sample_group(index, call)
            except Exception as e:  # noqa: BLE001 - raised by the trainer
                got = e
            slot.put(got)  # empty: the trainer asks for the next batch only after taking this one
            if isinstance(got, BaseException):
                return


def _get(q: queue.Queue, timeout_s: float, should_stop: Callable[[], bool]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if should_stop():
            return None
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            continue
    raise TimeoutError(f"no samples from the rollouts in {timeout_s:.0f} s")


def _in_parallel(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Runs each call on its own thread (the rollouts sample at once); re-raises the first failure."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:  # in slices: a Ctrl-C another thread took still interrupts (weightsync.signal_wait)
        wait_in_slices(lambda s, t=t: not (t.join(s) or t.is_alive()), None)
    if errors:
        raise errors[0]
    return results


def summary_fields(records: Sequence[StepRecord]) -> dict[str, Any]:
    """The JSON summary's learning fields."""
    rewards = [r.reward_mean for r in records]
    used = sum(r.samples for r in records)
    dropped = sum(r.dropped for r in records)
    return {
        "reward_first5": round(pg.mean(rewards[:5]), 4),
        "reward_last5": round(pg.mean(rewards[-5:]), 4),
        "logprob_mismatch_max": float(f"{max((r.mismatch for r in records), default=0.0):.3g}"),
        "samples": used,
        "stale_samples": sum(r.stale for r in records),
        "dropped_samples": dropped,
        "dropped_share": round(dropped / (used + dropped), 4) if used + dropped else 0.0,
    }


def provenance_fields(records: Sequence[StepRecord], digests: Mapping[int, str]) -> dict[str, Any]:
    """The JSON summary's check of every used response's provenance against the session's
    manifest digests (`digests`, the coordinator's): a response is verified when its
    fingerprint names one version and that version's manifest digest; the first few that
    are not are named."""
    responses = verified = 0
    unverified: list[str] = []
    for r in records:
        for rollout, named in r.responses.items():
            for text, count in named.items():
                responses += count
                if _names_its_digest(text, digests):
                    verified += count
                elif len(unverified) < 5:
                    unverified.append(f"step {r.step} {rollout}: {text or '(no fingerprint)'}")
    return {"responses": responses, "verified": verified, "unverified": unverified}


def _names_its_digest(text: str, digests: Mapping[int, str]) -> bool:
    try:
        entries = parse_fingerprint(text)
    except ValueError:
        return False
    if len(entries) != 1:
        return False
    version, prefix = entries[0]
    return bool(prefix) and digests.get(version, "")[:DIGEST_CHARS] == prefix
