"""Torch tensors published (a mapping, and a planned stream) and pulled back bit-exactly,
against an in-process coordinator."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rollout_agent.engines.dict_applier import DictApplier  # noqa: E402
from rollout_agent.pull.puller import WeightPuller  # noqa: E402
from rollout_agent.sync.round import sync_version  # noqa: E402
from trainer_agent.publish.publisher import WeightPublisher  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from weightsync.client import CoordinatorClient  # noqa: E402
from weightsync.errors import InvalidArgument  # noqa: E402
from weightsync.server import RunningServer  # noqa: E402


def _model(seed: int) -> dict[str, torch.Tensor]:
    """What a trainer's named_parameters() hold: leaves that require grad, bf16 and fp16 and
    fp32, one non-contiguous (a transposed view)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).bfloat16().requires_grad_(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).bfloat16().t(),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).half().requires_grad_(),
        "model.norm.weight": torch.randn(32, generator=g, requires_grad=True),
    }


def _bits(a: np.ndarray | torch.Tensor) -> bytes:
    if isinstance(a, torch.Tensor):
        a = torch.empty(a.shape, dtype=a.dtype).copy_(a.detach())
        return a.reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(a).tobytes()


@pytest.fixture
def rollout(inprocess_coordinator: RunningServer) -> Iterator[tuple[CoordinatorClient, str]]:
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    yield client, inprocess_coordinator.address
    client.close()


def _pull(client: CoordinatorClient, pub: WeightPublisher, version: int) -> tuple[DictApplier, object]:
    client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
    applier = DictApplier()
    puller = WeightPuller(client, "job", "r0", window_chunks=4)
    try:
        outcome = sync_version(puller, applier, version)
    finally:
        puller.close()
    assert outcome.ok, outcome.mismatch
    return applier, outcome


def test_torch_tensors_publish_and_stream_bit_exactly(
    rollout: tuple[CoordinatorClient, str], no_arena_leak: None
) -> None:
    client, address = rollout
    settings = PublisherSettings(coordinator=address, session="job", chunk_bytes=4096, delta="auto")
    with WeightPublisher(settings) as pub:
        first = _model(1)
        pub.publish(first, 1)  # the host path: views of the tensors, no copy
        assert pub.last_path in ("native", "python", "host+delta")
        applier, _ = _pull(client, pub, 1)
        for name, t in first.items():
            assert applier.weights[name].shape == tuple(t.shape)
            assert _bits(applier.weights[name]) == _bits(t), name
        for v in (2, 3):
            model = _model(2)
            if v == 3:  # an RL-sized step: one tensor changed
                with torch.no_grad():
                    model["model.norm.weight"].add_(1.0)
            specs = [(n, t.dtype, tuple(t.shape)) for n, t in model.items()]
            result = pub.publish_stream(iter(model.items()), v, specs=specs)
            assert result.state == "READY" and pub.last_path.startswith("device")
            if v == 3:  # the same layout as version 2, which the rollout holds: a delta
                assert result.delta_base == 2 and 0 < result.delta_bytes
            applier, _ = _pull(client, pub, v)
            for name, t in model.items():
                assert _bits(applier.weights[name]) == _bits(t), (v, name)


def test_a_stream_that_leaves_its_specs_publishes_nothing(
    rollout: tuple[CoordinatorClient, str], no_arena_leak: None
) -> None:
    client, address = rollout
    with WeightPublisher(PublisherSettings(coordinator=address, session="job", chunk_bytes=4096)) as pub:
        model = _model(1)
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in model.items()]
        wrong = dict(model, **{"model.norm.weight": torch.zeros(16)})
        said = r"params\['model.norm.weight'\]: item 3 is 'model.norm.weight' \[16\]"
        with pytest.raises(InvalidArgument, match=said):
            pub.publish_stream(iter(wrong.items()), 1, specs=specs)
        assert not [v for v in client.status("job").versions if v.version == 1]
        pub.publish_stream(iter(model.items()), 1, specs=specs)  # the same version, its slot reused
        applier, _ = _pull(client, pub, 1)
        assert _bits(applier.weights["model.norm.weight"]) == _bits(model["model.norm.weight"])


def test_a_stream_holds_a_window_of_tensors_not_the_model(
    rollout: tuple[CoordinatorClient, str], no_arena_leak: None
) -> None:
    """Tensors a source materializes one at a time (FSDP's full_tensor(), an export) are
    staged and let go as they come: at most the device-to-host window's worth is alive."""
    client, address = rollout
    alive = peak = 0  # tensors whose memory is held (freed with a tensor's last alias or view)
    n, shape = 40, (256, 64)  # 64 KiB each, 2.5 MiB in all

    def freed() -> None:
        nonlocal alive
        alive -= 1

    def materialized() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal alive, peak
        for i in range(n):
            memory = np.full(shape, float(i), np.float32)
            weakref.finalize(memory, freed)
            alive += 1
            peak = max(peak, alive)
            yield f"model.layers.{i}.mlp.up_proj.weight", torch.from_numpy(memory).requires_grad_()
            del memory

    window = 256 << 10  # half in flight, half landed and waiting for its fused pass: 2 tensors each
    settings = PublisherSettings(coordinator=address, session="job", chunk_bytes=16384, d2h_window_bytes=window)
    with WeightPublisher(settings) as pub:
        specs = [(f"model.layers.{i}.mlp.up_proj.weight", torch.float32, shape) for i in range(n)]
        pub.publish_stream(materialized(), 1, specs=specs)
        assert peak <= 6, f"{peak} of {n} tensors were alive at once"
        applier, _ = _pull(client, pub, 1)
        for i in range(n):
            assert np.all(applier.weights[f"model.layers.{i}.mlp.up_proj.weight"] == float(i))
