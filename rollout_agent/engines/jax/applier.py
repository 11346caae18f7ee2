"""JaxApplier: the Applier protocol over `JaxApply`, for `sync_version` and the agents.

    holder = WeightsHolder(params)  # the engine reads holder.get()
    applier = JaxApplier(holder, NameMap.of("qwen3", "tpu_inference", head_dim=128))
    sync_version(puller, applier)

`engines.jax.apply` holds the work and imports nothing of the data plane, so a bare JAX
host can run it (bench/apply.py).
"""

from __future__ import annotations

from rollout_agent.engines.applier import Applier
from rollout_agent.engines.jax.audit import JaxAudit


class JaxApplier(JaxAudit, Applier):
    """Applies verified versions into a JAX engine's sharded weights (`JaxApply`), and
    audits them on their devices (`JaxAudit`)."""
