"""The `worker_extension_cls` path callers give vLLM (docs/api.md); the class is in `vllm_worker.extension`."""

from rollout_agent.vllm_worker.extension import WeightsyncWorkerExtension

__all__ = ["WeightsyncWorkerExtension"]
