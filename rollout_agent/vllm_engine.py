"""A vLLM engine owned by the rollout sidecar, synced through vLLM's own weight-transfer API.

The sidecar's watch loop calls `sync(version)`; the `weightsync` backend inside the engine
pulls, verifies, applies and reports the handshake. With prefetch on (the default), the
sidecar first waits, outside the engine, until the backend's prefetcher holds the version
verified, so the engine keeps generating through the pull and pauses for the apply alone.
After each sync the sidecar can show one greedy completion, so a person sees the policy
change.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rollout_agent.sync import SyncResult
from rollout_agent.vllm_core import in_process


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
        )
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self.agent_id = init_info["agent_id"]
        self.prefetch_wait_s = prefetch_wait_s

    def sync(self, version: int) -> SyncResult:
        """One round through vLLM's API; raises nothing: a refused version is ok=False."""
        started = time.perf_counter()
        backend = in_process(self.agent_id)
        if version and backend is not None and backend.prefetcher is not None:
            # The engine serves meanwhile; a version that does not arrive is pulled by the update.
            backend.prefetcher.wait_ready(version, self.prefetch_wait_s)
        try:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"version": version or "latest"}})
            self.llm.finish_weight_update(weight_version=str(version) if version else None)
        except Exception as e:  # noqa: BLE001 - the engine reports why; the old weights keep serving
            why = str(e).splitlines()[0][:500]
            # The coordinator was unreachable (for the manifest or the handshake): try again.
            transient = any(m in why for m in ("not delivered yet", "UNAVAILABLE", "failed to connect", "unreachable"))
            corrupt = any(m in why for m in ("DATA_LOSS", "refusing to apply", "did not verify"))
            failure = "transient" if transient else "data_loss" if corrupt else "local"
            return SyncResult(version, ok=False, mismatch=why, transient=transient, failure=failure)
        finally:
            self.llm.reset_prefix_cache()  # finish does not; stale attention state otherwise
        applied = int(self.llm.get_weight_version()) if version == 0 else version
        return SyncResult(applied, ok=True, timings={"total_seconds": time.perf_counter() - started})

    def complete(self, prompt: str, max_tokens: int = 8) -> str:
        """One greedy completion of `prompt`."""
        sp = self._sampling(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return self.llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].text.strip()

    def close(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
