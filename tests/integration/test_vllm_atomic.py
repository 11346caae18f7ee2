"""The in-engine vLLM backend in an ATOMIC session (docs/design.md "Applying in vLLM"),
its engine a NumPy dict (no vLLM): the prefetch reports each version PREPARED while the
engine serves, and `update_weights` (here `VllmRollout.sync`) applies a version only once
its flip is decided, or refuses it naming the flip's state, changing nothing."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.settings import InitInfo
from rollout_agent.vllm_worker.rollout import VllmRollout
from tests.integration.support import eventually, state_name
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
from weightsync.errors import FailedPrecondition
from weightsync.manifest import Endpoint
from weightsync.server import RunningServer
from weightsync.wire import unix_seconds

WEIGHTS = {f"layer.{i}.weight": np.full((32, 32), float(i), dtype=np.float32) for i in range(3)}


@pytest.fixture
def backends(inprocess_coordinator: RunningServer) -> Iterator[list[VllmRollout]]:
    made = []
    for name in ("w0", "w1"):
        info = InitInfo(coordinator=inprocess_coordinator.address, session="job", agent_id=name, flip_wait_s=1.0)
        info.check()
        made.append(VllmRollout(info, None, None, applier=DictApplier()))
    yield made
    for b in made:
        b.close()


def test_an_update_applies_an_atomic_version_only_once_its_flip_is_decided(
    inprocess_coordinator: RunningServer, backends: list[VllmRollout]
) -> None:
    address = inprocess_coordinator.address
    settings = PublisherSettings(coordinator=address, session="job", slots=3, min_rollouts=2, flip_policy="atomic")
    with CoordinatorClient(address) as client, WeightPublisher(settings) as pub:
        # a third live rollout that never prepares: the flip cannot be decided while it is required
        client.register_agent("job", "idle", trainer=False, endpoint=Endpoint())
        pub.publish({k: v + 1 for k, v in WEIGHTS.items()}, 1)
        eventually(lambda: all(b.flips.undecided(1) for b in backends), what="both backends prepared version 1")
        with pytest.raises(FailedPrecondition) as refused:
            backends[0].sync(1)
        assert refused.value.field == "update_info.version"
        assert "ATOMIC" in refused.value.message and "not decided after 1 s (READY, " in refused.value.message
        assert backends[0].current_version == 0 and backends[0].prefetcher.status()["ready"] == 1  # still prepared
        client.deregister_agent("job", "idle")  # no longer required: the two that prepared decide it
        eventually(lambda: all(b.flips.decided(1) for b in backends), what="version 1's flip decided")
        for b in backends:
            result = b.sync(1)
            assert result.ok and b.current_version == 1, result.mismatch
        v1 = client.wait_for_version("job", 1, timeout_s=30)
        assert state_name(v1) == "COMMITTED" and v1.prepared == 2
        decided = unix_seconds(v1.flip_decided_at)
        applied = [h for h in client.status("job").handshakes if h.version == 1]
        assert len(applied) == 2 and all(unix_seconds(h.flipped_at) >= decided - 0.01 for h in applied)
        for b in backends:
            assert isinstance(b.applier, DictApplier) and b.applier.version == 1
            assert np.array_equal(b.applier.weights["layer.2.weight"], WEIGHTS["layer.2.weight"] + 1)
