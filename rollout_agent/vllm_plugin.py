"""vLLM general plugin: registers the `weightsync` weight-transfer backend (and nothing else).

Entry point `vllm.general_plugins: weightsync = rollout_agent.vllm_plugin:register`; only
an entry point reaches vLLM's EngineCore and worker processes.
"""

from __future__ import annotations


def register() -> None:
    """Registers lazily by module path, and keeps a refused version's tracebacks out of
    vLLM's log (`quiet_refusals`); safe to call in every process, any number of times."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout_agent.vllm_worker import quiet_refusals

    quiet_refusals.install()
    try:
        WeightTransferEngineFactory.register_engine(
            "weightsync", "rollout_agent.vllm_worker.backend", "WeightsyncEngine"
        )
    except ValueError:
        pass  # already registered in this process
