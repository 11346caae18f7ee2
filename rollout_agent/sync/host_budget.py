"""A rollout's bound on its own host memory (`host_memory_limit_bytes`), and what it
reports of that memory.

What a rollout adds to its host beyond its engine: the receive buffers a version is
pulled into (one copy of the model, kept between versions: the next pull lands there;
`WeightPuller.growth`), and what the apply stages on the host (`Applier.host_bytes`: cast
or assembled copies; an engine whose weights live in host memory, the new weights). The
host fingerprint the JAX applier checks each leaf against is a few numbers per leaf.
Before a version is pulled, the rollout's private resident memory (RssAnon: the engine's
runtime included) plus what the pull and the apply would add must fit the limit, else
the version is refused before its first byte (RESOURCE_EXHAUSTED, naming the numbers):
the host never runs out of memory mid-pull, and what the rollout serves is untouched.
"""

from __future__ import annotations

from typing import Any

from rollout_agent.engines.applier import Applier
from rollout_agent.pull.puller import WeightPuller
from weightsync.errors import ResourceExhausted
from weightsync.host_memory import host_memory
from weightsync.manifest import Manifest


def check_host_memory(
    puller: WeightPuller, manifest: Manifest, applier: Applier | None, *, aside: bool = False
) -> None:
    """ResourceExhausted (field host_memory_limit_bytes) where pulling and applying
    `manifest` (built `aside` the live weights: an atomic session's) would take this
    process past its limit; nothing where it has none."""
    limit = puller.host_memory_limit_bytes
    if not limit:
        return
    now = host_memory()
    held = now.own
    grow = puller.growth(manifest)
    staging = applier.host_bytes(manifest.tensors, aside=aside) if applier is not None else 0
    if held + grow + staging > limit:
        raise ResourceExhausted(
            f"version {manifest.version} needs {_gib(grow)} GiB more of receive buffers and {_gib(staging)} GiB "
            f"of apply staging; this rollout holds {_gib(held)} GiB of its own "
            f"({'RssAnon' if now.by_kind else 'VmRSS'}) and may hold {_gib(limit)} GiB",
            field="host_memory_limit_bytes",
        )


def memory_status(puller: WeightPuller | None) -> dict[str, Any]:
    """This process's resident memory by kind, the buffers the puller keeps and its limit."""
    out: dict[str, Any] = dict(host_memory().as_dict())
    if puller is not None:
        out["held"] = puller.held()
        out["limit"] = puller.host_memory_limit_bytes
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"
