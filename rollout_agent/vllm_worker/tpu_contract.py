"""A tpu-inference worker's weight-update contract, found by what the worker has.

tpu-inference releases differ in how an RL framework writes a worker's weights:

- 0.32 (`Updates032`): the worker has `start_weight_update(free_kv_cache)`,
  `get_weights_state()`, `refresh_model_state_leaves()` and `finish_weight_update()`;
- 0.25 (`Updates025`, the release that runs on Python 3.11 with jax 0.10.2): the worker has
  `sync_weights(updated_weights, mappings, transpose_keys, reshard_fn=None)`, which calls
  `model_runner._sync_weights`: that writes into `model_runner.state` (an `nnx.State` of
  sharded `jax.Array`s) and then re-derives `model_runner.state_leaves`, the flat tuple the
  jitted model takes, from it. The worker also has `delete_kv_cache()` and
  `reinitialize_kv_cache()`.

Both give the extension the same four steps: `start(free_kv_cache)`, `state()` (the live
tree, read again at every use: a `sync_weights` of another caller may replace it),
`refresh()` and `finish()`. The release is never read from a version number.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from rollout_agent.engines.jax.targets import InPlaceTree
from weightsync.errors import FailedPrecondition

CONTRACT_032 = ("start_weight_update", "get_weights_state", "refresh_model_state_leaves", "finish_weight_update")
CONTRACT_025 = ("sync_weights", "delete_kv_cache", "reinitialize_kv_cache")


class WeightUpdates(Protocol):
    """A worker's weight-update steps, as the extension calls them."""

    name: str

    def start(self, free_kv_cache: bool) -> None: ...

    def state(self) -> Any: ...

    def refresh(self) -> None: ...

    def finish(self) -> None: ...


class Updates032:
    """tpu-inference 0.32's TPUWorker: its own four methods."""

    name = "tpu_inference>=0.32: start_weight_update/get_weights_state/refresh_model_state_leaves/finish_weight_update"

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def start(self, free_kv_cache: bool) -> None:
        self.worker.start_weight_update(free_kv_cache=free_kv_cache)

    def state(self) -> Any:
        return self.worker.get_weights_state()

    def refresh(self) -> None:
        self.worker.refresh_model_state_leaves()

    def finish(self) -> None:
        self.worker.finish_weight_update()


class Updates025:
    """tpu-inference 0.25's TPUWorker: the model runner's `state` written where it is, and
    `state_leaves` re-derived from it as `TPUModelRunner._sync_weights` does; the KV cache
    deleted and reinitialized through the worker."""

    name = "tpu_inference 0.25: model_runner.state, state_leaves, delete_kv_cache/reinitialize_kv_cache"

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.freed = False

    def start(self, free_kv_cache: bool) -> None:
        if free_kv_cache:
            self.worker.delete_kv_cache()
            self.freed = True

    def state(self) -> Any:
        return self.worker.model_runner.state

    def refresh(self) -> None:
        runner = self.worker.model_runner
        runner.state_leaves = leaves_of(runner.state)

    def finish(self) -> None:
        if self.freed:
            self.worker.reinitialize_kv_cache()
            self.freed = False


def leaves_of(state: Any) -> Any:
    """What `TPUModelRunner._sync_weights` (0.25) sets `state_leaves` to: the flat tuple of
    an `nnx.State`'s leaves (the jitted model rebuilds the state from them), or the state
    itself (a dict of torchax-path params)."""
    try:
        from flax import nnx
    except ImportError:  # no Flax: no nnx.State either
        nnx = None
    if nnx is not None and isinstance(state, nnx.State):
        return tuple(jax.tree_util.tree_leaves(state))
    if type(state) is dict:
        return state
    return tuple(jax.tree_util.tree_leaves(state))  # an nnx.State's stand-in (devtools/tpu_worker_standin.State)


def _has(worker: Any, names: tuple[str, ...]) -> bool:
    """Whether the worker's own classes (not the extension mixed into them) have every
    method. The flag is read from each class's own namespace: vLLM appends the extension to
    the worker class's bases, so the worker's class inherits the flag it must not be judged by."""
    own = [c for c in type(worker).__mro__ if not c.__dict__.get("_weightsync_extension", False)]
    return all(any(callable(c.__dict__.get(n)) for c in own) for n in names)


def updates_of(worker: Any) -> WeightUpdates:
    """The worker's contract, by the methods it has (0.32's first).

    Raises:
        FailedPrecondition: the worker has neither contract.
    """
    if _has(worker, CONTRACT_032):
        return Updates032(worker)
    if _has(worker, CONTRACT_025) and hasattr(getattr(worker, "model_runner", None), "state"):
        return Updates025(worker)
    raise FailedPrecondition(
        f"{type(worker).__name__} has neither tpu-inference 0.32's weight-update methods ({', '.join(CONTRACT_032)}) "
        f"nor 0.25's ({', '.join(CONTRACT_025)} and model_runner.state)",
        field="worker",
    )


class LiveState:
    """The applier's target: the contract's state read again at every use, written in place
    (`engines.jax.targets.InPlaceTree`)."""

    def __init__(self, updates: WeightUpdates) -> None:
        self.updates = updates

    def leaves(self) -> dict[str, Any]:
        return InPlaceTree(self.updates.state()).leaves()

    def replace(self, new: Any) -> None:
        InPlaceTree(self.updates.state()).replace(new)
