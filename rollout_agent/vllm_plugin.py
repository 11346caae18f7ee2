"""vLLM general plugins: `weightsync` registers the weight-transfer backend, and in vLLM's
API server process the provenance its OpenAI responses carry (`openai_provenance`) and
its readiness route, `GET /weightsync/ready` (`ready_route`);
`weightsync-no-inet` lets vLLM start where inet sockets are refused, and only there.

Entry points `vllm.general_plugins: weightsync = rollout_agent.vllm_plugin:register` and
`weightsync-no-inet = rollout_agent.vllm_plugin:no_inet`; only an entry point reaches
vLLM's EngineCore and worker processes.
"""

from __future__ import annotations

import sys

# Modules only vLLM's OpenAI server imports before it loads plugins (`vllm serve`'s, by version).
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


def register() -> None:
    """Registers lazily by module path, and keeps a refused version's tracebacks out of
    vLLM's log (`quiet_refusals`); in vLLM's API server, installs the responses'
    provenance and the readiness route. Safe to call in every process, any number of times."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout_agent.vllm_worker import quiet_refusals

    quiet_refusals.install()
    try:
        WeightTransferEngineFactory.register_engine(
            "weightsync", "rollout_agent.vllm_worker.backend", "WeightsyncEngine"
        )
    except ValueError:
        pass  # already registered in this process
    if any(m in sys.modules for m in SERVER_MODULES):
        from rollout_agent.vllm_worker import openai_provenance, ready_route

        openai_provenance.install()
        ready_route.install()


def no_inet() -> None:
    """vLLM's start-up on a host that refuses inet sockets (a TPU VM under gVisor):
    `vllm_worker.no_inet`, applied only there; elsewhere it changes nothing."""
    from rollout_agent.vllm_worker import no_inet

    no_inet.install()
