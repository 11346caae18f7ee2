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

Its rooms, each importing only those below it (the import contracts in pyproject.toml):

- `__main__` and `config` (`TrainerConfig`, its flags): the entry point; `vllm/`: vLLM's
  trainer-side engine (`engine`; `trainer_agent.vllm_trainer` is that module).
- `publish/`: the publish, step by step. `publisher` runs the others in this order, and none
  imports it:
  - `publisher`: `WeightPublisher`, the facade: start and close, the publish calls, one publish at a time.
  - `stage_plan`: a publish's staging path and layout, planned before a slot is claimed, and its run.
  - `slots`: plan the slot: an arena slot claimed for a version, the version it held released.
  - `staged_part`: stage: the parameters in their slot as a `StagedPart`, with a delta where one pays.
  - `seal`: seal: a staged part's fs store copy, its slot served, and the `Part` that describes it.
  - `send`: send: the part to the coordinator, again while a failure may pass; `PublishResult`.
  - `session_link`: the rank's standing in its session: attach, heartbeat, leave, fencing.
  - `retry`: what a publish tries again, and for how long.
  - `commit_wait`: waiting for a version to end, and who it waits for where it does not.
  - `async_publish`: `publish_async`'s background worker (latest wins) and what it holds.
- `serve/`: `arena`, the shared-memory arena split into slots; `chunk_server`, the slot
  table, the TrainerAgent servicer and the chunk servers over them; `store_leftovers`, fs
  store parts a replaced trainer left behind.
- `settings`: `PublisherSettings`.
- `device/`: device arrays to host blocks. `device_blocks`: arrays cut into blocks, copied
  to the host through a window; `snapshot`: an on-device copy of a tree; `d2h_thread`: the
  process's one device-to-host thread; `staging_pool`: the device path's staging threads;
  `host_heap`: glibc's malloc, seen and steered (the only module that calls into the C
  library).
- `stage/`: a parameter tree into a slot. `params`: from a tree to host shards, and which
  staging path a publish takes; `torch_tensors`: torch tensors as host arrays; `cut_array`:
  what a snapshot holds of an array, already cut into the device path's blocks; `staging`:
  host shards into their places in a slot as a `Layout` planned them; `stream_staging`: a
  stream of unknown length staged in arrival order; `ffi_staging`: the JAX FFI path, XLA's
  own buffers handed to the shim; `delta`: a staged version's changed chunks, a `PartDelta`.
- `convert/`: MaxText -> HF converters; `synthetic`, `update_model`: the entry point's
  example model and its update.
"""

from __future__ import annotations

from weightsync.exports import Extra, available, lazy_exports

_EXPORTS = {
    "WeightPublisher": "trainer_agent.publish.publisher",
    "PublishResult": "trainer_agent.publish.publisher",
    "PublishFuture": "trainer_agent.publish.async_publish",
    "PublishSuperseded": "trainer_agent.publish.async_publish",
    "PublisherSettings": "trainer_agent.settings",
    "TrainerConfig": "trainer_agent.config",
    "convert_maxtext": "trainer_agent.convert",
    "ConvertOptions": "trainer_agent.convert",
    "ModelDims": "trainer_agent.convert",
    "WeightsyncTrainerInitInfo": "trainer_agent.vllm.engine",
    "WeightsyncTrainerEngine": "trainer_agent.vllm.engine",
}
_NEEDS = {"trainer_agent.vllm.engine": Extra("vllm", "vllm")}
__all__ = available(_EXPORTS, _NEEDS)

__getattr__ = lazy_exports(__name__, _EXPORTS, _NEEDS)
