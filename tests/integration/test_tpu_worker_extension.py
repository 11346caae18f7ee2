"""The TPU worker extension inside a stand-in TPUWorker that holds a real JAX Qwen3 in
tpu-inference's layouts (devtools/tpu_worker_standin.py: vllm-tpu cannot install here).

A trainer publishes HF-named fp32 versions of a transformers Qwen3; the extension pulls,
verifies and applies each one into the worker's live state inside its weight-update
window; the engine's logits then equal transformers' with the same weights to fp32
rounding, which holds only if every transform (heads split and permuted, head_dim padded,
kernels transposed) put every value in its place."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from devtools.tpu_worker_standin import TPUWorker, TPUWorker025, vllm_extended
from rollout_agent.vllm_worker.tpu_contract import Updates025, Updates032, updates_of
from rollout_agent.vllm_worker.tpu_extension import WeightsyncTPUWorkerExtension
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.errors import FailedPrecondition, InvalidArgument
from weightsync.server import RunningServer

TOKENS = np.array([[1, 5, 9, 200, 17, 3, 44, 101], [7, 7, 250, 2, 90, 12, 64, 33]], np.int64)


Worker = vllm_extended(TPUWorker, WeightsyncTPUWorkerExtension)


def _config(tied: bool) -> Any:
    import transformers

    return transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=tied, torch_dtype="float32",
    )  # fmt: skip


def _hf_model(config: Any, seed: int) -> tuple[Any, dict[str, np.ndarray]]:
    """A transformers Qwen3 with random weights (norms too), and its HF-named fp32 tensors."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    tensors = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return model, tensors


def _hf_logits(model: Any) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


@pytest.fixture
def worker() -> Iterator[Any]:
    import jax

    from rollout_agent.engines.jax.model import mesh_of

    made: list[Any] = []

    def make(tied: bool) -> Any:
        made.append(Worker(_config(tied), mesh_of((1, len(jax.devices())))))
        return made[-1]

    yield make  # type: ignore[misc]
    for w in made:
        w.weightsync_detach()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("mode", ["swap", "inplace"])
def test_versions_applied_through_the_extension_serve_transformers_logits(
    inprocess_coordinator: RunningServer, worker: Any, no_arena_leak: None, mode: str, tied: bool
) -> None:
    engine: Any = worker(tied)
    address = inprocess_coordinator.address
    with WeightPublisher(PublisherSettings(coordinator=address, session="job", chunk_bytes=65536)) as pub:
        status = engine.weightsync_attach(
            {"coordinator": address, "session": "job", "agent_id": "tpu-r0", "jax": {"mode": mode}}
        )
        assert status["agent_id"] == "tpu-r0" and status["current_version"] == 0
        served: list[np.ndarray] = []
        for v, seed in ((1, 11), (2, 12)):
            model, tensors = _hf_model(_config(tied), seed)
            pub.publish(tensors, v)
            engine.events.clear()
            result = engine.weightsync_sync(v)
            assert result["ok"], result["mismatch"]
            assert pub.wait_committed(v, 30) == "COMMITTED"
            assert result["apply"]["mode"] == mode and result["apply"]["version"] == v
            # the KV cache freed for the update, the jitted model re-pointed, the cache back
            assert engine.events == [
                "start_weight_update(free_kv_cache=True)", "refresh_model_state_leaves", "finish_weight_update"
            ]  # fmt: skip
            want = _hf_logits(model)
            got = engine.compute_logits(TOKENS)
            scale = float(np.abs(want).max())
            assert np.abs(got - want).max() <= 1e-5 * max(scale, 1.0), (np.abs(got - want).max(), scale)
            assert not served or np.abs(got - served[-1]).max() > 0.1 * scale  # the new version, not the old
            served.append(got)
            found = engine.weightsync_audit()  # the live leaves, on their devices, are the version
            assert found["exact"] and found["version"] == str(v) and found["tensors"] == len(tensors), found
        assert engine.weightsync_status()["current_version"] == 2 and not engine.weightsync_status()["torn"]
        held = {"session": "job", "agent_id": "tpu-r0", "version": 2, "manifest_digest": result["manifest_digest"]}
        assert len(result["manifest_digest"]) == 64 and engine.weightsync_provenance() == held


