"""The README's and docs' trainer examples, run as written against a real coordinator with
a rollout sidecar following the session: every step commits, and the rollout applied the
last step's arrays bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from devtools.cluster import Cluster
from tests.doc_snippets import snippet
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.server import RunningServer

CPU = jax.devices("cpu")[0]
SESSION = "my-job"  # the examples' session
N_STEPS = 3
SHAPES = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 128),
    "model.norm.weight": (64,),
}


def _params() -> dict[str, jax.Array]:
    with jax.default_device(CPU):
        keys = jax.random.split(jax.random.key(0), len(SHAPES))
        return {name: jax.random.normal(k, shape, jnp.float32) for k, (name, shape) in zip(keys, SHAPES.items())}


def _applied(dump: Path, version: int) -> dict[str, np.ndarray]:
    return load_file(str(dump / f"v{version}.safetensors"))


def _as_served(params: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.astype(jnp.bfloat16)) for k, v in params.items()}


def _run(name: str, coordinator: RunningServer, cluster: Cluster, dump: Path, **names: Any) -> dict[str, Any]:
    """Starts a following rollout, runs snippet `name` with `names` defined, checks every
    step committed; returns the snippet's variables."""
    code = snippet(name, coordinator.address)
    assert f'"{SESSION}"' in code, f"the example publishes under another session than {SESSION!r}"
    cluster.start_rollout("rollout-0", coordinator.address, SESSION, ["--dump-dir", str(dump)])
    scope: dict[str, Any] = {"n_steps": N_STEPS, **names}
    exec(code, scope)  # noqa: S102 - the documented example, as written
    with CoordinatorClient(coordinator.address) as client:
        versions = client.status(SESSION).versions
        states = {v.version: client.wait_for_version(SESSION, v.version, timeout_s=60).state for v in versions}
    assert N_STEPS in states and set(states.values()) == {tpb.COMMITTED}, states
    return scope


def test_the_readme_trainer_example_publishes_every_step_and_the_rollout_applies_it(
    inprocess_coordinator: RunningServer, cluster: Cluster, tmp_path: Path
) -> None:
    step = jax.jit(lambda p: {k: v * 0.5 + 1.0 for k, v in p.items()})
    scope = _run("trainer", inprocess_coordinator, cluster, tmp_path / "dump", params=_params(), train_step=step)
    want = _as_served(scope["params"])
    got = _applied(tmp_path / "dump", N_STEPS)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


def test_the_publish_async_example_publishes_off_a_donating_step(
    inprocess_coordinator: RunningServer, cluster: Cluster, tmp_path: Path
) -> None:
    def sgd(params: Any, opt_state: Any, batch: jax.Array) -> tuple[Any, Any]:
        grads = {k: v * batch for k, v in params.items()}
        opt_state = {k: 0.9 * opt_state[k] + g for k, g in grads.items()}
        return {k: v - 0.01 * opt_state[k] for k, v in params.items()}, opt_state

    params = _params()
    with jax.default_device(CPU):
        opt_state = {k: jnp.zeros_like(v) for k, v in params.items()}
        batch = jnp.float32(0.5)
    step = jax.jit(sgd, donate_argnums=(0, 1))
    scope = _run(
        "trainer-async", inprocess_coordinator, cluster, tmp_path / "dump",
        params=params, opt_state=opt_state, batch=batch, train_step=step,
    )  # fmt: skip
    want = _as_served(scope["params"])
    got = _applied(tmp_path / "dump", N_STEPS)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
    assert all(v.is_deleted() for v in params.values()), "the example's step donates its inputs"
