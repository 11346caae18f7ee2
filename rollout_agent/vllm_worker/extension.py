"""Worker extension for callers that use `worker_extension_cls` + `collective_rpc`.

llm = LLM(model, worker_extension_cls="rollout_agent.vllm_worker_extension.WeightsyncWorkerExtension")
llm.collective_rpc("weightsync_attach", args=({"coordinator": ..., "session": ...},))
llm.collective_rpc("weightsync_sync", args=(7,))   # plain dicts come back
llm.reset_prefix_cache()

Beside the weight-transfer backend (`--weight-transfer-config '{"backend": "weightsync"}'`),
`weightsync_ready` answers for the backend's own rollout: a trainer asks it, through vLLM's
dev-mode `/collective_rpc`, whether the workers hold a version verified before it pauses
the engine to apply it (`trainer_agent.vllm_trainer.WeightsyncTrainerEngine.wait_prefetched`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rollout_agent.settings import InitInfo
from rollout_agent.vllm_worker.rollout import VllmRollout, readiness_of, worker_index


class WeightsyncWorkerExtension:
    """Mixed into the vLLM worker class; `self` is the worker."""

    _weightsync: VllmRollout | None = None

    def weightsync_attach(self, init_info: dict[str, Any]) -> dict[str, Any]:
        if self._weightsync is not None:
            self._weightsync.close()
        model = self.model_runner.model  # type: ignore[attr-defined]
        config = self.vllm_config.model_config  # type: ignore[attr-defined]
        index = worker_index(self.vllm_config.parallel_config)  # type: ignore[attr-defined]
        self._weightsync = VllmRollout(InitInfo(**init_info), model, config, rank=index)
        return self._weightsync.status()

    def weightsync_sync(self, version: Any = "latest") -> dict[str, Any]:
        if self._weightsync is None:
            raise RuntimeError("weightsync: not attached; call weightsync_attach first")
        return asdict(self._weightsync.sync(version))

    def weightsync_prefetch(self, version: Any = "latest") -> dict[str, Any]:
        """Starts pulling and checking `version` in this worker's background thread while
        the engine serves; a later `weightsync_sync` of it only applies."""
        if self._weightsync is None:
            raise RuntimeError("weightsync: not attached; call weightsync_attach first")
        return self._weightsync.prefetch(version)

    def weightsync_ready(self, version: Any, timeout_s: Any = 0) -> dict[str, Any]:
        """Whether this worker holds `version` (or a newer one) pulled and verified, so that
        its update only applies; asks for it first. Waits up to `timeout_s` (0: answers at
        once; the engine runs no step while a call waits). Strings are taken too (vLLM's
        `/collective_rpc` passes only strings). The rollout attached here, else the
        weight-transfer backend's."""
        rollout = self._rollout()
        if rollout is None:
            raise RuntimeError("weightsync: neither attached nor initialized; call init_weight_transfer_engine first")
        ready = rollout.wait_ready(version, float(timeout_s))
        prefetch = rollout.prefetcher is not None  # without one nothing is ever held ahead of an update
        return {"agent_id": rollout.agent_id, "version": version, "ready": ready, "prefetch": prefetch}

    def weightsync_provenance(self) -> dict[str, Any]:
        """The weights this worker's engine holds: the version and its manifest digest
        (`VllmRollout.provenance`; version 0 and no digest before one was applied). vLLM's
        OpenAI server asks every worker when a weight-version label is set, to name the
        version and digest on each response (`openai_provenance`). The rollout attached
        here, else the weight-transfer backend's; `{"attached": False}` without either."""
        rollout = self._rollout()
        return rollout.provenance() if rollout is not None else {"attached": False}

    def _rollout(self) -> VllmRollout | None:
        """The rollout attached here, else the weight-transfer backend's (None: neither)."""
        if self._weightsync is not None:
            return self._weightsync
        return getattr(getattr(self, "weight_transfer_engine", None), "rollout", None)

    def weightsync_readiness(self) -> dict[str, Any]:
        """Whether this worker serves the session's newest committed version verified
        (`VllmRollout.readiness`), for vLLM's server's `GET /weightsync/ready`
        (`ready_route`); `{"ready": False, ...}` saying why where no rollout is attached.
        Never raises: vLLM 0.32 queues the replies after a failed one for the next call."""
        return readiness_of(self._rollout(), "init_weight_transfer_engine was not called")

    def weightsync_audit(self) -> dict[str, Any]:
        """Audits the weights this worker's engine serves against the version it was last
        given whole (its own tensor-parallel shard); an `AuditResult` as a dict."""
        if self._weightsync is None:
            raise RuntimeError("weightsync: not attached; call weightsync_attach first")
        return self._weightsync.audit()

    def weightsync_detach(self) -> None:
        """Stops heartbeats and closes connections (the weights stay as they are)."""
        if self._weightsync is not None:
            self._weightsync.close()
            self._weightsync = None

    def weightsync_status(self) -> dict[str, Any]:
        return self._weightsync.status() if self._weightsync is not None else {"attached": False}
