"""vLLM general plugins: `weightsync` registers the weight-transfer backend (and nothing
else); `weightsync-no-inet` lets vLLM start where inet sockets are refused, and only there.

Entry points `vllm.general_plugins: weightsync = rollout_agent.vllm_plugin:register` and
`weightsync-no-inet = rollout_agent.vllm_plugin:no_inet`; only an entry point reaches
vLLM's EngineCore and worker processes.
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


def no_inet() -> None:
    """vLLM's start-up on a host that refuses inet sockets (a TPU VM under gVisor):
    `vllm_worker.no_inet`, applied only there; elsewhere it changes nothing."""
    from rollout_agent.vllm_worker import no_inet

    no_inet.install()
