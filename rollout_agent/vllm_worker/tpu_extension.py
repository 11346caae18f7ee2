"""Worker extension for vLLM's TPU backend (tpu-inference's `TPUWorker`).

vLLM mixes `worker_extension_cls` into its worker class, so `self` here is the worker. The
extension finds the worker's weight-update contract by what the worker has
(`tpu_contract.updates_of`): tpu-inference 0.32's `start_weight_update(free_kv_cache)`,
`get_weights_state()`, `refresh_model_state_leaves()`, `finish_weight_update()`; or 0.25's
`model_runner.state` (an `nnx.State`), `model_runner.state_leaves` re-derived from it, and
`delete_kv_cache()` / `reinitialize_kv_cache()`. Per version it frees the KV cache (a second
copy of the weights roughly doubles peak HBM; the caller resets the prefix cache), writes
the state, refreshes what the jitted model takes, and gets the KV cache back.

The weights are written out of band: the worker pulls and verifies the version itself,
and a `JaxApplier` builds every leaf in the sharding of the leaf it replaces, checks each
one's bits on the device against the verified host bytes, swaps them in (or replaces them
leaf by leaf where HBM cannot hold two copies) and refreshes. Only plain dicts cross
vLLM's RPCs.

    llm = LLM(model, worker_extension_cls="rollout_agent.tpu_worker_extension.WeightsyncTPUWorkerExtension")
    llm.collective_rpc("weightsync_attach", args=({"coordinator": "unix:/run/ws/c.sock", "session": "job"},))
    llm.reset_prefix_cache()
    llm.collective_rpc("weightsync_sync", args=(7,))

A worker without vLLM's own weight-transfer methods (tpu-inference 0.25's) started with
`weight_transfer_config={"backend": "weightsync"}` also takes vLLM's weight-transfer API
through the extension, as the `weightsync` backend does on GPU and CPU:
`llm.init_weight_transfer_engine({"init_info": {...}})` attaches,
`llm.update_weights({"update_info": {"version": 7}})` syncs and raises when the version
was not applied (the previous weights keep serving), `start_weight_update` and
`finish_weight_update` bracket it. A worker that has those methods (0.32's) keeps its own.

An in-place apply that fails its device check part way leaves the engine holding a mix of
two versions: the extension then does not reallocate the KV cache, so the engine cannot
serve until a version applies whole (`weightsync_sync` again).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rollout_agent.engines.jax.applier import JaxApplier
from rollout_agent.engines.jax.names import NameMap
from rollout_agent.settings import InitInfo
from rollout_agent.vllm_worker.rollout import VllmRollout, parse_version, readiness_of
from rollout_agent.vllm_worker.tpu_contract import LiveState, WeightUpdates, updates_of
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


# vLLM's weight-transfer API, served by the extension on a worker that has none of its own
VLLM_API = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


class WeightsRefused(RuntimeError):
    """`update_weights` (vLLM's API on a 0.25 worker): the version was not applied."""


class WeightsyncTPUWorkerExtension:
    """Mixed into tpu-inference's TPUWorker; `self` is the worker."""

    _weightsync_extension = True  # tpu_contract tells the worker's own methods from these
    _weightsync: VllmRollout | None = None
    _weightsync_jax: dict[str, Any] = {}
    _weightsync_updates: WeightUpdates | None = None

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
        updates = updates_of(self)
        applier = JaxApplier(LiveState(updates), name_map, mode=jax_options["mode"], refresh=updates.refresh)
        self._weightsync_updates = updates
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
        updates = self._weightsync_updates
        assert updates is not None
        updates.start(free)
        try:
            result = rollout.sync(version)
        finally:
            # a torn engine (an in-place apply failed part way) keeps no KV cache: it cannot serve
            if not self._applier().torn:
                updates.finish()
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

    def weightsync_readiness(self) -> dict[str, Any]:
        """Whether the worker serves the session's newest committed version verified, for
        vLLM's server's `GET /weightsync/ready` (`VllmRollout.readiness`); never raises."""
        return readiness_of(self._weightsync, "weightsync_attach was not called")

    def weightsync_status(self) -> dict[str, Any]:
        if self._weightsync is None:
            return {"attached": False}
        updates = self._weightsync_updates
        return {**self._weightsync.status(), "torn": self._applier().torn, "contract": updates and updates.name}

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

    # -- vLLM's weight-transfer API, where the worker has none (tpu-inference 0.25) ----------
    def __getattr__(self, name: str) -> Any:
        """vLLM's `init_weight_transfer_engine`, `start_weight_update`, `update_weights` and
        `finish_weight_update` for a worker whose class has none of them, started with the
        `weightsync` weight-transfer backend (its `collective_rpc` finds them here); any
        other missing attribute stays missing."""
        if name in VLLM_API and _backend(self) == "weightsync":
            return getattr(self, f"_weightsync_api_{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _weightsync_api_init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.weightsync_attach(init_info)

    def _weightsync_api_start_weight_update(self) -> None:
        self._rollout()  # attached, or FailedPrecondition naming init_weight_transfer_engine's part

    def _weightsync_api_update_weights(self, update_info: dict[str, Any]) -> None:
        if not isinstance(update_info, dict):
            raise InvalidArgument(f"must be a dict, got {type(update_info).__name__}", field="update_info")
        result = self.weightsync_sync(update_info.get("version", "latest"))
        if not result["ok"]:
            raise WeightsRefused(f"weightsync refused version {result['version']}, not applied: {result['mismatch']}")

    def _weightsync_api_finish_weight_update(self) -> None:
        """Nothing left: the round completed (or was refused) inside update_weights."""


def _backend(worker: Any) -> str:
    """The weight-transfer backend vLLM was started with ("" without one)."""
    config = worker.__dict__.get("vllm_config")
    transfer = getattr(config, "weight_transfer_config", None)
    return str(getattr(transfer, "backend", "") or "")
