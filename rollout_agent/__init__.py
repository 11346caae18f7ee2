"""The rollout agent: follows a session, pulls and verifies each READY version, applies it
to its engine and closes the handshake; as a sidecar, inside a vLLM worker (the worker
extension) or as a vLLM weight-transfer backend.

Public API (imported on first use; vLLM's modules load only with the vLLM entry points):
`RolloutAgent`, `RolloutConfig`, `WeightPuller`, `PulledVersion`, and for vLLM
`WeightsyncWorkerExtension` and `WeightsyncEngine`. The last imports vLLM: it is listed
only where vLLM is installed, and elsewhere (a JAX-only rollout host) raises an ImportError
naming the extra.
"""

from __future__ import annotations

from weightsync.exports import Extra, available, lazy_exports

_EXPORTS = {
    "RolloutAgent": "rollout_agent.agent",
    "RolloutConfig": "rollout_agent.config",
    "WeightPuller": "rollout_agent.pull.puller",
    "PulledVersion": "rollout_agent.pull.puller",
    "WeightsyncWorkerExtension": "rollout_agent.vllm_worker.extension",
    "WeightsyncEngine": "rollout_agent.vllm_worker.backend",
}
_NEEDS = {"rollout_agent.vllm_worker.backend": Extra("vllm", "vllm")}
__all__ = available(_EXPORTS, _NEEDS)

__getattr__ = lazy_exports(__name__, _EXPORTS, _NEEDS)
