"""The rollout agent: follows a session, pulls and verifies each READY version, applies it
to its engine and closes the handshake; as a sidecar, inside a vLLM worker (the worker
extension) or as a vLLM weight-transfer backend.

Public API (imported on first use; vLLM's modules load only with the vLLM entry points):
`RolloutAgent`, `RolloutConfig`, `WeightPuller`, `PulledVersion`, and for vLLM
`WeightsyncWorkerExtension` and `WeightsyncEngine`.
"""

from __future__ import annotations

from weightsync.exports import lazy_exports

_EXPORTS = {
    "RolloutAgent": "rollout_agent.agent",
    "RolloutConfig": "rollout_agent.config",
    "WeightPuller": "rollout_agent.puller",
    "PulledVersion": "rollout_agent.puller",
    "WeightsyncWorkerExtension": "rollout_agent.vllm_worker_extension",
    "WeightsyncEngine": "rollout_agent.vllm_backend",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
