"""Worker extension for vLLM's TPU backend (tpu-inference's `TPUWorker`).

vLLM mixes `worker_extension_cls` into its worker class, so `self` here is the worker and
the methods below call the worker's own weight-update contract:

- `start_weight_update(free_kv_cache=True)` frees the KV cache (a second copy of the
  weights roughly doubles peak HBM; the caller resets the prefix cache first);
- `get_weights_state()` returns the live state of sharded `jax.Array`s;
- `refresh_model_state_leaves()` re-points the jitted model function at the state's
  current leaves (it takes them as an argument and goes stale when they are replaced);
- `finish_weight_update()` reallocates the KV cache.

The weights are written out of band (tpu-inference's `update_weights` is a no-op on TPU):
the worker pulls and verifies the version itself, and a `JaxApplier` builds every leaf in
the sharding of the leaf it replaces, checks each one's bits on the device against the
verified host bytes, swaps them in (or replaces them leaf by leaf where HBM cannot hold
two copies) and calls the refresh. Only plain dicts cross vLLM's RPCs.

    llm = LLM(model, worker_extension_cls="rollout_agent.tpu_worker_extension.WeightsyncTPUWorkerExtension")
    llm.collective_rpc("weightsync_attach", args=({"coordinator": "unix:/run/ws/c.sock", "session": "job"},))
    llm.reset_prefix_cache()
    llm.collective_rpc("weightsync_sync", args=(7,))

An in-place apply that fails its device check part way leaves the engine holding a mix of
two versions: the extension then does not reallocate the KV cache, so the engine cannot
serve until a version applies whole (`weightsync_sync` again).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rollout_agent.engines.jax.applier import JaxApplier
from rollout_agent.engines.jax.names import NameMap
from rollout_agent.engines.jax.targets import InPlaceTree
from rollout_agent.settings import InitInfo
from rollout_agent.vllm_worker.rollout import VllmRollout, parse_version
from weightsync.errors import FailedPrecondition, InvalidArgument

# HF config model_type -> weightsync's family name (weightsync.model_families)
FAMILY_OF_MODEL_TYPE = {"qwen3": "qwen3", "llama": "llama3", "gemma2": "gemma2", "gemma3_text": "gemma3"}
# init_info["jax"] keys and their defaults: how the worker's state is laid out and written
JAX_DEFAULTS: dict[str, Any] = {"layout": "tpu_inference", "mode": "auto", "prefix": "", "free_kv_cache": True}


def name_map_for(hf_config: Any, layout: str, prefix: str = "") -> NameMap:
    """The name map of the worker's model, from its HF config (family and head_dim)."""
    model_type = getattr(hf_config, "model_type", "")
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        known = ", ".join(sorted(FAMILY_OF_MODEL_TYPE))
        raise InvalidArgument(f"model_type {model_type!r} has no name map (known: {known})", field="model_type")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return NameMap.of(family, layout, head_dim, prefix=prefix)


class WeightsyncTPUWorkerExtension:
    """Mixed into tpu-inference's TPUWorker; `self` is the worker."""

    _weightsync: VllmRollout | None = None
    _weightsync_jax: dict[str, Any] = {}

    def weightsync_attach(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Registers this worker in a session. `init_info` takes InitInfo's fields and an
        optional `jax` dict: `layout` (the state's layout, "tpu_inference"), `mode` ("auto",
        "swap" or "inplace"), `prefix` (before every leaf path), `free_kv_cache` (True)."""
        info = dict(init_info)
        jax_options = {**JAX_DEFAULTS, **info.pop("jax", {})}
        unknown = set(jax_options) - set(JAX_DEFAULTS)
        if unknown:
            raise InvalidArgument(f"unknown option {sorted(unknown)[0]!r}", field="init_info.jax")
        if self._weightsync is not None:
            self._weightsync.close()
        config = self.vllm_config.model_config  # type: ignore[attr-defined]
        name_map = name_map_for(config.hf_config, jax_options["layout"], jax_options["prefix"])
        applier = JaxApplier(
            InPlaceTree(self.get_weights_state()),  # type: ignore[attr-defined]
            name_map,
            mode=jax_options["mode"],
            refresh=self.refresh_model_state_leaves,  # type: ignore[attr-defined]
        )
        self._weightsync_jax = jax_options
        self._weightsync = VllmRollout(InitInfo(**info), None, config, rank=getattr(self, "rank", 0), applier=applier)
        return self._weightsync.status()

    def weightsync_sync(self, version: Any = "latest") -> dict[str, Any]:
        """Pulls, verifies and applies `version` inside the worker's weight-update window;
        returns the SyncResult as a dict (its `apply` holds the mode, pause and HBM peak).
        A version the prefetch already built aside (`weightsync_wait_ready`) is swapped
        in with the KV cache kept: the window is the device check, the swap and the refresh."""
        rollout = self._rollout()
        v = parse_version(version)
        staged = v > 0 and rollout.prefetcher is not None and rollout.prefetcher.status()["staged"] == v
        free = self._weightsync_jax["free_kv_cache"] and not staged
        self.start_weight_update(free_kv_cache=free)  # type: ignore[attr-defined]
        try:
            result = rollout.sync(version)
        finally:
            # a torn engine (an in-place apply failed part way) keeps no KV cache: it cannot serve
            if not self._applier().torn:
                self.finish_weight_update()  # type: ignore[attr-defined]
        return asdict(result)

    def weightsync_prefetch(self, version: Any = "latest") -> dict[str, Any]:
        """Starts pulling and checking `version` while the engine serves; a later
        `weightsync_sync` of it only applies."""
        return self._rollout().prefetch(version)

    def weightsync_wait_ready(self, version: Any = "latest", timeout_s: float = 60.0) -> bool:
        """Waits, while the engine serves, until `version` is pulled, verified and built
        aside on the devices (where the applier swaps; in place it cannot be): call it
        before `weightsync_sync` so the engine pauses for the swap alone."""
        return self._rollout().wait_ready(version, timeout_s)

    def weightsync_audit(self) -> dict[str, Any]:
        """Audits the live leaves on their devices against the version last applied whole
        (design.md "Auditing the served weights"); an `AuditResult` as a dict."""
        return self._rollout().audit()

    def weightsync_provenance(self) -> dict[str, Any]:
        """The weights the worker's state holds: the version and its manifest digest, for
        vLLM's OpenAI server to name on each response (`openai_provenance`)."""
        if self._weightsync is None:
            return {"attached": False}
        return self._weightsync.provenance()

    def weightsync_status(self) -> dict[str, Any]:
        if self._weightsync is None:
            return {"attached": False}
        return {**self._weightsync.status(), "torn": self._applier().torn}

    def weightsync_detach(self) -> None:
        """Stops heartbeats and closes connections (the weights stay as they are)."""
        if self._weightsync is not None:
            self._weightsync.close()
            self._applier().close()
            self._weightsync = None

    def _rollout(self) -> VllmRollout:
        if self._weightsync is None:
            raise FailedPrecondition("weightsync: not attached; call weightsync_attach first", field="attach")
        return self._weightsync

    def _applier(self) -> JaxApplier:
        applier = self._rollout().applier
        assert isinstance(applier, JaxApplier)
        return applier
