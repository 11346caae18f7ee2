"""The trainer agent: stages a JAX trainer's weights into a shared-memory arena, publishes
versions to the coordinator and serves chunks to rollouts.

Public API (imported on first use, so `python -m trainer_agent --help` stays light):
`WeightPublisher` (the in-trainer publisher) and its `PublisherSettings`, `PublishResult`,
`PublishFuture` and `PublishSuperseded` (what `publish_async` returns, and a skipped version),
`TrainerConfig` (the entry point's flags: PublisherSettings and the synthetic run), the
MaxText converters `convert_maxtext`, `ConvertOptions`, `ModelDims`, and vLLM's trainer-side
engine `WeightsyncTrainerInitInfo`, `WeightsyncTrainerEngine` (importing them registers the
`weightsync` backend with vLLM's `WeightTransferTrainerFactory`). Those two import vLLM:
they are listed only where vLLM is installed, and elsewhere raise an ImportError naming
the extra.
"""

from __future__ import annotations

from weightsync.exports import Extra, available, lazy_exports

_EXPORTS = {
    "WeightPublisher": "trainer_agent.publisher",
    "PublishResult": "trainer_agent.publisher",
    "PublishFuture": "trainer_agent.async_publish",
    "PublishSuperseded": "trainer_agent.async_publish",
    "PublisherSettings": "trainer_agent.settings",
    "TrainerConfig": "trainer_agent.config",
    "convert_maxtext": "trainer_agent.convert",
    "ConvertOptions": "trainer_agent.convert",
    "ModelDims": "trainer_agent.convert",
    "WeightsyncTrainerInitInfo": "trainer_agent.vllm_trainer",
    "WeightsyncTrainerEngine": "trainer_agent.vllm_trainer",
}
_NEEDS = {"trainer_agent.vllm_trainer": Extra("vllm", "vllm")}
__all__ = available(_EXPORTS, _NEEDS)

__getattr__ = lazy_exports(__name__, _EXPORTS, _NEEDS)
