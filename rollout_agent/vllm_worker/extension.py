"""Worker extension for callers that use `worker_extension_cls` + `collective_rpc`.

llm = LLM(model, worker_extension_cls="rollout_agent.vllm_worker_extension.WeightsyncWorkerExtension")
llm.collective_rpc("weightsync_attach", args=({"coordinator": ..., "session": ...},))
llm.collective_rpc("weightsync_sync", args=(7,))   # plain dicts come back
llm.reset_prefix_cache()
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rollout_agent.settings import InitInfo
from rollout_agent.vllm_worker.rollout import VllmRollout, worker_index


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
