"""weightsync's `tpu_inference` name map against the real tpu-inference (0.25, flax_nnx
Qwen3), where it is installed (the TPU kit's closure, `source .tpu-kit/activate-vllm`; JAX
on the CPU is enough): skipped elsewhere, CI included, where the stand-in worker
(devtools/tpu_worker_standin.py) is tested instead.

tpu-inference's own loader reads checkpoint A into its model and, separately, checkpoint B
into another; weightsync then applies B's HF-named tensors into A's live `nnx.State`
through tpu-inference 0.25's worker contract (`tpu_contract.Updates025`). Every leaf must
then equal what tpu-inference's loader made of B, bit for bit, and the runner's
`state_leaves` must be B's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock, patch

import numpy as np
import pytest

pytest.importorskip("tpu_inference", reason="tpu-inference is not installed (the TPU kit's vLLM closure)")
pytest.importorskip("flax.nnx")
# flax, tpu-inference and vLLM warn about their own use of JAX's and torch's APIs
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")


def _load(path: Path) -> Any:
    """tpu-inference's Qwen3ForCausalLM loaded by its own HF loader, split: its nnx.State."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh
    from tpu_inference.distributed.jax_parallel_state import init_pp_distributed_environment
    from tpu_inference.models.jax.qwen3 import Qwen3ForCausalLM
    from vllm.config import ModelConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import LoadConfig, get_model_loader

    config = MagicMock()
    config.model_config = ModelConfig(model=str(path))
    config.model_config.dtype = jnp.bfloat16
    config.cache_config = MagicMock(cache_dtype="auto")
    config.quant_config, config.parallel_config, config.speculative_config = None, None, None
    config.additional_config = {}
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "attn_dp", "expert", "model"))
    init_pp_distributed_environment(ip="", rank=0, world_size=1, device=jax.devices()[0], need_pp=False)
    pp = MagicMock(is_first_rank=True, is_last_rank=True, rank_in_group=0, world_size=1)
    with patch("tpu_inference.models.jax.qwen3.get_pp_group", return_value=pp):
        with jax.set_mesh(mesh):
            model = Qwen3ForCausalLM(config, jax.random.PRNGKey(0), mesh)
        with jax.set_mesh(mesh), set_current_vllm_config(config):
            get_model_loader(LoadConfig(load_format="hf")).load_weights(model, config.model_config)
    return nnx.split(model)[1]


class Worker025:
    """tpu-inference 0.25's TPUWorker as weightsync's contract reads it."""

    def __init__(self, state: Any) -> None:
        import jax

        self.model_runner = MagicMock(state=state, state_leaves=tuple(jax.tree_util.tree_leaves(state)))
        self.events: list[str] = []

    def sync_weights(self, updated_weights: Any, mappings: Any, transpose_keys: Any, reshard_fn: Any = None) -> None:
        raise NotImplementedError

    def delete_kv_cache(self) -> None:
        self.events.append("delete_kv_cache")

    def reinitialize_kv_cache(self) -> None:
        self.events.append("reinitialize_kv_cache")


@pytest.mark.parametrize("mode", ["swap", "inplace"])
def test_a_version_applied_into_tpu_inference_s_state_equals_its_own_loader_s(tmp_path: Path, mode: str) -> None:
    import jax

    from devtools.tpu_vllm_check import SHAPE, make_base, version_of, write_checkpoint
    from rollout_agent.engines.applier import layer_groups
    from rollout_agent.engines.jax.applier import JaxApplier
    from rollout_agent.engines.jax.names import NameMap
    from rollout_agent.engines.jax.targets import named_leaves
    from rollout_agent.vllm_worker.tpu_contract import LiveState, Updates025, updates_of
    from weightsync.manifest import TensorSpec

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = make_base()
    new = version_of(base, 1)
    write_checkpoint(tmp_path / "a", base)
    write_checkpoint(tmp_path / "b", new)
    live, want = _load(tmp_path / "a"), _load(tmp_path / "b")
    worker = Worker025(live)
    updates = updates_of(worker)
    assert isinstance(updates, Updates025)

    names = set(named_leaves(live)[0])
    assert names == set(new)  # the engine's leaves are HF-named (q_proj.weight, lm_head.weight, ...)
    applier = JaxApplier(LiveState(updates), NameMap.of("qwen3", "tpu_inference", SHAPE.head_dim), mode=mode,
                         refresh=updates.refresh)  # fmt: skip
    specs = {n: TensorSpec(n, "bfloat16", a.shape) for n, a in new.items()}
    updates.start(True)
    applier.check(1, specs)
    applier.prepare(1, new)
    applier.begin_update(1, specs)
    for group in layer_groups(new):
        applier.apply([(n, new[n]) for n in group])
    applier.commit_update(1)
    updates.finish()
    assert worker.events == ["delete_kv_cache", "reinitialize_kv_cache"]

    got, expected = named_leaves(worker.model_runner.state)[0], named_leaves(want)[0]
    for name, (_, leaf) in expected.items():
        a, b = np.asarray(got[name][1]), np.asarray(leaf)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), name
    served = worker.model_runner.state_leaves
    assert len(served) == len(expected)
    for a, b in zip(served, jax.tree_util.tree_leaves(want)):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    applier.close()