def test_the_engine_serves_the_leaves_of_its_last_refresh(worker: Any) -> None:
    """Why the extension refreshes: the jitted model takes the leaves it was last given."""
    engine: Any = worker(False)
    before = engine.compute_logits(TOKENS)
    state = engine.get_weights_state()
    state["model"]["norm"]["weight"] = state["model"]["norm"]["weight"] * 0 + 2.0
    assert np.array_equal(engine.compute_logits(TOKENS), before)
    engine.refresh_model_state_leaves()
    assert not np.array_equal(engine.compute_logits(TOKENS), before) or not before.any()
    engine.start_weight_update(free_kv_cache=True)
    with pytest.raises(RuntimeError, match="KV cache is freed"):
        engine.compute_logits(TOKENS)
    engine.finish_weight_update()


def test_a_misdeclared_attach_is_refused_by_field(worker: Any) -> None:
    engine: Any = worker(False)
    with pytest.raises(FailedPrecondition, match="not attached"):
        engine.weightsync_sync(1)
    with pytest.raises(InvalidArgument) as e:
        engine.weightsync_attach({"coordinator": "127.0.0.1:1", "session": "job", "jax": {"layuot": "hf"}})
    assert e.value.field == "init_info.jax" and "layuot" in e.value.message
    engine.vllm_config.model_config.hf_config.model_type = "mistral"
    with pytest.raises(InvalidArgument) as e:
        engine.weightsync_attach({"coordinator": "127.0.0.1:1", "session": "job"})
    assert e.value.field == "model_type" and "mistral" in e.value.message


@pytest.mark.parametrize("mode", ["swap", "inplace"])
def test_a_version_built_aside_swaps_in_with_the_kv_cache_kept(
    inprocess_coordinator: RunningServer, worker: Any, no_arena_leak: None, mode: str
) -> None:
    """`weightsync_wait_ready` returns once the prefetch pulled, verified and (swapping)
    built the version on the devices while the engine served the old one; the sync then
    keeps the KV cache (no room to make) and only swaps and refreshes. In place nothing
    can be built aside: the sync frees the cache and writes the live leaves."""
    engine: Any = worker(False)
    address = inprocess_coordinator.address
    with WeightPublisher(PublisherSettings(coordinator=address, session="job", chunk_bytes=65536)) as pub:
        engine.weightsync_attach(
            {"coordinator": address, "session": "job", "agent_id": "tpu-r0", "jax": {"mode": mode}}
        )
        before = engine.compute_logits(TOKENS)
        model, tensors = _hf_model(_config(False), 21)
        pub.publish(tensors, 1)
        assert engine.weightsync_wait_ready(1, 30)
        status = engine.weightsync_status()
        assert status["prefetch"]["ready"] == 1 and status["prefetch"]["staged"] == (1 if mode == "swap" else 0)
        assert np.array_equal(engine.compute_logits(TOKENS), before)  # the engine serves the old weights meanwhile
        engine.events.clear()
        result = engine.weightsync_sync(1)
        assert result["ok"], result["mismatch"]
        assert engine.events == [
            f"start_weight_update(free_kv_cache={mode == 'inplace'})", "refresh_model_state_leaves",
            "finish_weight_update",
        ]  # fmt: skip
        want = _hf_logits(model)
        assert np.abs(engine.compute_logits(TOKENS) - want).max() <= 1e-5 * max(float(np.abs(want).max()), 1.0)
        assert engine.weightsync_status()["host_memory"]["held"]["receive"] > 0
        pub.publish(_hf_model(_config(False), 22)[1], 2)
        engine.events.clear()
        assert engine.weightsync_sync("latest")["ok"]  # not known to be built aside: the cache is freed for room
        assert engine.events[0] == "start_weight_update(free_kv_cache=True)"


# -- tpu-inference 0.25's contract (the release on the v5e host) ---------------------------
Worker025 = vllm_extended(TPUWorker025, WeightsyncTPUWorkerExtension)


