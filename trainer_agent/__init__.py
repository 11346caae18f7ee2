"""The trainer agent: stages a JAX trainer's weights into a shared-memory arena, publishes
versions to the coordinator and serves chunks to rollouts.

Public API (imported on first use, so `python -m trainer_agent --help` stays light):
`WeightPublisher` (the in-trainer publisher), `PublishResult`, `TrainerConfig`, and the
MaxText converters `convert_maxtext`, `ConvertOptions`, `ModelDims`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "WeightPublisher": "trainer_agent.publisher",
    "PublishResult": "trainer_agent.publisher",
    "TrainerConfig": "trainer_agent.config",
    "convert_maxtext": "trainer_agent.convert",
    "ConvertOptions": "trainer_agent.convert",
    "ModelDims": "trainer_agent.convert",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
