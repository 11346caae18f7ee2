"""The `worker_extension_cls` path callers give vLLM on TPU (docs/jax-applier.md); the class is in
`vllm_worker.tpu_extension`."""

from rollout_agent.vllm_worker.tpu_extension import WeightsyncTPUWorkerExtension

__all__ = ["WeightsyncTPUWorkerExtension"]