def _config128(tied: bool = False) -> Any:
    """head_dim 128: 0.25 pads no norm, so only an unpadded head_dim loads there."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=tied, torch_dtype="float32",
    )  # fmt: skip


@pytest.fixture
def worker025() -> Iterator[Any]:
    import jax

    from rollout_agent.engines.jax.model import mesh_of

    made: list[Any] = []

    def make(backend: str = "") -> Any:
        made.append(Worker025(_config128(), mesh_of((1, len(jax.devices())))))
        if backend:
            made[-1].vllm_config.weight_transfer_config = SimpleNamespace(backend=backend)
        return made[-1]

    yield make
    for w in made:
        w.weightsync_detach()


def test_the_contract_is_found_by_what_the_worker_has(worker: Any, worker025: Any) -> None:
    assert isinstance(updates_of(worker(False)), Updates032)
    assert isinstance(updates_of(worker025()), Updates025)

    class Bare(WeightsyncTPUWorkerExtension):
        vllm_config = None

    with pytest.raises(FailedPrecondition, match="neither tpu-inference 0.32's"):
        updates_of(Bare())


def test_a_head_dim_0_25_would_pad_is_refused_by_its_stand_in() -> None:
    import jax

    from rollout_agent.engines.jax.model import mesh_of

    with pytest.raises(ValueError, match=r"k_norm.weight': torch \(32,\) vs jax \(128,\)"):
        TPUWorker025(_config(False), mesh_of((1, len(jax.devices()))))


@pytest.mark.parametrize("mode", ["swap", "inplace"])
def test_versions_apply_into_the_0_25_runner_state_and_its_leaves(
    inprocess_coordinator: RunningServer, worker025: Any, no_arena_leak: None, mode: str
) -> None:
    """The state written where it is, `state_leaves` (what the jitted model takes) derived
    again, the KV cache deleted and reinitialized: the engine then serves transformers'
    logits of each version."""
    engine: Worker025 = worker025()
    address = inprocess_coordinator.address
    with WeightPublisher(PublisherSettings(coordinator=address, session="job", chunk_bytes=65536)) as pub:
        engine.weightsync_attach(
            {"coordinator": address, "session": "job", "agent_id": "tpu-r0", "jax": {"mode": mode}}
        )
        assert "0.25" in engine.weightsync_status()["contract"]
        for v, seed in ((1, 31), (2, 32)):
            model, tensors = _hf_model(_config128(), seed)
            pub.publish(tensors, v)
            engine.events.clear()
            leaves_before = engine.model_runner.state_leaves
            result = engine.weightsync_sync(v)
            assert result["ok"], result["mismatch"]
            assert engine.events == ["delete_kv_cache", "reinitialize_kv_cache"]
            assert engine.model_runner.state_leaves is not leaves_before
            want = _hf_logits(model)
            got = engine.compute_logits(TOKENS)
            assert np.abs(got - want).max() <= 1e-5 * max(float(np.abs(want).max()), 1.0)
            assert engine.weightsync_audit()["exact"]


def test_vllm_s_weight_transfer_api_on_a_0_25_worker(
    inprocess_coordinator: RunningServer, worker025: Any, no_arena_leak: None
) -> None:
    """Started with the `weightsync` backend, a worker without vLLM's weight-transfer methods
    takes them from the extension: a version applies; one a loader would refuse (q_proj a
    row short) raises, and the engine serves the version before it."""
    from rollout_agent.vllm_worker.tpu_extension import WeightsRefused

    assert not hasattr(worker025(), "update_weights")  # no backend: vLLM's API stays missing
    engine: Worker025 = worker025("weightsync")
    address = inprocess_coordinator.address
    with WeightPublisher(PublisherSettings(coordinator=address, session="job", chunk_bytes=65536)) as pub:
        engine.init_weight_transfer_engine({"coordinator": address, "session": "job", "agent_id": "tpu-r0"})
        model, tensors = _hf_model(_config128(), 41)
        pub.publish(tensors, 1)
        engine.start_weight_update()
        engine.update_weights({"version": 1})
        engine.finish_weight_update()
        served = engine.compute_logits(TOKENS)
        assert np.abs(served - _hf_logits(model)).max() <= 1e-5 * max(float(np.abs(served).max()), 1.0)
        bad = dict(_hf_model(_config128(), 42)[1])
        bad["model.layers.1.self_attn.q_proj.weight"] = bad["model.layers.1.self_attn.q_proj.weight"][:-1]
        pub.publish(bad, 2)
        engine.start_weight_update()
        with pytest.raises(WeightsRefused, match="q_proj"):
            engine.update_weights({"version": 2})
        assert np.array_equal(engine.compute_logits(TOKENS), served)
        assert engine.weightsync_audit()["exact"] and engine.weightsync_status()["current_version"] == 1
