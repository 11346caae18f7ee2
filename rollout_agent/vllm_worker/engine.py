"""A vLLM engine owned by the rollout sidecar, synced through vLLM's own weight-transfer API.

The sidecar's watch loop calls `sync(version)`; the `weightsync` backend inside the engine
pulls, verifies, applies and reports the handshake. With prefetch on (the default), the
sidecar first waits, outside the engine, until the backend's prefetcher holds the version
verified, so the engine keeps generating through the pull and pauses for the apply alone.
After each sync the sidecar can show one greedy completion, so a person sees the policy
change, and a trainer can sample completions with their log-probs (`sample`), each tagged
with the version that produced it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from rollout_agent.sampling import SampledCompletion, SampleSpec, check_fits
from rollout_agent.sync.round import SyncResult
from rollout_agent.vllm_worker.rollout import in_process
from weightsync.provenance import Provenance, spans_of_labels, version_of_label


class VllmEngineSyncer:
    """An in-process `vllm.LLM` with the weightsync backend attached to a session."""

    def __init__(
        self,
        model: str,
        init_info: dict[str, Any],
        *,
        dtype: str = "bfloat16",
        kv_cache_bytes: int = 64 << 20,
        max_model_len: int = 256,
        prefetch_wait_s: float = 120.0,
    ) -> None:
        """`init_info`: the backend's settings (`SyncSettings.init_info()`)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process per rollout sidecar
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM, SamplingParams

        self._sampling = SamplingParams
        self.llm = LLM(
            model=model,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,  # bounded: vLLM would take ~90% of RAM otherwise
            block_size=32,
            seed=0,
            weight_transfer_config={"backend": "weightsync"},
            # the log-prob of each sampled token under the model itself, before any sampling
            # transform (vLLM's default, stated: a trainer compares it with its own)
            logprobs_mode="raw_logprobs",
        )
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self.agent_id = init_info["agent_id"]
        self.prefetch_wait_s = prefetch_wait_s
        # One caller in the engine at a time: an update round (start .. reset of the prefix
        # cache) never interleaves with a generate, so every sampled token comes from one
        # version, the one the engine's label names. The prefetch pulls outside it.
        self._engine_lock = threading.Lock()
        config = self.llm.llm_engine.model_config
        self.vocab = int(config.get_vocab_size())
        self.max_model_len = int(config.max_model_len)

    def sync(self, version: int) -> SyncResult:
        """One round through vLLM's API; raises nothing: a refused version is ok=False."""
        started = time.perf_counter()
        backend = in_process(self.agent_id)
        if version and backend is not None and backend.prefetcher is not None:
            # The engine serves meanwhile; a version that does not arrive is pulled by the update.
            backend.prefetcher.wait_ready(version, self.prefetch_wait_s)
            if backend.flips.undecided(version):  # ATOMIC: the flip's decision, waited for outside the engine
                backend.flips.wait(version, self.prefetch_wait_s)
        with self._engine_lock:
            try:
                self.llm.start_weight_update()
                self.llm.update_weights({"update_info": {"version": version or "latest"}})
                # the label every token it samples from now carries: the version applied ("latest": which one)
                applied = version or (backend.engine.applied if backend is not None else 0)
                self.llm.finish_weight_update(weight_version=str(applied) if applied else None)
            except Exception as e:  # noqa: BLE001 - the engine reports why; the old weights keep serving
                why = str(e).splitlines()[0][:500]
                # The coordinator was unreachable (for the manifest or the handshake): try again.
                transient = any(
                    m in why for m in ("not delivered yet", "UNAVAILABLE", "failed to connect", "unreachable")
                )
                corrupt = any(m in why for m in ("DATA_LOSS", "refusing to apply", "did not verify"))
                failure = "transient" if transient else "data_loss" if corrupt else "local"
                return SyncResult(version, ok=False, mismatch=why, transient=transient, failure=failure)
            finally:
                self.llm.reset_prefix_cache()  # finish does not; stale attention state otherwise
        return SyncResult(
            applied,
            ok=True,
            timings={"total_seconds": time.perf_counter() - started},
            manifest_digest=self._provenance(applied).manifest_digest,
        )

    def _provenance(self, version: int) -> Provenance:
        """`version`'s weights: its manifest digest as the backend applied it."""
        backend = in_process(self.agent_id)
        return backend.engine.provenance(version) if backend is not None else Provenance(version)

    def held(self) -> threading.Lock:
        """The engine's lock: held, nothing runs in the engine (no generate, no update)."""
        return self._engine_lock

    def complete(self, prompt: str, max_tokens: int = 8) -> str:
        """One greedy completion of `prompt`."""
        sp = self._sampling(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        with self._engine_lock:
            return self.llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].text.strip()

    def sample(self, spec: SampleSpec) -> list[SampledCompletion]:
        """`spec.n` completions from the model's own distribution (temperature 1, no top-k or
        top-p, no stop at EOS) with each token's raw log-prob, tagged with the version
        whose weights sampled them and its manifest digest (the engine's own label spans,
        resolved)."""
        check_fits(spec, self.vocab, self.max_model_len)
        sp = self._sampling(
            n=spec.n,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            logprobs=0,  # the sampled token's own log-prob alone
            seed=spec.seed,
        )
        with self._engine_lock:
            label = self.llm.get_weight_version()
            out = self.llm.generate([{"prompt_token_ids": list(spec.prompt)}], sp, use_tqdm=False)[0]
        completions = []
        for c in out.outputs:
            # Under the lock one label covers every token; the engine's own spans say which.
            found = c.weight_versions
            labels = [(s.version, s.start, s.end) for s in found] if found else [(label, 0, len(c.token_ids))]
            # (this sidecar sets each version's number as the engine's label)
            spans = spans_of_labels(labels, lambda v: self._provenance(version_of_label(v)), len(c.token_ids))
            logprobs = tuple(float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs or []))
            completions.append(SampledCompletion(tuple(c.token_ids), logprobs, spans))
        return completions

    def close(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
