"""`make demo`'s learning run: this process trains the tiny Qwen3 policy in JAX on what the
rollouts' vLLM engines sample, and publishes each version through a `WeightPublisher`.

One line per step: the reward (mean and best over the step's samples), the version each
rollout's samples came from, the largest |trainer log-prob - vLLM log-prob| over the sampled
tokens, stale and dropped samples, and the best completion.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from devtools.cluster import Proc

MISMATCH_BOUND = 1e-3  # fp32 on both sides: the trainer and vLLM compute the same log-probs to ~1e-5


def prompt_ids(text: str) -> tuple[int, ...]:
    """The tiny tokenizer's ids of a prompt of words w0, w1, ... (ValueError naming a word it lacks)."""
    from devtools.policy_gradient import FIRST_WORD_ID

    ids = []
    for w in text.split():
        if not (w.startswith("w") and w[1:].isdigit()):
            raise ValueError(f"--prompt: {w!r} is not a word of the tiny tokenizer (w0, w1, ...)")
        ids.append(FIRST_WORD_ID + int(w[1:]))
    if not ids:
        raise ValueError("--prompt: empty")
    return tuple(ids)


def run_learning(
    args: argparse.Namespace,
    console: Console,
    coordinator: str,
    rollouts: Sequence[Proc],
    model_dir: Path,
    workdir: Path,
    should_stop: Callable[[], bool],
) -> dict[str, Any]:
    """Trains for `args.steps` steps against the started rollouts; the summary's fields."""
    if args.trainer_platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # read once, when JAX first starts a backend
    import jax

    from devtools.learning import LearnConfig, Learner, RolloutSampler, StepRecord, provenance_fields, summary_fields
    from devtools.policy_gradient import TARGET_WORDS
    from trainer_agent import PublisherSettings, WeightPublisher
    from weightsync.client import CoordinatorClient
    from weightsync.errors import WeightsyncError
    from weightsync.models import qwen3_jax

    model, params = qwen3_jax.load_checkpoint(model_dir)
    cfg = LearnConfig(
        steps=args.steps,
        group=args.group,
        max_tokens=args.max_tokens,
        lr=args.lr,
        prompt=prompt_ids(args.prompt),
        seed=args.seed,
        async_mode=args.async_mode,
    )
    settings = PublisherSettings(
        coordinator=coordinator,
        session=args.session,
        weight_dtype="float32",  # what the engines serve: their log-probs then match the trainer's
        weight_sync_mode=args.weight_sync_mode,
        min_rollouts=len(rollouts),
        flip_policy=args.flip,
        fs_root=args.fs_root,
        fs_option=tuple(args.fs_option),
    )
    os.environ.update(args.fs_env)  # an emulator's endpoint and dummy credentials (--fs-emulator)
    console.print(
        f"trainer      in this process (JAX on {jax.default_backend().upper()}): GRPO on the tiny Qwen3, "
        f"{cfg.group} completions x {cfg.max_tokens} tokens per rollout and step, lr {cfg.lr:g}, "
        f"{'asynchronous' if cfg.async_mode else 'synchronous'}",
        soft_wrap=True,
    )
    console.print(
        f"reward: the share of completion words among w0..w{TARGET_WORDS - 1} (single-digit words); "
        f"prompt {args.prompt!r}",
        soft_wrap=True,
    )

    def show(r: StepRecord) -> None:
        sampled = " ".join(f"{name}@" + "+".join(f"v{v}" for v in vs) for name, vs in r.sampled.items())
        ok = r.mismatch <= MISMATCH_BOUND
        console.print(
            f"step {r.step:>3}  v{r.version}->v{r.version + 1}  reward mean {r.reward_mean:.3f} best "
            f"{r.reward_best:.3f}  sampled {sampled}  |dlogp| "
            + (f"[green]{r.mismatch:.1e}[/]" if ok else f"[red]{r.mismatch:.1e}[/]")
            + f"  stale {r.stale} dropped {r.dropped}  {r.step_s:.2f}s  best: {r.best_text}",
            soft_wrap=True,
            highlight=False,
        )

    samplers = [RolloutSampler(r.name, r.address, None) for r in rollouts]
    error = ""
    try:
        with WeightPublisher(settings).start(next_version=1) as pub:
            learner = Learner(cfg, model, params, pub, samplers, should_stop=should_stop, on_step=show)
            try:
                learner.run()
            except (RuntimeError, TimeoutError, WeightsyncError) as e:  # said in one line; the summary says not ok
                error = str(e)
                console.print(f"[red]stopped: {error}[/]", soft_wrap=True)
    finally:
        for s in samplers:
            s.close()
    records = learner.records
    fields = summary_fields(records)
    with CoordinatorClient(coordinator) as client:
        digests = {v.version: v.manifest_digest for v in client.status(args.session, 1000).versions}
    fields["provenance"] = provenance_fields(records, digests)
    complete = len(records) == cfg.steps and not error
    fields.update(
        {
            "mode": "learn",
            "async": cfg.async_mode,
            "steps": len(records),
            "committed": learner.committed,
            "ok": complete
            and fields["logprob_mismatch_max"] <= MISMATCH_BOUND
            and fields["provenance"]["verified"] == fields["samples"]
            and (cfg.async_mode or fields["stale_samples"] == 0),
            "bytes_per_step": sum(int(v.nbytes) for v in learner.params.values()),
            "error": error,
            "trainer_platform": jax.default_backend(),
            "group": cfg.group,
            "max_tokens": cfg.max_tokens,
            "lr": cfg.lr,
            "per_step": [r.summary() for r in records],
        }
    )
    return fields
