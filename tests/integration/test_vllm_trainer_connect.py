"""vLLM's trainer-side init against a coordinator nobody serves: a clear error naming the
address within the init info's connect wait, not the publisher's attach wait (120 s)."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402

from tests.unit.test_vllm_trainer import RecordingClient  # noqa: E402
from trainer_agent.vllm_trainer import WeightsyncTrainerInitInfo  # noqa: E402
from weightsync.errors import TransportUnavailable  # noqa: E402


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nobody listens there


@pytest.mark.parametrize("connect_timeout_s", [0.5, 2.0])
def test_an_unreachable_coordinator_fails_trainer_init_within_the_connect_wait(connect_timeout_s: float) -> None:
    address = f"127.0.0.1:{_unused_port()}"
    client = RecordingClient()
    t0 = time.monotonic()
    with pytest.raises(TransportUnavailable, match=f"coordinator at {address} is not reachable") as raised:
        WeightTransferTrainerFactory.trainer_init(
            init_info=WeightsyncTrainerInitInfo(address, "job", rank=0, connect_timeout_s=connect_timeout_s),
            client=client,
            source=ModuleSource(torch.nn.Linear(3, 2)),
        )
    took = time.monotonic() - t0
    assert took < connect_timeout_s + 15, took  # the wait bounded (it was 122 s), with room for a busy host
    assert f"within {connect_timeout_s:g} s" in str(raised.value)
    assert client.calls == []  # the worker side was never told
